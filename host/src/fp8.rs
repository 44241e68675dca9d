//! The two 8-bit float formats of Hopper's FP8 tensor cores (OCP FP8: e4m3 in its "fn"
//! variant, e5m2), their rounding, and the row-wise scaling that fits a tensor into
//! them: what the CPU backend's `fp8` precision emulates (`cpu`, docs/NUMERICS.md).
//!
//! A value is kept as the FP32 number it stands for (every e4m3 and e5m2 value is an
//! FP32 value): the emulation rounds to the format's grid and multiplies in FP32, where
//! the product of two FP8 values (at most 4 significant bits each) is exact.

use rayon::prelude::*;

/// An 8-bit float format: the grid [`Fp8Format::round`] rounds to.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fp8Format {
    /// Stored mantissa bits (3 for e4m3, 2 for e5m2): a normal value has one more
    /// significant bit, so rounding to nearest is off by at most `2^-(m+1)` relative.
    pub mantissa_bits: i32,
    /// Exponent of the smallest normal value; below it the grid's step stays
    /// `2^(min_exp - mantissa_bits)` (the subnormals).
    pub min_exp: i32,
    /// The largest finite value: what larger magnitudes saturate to.
    pub max: f32,
    /// Whether the exponent field's top value holds infinities and NaNs (e5m2, IEEE
    /// style), or only NaN at all-ones (e4m3fn: one more binade of finite values).
    ieee_specials: bool,
}

/// e4m3 ("fn": no infinities, NaN at 0x7f / 0xff): 3 mantissa bits, bias 7, normal
/// from 2^-6, subnormals down to 2^-9, finite up to 448 = 1.75 * 2^8.
pub const E4M3: Fp8Format = Fp8Format { mantissa_bits: 3, min_exp: -6, max: 448.0, ieee_specials: false };
/// e5m2 (IEEE-like: infinities and NaNs at exponent 31): 2 mantissa bits, bias 15,
/// normal from 2^-14, subnormals down to 2^-16, finite up to 57344 = 1.75 * 2^15.
pub const E5M2: Fp8Format = Fp8Format { mantissa_bits: 2, min_exp: -14, max: 57344.0, ieee_specials: true };

impl Fp8Format {
    /// `v` rounded to the nearest value of the format, ties to even, saturating: a
    /// magnitude of `max` or more (infinity included) becomes `±max`, as the GPU's
    /// `cvt.rn.satfinite` conversions do. NaN stays NaN; the sign of zero is kept.
    pub fn round(self, v: f32) -> f32 {
        if v.is_nan() {
            return v;
        }
        let a = v.abs();
        if a >= self.max {
            return self.max.copysign(v);
        }
        // The grid's step in `a`'s binade (the subnormals share the smallest normal's).
        // Both scalings by a power of two are exact in FP32 (`a` >= 2^-149, the step >= 2^-16).
        let exp = ((a.to_bits() >> 23) as i32 - 127).max(self.min_exp);
        let step = f32::from_bits(((exp - self.mantissa_bits + 127) as u32) << 23);
        ((a / step).round_ties_even() * step).copysign(v)
    }

    /// The value of the 8-bit pattern `bits` (sign, exponent, mantissa), decoded from
    /// the format's definition (independent of [`Fp8Format::round`]: the tests hold one
    /// to the other).
    pub fn decode(self, bits: u8) -> f32 {
        let m = self.mantissa_bits;
        let exp_bits = 7 - m;
        let bias = (1 << (exp_bits - 1)) - 1;
        let (sign, e, mant) = (bits & 0x80 != 0, i32::from((bits & 0x7f) >> m), i32::from(bits) & ((1 << m) - 1));
        let top = (1 << exp_bits) - 1;
        let v = if self.ieee_specials && e == top {
            if mant == 0 { f32::INFINITY } else { f32::NAN }
        } else if !self.ieee_specials && e == top && mant == (1 << m) - 1 {
            f32::NAN
        } else if e == 0 {
            mant as f32 * 2f32.powi(1 - bias - m)
        } else {
            (((1 << m) + mant) as f32) * 2f32.powi(e - bias - m)
        };
        if sign { -v } else { v }
    }
}

/// Which way a matrix's scales go: one per row, or one per column.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Axis {
    /// One scale per row (amax over the row's columns).
    Rows,
    /// One scale per column (amax over the column's rows).
    Cols,
}

/// The scale that maps a slice of largest magnitude `amax` into e4m3: the largest power
/// of two `s` with `amax * s <= 448` (so the largest value lands in `(224, 448]`).
/// Powers of two make the scaling and its undoing exact, so the quantised operand is
/// the e4m3 rounding of the value itself (shifted a few binades) and nothing else;
/// `448 / amax` exactly would use the last half binade too, which matters only for
/// values near e4m3's subnormals, 17 binades below the largest (docs/NUMERICS.md).
///
/// `amax` 0 (a row of zeros) gives 1; a non-finite `amax` (the slice holds ±inf or NaN)
/// gives NaN, so that the slice's products come out NaN rather than a saturated
/// finite value. The exponent is clamped to FP32's normal range (2^-126..=2^127): a
/// slice whose largest value is below 2^-119 quantises partly to zero.
pub fn scale_for(format: Fp8Format, amax: f32) -> f32 {
    if !amax.is_finite() {
        return f32::NAN;
    }
    if amax == 0.0 {
        return 1.0;
    }
    let ratio = f64::from(format.max) / f64::from(amax);
    let mut e = ratio.log2().floor() as i32;
    // log2 of a ratio next to a power of two may round across it: settle it exactly.
    while f64::from(amax) * 2f64.powi(e) > f64::from(format.max) {
        e -= 1;
    }
    while f64::from(amax) * 2f64.powi(e + 1) <= f64::from(format.max) {
        e += 1;
    }
    2f32.powi(e.clamp(-126, 127))
}

/// The largest magnitude of a slice, NaN if it holds a NaN.
fn amax(values: impl Iterator<Item = f32>) -> f32 {
    values.fold(0.0f32, |m, v| if m.is_nan() || v.is_nan() { f32::NAN } else { m.max(v.abs()) })
}

/// A row-major `rows x cols` matrix quantised to `format` with one scale per row or per
/// column ([`scale_for`]): `values[i] = format.round(data[i] * scale)`, so `data[i]` is
/// about `values[i] / scale`.
pub struct Quantised {
    pub values: Vec<f32>,
    pub scales: Vec<f32>,
}

/// Quantises the row-major `rows x cols` matrix `data` to `format`, scaled along `axis`.
pub fn quantise(data: &[f32], rows: usize, cols: usize, axis: Axis, format: Fp8Format) -> Quantised {
    assert_eq!(data.len(), rows * cols, "fp8 quantise: {rows}x{cols} from {} values", data.len());
    if rows == 0 || cols == 0 {
        return Quantised { values: data.to_vec(), scales: vec![1.0; if axis == Axis::Rows { rows } else { cols }] };
    }
    let scales: Vec<f32> = match axis {
        Axis::Rows => data.par_chunks(cols).map(|r| scale_for(format, amax(r.iter().copied()))).collect(),
        Axis::Cols => {
            let fold = |m: f32, v: f32| if m.is_nan() || v.is_nan() { f32::NAN } else { m.max(v.abs()) };
            let amaxes = data
                .par_chunks(cols * 64)
                .map(|block| {
                    let mut m = vec![0.0f32; cols];
                    for r in block.chunks_exact(cols) {
                        m.iter_mut().zip(r).for_each(|(m, &v)| *m = fold(*m, v));
                    }
                    m
                })
                .reduce(|| vec![0.0f32; cols], |a, b| a.iter().zip(&b).map(|(&a, &b)| fold(a, b)).collect());
            amaxes.into_iter().map(|m| scale_for(format, m)).collect()
        }
    };
    let values = data
        .par_chunks(cols)
        .enumerate()
        .flat_map_iter(|(r, row)| {
            let scales = &scales;
            row.iter().enumerate().map(move |(c, &v)| {
                let s = if axis == Axis::Rows { scales[r] } else { scales[c] };
                format.round(v * s)
            })
        })
        .collect();
    Quantised { values, scales }
}

/// `dX = dZ W`'s scales under the forward's weight copy (quantised by rows, `w_scales`
/// one per output channel), as the GPU makes them (`fp8_transpose_weight`): `W` is about
/// `diag(1 / s) Wq`, so `dZ`'s columns take the inverse scales `1 / s_n` before `dZ` is
/// quantised by rows; dividing them by their largest, `m`, keeps those products from
/// overflowing, and `dX`'s columns take `m` back. Returns the multipliers `(1 / s_n) / m`
/// (powers of two, at most 1) and the scale of `dX`'s columns, `1 / m`. A NaN scale (a
/// non-finite weight) makes every multiplier NaN.
pub fn moved_scales(w_scales: &[f32]) -> (Vec<f32>, f32) {
    let inv: Vec<f32> = w_scales.iter().map(|s| 1.0 / s).collect();
    let m = inv.iter().fold(0.0f32, |m, &v| if m.is_nan() || v.is_nan() { f32::NAN } else { m.max(v) });
    (inv.iter().map(|v| v / m).collect(), 1.0 / m)
}

/// Undoes the scales of a product: `dst[r][c] /= row_scales[r] * col_scales[c]` for the
/// row-major `dst` (`row_scales.len() x col_scales.len()`), as two exact multiplications
/// by the reciprocals (powers of two) rather than a rounded division.
pub fn unscale(dst: &mut [f32], row_scales: &[f32], col_scales: &[f32]) {
    let n = col_scales.len();
    assert_eq!(dst.len(), row_scales.len() * n, "fp8 unscale: {} values for {}x{n}", dst.len(), row_scales.len());
    if n == 0 {
        return;
    }
    let inv_cols: Vec<f32> = col_scales.iter().map(|s| 1.0 / s).collect();
    dst.par_chunks_mut(n).zip(row_scales.par_iter()).for_each(|(row, &rs)| {
        let inv_r = 1.0 / rs;
        row.iter_mut().zip(&inv_cols).for_each(|(v, &ic)| *v = *v * inv_r * ic);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every finite positive value of the format, ascending.
    fn grid(f: Fp8Format) -> Vec<f32> {
        let mut v: Vec<f32> = (0..=0x7fu8).map(|b| f.decode(b)).filter(|v| v.is_finite()).collect();
        v.sort_by(f32::total_cmp);
        v
    }

    #[test]
    fn decode_gives_the_formats_landmarks() {
        assert_eq!(E4M3.decode(0x7e), 448.0);
        assert!(E4M3.decode(0x7f).is_nan() && E4M3.decode(0xff).is_nan());
        assert_eq!(E4M3.decode(0x08), 2f32.powi(-6)); // smallest normal
        assert_eq!(E4M3.decode(0x01), 2f32.powi(-9)); // smallest subnormal
        assert_eq!(E4M3.decode(0x38), 1.0);
        assert_eq!(E4M3.decode(0xb8), -1.0);
        assert_eq!(E5M2.decode(0x7b), 57344.0);
        assert_eq!(E5M2.decode(0x7c), f32::INFINITY);
        assert!(E5M2.decode(0x7d).is_nan());
        assert_eq!(E5M2.decode(0x04), 2f32.powi(-14));
        assert_eq!(E5M2.decode(0x01), 2f32.powi(-16));
        assert_eq!(E5M2.decode(0x3c), 1.0);
        // 126 finite positive e4m3 values besides zero (0x7f is NaN), 123 for e5m2.
        assert_eq!(grid(E4M3).len(), 127);
        assert_eq!(grid(E5M2).len(), 124);
        assert_eq!(*grid(E4M3).last().unwrap(), E4M3.max);
        assert_eq!(*grid(E5M2).last().unwrap(), E5M2.max);
    }

    /// Every value round-trips; every midpoint goes to the neighbour with the even
    /// pattern; just off a midpoint goes to the nearer one; both signs.
    #[test]
    fn every_value_and_midpoint_rounds_as_specified() {
        for f in [E4M3, E5M2] {
            let g = grid(f);
            for &v in &g {
                assert_eq!(f.round(v).to_bits(), v.to_bits(), "{f:?} {v}");
                assert_eq!(f.round(-v).to_bits(), (-v).to_bits(), "{f:?} -{v}");
            }
            // g[i] is the pattern i (the positive patterns ascend with the value).
            for (i, w) in g.windows(2).enumerate() {
                let (lo, hi) = (w[0], w[1]);
                let mid = (lo + hi) / 2.0; // exact: a few significant bits
                let even = if i % 2 == 0 { lo } else { hi };
                assert_eq!(f.round(mid), even, "{f:?} midpoint of {lo} and {hi}");
                assert_eq!(f.round(-mid), -even, "{f:?} -midpoint of {lo} and {hi}");
                let below = f32::from_bits(mid.to_bits() - 1);
                let above = f32::from_bits(mid.to_bits() + 1);
                assert_eq!(f.round(below), lo, "{f:?} just below the midpoint of {lo} and {hi}");
                assert_eq!(f.round(above), hi, "{f:?} just above the midpoint of {lo} and {hi}");
            }
        }
    }

    #[test]
    fn saturates_keeps_nan_and_signed_zero() {
        for f in [E4M3, E5M2] {
            for v in [f.max * 1.01, f.max * 1.2, 1e30, f32::MAX, f32::INFINITY] {
                assert_eq!(f.round(v), f.max, "{f:?} {v}");
                assert_eq!(f.round(-v), -f.max, "{f:?} -{v}");
            }
            assert!(f.round(f32::NAN).is_nan());
            assert_eq!(f.round(-0.0).to_bits(), (-0.0f32).to_bits());
            // Below half the smallest subnormal: zero; at it: zero (ties to even); above: the subnormal.
            let tiny = f.decode(1);
            assert_eq!(f.round(tiny * 0.25), 0.0);
            assert_eq!(f.round(tiny * 0.5), 0.0);
            assert_eq!(f.round(tiny * 0.51), tiny);
            assert_eq!(f.round(f32::from_bits(1)), 0.0); // FP32's smallest subnormal
        }
        assert_eq!(E4M3.round(464.0), 448.0); // halfway to a 480 that e4m3fn lacks
        assert_eq!(E4M3.round(1.0 + 1.0 / 16.0), 1.0); // tie at 1, to even
        assert_eq!(E4M3.round(1.0 + 3.0 / 16.0), 1.25); // tie at 1.125, to even
        assert_eq!(E4M3.round(0.3), 0.3125);
        assert_eq!(E5M2.round(1.0 + 1.0 / 8.0), 1.0);
        assert_eq!(E5M2.round(0.3), 0.3125); // step 1/16 in [0.25, 0.5)
        assert_eq!(E5M2.round(0.27), 0.25);
        assert_eq!(E4M3.round(0.27), 0.28125); // step 1/32
    }

    /// Monotone over a sweep of FP32 patterns across the whole range, and never more than
    /// half a step away (a relative `2^-(m+1)` for normal values).
    #[test]
    fn monotone_and_within_half_a_step() {
        for f in [E4M3, E5M2] {
            let mut last = 0.0f32;
            for bits in (0..0x7f80_0000u32).step_by(997) {
                let v = f32::from_bits(bits);
                let r = f.round(v);
                assert!(r >= last, "{f:?}: round({v}) = {r} below {last}");
                last = r;
                if v < f.max && v >= 2f32.powi(f.min_exp) {
                    assert!((r - v).abs() <= v * 2f32.powi(-f.mantissa_bits - 1), "{f:?} {v} -> {r}");
                }
            }
        }
    }

    #[test]
    fn scales_are_powers_of_two_fitting_448() {
        assert_eq!(scale_for(E4M3, 1.0), 256.0);
        assert_eq!(scale_for(E4M3, 448.0), 1.0);
        assert_eq!(scale_for(E4M3, 449.0), 0.5);
        assert_eq!(scale_for(E4M3, 224.0), 2.0); // 224 * 2 = 448 exactly
        assert_eq!(scale_for(E4M3, 0.0), 1.0);
        assert!(scale_for(E4M3, f32::INFINITY).is_nan() && scale_for(E4M3, f32::NAN).is_nan());
        assert_eq!(scale_for(E4M3, f32::MAX), 2f32.powi(-120));
        assert_eq!(scale_for(E4M3, f32::from_bits(1)), 2f32.powi(127)); // clamped
        for amax in [1e-20f32, 3e-3, 0.7, 1.0, 5.5, 1000.0, 3e20] {
            let s = scale_for(E4M3, amax);
            assert!(amax * s <= 448.0 && amax * s > 224.0, "{amax} * {s}");
            assert_eq!(s.to_bits() & 0x007f_ffff, 0, "a power of two");
        }
    }

    #[test]
    fn quantise_scales_rows_and_columns() {
        // 3 x 4: a row of zeros, one with a large value, one small.
        let data = [0.0, 0.0, 0.0, 0.0, 1000.0, -3.0, 0.1, 1.0, 1e-3, -2e-3, 0.0, 5e-4];
        let q = quantise(&data, 3, 4, Axis::Rows, E4M3);
        assert_eq!(q.scales, vec![1.0, 0.25, 131072.0]); // 2e-3 * 2^17 = 262
        assert_eq!(&q.values[..4], &[0.0; 4]);
        assert_eq!(q.values[4], 256.0); // 250, on e4m3's grid of step 16 in [128, 256)
        for (i, (&v, &d)) in q.values.iter().zip(&data).enumerate() {
            let s = q.scales[i / 4];
            assert_eq!(v, E4M3.round(d * s), "element {i}");
            assert!(v.abs() <= 448.0);
        }
        let q = quantise(&data, 3, 4, Axis::Cols, E4M3);
        assert_eq!(q.scales, vec![0.25, 128.0, 4096.0, 256.0]);
        for (i, (&v, &d)) in q.values.iter().zip(&data).enumerate() {
            assert_eq!(v, E4M3.round(d * q.scales[i % 4]), "element {i}");
        }
        // A NaN poisons its row's scale (and so its products), not the others'.
        let q = quantise(&[1.0, f32::NAN, 2.0, 3.0], 2, 2, Axis::Rows, E4M3);
        assert!(q.scales[0].is_nan() && q.values[..2].iter().all(|v| v.is_nan()));
        assert_eq!(q.scales[1], 128.0);
        // dX's scales under the forward's copy: multipliers over the largest inverse.
        let (mult, col) = moved_scales(&[256.0, 1024.0, 64.0]);
        assert_eq!((mult, col), (vec![0.25, 0.0625, 1.0], 64.0));
        assert!(moved_scales(&[2.0, f32::NAN]).0.iter().all(|v| v.is_nan()));
        // Undoing the scales.
        let mut z = vec![256.0, 512.0, 1024.0, 2048.0];
        unscale(&mut z, &[2.0, 4.0], &[8.0, 16.0]);
        assert_eq!(z, vec![16.0, 16.0, 32.0, 32.0]);
    }
}

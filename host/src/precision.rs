//! The arithmetic of the GEMMs ([`Precision`]) and what each is held to: its tolerance
//! against the f64 reference, explained here beside the arithmetic it bounds.
//!
//! Why these numbers (see `docs/MODELS.md`; [`crate::check`] holds the other
//! tolerances — f64 against f64, finite differences, `allclose` — and the comparison):
//! * A GEMM output summed over `k` terms in f32 has a relative error of about
//!   `sqrt(k) * 2^-24` for random data (~5e-6 at k = 8192); the epilogue ops add a
//!   few ulps each and GroupNorm divides by a standard deviation that is itself
//!   computed in f32. [`FP32_REL`] = 1e-4 leaves ~20x headroom for that, and is what
//!   every strict-f32 path is held to. 3xTF32 is held to it too: its products are
//!   FP32-accurate.
//! * TF32 keeps 10 mantissa bits of each operand ([`TF32_REL`]), fp16 10 rounded to
//!   nearest ([`FP16_REL`]), bf16 7 ([`BF16_REL`]): the bars of the tensor-core paths.
//! * FP8 (e4m3, 3 mantissa bits, row-wise scales; the CPU emulates it, the GPU refuses
//!   it so far) is held to [`FP8_REL`], derived beside it.
//!
//! Every comparison is norm-wise relative ([`crate::check::Comparison::passes`]).
//!
//! The error model ([`Precision::z_error`]) is the other side of the same arithmetic:
//! how far a GEMM output computed in a precision may be from the exact one, which the
//! kink scan uses to decide which values of `z` to recompute exactly.

/// Strict-f32 GPU or CPU result vs the f64 reference, norm-wise relative error.
/// (3xTF32 tensor-core GEMMs are held to it too: their products are FP32-accurate.)
pub const FP32_REL: f64 = 1e-4;
/// TF32 tensor-core GEMMs: operands keep 10 mantissa bits (relative rounding 2^-11),
/// so a k-term product is off by about 2^-11 / sqrt(few) relative; 2e-3 is the bound
/// the tensor-core issue sets.
pub const TF32_REL: f64 = 2e-3;
/// `--precision bf16`: operands rounded to bf16 (8 mantissa bits, ~2e-3 per element),
/// FP32 accumulation: the tensor-core issue's bar.
pub const BF16_REL: f64 = 2e-2;
/// A bf16 model's tensors (`GpuBlock<Bf16>`) against the f64 reference computed from
/// the same bf16 values: the operands are exact, so what is left is the FP32
/// accumulation (~1e-5 at k = 8192) and the one rounding of each bf16 output (`y`,
/// `dX`, `dW`: at most 2^-9 relative, ~1.1e-3 as a norm over uniform mantissas). 5e-3
/// is 4x that; FP32 outputs (the bias's and the chain parameters' gradients) meet it
/// with room.
pub const BF16_STORED_REL: f64 = 5e-3;
/// `--precision fp16`: operands rounded to fp16 (10 mantissa bits, rounded to nearest:
/// 2^-11 relative at most, half TF32's truncation), FP32 accumulation: TF32's bar.
/// Operands beyond fp16's range (|v| > 65504) become infinite, as in PyTorch's fp16
/// GEMMs: the bar holds for data in range (docs/NUMERICS.md).
pub const FP16_REL: f64 = 2e-3;
/// An fp16 model's tensors (`GpuBlock<F16>`) against the f64 reference computed from
/// the same fp16 values: as [`BF16_STORED_REL`], with each output's one rounding 8x
/// finer (at most 2^-11 relative, ~1.4e-4 as a norm). 1e-3 is 7x that, leaving room
/// for gradients whose small values fall into fp16's subnormals (below 2^-14, an
/// absolute step of 2^-24) and for the FP32 accumulation and epilogue.
pub const FP16_STORED_REL: f64 = 1e-3;

/// The arithmetic of the GEMMs (the epilogue is always FP32).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum Precision {
    /// Strict FP32 on the FMA units.
    Fp32,
    /// Tensor cores, each FP32 operand as a TF32 high and low part, three MMAs per
    /// product: FP32-level accuracy.
    Tf32x3,
    /// Tensor cores, operands rounded to TF32 (10-bit mantissa).
    Tf32,
    /// Tensor cores, operands rounded to fp16 (10-bit mantissa, 5-bit exponent: finite
    /// up to 65504), FP32 accumulation.
    Fp16,
    /// Tensor cores, operands rounded to bf16 (7-bit mantissa), FP32 accumulation.
    Bf16,
    /// FP8 (e4m3) operands with row-wise power-of-two scales, FP32 accumulation, the
    /// scales undone in the epilogue; every GEMM of the backward in FP8 too. The GPU
    /// runs it on Hopper's e4m3 `wgmma` (float32 blocks), the CPU backend emulates it.
    Fp8,
    /// [`Precision::Fp8`] with the weight's gradient `dZ^T X` from bf16 operands
    /// instead (torchao's `rowwise_with_gw_hp`): the update keeps 8 significant bits.
    #[value(name = "fp8_gw_bf16")]
    Fp8GwBf16,
}

/// `--precision fp8` (emulated on the CPU: docs/NUMERICS.md): every GEMM operand scaled
/// by a power of two that puts its row's (or column's) largest magnitude in `(224, 448]`
/// and rounded to e4m3, FP32 sums. e4m3 keeps 3 mantissa bits: rounding to nearest is
/// off by at most `2^-4` relative (unit roundoff) for a value in its normal range, which
/// reaches 16 binades below the scaled maximum; a product of two by at most `2 * 2^-4`,
/// with a standard deviation of [`FP8_PRODUCT_SIGMA`] (3.7e-2, 16x bf16's: `tests`
/// simulates it). A GEMM output summed over `k` products of unrelated signs has a
/// norm-wise error of about that standard deviation (the error's and the output's
/// squares both sum `(x w)^2`), whatever `k`; the FP32 sums (`sqrt(k) 2^-24`) add nothing
/// visible. So the forward's `z`, and `dX`, `dW` at a given `dz`, are about `2^-4.8` off.
/// 0.15 is 4 such standard deviations (the kink scan's `SIGMAS`): room for tensors of a
/// few elements, whose norm-wise ratio spreads (8.7e-2 was seen on a 1x1 weight's
/// gradient over 40 rows), and for a chain's norms and pools, while the rounding is still
/// visible (the tests hold fp8's error above 10x bf16's on the same case). Gradients are
/// held to it at the backend's own `z`: a `z` 4% off picks another row maximum or side
/// of a kink now and then, which moves gradients by O(1) (docs/NUMERICS.md).
pub const FP8_REL: f64 = 0.15;

/// How many estimated standard deviations of the GEMM's error a value's radius spans.
/// Outside 4 sigma a Gaussian error crosses a kink so rarely that the flips left
/// (~2e-5 of those the radius catches, were it exact) are far below any tolerance;
/// the margin is for the model below being an estimate.
const SIGMAS: f32 = 4.0;

/// Standard deviation of one product `x w`'s relative error with both operands
/// truncated to TF32 (see [`Precision::z_error`]; `tests` checks both against a simulation).
const TF32_PRODUCT_SIGMA: f32 = 3.1e-4;
/// The same with both operands rounded to nearest bf16.
const BF16_PRODUCT_SIGMA: f32 = 2.3e-3;
/// The same with both operands rounded to nearest fp16 (3 bits finer than bf16: 1/8).
const FP16_PRODUCT_SIGMA: f32 = 2.9e-4;
/// The same with both operands rounded to nearest e4m3 after their power-of-two scale
/// (4 significant bits: 16x bf16's; the scale keeps them out of the subnormals).
pub const FP8_PRODUCT_SIGMA: f32 = 3.7e-2;
/// 3xTF32: the tensor cores' accumulation, per accumulating MMA (three per 8 of `k`),
/// relative to `rms(z row)`. They truncate as they add, and the errors of a run of
/// adds sum like its partial sums: H100, M1 / M3 / M5 at `k` = 8192, the forward's
/// rows came out 3.1e-5 (norm-wise) from the f64 reference with 3072 adds in a run,
/// 7.8e-6 flushed every 2048 of `k` (768): 1.0e-8 per add either way. 1.5x that here.
const TF32X3_ADD_SIGMA: f32 = 1.5e-8;

impl Precision {
    /// Every precision, strictest first.
    pub const ALL: [Precision; 7] = [
        Precision::Fp32,
        Precision::Tf32x3,
        Precision::Tf32,
        Precision::Fp16,
        Precision::Bf16,
        Precision::Fp8GwBf16,
        Precision::Fp8,
    ];
    /// Whether the GEMMs' operands are FP8 (the forward's and `dX`'s at least).
    pub fn is_fp8(self) -> bool {
        matches!(self, Precision::Fp8 | Precision::Fp8GwBf16)
    }

    /// The precision of a 16-bit model's GEMMs: its operands as stored, the products
    /// exact (`None` for FP32 tensors, whose precision is the caller's choice).
    pub fn of_storage(dtype: crate::gpu::Dtype) -> Option<Precision> {
        match dtype {
            crate::gpu::Dtype::F32 => None,
            crate::gpu::Dtype::Bf16 => Some(Precision::Bf16),
            crate::gpu::Dtype::F16 => Some(Precision::Fp16),
        }
    }

    /// Whether the GEMMs' operands are a 16-bit type (bf16 or fp16).
    pub fn is_half(self) -> bool {
        matches!(self, Precision::Bf16 | Precision::Fp16)
    }

    /// Relative error against the f64 reference this precision is held to (see the
    /// module's explanation).
    pub fn tolerance(self) -> f64 {
        match self {
            Precision::Fp32 | Precision::Tf32x3 => FP32_REL,
            Precision::Tf32 => TF32_REL,
            Precision::Fp16 => FP16_REL,
            Precision::Bf16 => BF16_REL,
            Precision::Fp8 | Precision::Fp8GwBf16 => FP8_REL,
        }
    }

    /// The model of `z`'s error (the GEMM's output in this precision, depth `k`) that
    /// the kink scan (`gpu::epilogue::kinks`) starts from: `(rel, abs)` such that a
    /// value's error is within `rel * rms(z row) + abs * |z|` (`rel`: `SIGMAS` standard
    /// deviations of the random part; `abs`: a bound on a shrink common to the row).
    ///
    /// * TF32 (operands truncated to 10 mantissa bits): each product `x w` is off by
    ///   `x w (dx + dw)`, the truncations `dx`, `dw` in `[0, 2^-10)` relative, mean
    ///   `0.72 * 2^-11` and standard deviation `2.2e-4` each (mantissas log-uniform).
    ///   Summed over `k`, the random part has a standard deviation of
    ///   `3.1e-4 * sqrt(sum (x w)^2)`, which `rms(z row)` estimates for products of
    ///   unrelated signs (a row of `z` sums the same `x` against every weight row), and
    ///   the mean part shrinks `z` by `7e-4 |z|` (taken whole, as a bound: `2^-10`).
    /// * bf16 (rounded to nearest, 8 significant bits): each operand off by a standard
    ///   deviation of `1.6e-3`, a product by `2.3e-3`, no bias; fp16 (11 significant
    ///   bits) 8x less, `2.9e-4` a product (for values in its normal range).
    /// * FP32 and 3xTF32: the FP32 accumulation over `k` terms, about `2^-24 sqrt(k)`
    ///   (3xTF32 also drops the low parts' product, `2^-22`, and the tensor cores'
    ///   accumulation adds `TF32X3_ADD_SIGMA` per MMA, `3 k / 8` of them: no credit is
    ///   taken for the forward's flushes, which not every path makes). Without that term
    ///   the radius was 3 of the flushed forward's standard deviations, and M5's 3xTF32
    ///   gradients at seed size were 6.1e-4 from the f64 reference (a few kinks taken on
    ///   the wrong side).
    ///
    /// `rms(z row)` estimates `sqrt(sum (x w)^2)` only on average over the row's columns:
    /// over a few terms the sum of squares varies from column to column (a coefficient of
    /// variation near `0.9 / sqrt(k)` for uniform weights), so the per-product parts are
    /// widened by `sqrt(1 + 3 * 0.9 / sqrt(k))` (1.5x at `k = 5`, 1.02x at 8192).
    pub fn z_error(self, k: usize) -> (f32, f32) {
        let fp32 = (k as f32).sqrt() * f32::EPSILON / 2.0;
        let spread = (1.0 + 2.7 / (k.max(1) as f32).sqrt()).sqrt();
        // (standard deviation of the random part, bound of the common shrink)
        let (sigma, shrink) = match self {
            Precision::Fp32 => (fp32, 0.0),
            Precision::Tf32x3 => (fp32 + 2f32.powi(-22) + TF32X3_ADD_SIGMA * (3 * k).div_ceil(8) as f32, 0.0),
            Precision::Tf32 => (TF32_PRODUCT_SIGMA * spread, 2f32.powi(-10)),
            Precision::Fp16 => (FP16_PRODUCT_SIGMA * spread, 0.0),
            Precision::Bf16 => (BF16_PRODUCT_SIGMA * spread, 0.0),
            Precision::Fp8 | Precision::Fp8GwBf16 => (FP8_PRODUCT_SIGMA * spread, 0.0),
        };
        (SIGMAS * sigma, shrink)
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Precision::Fp32 => "fp32",
            Precision::Tf32x3 => "tf32x3",
            Precision::Tf32 => "tf32",
            Precision::Fp16 => "fp16",
            Precision::Bf16 => "bf16",
            Precision::Fp8 => "fp8",
            Precision::Fp8GwBf16 => "fp8_gw_bf16",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tolerances_order_the_precisions() {
        let tol: Vec<f64> = Precision::ALL.iter().map(|p| p.tolerance()).collect();
        assert!(tol.windows(2).all(|w| w[0] <= w[1]), "{tol:?}");
        assert_eq!(Precision::Tf32x3.tolerance(), Precision::Fp32.tolerance());
        // 4 standard deviations of an FP8 GEMM output's norm-wise error.
        assert!((FP8_REL - 4.0 * f64::from(FP8_PRODUCT_SIGMA)).abs() < 0.01);
    }

    #[test]
    fn fp8_precisions_parse_by_name() {
        assert!(Precision::ALL.iter().filter(|p| p.is_fp8()).eq([Precision::Fp8GwBf16, Precision::Fp8].iter()));
        use clap::ValueEnum;
        assert_eq!(Precision::from_str("fp8_gw_bf16", false), Ok(Precision::Fp8GwBf16));
        assert_eq!(Precision::from_str("fp8", false), Ok(Precision::Fp8));
    }

    /// The per-product error the model assumes, against products of random operands
    /// rounded as the GEMMs round them (TF32: low 13 bits dropped; bf16: to nearest even).
    #[test]
    fn per_product_error_matches_the_roundings() {
        use rand::{Rng, SeedableRng, rngs::StdRng};
        let tf32 = |v: f32| f32::from_bits(v.to_bits() & 0xffff_e000);
        let bf16 = |v: f32| {
            let b = v.to_bits();
            f32::from_bits((b + 0x7fff + ((b >> 16) & 1)) & 0xffff_0000)
        };
        let fp16 = |v: f32| crate::tensor::F16::from_f32(v).to_f32();
        // Scaled as the FP8 GEMMs scale a slice of largest magnitude 1 (by 256).
        let e4m3 = |v: f32| crate::fp8::E4M3.round(v * 256.0) / 256.0;
        let mut rng = StdRng::seed_from_u64(5);
        let pairs: Vec<(f32, f32)> =
            (0..200_000).map(|_| (rng.random_range(-1.0..1.0), rng.random_range(-1.0..1.0))).collect();
        for (round, model, name) in [
            (&tf32 as &dyn Fn(f32) -> f32, TF32_PRODUCT_SIGMA, "tf32"),
            (&bf16, BF16_PRODUCT_SIGMA, "bf16"),
            (&fp16, FP16_PRODUCT_SIGMA, "fp16"),
            (&e4m3, FP8_PRODUCT_SIGMA, "e4m3"),
        ] {
            let errs: Vec<f64> = pairs
                .iter()
                .map(|&(x, w)| {
                    let exact = f64::from(x) * f64::from(w);
                    (f64::from(round(x)) * f64::from(round(w)) - exact) / exact
                })
                .collect();
            let mean = errs.iter().sum::<f64>() / errs.len() as f64;
            let sd = (errs.iter().map(|e| (e - mean).powi(2)).sum::<f64>() / errs.len() as f64).sqrt();
            let ratio = f64::from(model) / sd;
            assert!((0.95..1.15).contains(&ratio), "{name}: model {model:.3e} against a simulated {sd:.3e}");
        }
    }

    #[test]
    fn error_model_orders_the_precisions() {
        let k = 8192;
        let rel = |p: Precision| p.z_error(k).0;
        assert!(rel(Precision::Fp32) < rel(Precision::Tf32x3));
        // (3xTF32's tensor-core accumulation, taken unflushed, is 5-6x under TF32's rounding.)
        assert!(rel(Precision::Tf32x3) * 5.0 < rel(Precision::Tf32));
        assert!(rel(Precision::Tf32) < rel(Precision::Bf16));
        assert!(rel(Precision::Bf16) * 10.0 < rel(Precision::Fp8));
        assert!(rel(Precision::Fp16) < rel(Precision::Bf16) && Precision::Fp16.z_error(k).1 == 0.0);
        // TF32 truncates (biased toward zero), so only it has a value-proportional part.
        assert!(Precision::Tf32.z_error(k).1 > 0.0 && Precision::Bf16.z_error(k).1 == 0.0);
    }
}

//! A plain host tensor: a shape and a row-major `Vec`. Device tensors live in `gpu`.

use crate::error::{Error, Result};

#[derive(Clone, Debug, PartialEq)]
pub struct Tensor<T> {
    shape: Vec<usize>,
    data: Vec<T>,
}

/// Elements of a tensor of `shape`, refusing shapes whose element count overflows
/// `usize` or whose `T` values would not fit one allocation (`isize::MAX` bytes):
/// `shape.iter().product()` wraps silently in release builds, and `vec!` panics.
pub fn numel<T>(shape: &[usize]) -> Result<usize> {
    let too_large = || Error::Shape(format!("shape {shape:?} has more elements than memory can address"));
    let n = shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).ok_or_else(too_large)?;
    match n.checked_mul(std::mem::size_of::<T>()) {
        Some(bytes) if bytes <= isize::MAX as usize => Ok(n),
        _ => Err(too_large()),
    }
}

impl<T: Copy> Tensor<T> {
    /// A tensor of `shape` holding `data` (row-major); the lengths must agree.
    pub fn new(shape: &[usize], data: Vec<T>) -> Result<Self> {
        let expected = numel::<T>(shape)?;
        if expected != data.len() {
            return Err(Error::Shape(format!("shape {shape:?} needs {expected} elements, got {}", data.len())));
        }
        Ok(Tensor { shape: shape.to_vec(), data })
    }

    /// A tensor of `shape` with every element `value`.
    pub fn full(shape: &[usize], value: T) -> Result<Self> {
        Ok(Tensor { shape: shape.to_vec(), data: vec![value; numel::<T>(shape)?] })
    }

    /// A tensor of `shape` whose element at flat index `i` is `f(i)`.
    pub fn from_fn(shape: &[usize], mut f: impl FnMut(usize) -> T) -> Result<Self> {
        Ok(Tensor { shape: shape.to_vec(), data: (0..numel::<T>(shape)?).map(&mut f).collect() })
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn data(&self) -> &[T] {
        &self.data
    }
    pub fn data_mut(&mut self) -> &mut [T] {
        &mut self.data
    }
    pub fn into_data(self) -> Vec<T> {
        self.data
    }
    pub fn len(&self) -> usize {
        self.data.len()
    }
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Rows of a 2-D tensor (the batch), 1 for a vector.
    pub fn rows(&self) -> usize {
        if self.shape.len() == 2 { self.shape[0] } else { 1 }
    }
    /// Columns of a 2-D tensor (the features), the length of a vector.
    pub fn cols(&self) -> usize {
        *self.shape.last().unwrap_or(&1)
    }
    /// Row `r` of a 2-D tensor.
    pub fn row(&self, r: usize) -> &[T] {
        let c = self.cols();
        &self.data[r * c..(r + 1) * c]
    }

    pub fn map<U: Copy>(&self, f: impl FnMut(T) -> U) -> Tensor<U> {
        Tensor { shape: self.shape.clone(), data: self.data.iter().copied().map(f).collect() }
    }

    /// The same data under another shape of equal size.
    pub fn reshape(self, shape: &[usize]) -> Result<Self> {
        Tensor::new(shape, self.data)
    }
}

impl Tensor<f32> {
    pub fn to_f64(&self) -> Tensor<f64> {
        self.map(f64::from)
    }

    /// Every value rounded to bf16 (to nearest, ties to even).
    pub fn to_bf16(&self) -> Tensor<Bf16> {
        self.map(Bf16::from_f32)
    }
}

impl Tensor<f32> {
    /// Every value rounded to fp16 (to nearest, ties to even; beyond 65504, infinity).
    pub fn to_f16(&self) -> Tensor<F16> {
        self.map(F16::from_f32)
    }

    /// Every value rounded to the 16-bit `H` (to nearest, ties to even).
    pub fn to_half<H: Half>(&self) -> Tensor<H> {
        self.map(H::from_f32)
    }
}

impl<H: Half> Tensor<H> {
    /// The values as FP32 (exact).
    pub fn to_f32(&self) -> Tensor<f32> {
        self.map(H::to_f32)
    }
}

/// A 16-bit float a model's tensors are stored in ([`Bf16`], [`F16`]): read as stored
/// by its own kernels, widened to FP32 exactly, rounded from FP32 to nearest even.
pub trait Half: Copy + Default + PartialEq + std::fmt::Debug + Send + Sync + 'static {
    /// `v` rounded to the nearest value, ties to even (NaN stays NaN).
    fn from_f32(v: f32) -> Self;
    /// The value as FP32 (exact).
    fn to_f32(self) -> f32;
    /// The bit pattern.
    fn bits(self) -> u16;
    /// The value of a bit pattern.
    fn from_bits(bits: u16) -> Self;
}

impl Half for Bf16 {
    fn from_f32(v: f32) -> Bf16 {
        Bf16::from_f32(v)
    }
    fn to_f32(self) -> f32 {
        Bf16::to_f32(self)
    }
    fn bits(self) -> u16 {
        self.0
    }
    fn from_bits(bits: u16) -> Bf16 {
        Bf16(bits)
    }
}

impl Half for F16 {
    fn from_f32(v: f32) -> F16 {
        F16::from_f32(v)
    }
    fn to_f32(self) -> f32 {
        F16::to_f32(self)
    }
    fn bits(self) -> u16 {
        self.0
    }
    fn from_bits(bits: u16) -> F16 {
        F16(bits)
    }
}

/// An IEEE binary16 value (its 16-bit pattern): how an fp16 model's tensors are stored,
/// on the host and in device memory. 10 mantissa bits (bf16 has 7), but 5 exponent
/// bits: the largest finite value is 65504, the smallest normal 2^-14, subnormals
/// reach down to 2^-24.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct F16(pub u16);

impl F16 {
    /// The largest finite fp16 value.
    pub const MAX: f32 = 65504.0;

    /// `v` rounded to the nearest fp16, ties to even, as the GPU's `cvt.rn.f16.f32`
    /// rounds: from 65520 on (halfway to 2^16) to infinity, below 2^-14 to a subnormal
    /// (NaN stays NaN).
    pub fn from_f32(v: f32) -> F16 {
        let b = v.to_bits();
        let sign = ((b >> 16) & 0x8000) as u16;
        let (a, x) = (b & 0x7fff_ffff, v.abs());
        if v.is_nan() {
            return F16(sign | 0x7e00 | ((a >> 13) & 0x1ff) as u16);
        }
        if x >= 65520.0 {
            return F16(sign | 0x7c00);
        }
        if x < 2f32.powi(-14) {
            // Multiples of 2^-24 (the scaling is exact); 2^-14 itself is the smallest
            // normal's pattern, 0x400.
            return F16(sign | (x * 2f32.powi(24)).round_ties_even() as u16);
        }
        // The FP32 pattern's exponent and top 10 mantissa bits, rounded at bit 13 (a
        // carry moves into the exponent), rebased from bias 127 to 15.
        let rounded = (a + 0xfff + ((a >> 13) & 1)) >> 13;
        F16(sign | (rounded - (112 << 10)) as u16)
    }

    /// The value as FP32 (exact).
    pub fn to_f32(self) -> f32 {
        let (sign, exp, mant) = (self.0 & 0x8000 != 0, (self.0 >> 10) & 0x1f, (self.0 & 0x3ff) as u32);
        let v = match exp {
            0 => mant as f32 * 2f32.powi(-24),
            31 if mant == 0 => f32::INFINITY,
            31 => f32::from_bits(0x7fc0_0000 | (mant << 13)),
            e => f32::from_bits(((e as u32 + 112) << 23) | (mant << 13)),
        };
        if sign { -v } else { v }
    }
}

/// A bfloat16 value (its 16-bit pattern: the top half of an FP32's): how a bf16
/// model's tensors are stored, on the host and in device memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct Bf16(pub u16);

impl Bf16 {
    /// `v` rounded to the nearest bf16, ties to even (NaN stays NaN).
    pub fn from_f32(v: f32) -> Bf16 {
        let b = v.to_bits();
        if v.is_nan() {
            return Bf16(((b >> 16) | 0x40) as u16);
        }
        Bf16(((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16)
    }

    /// The value as FP32 (exact).
    pub fn to_f32(self) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }
}

impl Tensor<f64> {
    pub fn to_f32(&self) -> Tensor<f32> {
        self.map(|v| v as f32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(Bf16::from_f32(1.0).0, 0x3f80);
        assert_eq!(Bf16::from_f32(1.0).to_f32(), 1.0);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1).
        assert_eq!(Bf16::from_f32(1.0 + 1.0 / 256.0).to_f32(), 1.0);
        // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: even is the upper one.
        assert_eq!(Bf16::from_f32(1.0 + 3.0 / 256.0).to_f32(), 1.0 + 1.0 / 64.0);
        assert_eq!(Bf16::from_f32(1.0 + 1.1 / 256.0).to_f32(), 1.0 + 1.0 / 128.0);
        assert_eq!(Bf16::from_f32(-2.5).to_f32(), -2.5);
        assert!(Bf16::from_f32(f32::NAN).to_f32().is_nan());
        assert_eq!(Bf16::from_f32(f32::INFINITY).to_f32(), f32::INFINITY);
        assert_eq!(Bf16::from_f32(f32::MAX).to_f32(), f32::INFINITY);
    }

    #[test]
    fn f16_rounds_to_nearest_even() {
        assert_eq!(F16::from_f32(1.0).0, 0x3c00);
        // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: ties to even (1).
        assert_eq!(F16::from_f32(1.0 + 2f32.powi(-11)).to_f32(), 1.0);
        // 1 + 3 * 2^-11 is halfway between 1 + 2^-10 and 1 + 2^-9: even is the upper one.
        assert_eq!(F16::from_f32(1.0 + 3.0 * 2f32.powi(-11)).to_f32(), 1.0 + 2f32.powi(-9));
        assert_eq!(F16::from_f32(1.0 + 1.1 * 2f32.powi(-11)).to_f32(), 1.0 + 2f32.powi(-10));
        assert_eq!(F16::from_f32(-2.5).to_f32(), -2.5);
        assert!(F16::from_f32(f32::NAN).to_f32().is_nan());
        // The range: 65504 is the largest; halfway to 2^16 rounds to infinity (even).
        assert_eq!(F16::from_f32(65504.0).0, 0x7bff);
        assert_eq!(F16::from_f32(65519.0).to_f32(), 65504.0);
        assert_eq!(F16::from_f32(65520.0).to_f32(), f32::INFINITY);
        assert_eq!(F16::from_f32(-1e6).to_f32(), f32::NEG_INFINITY);
        assert_eq!(F16::from_f32(f32::INFINITY).0, 0x7c00);
        // Subnormals: multiples of 2^-24, ties to even; half the smallest goes to zero.
        assert_eq!(F16::from_f32(2f32.powi(-24)).0, 1);
        assert_eq!(F16::from_f32(2f32.powi(-25)).0, 0);
        assert_eq!(F16::from_f32(3.0 * 2f32.powi(-25)).0, 2);
        assert_eq!(F16::from_f32(-2f32.powi(-14)).0, 0x8400);
        assert_eq!(F16::from_f32(2f32.powi(-14) * (1.0 - 2f32.powi(-12))).0, 0x400);
        assert_eq!(F16::from_f32(-0.0).0, 0x8000);
    }

    /// Every fp16 pattern widens exactly and rounds back to itself; every FP32 value
    /// between two neighbours rounds to the nearer (the even one at the midpoint).
    #[test]
    fn f16_round_trips_every_pattern() {
        for bits in 0..=u16::MAX {
            let v = F16(bits).to_f32();
            if v.is_nan() {
                assert!(F16::from_f32(v).to_f32().is_nan());
                continue;
            }
            assert_eq!(F16::from_f32(v).0, bits, "{bits:#06x} = {v}");
            let next = F16(bits + 1).to_f32();
            if bits & 0x7fff < 0x7bff && bits & 0x8000 == 0 {
                let mid = ((f64::from(v) + f64::from(next)) / 2.0) as f32;
                let want = if bits % 2 == 0 { bits } else { bits + 1 };
                assert_eq!(F16::from_f32(mid).0, want, "midpoint after {bits:#06x}");
                let below = f32::from_bits(mid.to_bits() - 1);
                assert_eq!(F16::from_f32(below).0, bits, "below the midpoint after {bits:#06x}");
            }
        }
    }

    #[test]
    fn sizes_that_overflow_are_refused_not_wrapped() {
        // 2^33 * 2^31 wraps to 0 in a plain product, which would accept empty data.
        let wraps = [1usize << 33, 1 << 31];
        assert!(matches!(Tensor::<f32>::new(&wraps, vec![]), Err(Error::Shape(_))));
        assert!(matches!(Tensor::full(&wraps, 0.0f32), Err(Error::Shape(_))));
        assert!(matches!(Tensor::from_fn(&wraps, |_| 0.0f64), Err(Error::Shape(_))));
        // Fits usize, but not one allocation of f64.
        let e = Tensor::full(&[usize::MAX / 4], 0.0f64).unwrap_err().to_string();
        assert!(e.contains("more elements than memory can address"), "{e}");
        assert_eq!(numel::<f32>(&[0, usize::MAX]).unwrap(), 0);
        assert_eq!(Tensor::from_fn(&[2, 3], |i| i as f32).unwrap().data(), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    }
}

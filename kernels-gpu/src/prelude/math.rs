//! Fast single-precision math for epilogues, with stated accuracy.
//!
//! `core` has no `exp`/`tanh`/`erf` on nvptx64. These use the PTX approximate
//! instructions (`ex2.approx`, `rsqrt.approx`) plus short, well-conditioned formulas.
//! Accuracy below is relative error unless said otherwise, over finite inputs, and is
//! what the block tolerances (1e-4 relative, docs/MODELS.md) rely on:
//! every function here is at least ~30x tighter than that.
//!
//! | fn        | method                                          | accuracy                       |
//! |-----------|-------------------------------------------------|--------------------------------|
//! | `exp2`    | `ex2.approx.ftz.f32`                            | 2^-22 (PTX ISA)                |
//! | `exp`     | `exp2(x * log2 e)`                              | 2^-22 + |x| * 2^-24 (< 6e-6 in range) |
//! | `ln`      | `lg2.approx.ftz.f32` times `ln 2`               | 2^-22 absolute (PTX ISA)       |
//! | `rsqrt`   | `rsqrt.approx.ftz.f32`                          | 2^-22.9 (PTX ISA)              |
//! | `recip`   | `rcp.approx.ftz.f32`                            | 1 ulp (PTX ISA)                |
//! | `sigmoid` | `recip(1 + exp(-x))`                            | as `exp`, plus 1 ulp           |
//! | `tanh`    | odd Taylor series for |x| < 0.125, else `1 - 2 recip(e^2x + 1)` | < 2e-6         |
//! | `erfc`    | Chebyshev fit (Numerical Recipes `erfcc`)       | 1.2e-7 fractional + `exp`'s    |
//! | `erf`     | `1 - erfc(x)`                                   | 2e-7 absolute                  |
//!
//! Subnormal results flush to zero (`.ftz`), as CUDA's fast-math intrinsics do.
//!
//! Per-element functions divide with `recip`, never `/`: an IEEE `div.rn.f32` compiles
//! to a reciprocal, a correction and a branch to a slow path, and the branch ends the
//! basic block, so the 64 values of an epilogue half-fragment could not interleave —
//! each paid the whole latency chain (390 such calls in the TMA kernel's SASS).

use core::arch::asm;

pub const LOG2_E: f32 = core::f32::consts::LOG2_E;

/// `2^x` (`ex2.approx.ftz.f32`).
#[inline(always)]
pub fn exp2(x: f32) -> f32 {
    let out: u32;
    // SAFETY: register-only arithmetic instruction.
    unsafe {
        asm!("ex2.approx.ftz.f32 {o}, {i};", o = out(reg32) out, i = in(reg32) x.to_bits(),
             options(pure, nomem, nostack, preserves_flags));
    }
    f32::from_bits(out)
}

/// `e^x`.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    exp2(x * LOG2_E)
}

/// `ln x` (`lg2.approx.ftz.f32`, scaled).
#[inline(always)]
pub fn ln(x: f32) -> f32 {
    let out: u32;
    // SAFETY: register-only arithmetic instruction.
    unsafe {
        asm!("lg2.approx.ftz.f32 {o}, {i};", o = out(reg32) out, i = in(reg32) x.to_bits(),
             options(pure, nomem, nostack, preserves_flags));
    }
    f32::from_bits(out) * core::f32::consts::LN_2
}

/// `1 / sqrt(x)` (`rsqrt.approx.ftz.f32`).
#[inline(always)]
pub fn rsqrt(x: f32) -> f32 {
    let out: u32;
    // SAFETY: register-only arithmetic instruction.
    unsafe {
        asm!("rsqrt.approx.ftz.f32 {o}, {i};", o = out(reg32) out, i = in(reg32) x.to_bits(),
             options(pure, nomem, nostack, preserves_flags));
    }
    f32::from_bits(out)
}

/// `1 / x` (`rcp.approx.ftz.f32`): `1 / inf` = 0, no branch.
#[inline(always)]
pub fn recip(x: f32) -> f32 {
    let out: u32;
    // SAFETY: register-only arithmetic instruction.
    unsafe {
        asm!("rcp.approx.ftz.f32 {o}, {i};", o = out(reg32) out, i = in(reg32) x.to_bits(),
             options(pure, nomem, nostack, preserves_flags));
    }
    f32::from_bits(out)
}

/// `1 / (1 + e^-x)`; exact limits 0 and 1 at the ends, no NaN for finite `x`.
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    recip(1.0 + exp(-x))
}

/// Hyperbolic tangent. Both forms are computed and one is selected: a branch between
/// them (LLVM cannot move the `ex2`/`rcp` asm into a select) ended the basic block, so
/// the 64 values of an epilogue half-fragment each paid the whole `ex2`, `rcp` latency
/// chain in turn (63 branches in `gemm_tma_bf16_nt_to_bf16`'s SASS).
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let a = fabs(x);
    // x - x^3/3 + 2x^5/15 - 17x^7/315: truncation < 1e-9 relative below 0.125.
    let x2 = x * x;
    let series = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))));
    // e^{2a} overflows to +inf for a > 44, giving exactly 1.
    let far = copysign(1.0 - 2.0 * recip(exp(2.0 * a) + 1.0), x);
    if a < 0.125 { series } else { far }
}

/// Complementary error function `1 - erf(x)`, accurate relative to its own (tiny) value
/// for large `x`, which is what GELU's negative tail needs.
#[inline(always)]
pub fn erfc(x: f32) -> f32 {
    let z = fabs(x);
    let t = recip(1.0 + 0.5 * z);
    let poly = -1.265_512_2
        + t * (1.000_023_7
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07 + t * (-1.135_204 + t * (1.488_515_9 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let r = t * exp(-z * z + poly);
    if x >= 0.0 { r } else { 2.0 - r }
}

/// Error function.
#[inline(always)]
pub fn erf(x: f32) -> f32 {
    1.0 - erfc(x)
}

#[inline(always)]
pub fn fabs(x: f32) -> f32 {
    f32::from_bits(x.to_bits() & 0x7fff_ffff)
}

#[inline(always)]
pub fn copysign(magnitude: f32, sign: f32) -> f32 {
    f32::from_bits((magnitude.to_bits() & 0x7fff_ffff) | (sign.to_bits() & 0x8000_0000))
}

/// Maximum that returns NaN if either input is NaN (PyTorch's `max` semantics;
/// `f32::max` would drop the NaN).
#[inline(always)]
pub fn max_nan(a: f32, b: f32) -> f32 {
    if a.is_nan() || a > b { a } else { b }
}

/// Fused multiply-add `a * b + c` with one rounding (`fma.rn.f32`).
#[inline(always)]
pub fn fma(a: f32, b: f32, c: f32) -> f32 {
    core::intrinsics::fmaf32(a, b, c)
}

/// Square root, correctly rounded (`sqrt.rn.f32`).
#[inline(always)]
pub fn sqrt(x: f32) -> f32 {
    core::intrinsics::sqrtf32(x)
}

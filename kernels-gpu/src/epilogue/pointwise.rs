//! Elementwise ops of the epilogue, forward `f` and derivative `df` side by side.
//!
//! Written from the math in shared/spec/models.md, on the fast functions of
//! `prelude::math` (accuracy stated there).

use crate::prelude::math::{erfc, exp, fma, recip, sigmoid};

/// `swish(x) = x * sigmoid(x)`
#[inline(always)]
pub fn swish(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `swish'(x) = s + x * s * (1 - s)`, `s = sigmoid(x)`. Needs the input.
#[inline(always)]
pub fn swish_grad(x: f32) -> f32 {
    let s = sigmoid(x);
    s * fma(x, 1.0 - s, 1.0)
}

/// `mish(x) = x * tanh(softplus(x))`. With `e = e^x`,
/// `tanh(log(1 + e)) = e (e + 2) / (e (e + 2) + 2)`: one `exp`, no cancellation.
/// Above 20, `tanh(softplus(x))` is 1 in f32 (and `e (e + 2)` would overflow near 44):
/// computed at `min(x, 20)` and selected, so a row of values has no branch (a NaN `x`
/// still gives NaN through the factor `x`).
#[inline(always)]
pub fn mish(x: f32) -> f32 {
    let e = exp(if x < 20.0 { x } else { 20.0 });
    let n = e * (e + 2.0);
    let y = x * n * recip(n + 2.0);
    if x > 20.0 { x } else { y }
}

/// `mish'(x) = t + x * sigmoid(x) * (1 - t^2)`, `t = tanh(softplus(x))`. Needs the input.
#[inline(always)]
pub fn mish_grad(x: f32) -> f32 {
    let e = exp(if x < 20.0 { x } else { 20.0 });
    let n = e * (e + 2.0);
    let t = n * recip(n + 2.0);
    let d = t + x * sigmoid(x) * (1.0 - t * t);
    if x > 20.0 { 1.0 } else { d }
}

const FRAC_1_SQRT_2: f32 = core::f32::consts::FRAC_1_SQRT_2;
/// `1 / sqrt(2 pi)`
const FRAC_1_SQRT_2PI: f32 = 0.398_942_3;

/// `gelu(x) = x * Phi(x) = 0.5 x erfc(-x / sqrt 2)` (exact form; erfc keeps the negative
/// tail accurate where `1 + erf` would cancel).
#[inline(always)]
pub fn gelu(x: f32) -> f32 {
    0.5 * x * erfc(-x * FRAC_1_SQRT_2)
}

/// `gelu'(x) = Phi(x) + x phi(x)`. Needs the input.
#[inline(always)]
pub fn gelu_grad(x: f32) -> f32 {
    0.5 * erfc(-x * FRAC_1_SQRT_2) + x * FRAC_1_SQRT_2PI * exp(-0.5 * x * x)
}

/// `leaky_relu(x) = x` for `x > 0`, else `slope * x`.
#[inline(always)]
pub fn leaky_relu(x: f32, slope: f32) -> f32 {
    if x > 0.0 { x } else { slope * x }
}

/// 1 for `x > 0`, else `slope` (PyTorch: `slope` at exactly 0). Needs the input.
#[inline(always)]
pub fn leaky_relu_grad(x: f32, slope: f32) -> f32 {
    if x > 0.0 { 1.0 } else { slope }
}

/// `clamp(x, lo, hi)`; NaN stays NaN.
#[inline(always)]
pub fn hardtanh(x: f32, lo: f32, hi: f32) -> f32 {
    if x < lo {
        lo
    } else if x > hi {
        hi
    } else {
        x
    }
}

/// 1 strictly inside `(lo, hi)`, else 0. Needs the input.
#[inline(always)]
pub fn hardtanh_grad(x: f32, lo: f32, hi: f32) -> f32 {
    if x > lo && x < hi { 1.0 } else { 0.0 }
}

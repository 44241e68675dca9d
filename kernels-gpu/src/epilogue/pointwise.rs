//! The per-element ops' math, forward `f` and derivatives side by side, one type per
//! op of `kernel_abi::ops` (the registry), and `match_pointwise!`, the one dispatch
//! from an op code to its type that every register layout and the kink scans use.
//!
//! Written from the ops' definitions (docs/MODELS.md), on the fast functions of
//! `prelude::math` (accuracy stated there).

use crate::prelude::math::{erfc, exp, fma, recip, sigmoid, tanh};
use kernel_abi::epilogue::OpDesc;
use kernel_abi::ops::Pointwise;

/// The math of one per-element op.
pub trait PointwiseMath {
    const OP: Pointwise;
    /// Whether it reads a per-channel parameter (`OpDesc::param0`).
    const HAS_PARAM: bool = !Self::OP.info().params.is_empty();
    /// `f(x)`: `p` is the op's parameter at `x`'s column (0 without one), `a` and `b`
    /// its arguments (`OpDesc::a`, `OpDesc::b`; passed as values, read before any
    /// branch, so that a clamp or a sign compiles to selects).
    fn forward(x: f32, p: f32, a: f32, b: f32) -> f32;
    /// `df/dx`. Needs the input.
    fn grad(x: f32, p: f32, a: f32, b: f32) -> f32;
    /// `df/dp` (ops with a parameter).
    #[inline(always)]
    fn param_grad(_x: f32) -> f32 {
        0.0
    }
}

/// `match code { <each per-element op> => { type P = <its math>; body } _ => other }`:
/// `body` is compiled once per op with `P` its [`PointwiseMath`], so in each arm the
/// op is a constant (no dispatch per value).
macro_rules! match_pointwise {
    ($code:expr, $P:ident => $body:expr, _ => $other:expr $(,)?) => {
        kernel_abi::for_each_pointwise!(crate::epilogue::pointwise::pointwise_arms!($code, $P, $body, $other))
    };
}

/// The arms of `match_pointwise!`, from the registry's list.
macro_rules! pointwise_arms {
    (($code:expr, $P:ident, $body:expr, $other:expr) [$($name:ident = $c:literal,)*]) => {
        match $code {
            $(kernel_abi::ops::code::$name => {
                type $P = crate::epilogue::pointwise::$name;
                $body
            })*
            _ => $other,
        }
    };
}
pub(crate) use {match_pointwise, pointwise_arms};

/// Parameter vectors of any op (`param0`, then `param1`), each with its gradient slot
/// in the backward: a per-element op's own, GroupNorm's gamma and beta, RMSNorm's weight.
#[inline(always)]
pub fn param_count(op: &OpDesc) -> usize {
    match op.code {
        kernel_abi::ops::OP_GROUP_NORM => 2,
        kernel_abi::ops::OP_RMS_NORM => 1,
        code => match_pointwise!(code, P => usize::from(P::HAS_PARAM), _ => 0),
    }
}

/// `x + bias[c]`.
pub struct Bias;
impl PointwiseMath for Bias {
    const OP: Pointwise = Pointwise::Bias;
    #[inline(always)]
    fn forward(x: f32, p: f32, _: f32, _: f32) -> f32 {
        x + p
    }
    #[inline(always)]
    fn grad(_: f32, _: f32, _: f32, _: f32) -> f32 {
        1.0
    }
    #[inline(always)]
    fn param_grad(_: f32) -> f32 {
        1.0
    }
}

/// `x * w[c]`.
pub struct Mul;
impl PointwiseMath for Mul {
    const OP: Pointwise = Pointwise::Mul;
    #[inline(always)]
    fn forward(x: f32, p: f32, _: f32, _: f32) -> f32 {
        x * p
    }
    #[inline(always)]
    fn grad(_: f32, p: f32, _: f32, _: f32) -> f32 {
        p
    }
    #[inline(always)]
    fn param_grad(x: f32) -> f32 {
        x
    }
}

/// `s * x`, `s = a`.
pub struct Scale;
impl PointwiseMath for Scale {
    const OP: Pointwise = Pointwise::Scale;
    #[inline(always)]
    fn forward(x: f32, _: f32, a: f32, _: f32) -> f32 {
        x * a
    }
    #[inline(always)]
    fn grad(_: f32, _: f32, a: f32, _: f32) -> f32 {
        a
    }
}

/// `swish(x) = x * sigmoid(x)`; `swish'(x) = s + x * s * (1 - s)`, `s = sigmoid(x)`.
pub struct Swish;
impl PointwiseMath for Swish {
    const OP: Pointwise = Pointwise::Swish;
    #[inline(always)]
    fn forward(x: f32, _: f32, _: f32, _: f32) -> f32 {
        x * sigmoid(x)
    }
    #[inline(always)]
    fn grad(x: f32, _: f32, _: f32, _: f32) -> f32 {
        let s = sigmoid(x);
        s * fma(x, 1.0 - s, 1.0)
    }
}

/// `mish(x) = x * tanh(softplus(x))`. With `e = e^x`,
/// `tanh(log(1 + e)) = e (e + 2) / (e (e + 2) + 2)`: one `exp`, no cancellation.
/// Above 20, `tanh(softplus(x))` is 1 in f32 (and `e (e + 2)` would overflow near 44):
/// computed at `min(x, 20)` and selected, so a row of values has no branch (a NaN `x`
/// still gives NaN through the factor `x`).
/// `mish'(x) = t + x * sigmoid(x) * (1 - t^2)`, `t = tanh(softplus(x))`.
pub struct Mish;
impl PointwiseMath for Mish {
    const OP: Pointwise = Pointwise::Mish;
    #[inline(always)]
    fn forward(x: f32, _: f32, _: f32, _: f32) -> f32 {
        let e = exp(if x < 20.0 { x } else { 20.0 });
        let n = e * (e + 2.0);
        let y = x * n * recip(n + 2.0);
        if x > 20.0 { x } else { y }
    }
    #[inline(always)]
    fn grad(x: f32, _: f32, _: f32, _: f32) -> f32 {
        let e = exp(if x < 20.0 { x } else { 20.0 });
        let n = e * (e + 2.0);
        let t = n * recip(n + 2.0);
        let d = t + x * sigmoid(x) * (1.0 - t * t);
        if x > 20.0 { 1.0 } else { d }
    }
}

const FRAC_1_SQRT_2: f32 = core::f32::consts::FRAC_1_SQRT_2;
/// `1 / sqrt(2 pi)`
const FRAC_1_SQRT_2PI: f32 = 0.398_942_3;

/// `gelu(x) = x * Phi(x) = 0.5 x erfc(-x / sqrt 2)` (exact form; erfc keeps the negative
/// tail accurate where `1 + erf` would cancel); `gelu'(x) = Phi(x) + x phi(x)`.
pub struct Gelu;
impl PointwiseMath for Gelu {
    const OP: Pointwise = Pointwise::Gelu;
    #[inline(always)]
    fn forward(x: f32, _: f32, _: f32, _: f32) -> f32 {
        0.5 * x * erfc(-x * FRAC_1_SQRT_2)
    }
    #[inline(always)]
    fn grad(x: f32, _: f32, _: f32, _: f32) -> f32 {
        0.5 * erfc(-x * FRAC_1_SQRT_2) + x * FRAC_1_SQRT_2PI * exp(-0.5 * x * x)
    }
}

/// `x` for `x > 0`, else `slope * x` (`slope = a`); the derivative is `slope` at
/// exactly 0, as PyTorch's.
pub struct LeakyRelu;
impl PointwiseMath for LeakyRelu {
    const OP: Pointwise = Pointwise::LeakyRelu;
    #[inline(always)]
    fn forward(x: f32, _: f32, a: f32, _: f32) -> f32 {
        if x > 0.0 { x } else { a * x }
    }
    #[inline(always)]
    fn grad(x: f32, _: f32, a: f32, _: f32) -> f32 {
        if x > 0.0 { 1.0 } else { a }
    }
}

/// `clamp(x, a, b)`, NaN staying NaN; the derivative is 1 strictly inside, else 0.
pub struct Hardtanh;
impl PointwiseMath for Hardtanh {
    const OP: Pointwise = Pointwise::Hardtanh;
    #[inline(always)]
    fn forward(x: f32, _: f32, a: f32, b: f32) -> f32 {
        if x < a {
            a
        } else if x > b {
            b
        } else {
            x
        }
    }
    #[inline(always)]
    fn grad(x: f32, _: f32, a: f32, b: f32) -> f32 {
        if x > a && x < b { 1.0 } else { 0.0 }
    }
}

/// `tanh(x)`; `tanh'(x) = 1 - tanh(x)^2`.
pub struct Tanh;
impl PointwiseMath for Tanh {
    const OP: Pointwise = Pointwise::Tanh;
    #[inline(always)]
    fn forward(x: f32, _: f32, _: f32, _: f32) -> f32 {
        tanh(x)
    }
    #[inline(always)]
    fn grad(x: f32, _: f32, _: f32, _: f32) -> f32 {
        let t = tanh(x);
        fma(-t, t, 1.0)
    }
}

/// `sigmoid(x) = 1 / (1 + e^-x)`; `sigmoid'(x) = s (1 - s)`, `s = sigmoid(x)` (as
/// `s - s^2` in one rounding). Above ~17, `1 - s` is 0 in f32 where the derivative is
/// below 4e-8: an absolute error, far under the tolerances.
pub struct Sigmoid;
impl PointwiseMath for Sigmoid {
    const OP: Pointwise = Pointwise::Sigmoid;
    #[inline(always)]
    fn forward(x: f32, _: f32, _: f32, _: f32) -> f32 {
        sigmoid(x)
    }
    #[inline(always)]
    fn grad(x: f32, _: f32, _: f32, _: f32) -> f32 {
        let s = sigmoid(x);
        fma(-s, s, s)
    }
}

/// `sqrt(2 / pi)`
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
/// The cubic term of GELU's tanh approximation.
const GELU_TANH_CUBIC: f32 = 0.044_715;

/// GELU's tanh form, `x (1 + tanh(u)) / 2` with `u = sqrt(2/pi) (x + 0.044715 x^3)`,
/// computed as `x * sigmoid(2u)` (the same value: `(1 + tanh(u)) / 2 = sigmoid(2u)`),
/// which has no `1 + tanh` to cancel in the negative tail. With `s = sigmoid(2u)`,
/// `f'(x) = s + x * 2 s (1 - s) * sqrt(2/pi) (1 + 3 * 0.044715 x^2)`; where
/// `s (1 - s)` is 0 in f32 (|x| above ~10) the second term is selected away, so an
/// `x^2` that overflows gives no `0 * inf`.
pub struct GeluTanh;
impl PointwiseMath for GeluTanh {
    const OP: Pointwise = Pointwise::GeluTanh;
    #[inline(always)]
    fn forward(x: f32, _: f32, _: f32, _: f32) -> f32 {
        let x2 = x * x;
        x * sigmoid(2.0 * SQRT_2_OVER_PI * x * fma(GELU_TANH_CUBIC, x2, 1.0))
    }
    #[inline(always)]
    fn grad(x: f32, _: f32, _: f32, _: f32) -> f32 {
        let x2 = x * x;
        let s = sigmoid(2.0 * SQRT_2_OVER_PI * x * fma(GELU_TANH_CUBIC, x2, 1.0));
        let d = fma(-s, s, s);
        let g = fma(x * d, 2.0 * SQRT_2_OVER_PI * fma(3.0 * GELU_TANH_CUBIC, x2, 1.0), s);
        if d == 0.0 { s } else { g }
    }
}

//! Elementwise activations: each `f(x)` next to its derivative `f'(x)`. The backward
//! of every one is `dx = dy * f'(x)`, so it needs the input `x`.

use super::{Real, matrix_dims};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// `sigmoid(x) = 1 / (1 + e^-x)`, evaluated so that `exp` never overflows.
pub fn sigmoid<T: Real>(x: T) -> T {
    if x >= T::ZERO {
        T::ONE / (T::ONE + (-x).exp())
    } else {
        let e = x.exp();
        e / (T::ONE + e)
    }
}

/// `softplus(x) = ln(1 + e^x) = max(x, 0) + ln(1 + e^-|x|)`: the second form
/// neither overflows for large `x` nor loses `e^x` to rounding for very negative `x`.
pub fn softplus<T: Real>(x: T) -> T {
    let positive_part = if x > T::ZERO { x } else { T::ZERO };
    positive_part + (-x.abs()).exp().ln_1p()
}

/// Swish (SiLU): `f(x) = x sigmoid(x)`.
pub fn swish<T: Real>(x: T) -> T {
    x * sigmoid(x)
}

/// `f'(x) = s + x s (1 - s)` with `s = sigmoid(x)`.
pub fn swish_grad<T: Real>(x: T) -> T {
    let s = sigmoid(x);
    s * (T::ONE + x * (T::ONE - s))
}

/// Mish: `f(x) = x tanh(softplus(x))`.
pub fn mish<T: Real>(x: T) -> T {
    x * softplus(x).tanh()
}

/// `f'(x) = t + x (1 - t^2) sigmoid(x)` with `t = tanh(softplus(x))`
/// (`softplus' = sigmoid`, `tanh' = 1 - tanh^2`).
pub fn mish_grad<T: Real>(x: T) -> T {
    let t = softplus(x).tanh();
    t + x * (T::ONE - t * t) * sigmoid(x)
}

/// GELU, exact form: `f(x) = x Phi(x)`, `Phi(x) = (1 + erf(x / sqrt 2)) / 2`.
pub fn gelu<T: Real>(x: T) -> T {
    x * normal_cdf(x)
}

/// `f'(x) = Phi(x) + x phi(x)`, `phi(x) = e^(-x^2/2) / sqrt(2 pi)`.
pub fn gelu_grad<T: Real>(x: T) -> T {
    let inv_sqrt_2pi = T::from_f64_nearest(0.5 * std::f64::consts::FRAC_2_SQRT_PI * std::f64::consts::FRAC_1_SQRT_2);
    let pdf = (-x * x * T::from_f64_nearest(0.5)).exp() * inv_sqrt_2pi;
    normal_cdf(x) + x * pdf
}

fn normal_cdf<T: Real>(x: T) -> T {
    let half = T::from_f64_nearest(0.5);
    half * (T::ONE + (x * T::from_f64_nearest(std::f64::consts::FRAC_1_SQRT_2)).erf())
}

/// LeakyReLU: `f(x) = x` for `x > 0`, else `slope x`.
pub fn leaky_relu<T: Real>(x: T, slope: T) -> T {
    if x > T::ZERO { x } else { slope * x }
}

/// `f'(x) = 1` for `x > 0`, else `slope` (at exactly 0 too, as PyTorch).
pub fn leaky_relu_grad<T: Real>(x: T, slope: T) -> T {
    if x > T::ZERO { T::ONE } else { slope }
}

/// Hardtanh: `f(x) = clamp(x, min, max)`; NaN stays NaN (as `torch.clamp`).
pub fn hardtanh<T: Real>(x: T, min: T, max: T) -> T {
    if x < min {
        min
    } else if x > max {
        max
    } else {
        x
    }
}

/// `f'(x) = 1` strictly inside `(min, max)`, 0 at the bounds and outside (as
/// PyTorch, which also lets a NaN's gradient through: no comparison with NaN holds).
pub fn hardtanh_grad<T: Real>(x: T, min: T, max: T) -> T {
    if x <= min || x >= max { T::ZERO } else { T::ONE }
}

/// `y = f(x)` elementwise.
pub fn elementwise_forward<T: Real>(x: &Tensor<T>, f: impl Fn(T) -> T) -> Tensor<T> {
    x.map(f)
}

/// `dx = dy * f'(x)` elementwise; `x` is the forward's input.
pub fn elementwise_backward<T: Real>(x: &Tensor<T>, dy: &Tensor<T>, df: impl Fn(T) -> T) -> Result<Tensor<T>> {
    matrix_dims("x", x)?;
    if dy.shape() != x.shape() {
        return Err(Error::tensor("dy", format!("expected shape {:?}, got {:?}", x.shape(), dy.shape())));
    }
    let dx = x.data().iter().zip(dy.data()).map(|(&v, &g)| g * df(v)).collect();
    Tensor::new(x.shape(), dx)
}

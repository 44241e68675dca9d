//! The per-element ops (`kernel_abi::ops::Pointwise`): each `f(x)` next to its
//! derivative `f'(x)`, written from their definitions in `T` (f64 for the checks),
//! independently of the kernels. The backward of every one is `dx = dy * f'(x)`, so
//! it needs the input `x`; an op with a per-channel parameter `p` also sums
//! `dy * df/dp` over the batch.

use super::{Real, check_vector, matrix_dims};
use crate::chain::Pointwise;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// `f(x)` of a per-element op: `p` its parameter at `x`'s column (0 without one),
/// `a` and `b` its arguments.
pub fn pointwise<T: Real>(op: Pointwise, x: T, p: T, a: T, b: T) -> T {
    match op {
        Pointwise::Bias => x + p,
        Pointwise::Mul => x * p,
        Pointwise::Scale => a * x,
        Pointwise::Swish => swish(x),
        Pointwise::Mish => mish(x),
        Pointwise::Gelu => gelu(x),
        Pointwise::LeakyRelu => leaky_relu(x, a),
        Pointwise::Hardtanh => hardtanh(x, a, b),
        Pointwise::Tanh => x.tanh(),
        Pointwise::Sigmoid => sigmoid(x),
        Pointwise::GeluTanh => gelu_tanh(x),
    }
}

/// `(df/dx, df/dp)` of a per-element op at `x` (arguments as [`pointwise`]).
pub fn pointwise_grad<T: Real>(op: Pointwise, x: T, p: T, a: T, b: T) -> (T, T) {
    match op {
        Pointwise::Bias => (T::ONE, T::ONE),
        Pointwise::Mul => (p, x),
        Pointwise::Scale => (a, T::ZERO),
        Pointwise::Swish => (swish_grad(x), T::ZERO),
        Pointwise::Mish => (mish_grad(x), T::ZERO),
        Pointwise::Gelu => (gelu_grad(x), T::ZERO),
        Pointwise::LeakyRelu => (leaky_relu_grad(x, a), T::ZERO),
        Pointwise::Hardtanh => (hardtanh_grad(x, a, b), T::ZERO),
        Pointwise::Tanh => {
            let t = x.tanh();
            (T::ONE - t * t, T::ZERO)
        }
        Pointwise::Sigmoid => (sigmoid(x) * sigmoid(-x), T::ZERO),
        Pointwise::GeluTanh => (gelu_tanh_grad(x), T::ZERO),
    }
}

/// `y = f(x)` of a per-element op on `(B, C)`; `param` is its per-channel parameter
/// (`(C,)`) when it has one.
pub fn pointwise_forward<T: Real>(
    op: Pointwise,
    x: &Tensor<T>,
    param: Option<&Tensor<T>>,
    a: T,
    b: T,
) -> Result<Tensor<T>> {
    let (_, channels) = matrix_dims("x", x)?;
    let p = column_values(op, param, channels)?;
    let y = x.data().iter().enumerate().map(|(i, &v)| pointwise(op, v, p(i % channels), a, b)).collect();
    Tensor::new(x.shape(), y)
}

/// The backward of [`pointwise_forward`]: `dx = dy * df/dx` and, for an op with a
/// parameter, its gradient `sum_b dy * df/dp`.
pub fn pointwise_backward<T: Real>(
    op: Pointwise,
    x: &Tensor<T>,
    param: Option<&Tensor<T>>,
    dy: &Tensor<T>,
    a: T,
    b: T,
) -> Result<(Tensor<T>, Option<Tensor<T>>)> {
    let (_, channels) = matrix_dims("x", x)?;
    if dy.shape() != x.shape() {
        return Err(Error::tensor("dy", format!("expected shape {:?}, got {:?}", x.shape(), dy.shape())));
    }
    let p = column_values(op, param, channels)?;
    let mut dx = Vec::with_capacity(x.data().len());
    let mut dp = vec![T::ZERO; channels];
    for (i, (&v, &g)) in x.data().iter().zip(dy.data()).enumerate() {
        let (gx, gp) = pointwise_grad(op, v, p(i % channels), a, b);
        dx.push(g * gx);
        dp[i % channels] += g * gp;
    }
    let dp = if param.is_some() { Some(Tensor::new(&[channels], dp)?) } else { None };
    Ok((Tensor::new(x.shape(), dx)?, dp))
}

/// The op's parameter by column (0 for an op without one), checked against `channels`.
fn column_values<'a, T: Real>(
    op: Pointwise,
    param: Option<&'a Tensor<T>>,
    channels: usize,
) -> Result<impl Fn(usize) -> T + 'a> {
    let wanted = op.info().params;
    match (param, wanted.first()) {
        (Some(t), Some(name)) => check_vector(name, t, channels)?,
        (None, None) => {}
        _ => return Err(Error::Argument(format!("`{}` takes {} parameter(s)", op.name(), wanted.len()))),
    }
    Ok(move |c: usize| param.map_or(T::ZERO, |t| t.data()[c]))
}

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

/// GELU, exact form: `f(x) = x Phi(x)`, `Phi(x) = (1 + erf(x / sqrt 2)) / 2 =
/// erfc(-x / sqrt 2) / 2` (the second form: no `1 + erf` to cancel for negative `x`).
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
    half * (-x * T::from_f64_nearest(std::f64::consts::FRAC_1_SQRT_2)).erfc()
}

/// `u(x) = sqrt(2/pi) (x + 0.044715 x^3)` of GELU's tanh form, and `u'(x)`.
fn gelu_tanh_inner<T: Real>(x: T) -> (T, T) {
    let k = T::from_f64_nearest((2.0 / std::f64::consts::PI).sqrt());
    let c = T::from_f64_nearest(0.044715);
    let x2 = x * x;
    (k * x * (T::ONE + c * x2), k * (T::ONE + T::from_f64_nearest(3.0) * c * x2))
}

/// GELU, tanh form: `f(x) = x (1 + tanh(u)) / 2 = x sigmoid(2u)` (the second form
/// has no `1 + tanh(u)` to cancel for negative `x`).
pub fn gelu_tanh<T: Real>(x: T) -> T {
    let (u, _) = gelu_tanh_inner(x);
    x * sigmoid(u + u)
}

/// `f'(x) = s + 2 x s (1 - s) u'(x)` with `s = sigmoid(2u)`, `1 - s = sigmoid(-2u)`.
/// Where `s (1 - s)` is 0 (`|x|` large) the second term is too, also when `x^2` or
/// `x^3` overflows.
pub fn gelu_tanh_grad<T: Real>(x: T) -> T {
    let (u, du) = gelu_tanh_inner(x);
    let s = sigmoid(u + u);
    let d = s * sigmoid(-(u + u));
    if d == T::ZERO { s } else { s + (x + x) * d * du }
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

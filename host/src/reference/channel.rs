//! Per-channel and scalar affine ops on `(B, C)`. Their parameter gradients sum
//! over the batch, because one parameter value touches every row.

use super::{Real, check_vector, matrix_dims};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

fn check_dy<T: Copy>(x_shape: &[usize], dy: &Tensor<T>) -> Result<()> {
    if dy.shape() != x_shape {
        return Err(Error::tensor("dy", format!("expected shape {x_shape:?}, got {:?}", dy.shape())));
    }
    Ok(())
}

/// Bias add: `y[b, c] = x[b, c] + bias[c]`.
pub fn bias_forward<T: Real>(x: &Tensor<T>, bias: &Tensor<T>) -> Result<Tensor<T>> {
    let (_, channels) = matrix_dims("x", x)?;
    check_vector("bias", bias, channels)?;
    let mut y = x.clone();
    for row in y.data_mut().chunks_exact_mut(channels) {
        for (v, &b) in row.iter_mut().zip(bias.data()) {
            *v += b;
        }
    }
    Ok(y)
}

/// `dx = dy`, `dbias[c] = sum_b dy[b, c]`; needs nothing saved.
pub fn bias_backward<T: Real>(dy: &Tensor<T>) -> Result<(Tensor<T>, Tensor<T>)> {
    let (_, channels) = matrix_dims("dy", dy)?;
    Ok((dy.clone(), sum_over_batch(dy, channels, |_, g| g)))
}

/// Per-channel multiply: `y[b, c] = x[b, c] w[c]`.
pub fn channel_mul_forward<T: Real>(x: &Tensor<T>, w: &Tensor<T>) -> Result<Tensor<T>> {
    let (_, channels) = matrix_dims("x", x)?;
    check_vector("w", w, channels)?;
    let mut y = x.clone();
    for row in y.data_mut().chunks_exact_mut(channels) {
        for (v, &wc) in row.iter_mut().zip(w.data()) {
            *v *= wc;
        }
    }
    Ok(y)
}

/// `dx[b, c] = dy[b, c] w[c]`, `dw[c] = sum_b dy[b, c] x[b, c]`; needs `x` and `w`.
pub fn channel_mul_backward<T: Real>(x: &Tensor<T>, w: &Tensor<T>, dy: &Tensor<T>) -> Result<(Tensor<T>, Tensor<T>)> {
    let (_, channels) = matrix_dims("x", x)?;
    check_vector("w", w, channels)?;
    check_dy(x.shape(), dy)?;
    let dx = channel_mul_forward(dy, w)?;
    let dw = sum_over_batch(dy, channels, |i, g| g * x.data()[i]);
    Ok((dx, dw))
}

/// Scale: `y = s x`.
pub fn scale_forward<T: Real>(x: &Tensor<T>, s: T) -> Tensor<T> {
    x.map(|v| s * v)
}

/// `dx = s dy`; needs nothing saved.
pub fn scale_backward<T: Real>(dy: &Tensor<T>, s: T) -> Tensor<T> {
    dy.map(|g| s * g)
}

/// `out[c] = sum_b term(i, dy[b, c])`, `i` being the flat index of `(b, c)`.
fn sum_over_batch<T: Real>(dy: &Tensor<T>, channels: usize, term: impl Fn(usize, T) -> T) -> Tensor<T> {
    let mut out = vec![T::ZERO; channels];
    for (i, &g) in dy.data().iter().enumerate() {
        out[i % channels] += term(i, g);
    }
    Tensor::new(&[channels], out).expect("one value per channel")
}

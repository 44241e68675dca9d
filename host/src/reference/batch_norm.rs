//! BatchNorm1d in training mode over `(N, C)`: each channel's statistics over the `N`
//! rows (the one op of a chain that mixes rows).
//!
//! * forward: per channel `c`, `mean = sum_n(x)/N`, `var = sum_n((x - mean)^2)/N`
//!   (biased, two passes), `rstd = 1/sqrt(var + eps)`, `xhat = (x - mean) rstd`,
//!   `y = xhat gamma[c] + beta[c]`.
//! * backward, given `dy`: `dbeta[c] = sum_n dy`, `dgamma[c] = sum_n dy xhat`, and
//!   `dx = gamma rstd (dy - dbeta/N - xhat dgamma/N)` (the paths through the mean and
//!   the variance). The running statistics are the caller's: [`BatchNormStats::var`]
//!   is the biased variance, `N/(N-1)` times it the unbiased one PyTorch keeps.

use super::{Real, check_vector, matrix_dims};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Each channel's batch mean and `1 / sqrt(var + eps)`, and the biased variance.
#[derive(Clone, Debug, PartialEq)]
pub struct BatchNormStats<T> {
    pub mean: Vec<T>,
    pub var: Vec<T>,
    pub rstd: Vec<T>,
}

/// `x` (N,C), `gamma`, `beta` (C,) → `y` (N,C) and the statistics the backward needs.
pub fn batch_norm_forward<T: Real>(
    x: &Tensor<T>,
    eps: T,
    gamma: &Tensor<T>,
    beta: &Tensor<T>,
) -> Result<(Tensor<T>, BatchNormStats<T>)> {
    let (rows, channels) = matrix_dims("x", x)?;
    check_vector("bn.weight", gamma, channels)?;
    check_vector("bn.bias", beta, channels)?;
    if eps.is_nan() || eps <= T::ZERO {
        return Err(Error::Argument(format!("batchnorm: eps must be positive, got {eps}")));
    }
    if rows < 2 {
        return Err(Error::Shape(format!(
            "batchnorm: the batch statistics need more than 1 row, got {rows} (PyTorch: \"Expected more than \
             1 value per channel when training\")"
        )));
    }
    let count = T::from_count(rows);
    let mut stats = BatchNormStats { mean: Vec::new(), var: Vec::new(), rstd: Vec::new() };
    for c in 0..channels {
        let column = || (0..rows).map(|n| x.row(n)[c]);
        let mut sum = T::ZERO;
        for v in column() {
            sum += v;
        }
        let mean = sum / count;
        let mut sum_sq = T::ZERO;
        for v in column() {
            sum_sq += (v - mean) * (v - mean);
        }
        let var = sum_sq / count;
        stats.mean.push(mean);
        stats.var.push(var);
        stats.rstd.push(T::ONE / (var + eps).sqrt());
    }
    let (gamma, beta) = (gamma.data(), beta.data());
    let y = Tensor::from_fn(&[rows, channels], |i| {
        let c = i % channels;
        (x.data()[i] - stats.mean[c]) * stats.rstd[c] * gamma[c] + beta[c]
    })?;
    Ok((y, stats))
}

/// `dx`, `dgamma`, `dbeta` from the forward's input and statistics.
pub fn batch_norm_backward<T: Real>(
    x: &Tensor<T>,
    stats: &BatchNormStats<T>,
    gamma: &Tensor<T>,
    dy: &Tensor<T>,
) -> Result<(Tensor<T>, Tensor<T>, Tensor<T>)> {
    let (rows, channels) = matrix_dims("x", x)?;
    check_vector("bn.weight", gamma, channels)?;
    if dy.shape() != x.shape() {
        return Err(Error::tensor("dy", format!("expected shape {:?}, got {:?}", x.shape(), dy.shape())));
    }
    let count = T::from_count(rows);
    let xhat = |n: usize, c: usize| (x.row(n)[c] - stats.mean[c]) * stats.rstd[c];
    let mut dgamma = vec![T::ZERO; channels];
    let mut dbeta = vec![T::ZERO; channels];
    for c in 0..channels {
        for n in 0..rows {
            let d = dy.row(n)[c];
            dbeta[c] += d;
            dgamma[c] += d * xhat(n, c);
        }
    }
    let gamma = gamma.data();
    let dx = Tensor::from_fn(&[rows, channels], |i| {
        let (n, c) = (i / channels, i % channels);
        gamma[c] * stats.rstd[c] * (dy.row(n)[c] - dbeta[c] / count - xhat(n, c) * dgamma[c] / count)
    })?;
    Ok((dx, Tensor::new(&[channels], dgamma)?, Tensor::new(&[channels], dbeta)?))
}

/// The running statistics after one training step, as `nn.BatchNorm1d` updates them:
/// `(1 - momentum) old + momentum batch`, the variance unbiased (`N / (N - 1)`).
pub fn running_stats_update<T: Real>(
    stats: &BatchNormStats<T>,
    rows: usize,
    momentum: T,
    running_mean: &mut [T],
    running_var: &mut [T],
) {
    let unbias = T::from_count(rows) / T::from_count(rows - 1);
    for (c, (m, v)) in running_mean.iter_mut().zip(running_var.iter_mut()).enumerate() {
        *m = (T::ONE - momentum) * *m + momentum * stats.mean[c];
        *v = (T::ONE - momentum) * *v + momentum * stats.var[c] * unbias;
    }
}

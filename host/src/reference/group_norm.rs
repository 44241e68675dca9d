//! GroupNorm over `(B, C)`: the `C` channels form `G` groups of `n = C/G`
//! consecutive channels; statistics are per row and per group, never across rows.
//!
//! * forward: `mean = sum(x)/n`, `var = sum((x - mean)^2)/n` (biased, two passes),
//!   `rstd = 1/sqrt(var + eps)`, `xhat = (x - mean) rstd`,
//!   `y[c] = xhat[c] gamma[c] + beta[c]`.
//! * backward, given `dy`: `dbeta[c] = sum_b dy`, `dgamma[c] = sum_b dy xhat`;
//!   with `g = dy gamma` and means over the group,
//!   `dx = rstd (g - mean(g) - xhat mean(g xhat))`
//!   (the two subtracted terms are the paths through `mean` and through `var`).
//!   The backward needs `x`, each group's `mean` and `rstd`, and `gamma`.

use super::{Real, check_vector, matrix_dims};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Per-row, per-group statistics of a forward pass, row-major `(B, G)`.
#[derive(Clone, Debug, PartialEq)]
pub struct GroupNormStats<T> {
    pub groups: usize,
    pub mean: Vec<T>,
    /// `1 / sqrt(var + eps)`.
    pub rstd: Vec<T>,
}

/// Channels per group, or why `groups` does not divide `channels`.
fn group_size(channels: usize, groups: usize) -> Result<usize> {
    if groups == 0 || !channels.is_multiple_of(groups) {
        return Err(Error::Argument(format!(
            "groupnorm({groups}): the number of groups must divide the {channels} channels"
        )));
    }
    Ok(channels / groups)
}

/// `x` (B,C), `gamma`, `beta` (C,) → `y` (B,C) and the statistics the backward needs.
pub fn group_norm_forward<T: Real>(
    x: &Tensor<T>,
    groups: usize,
    eps: T,
    gamma: &Tensor<T>,
    beta: &Tensor<T>,
) -> Result<(Tensor<T>, GroupNormStats<T>)> {
    let (batch, channels) = matrix_dims("x", x)?;
    let n = group_size(channels, groups)?;
    check_vector("gn.weight", gamma, channels)?;
    check_vector("gn.bias", beta, channels)?;
    if eps.is_nan() || eps <= T::ZERO {
        return Err(Error::Argument(format!("groupnorm: eps must be positive, got {eps}")));
    }

    let (gamma, beta) = (gamma.data(), beta.data());
    // Means divide by `n` rather than multiply by a rounded `1 / n` (one rounding less).
    let count = T::from_count(n);
    let mut y = Tensor::full(&[batch, channels], T::ZERO)?;
    let mut stats =
        GroupNormStats { groups, mean: Vec::with_capacity(batch * groups), rstd: Vec::with_capacity(batch * groups) };
    for b in 0..batch {
        for g in 0..groups {
            let channels_of_group = g * n..(g + 1) * n;
            let xs = &x.row(b)[channels_of_group.clone()];
            let mut sum = T::ZERO;
            for &v in xs {
                sum += v;
            }
            // One correction pass (the corrected two-pass algorithm): the mean of the
            // residuals `x - mean` (exact by Sterbenz where they are small) fixes the
            // sum's rounding, so a group of equal values gets exactly that mean, `xhat`
            // = 0 and an exactly zero `dgamma` (without it, ~1e-13 against the GPU's 0
            // failed a relative comparison: an analytically zero result has no scale).
            let mean = sum / count;
            let mut residual = T::ZERO;
            for &v in xs {
                residual += v - mean;
            }
            let mean = mean + residual / count;
            let mut sum_sq = T::ZERO;
            for &v in xs {
                sum_sq += (v - mean) * (v - mean);
            }
            let var = sum_sq / count;
            let rstd = T::ONE / (var + eps).sqrt();
            let ys = &mut y.data_mut()[b * channels..(b + 1) * channels];
            for c in channels_of_group {
                let xhat = (x.row(b)[c] - mean) * rstd;
                ys[c] = xhat * gamma[c] + beta[c];
            }
            stats.mean.push(mean);
            stats.rstd.push(rstd);
        }
    }
    Ok((y, stats))
}

/// `x` (B,C) as given to the forward, its `stats`, `gamma` (C,) and `dy` (B,C)
/// → `(dx (B,C), dgamma (C,), dbeta (C,))`.
pub fn group_norm_backward<T: Real>(
    x: &Tensor<T>,
    stats: &GroupNormStats<T>,
    gamma: &Tensor<T>,
    dy: &Tensor<T>,
) -> Result<(Tensor<T>, Tensor<T>, Tensor<T>)> {
    let (batch, channels) = matrix_dims("x", x)?;
    let groups = stats.groups;
    let n = group_size(channels, groups)?;
    check_vector("gn.weight", gamma, channels)?;
    if dy.shape() != x.shape() {
        return Err(Error::tensor("dy", format!("expected shape {:?}, got {:?}", x.shape(), dy.shape())));
    }
    if stats.mean.len() != batch * groups || stats.rstd.len() != batch * groups {
        return Err(Error::Argument(format!("groupnorm backward: statistics for {batch} x {groups} groups expected")));
    }

    let gamma = gamma.data();
    let count = T::from_count(n);
    let mut dx = Tensor::full(&[batch, channels], T::ZERO)?;
    let mut dgamma = vec![T::ZERO; channels];
    let mut dbeta = vec![T::ZERO; channels];
    for b in 0..batch {
        let (xs, dys) = (x.row(b), dy.row(b));
        for g in 0..groups {
            let (mean, rstd) = (stats.mean[b * groups + g], stats.rstd[b * groups + g]);
            let channels_of_group = g * n..(g + 1) * n;
            // Group means of g = dy*gamma and of g*xhat.
            let (mut sum_g, mut sum_g_xhat) = (T::ZERO, T::ZERO);
            for c in channels_of_group.clone() {
                let xhat = (xs[c] - mean) * rstd;
                let gc = dys[c] * gamma[c];
                sum_g += gc;
                sum_g_xhat += gc * xhat;
                dgamma[c] += dys[c] * xhat;
                dbeta[c] += dys[c];
            }
            let (mean_g, mean_g_xhat) = (sum_g / count, sum_g_xhat / count);
            let dxs = &mut dx.data_mut()[b * channels..(b + 1) * channels];
            for c in channels_of_group {
                let xhat = (xs[c] - mean) * rstd;
                dxs[c] = rstd * (dys[c] * gamma[c] - mean_g - xhat * mean_g_xhat);
            }
        }
    }
    Ok((dx, Tensor::new(&[channels], dgamma)?, Tensor::new(&[channels], dbeta)?))
}

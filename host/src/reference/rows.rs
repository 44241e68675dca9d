//! The whole-row ops over `(B, F)` besides GroupNorm, AvgPool and the row max: the
//! row reductions `sum`, `mean`, `min`, `logsumexp` (to `(B, 1)`), softmax, MaxPool1d
//! and RMSNorm, each forward and backward from its formula.
//!
//! * `sum`: `dx[j] = dy`; `mean`: `dy / F`; `min`: `dy` at the first minimum (the
//!   first NaN if any), 0 elsewhere; `logsumexp`: `y = log(sum(exp(x)))`,
//!   `dx[j] = dy exp(x[j] - y)`.
//! * softmax: `s = exp(x) / sum(exp(x))`, `dx = s (dy - sum(dy s))`.
//! * MaxPool1d(k), stride `k`: `y[j] = max(x[j k .. j k + k])`; the gradient goes to
//!   each window's first maximum (first NaN); the `F mod k` trailing inputs get 0.
//! * RMSNorm: `r = 1 / sqrt(mean(x^2) + eps)`, `xhat = x r`, `y = xhat w`;
//!   `dx = r (dy w - xhat mean(dy w xhat))`, `dw = sum_b dy xhat`.

use super::reduce::pick;
use super::{Real, check_vector, matrix_dims};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Checks that `dy` has `shape`.
fn check_dy<T: Copy>(dy: &Tensor<T>, shape: &[usize]) -> Result<()> {
    if dy.shape() != shape {
        return Err(Error::tensor("dy", format!("expected shape {shape:?}, got {:?}", dy.shape())));
    }
    Ok(())
}

/// Sum (or, with `mean`, mean) of each row: `(B, F) -> (B, 1)`.
pub fn row_sum_forward<T: Real>(x: &Tensor<T>, mean: bool) -> Result<Tensor<T>> {
    let (batch, features) = matrix_dims("x", x)?;
    let y = (0..batch)
        .map(|b| {
            let s = x.row(b).iter().fold(T::ZERO, |a, &v| a + v);
            if mean { s / T::from_count(features) } else { s }
        })
        .collect();
    Tensor::new(&[batch, 1], y)
}

/// `dx[b, j] = dy[b]` (divided by `F` for the mean).
pub fn row_sum_backward<T: Real>(dy: &Tensor<T>, mean: bool, in_features: usize) -> Result<Tensor<T>> {
    let batch = dy.shape().first().copied().unwrap_or(0);
    check_dy(dy, &[batch, 1])?;
    let scale = if mean { T::ONE / T::from_count(in_features) } else { T::ONE };
    Tensor::from_fn(&[batch, in_features], |i| dy.data()[i / in_features] * scale)
}

/// Min over features: `(B, F) -> (B,)`, and each row's index of it (as
/// `torch.min(dim=1)`: the first of equal minima, the first NaN if there is one).
pub fn row_min_forward<T: Real>(x: &Tensor<T>) -> Result<(Tensor<T>, Vec<usize>)> {
    super::reduce::row_pick_forward(x, "min", |v, best| v < best)
}

/// `log(sum(exp(x)))` of each row, `(B, F) -> (B, 1)`, shifted by the row max (by 0
/// where that max is infinite: `-inf` for a row of `-inf`, `inf` for one with `inf`).
pub fn logsumexp_forward<T: Real>(x: &Tensor<T>) -> Result<Tensor<T>> {
    let (batch, _) = matrix_dims("x", x)?;
    let y = (0..batch)
        .map(|b| {
            let row = x.row(b);
            let m = row[pick(row, |v, best| v > best)];
            let shift = if m.to_f64().is_infinite() { T::ZERO } else { m };
            shift + row.iter().fold(T::ZERO, |a, &v| a + (v - shift).exp()).ln()
        })
        .collect();
    Tensor::new(&[batch, 1], y)
}

/// `dx[b, j] = dy[b] exp(x[b, j] - y[b])`, `y` the forward's output.
pub fn logsumexp_backward<T: Real>(x: &Tensor<T>, y: &Tensor<T>, dy: &Tensor<T>) -> Result<Tensor<T>> {
    let (batch, features) = matrix_dims("x", x)?;
    check_dy(dy, &[batch, 1])?;
    check_dy(y, &[batch, 1]).map_err(|_| Error::Argument("logsumexp backward: the saved output's shape".into()))?;
    Tensor::from_fn(&[batch, features], |i| {
        let b = i / features;
        dy.data()[b] * (x.data()[i] - y.data()[b]).exp()
    })
}

/// Softmax of each row (shape kept), shifted by the row max.
pub fn softmax_forward<T: Real>(x: &Tensor<T>) -> Result<Tensor<T>> {
    let (batch, features) = matrix_dims("x", x)?;
    let mut y = Vec::with_capacity(batch * features);
    for b in 0..batch {
        let row = x.row(b);
        let m = row[pick(row, |v, best| v > best)];
        let e: Vec<T> = row.iter().map(|&v| (v - m).exp()).collect();
        let s = e.iter().fold(T::ZERO, |a, &v| a + v);
        y.extend(e.into_iter().map(|v| v / s));
    }
    Tensor::new(&[batch, features], y)
}

/// `dx = s (dy - sum(dy s))` per row, `s` the forward's output.
pub fn softmax_backward<T: Real>(s: &Tensor<T>, dy: &Tensor<T>) -> Result<Tensor<T>> {
    let (batch, features) = matrix_dims("s", s)?;
    check_dy(dy, s.shape())?;
    let mut dx = Vec::with_capacity(batch * features);
    for b in 0..batch {
        let (sr, dr) = (s.row(b), dy.row(b));
        let dot = sr.iter().zip(dr).fold(T::ZERO, |a, (&p, &d)| a + p * d);
        dx.extend(sr.iter().zip(dr).map(|(&p, &d)| p * (d - dot)));
    }
    Tensor::new(&[batch, features], dx)
}

/// MaxPool1d(k), stride `k`, no padding: `(B, F) -> (B, F / k)`, and the input index
/// each output came from (the window's first maximum, or its first NaN).
pub fn max_pool_forward<T: Real>(x: &Tensor<T>, k: usize) -> Result<(Tensor<T>, Vec<usize>)> {
    let (batch, features) = matrix_dims("x", x)?;
    if k == 0 || k > features {
        return Err(Error::Argument(format!("maxpool({k}): kernel must be between 1 and the {features} features")));
    }
    let out = features / k;
    let (mut y, mut from) = (Vec::with_capacity(batch * out), Vec::with_capacity(batch * out));
    for b in 0..batch {
        let row = x.row(b);
        for j in 0..out {
            let best = j * k + pick(&row[j * k..(j + 1) * k], |v, best| v > best);
            y.push(row[best]);
            from.push(best);
        }
    }
    Ok((Tensor::new(&[batch, out], y)?, from))
}

/// `dx[b, from[b, j]] = dy[b, j]`, 0 elsewhere.
pub fn max_pool_backward<T: Real>(dy: &Tensor<T>, from: &[usize], in_features: usize) -> Result<Tensor<T>> {
    let (batch, out) = matrix_dims("dy", dy)?;
    if from.len() != batch * out {
        return Err(Error::tensor("dy", format!("expected {} outputs of maxpool, got {:?}", from.len(), dy.shape())));
    }
    let mut dx = Tensor::full(&[batch, in_features], T::ZERO)?;
    for (i, &f) in from.iter().enumerate() {
        if f >= in_features {
            return Err(Error::Argument(format!("maxpool backward: index {f} outside {in_features} features")));
        }
        dx.data_mut()[i / out * in_features + f] = dy.data()[i];
    }
    Ok(dx)
}

/// RMSNorm of each row with weight `w` `(F,)`: the output and each row's `r`.
pub fn rms_norm_forward<T: Real>(x: &Tensor<T>, eps: T, w: &Tensor<T>) -> Result<(Tensor<T>, Vec<T>)> {
    let (batch, features) = matrix_dims("x", x)?;
    check_vector("rms.weight", w, features)?;
    if eps.is_nan() || eps <= T::ZERO {
        return Err(Error::Argument(format!("rmsnorm: eps must be positive, got {eps}")));
    }
    let (mut y, mut rstd) = (Vec::with_capacity(batch * features), Vec::with_capacity(batch));
    for b in 0..batch {
        let row = x.row(b);
        let ms = row.iter().fold(T::ZERO, |a, &v| a + v * v) / T::from_count(features);
        let r = T::ONE / (ms + eps).sqrt();
        y.extend(row.iter().zip(w.data()).map(|(&v, &wc)| v * r * wc));
        rstd.push(r);
    }
    Ok((Tensor::new(&[batch, features], y)?, rstd))
}

/// `(dx, dw)` of RMSNorm from its input, each row's `r`, `w` and `dy`.
pub fn rms_norm_backward<T: Real>(
    x: &Tensor<T>,
    rstd: &[T],
    w: &Tensor<T>,
    dy: &Tensor<T>,
) -> Result<(Tensor<T>, Tensor<T>)> {
    let (batch, features) = matrix_dims("x", x)?;
    check_vector("rms.weight", w, features)?;
    check_dy(dy, x.shape())?;
    if rstd.len() != batch {
        return Err(Error::Argument(format!("rmsnorm backward: {batch} rows' statistics expected")));
    }
    let w = w.data();
    let mut dx = Vec::with_capacity(batch * features);
    let mut dw = vec![T::ZERO; features];
    for (b, &r) in rstd.iter().enumerate() {
        let (xs, ds) = (x.row(b), dy.row(b));
        let mut dot = T::ZERO;
        for c in 0..features {
            dot += ds[c] * w[c] * xs[c] * r;
            dw[c] += ds[c] * xs[c] * r;
        }
        let m = dot / T::from_count(features);
        dx.extend((0..features).map(|c| r * (ds[c] * w[c] - xs[c] * r * m)));
    }
    Ok((Tensor::new(&[batch, features], dx)?, Tensor::new(&[features], dw)?))
}

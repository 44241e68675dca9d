//! Reductions over the feature axis of `(B, F)`.

use super::{Real, matrix_dims};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// AvgPool1d(k) over features, stride `k`, no padding: `(B, F) -> (B, floor(F/k))`,
/// `y[b, j] = sum_{i<k} x[b, j k + i] / k`.
pub fn avg_pool_forward<T: Real>(x: &Tensor<T>, k: usize) -> Result<Tensor<T>> {
    let (batch, features) = matrix_dims("x", x)?;
    if k == 0 || k > features {
        return Err(Error::Argument(format!("avgpool({k}): kernel must be between 1 and the {features} features")));
    }
    let out = features / k;
    let inv_k = T::ONE / T::from_count(k);
    let mut y = Vec::with_capacity(batch * out);
    for b in 0..batch {
        let row = x.row(b);
        for j in 0..out {
            let mut sum = T::ZERO;
            for &v in &row[j * k..(j + 1) * k] {
                sum += v;
            }
            y.push(sum * inv_k);
        }
    }
    Tensor::new(&[batch, out], y)
}

/// `dx[b, j k + i] = dy[b, j] / k`; the trailing `F mod k` features, which no
/// output reads, get 0. Needs only the input's feature count.
pub fn avg_pool_backward<T: Real>(dy: &Tensor<T>, k: usize, in_features: usize) -> Result<Tensor<T>> {
    let (batch, out) = matrix_dims("dy", dy)?;
    if k == 0 || k > in_features || in_features / k != out {
        return Err(Error::tensor(
            "dy",
            format!(
                "avgpool({k}) of {in_features} features gives (batch, {}), got {:?}",
                in_features / k.max(1),
                dy.shape()
            ),
        ));
    }
    let inv_k = T::ONE / T::from_count(k);
    let mut dx = Tensor::full(&[batch, in_features], T::ZERO)?;
    for b in 0..batch {
        let dxs = &mut dx.data_mut()[b * in_features..(b + 1) * in_features];
        for j in 0..out {
            for v in &mut dxs[j * k..(j + 1) * k] {
                *v = dy.row(b)[j] * inv_k;
            }
        }
    }
    Ok(dx)
}

/// Max over features: `(B, F) -> (B,)`, and the index of each row's maximum
/// (what the backward needs). As `torch.max(dim=1)`: ties go to the first
/// occurrence, and a row holding NaN has max NaN at its first NaN.
pub fn row_max_forward<T: Real>(x: &Tensor<T>) -> Result<(Tensor<T>, Vec<usize>)> {
    row_pick_forward(x, "max", |v, best| v > best)
}

/// Each row's value that `beats` every earlier one (the first of equals), or its first
/// NaN, with its index: the row max or min as PyTorch picks them.
pub(super) fn row_pick_forward<T: Real>(
    x: &Tensor<T>,
    what: &str,
    beats: impl Fn(T, T) -> bool,
) -> Result<(Tensor<T>, Vec<usize>)> {
    let (batch, features) = matrix_dims("x", x)?;
    if features == 0 {
        return Err(Error::tensor("x", format!("{what} over an empty feature axis")));
    }
    let picked: Vec<usize> = (0..batch).map(|b| pick(x.row(b), &beats)).collect();
    let y = picked.iter().enumerate().map(|(b, &i)| x.row(b)[i]).collect();
    Ok((Tensor::new(&[batch], y)?, picked))
}

/// The index in `values` (not empty) of the first value that `beats` every earlier one
/// (`>`: the first maximum), or of the first NaN: the element PyTorch's max, min and
/// MaxPool pick.
pub(super) fn pick<T: Real>(values: &[T], beats: impl Fn(T, T) -> bool) -> usize {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate().skip(1) {
        if values[best].is_nan() {
            break;
        }
        if v.is_nan() || beats(v, values[best]) {
            best = i;
        }
    }
    best
}

/// `dx[b, argmax[b]] = dy[b]`, 0 elsewhere.
pub fn row_max_backward<T: Real>(dy: &Tensor<T>, argmax: &[usize], in_features: usize) -> Result<Tensor<T>> {
    let batch = argmax.len();
    if dy.shape() != [batch] {
        return Err(Error::tensor("dy", format!("expected shape [{batch}], got {:?}", dy.shape())));
    }
    let mut dx = Tensor::full(&[batch, in_features], T::ZERO)?;
    for (b, &i) in argmax.iter().enumerate() {
        if i >= in_features {
            return Err(Error::Argument(format!("row max backward: index {i} outside {in_features} features")));
        }
        dx.data_mut()[b * in_features + i] = dy.data()[b];
    }
    Ok(dx)
}

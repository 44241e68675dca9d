//! The Linear layer, `y = x W^T + b`.
//!
//! * forward: `y[b, n] = sum_k x[b, k] W[n, k] + bias[n]`
//! * backward, given `dy = dL/dy`: `dx = dy W` (B,K), `dW = dy^T x` (N,K),
//!   `db[n] = sum_b dy[b, n]`. The backward needs `x` and `W`.
//!
//! The GEMMs go through `nalgebra`, which is column-major. A row-major `(R, C)`
//! buffer read column-major is the `(C, R)` matrix, its transpose; so every product
//! below is the transposed one, and the column-major result is the row-major answer:
//! with `xc = x^T` (K,B), `wc = W^T` (K,N) and `dyc = dy^T` (N,B):
//! * `y^T  = W x^T   = wc^T xc`   (N,B) → row-major `y` (B,N)
//! * `dx^T = W^T dy^T = wc dyc`   (K,B) → row-major `dx` (B,K)
//! * `dW^T = x^T dy   = xc dyc^T` (K,N) → row-major `dW` (N,K)

use super::{Real, check_vector, matrix_dims};
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use nalgebra::DMatrixView;

/// `x` (B,K), `w` (N,K), `b` (N,) → `y` (B,N).
pub fn linear_forward<T: Real>(x: &Tensor<T>, w: &Tensor<T>, b: &Tensor<T>) -> Result<Tensor<T>> {
    let (batch, k, n) = linear_dims(x, w)?;
    check_vector("lin.bias", b, n)?;

    let xc = DMatrixView::from_slice(x.data(), k, batch);
    let wc = DMatrixView::from_slice(w.data(), k, n);
    let yc = wc.tr_mul(&xc); // (N,B) column-major = (B,N) row-major
    let mut y = Tensor::new(&[batch, n], yc.as_slice().to_vec())?;
    for row in y.data_mut().chunks_exact_mut(n) {
        for (v, &bias) in row.iter_mut().zip(b.data()) {
            *v += bias;
        }
    }
    Ok(y)
}

/// `x` (B,K), `w` (N,K), `dy` (B,N) → `(dx (B,K), dW (N,K), db (N,))`.
pub fn linear_backward<T: Real>(
    x: &Tensor<T>,
    w: &Tensor<T>,
    dy: &Tensor<T>,
) -> Result<(Tensor<T>, Tensor<T>, Tensor<T>)> {
    let (batch, k, n) = linear_dims(x, w)?;
    if dy.shape() != [batch, n] {
        return Err(Error::tensor("dy", format!("expected shape [{batch}, {n}], got {:?}", dy.shape())));
    }

    let xc = DMatrixView::from_slice(x.data(), k, batch);
    let wc = DMatrixView::from_slice(w.data(), k, n);
    let dyc = DMatrixView::from_slice(dy.data(), n, batch);
    let dxc = wc * dyc; // (K,B) column-major = (B,K) row-major
    let dwc = xc * dyc.transpose(); // (K,N) column-major = (N,K) row-major
    let dx = Tensor::new(&[batch, k], dxc.as_slice().to_vec())?;
    let dw = Tensor::new(&[n, k], dwc.as_slice().to_vec())?;

    let mut db = vec![T::ZERO; n];
    for row in dy.data().chunks_exact(n) {
        for (acc, &g) in db.iter_mut().zip(row) {
            *acc += g;
        }
    }
    Ok((dx, dw, Tensor::new(&[n], db)?))
}

/// `(batch, in, out)` of `x` (B,K) and `w` (N,K), or why they do not fit.
fn linear_dims<T: Copy>(x: &Tensor<T>, w: &Tensor<T>) -> Result<(usize, usize, usize)> {
    let (batch, k) = matrix_dims("x", x)?;
    let (n, wk) = matrix_dims("lin.weight", w)?;
    if wk != k {
        return Err(Error::Shape(format!("x has {k} features, the Linear weight {:?} expects {wk}", w.shape())));
    }
    Ok((batch, k, n))
}

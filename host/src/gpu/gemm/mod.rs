//! Launchers of the GEMM family (`kernels-gpu/src/gemm`).

pub mod simt;
pub mod tma;

use super::DeviceTensor;
use crate::error::{Error, Result};

/// Checks a Linear layer's `x (m, k)` against its weight `w (n, k)`; returns `(m, n, k)`.
pub fn linear_dims(x: &DeviceTensor, w: &DeviceTensor) -> Result<(usize, usize, usize)> {
    let (m, k) = match x.shape[..] {
        [m, k] => (m, k),
        _ => return Err(Error::tensor("x", format!("expected 2 dimensions, got {:?}", x.shape))),
    };
    match w.shape[..] {
        [n, wk] if wk == k => Ok((m, n, k)),
        _ => Err(Error::tensor("lin.weight", format!("expected shape (out, {k}), got {:?}", w.shape))),
    }
}

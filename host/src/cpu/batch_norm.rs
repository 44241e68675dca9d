//! A chain with a BatchNorm on the CPU backend: the rows are no longer independent, so
//! the chain runs in three phases around the batch statistics.
//!
//! With `u` the BatchNorm's input (the ops before it, all per-element, on `z`):
//! * forward: `u` row by row; each feature's mean and biased variance over the rows
//!   (two passes, summed in f64, so no cancellation and no growth with the batch);
//!   then the BatchNorm, per element now (`epilogue::forward_row` with the statistics
//!   as two more parameters) and the ops after it, row by row.
//! * backward: the ops after the BatchNorm and the BatchNorm at fixed statistics give
//!   `g = gamma rstd dv` and `dgamma = S2 = sum dv xhat`, `dbeta = S1 = sum dv`; the
//!   statistics' paths then give `du = g - gamma rstd (S1 + xhat S2) / N`, and the ops
//!   before it take `du` back to `dz` row by row.

use super::epilogue::ChainRows;
use crate::block::{BlockSpec, Params};
use crate::tensor::Tensor;
use rayon::prelude::*;

/// Rows per task of the column sums.
const ROWS_PER_TASK: usize = 64;

/// Each feature's mean and biased variance over the rows of `u` `(rows, f)`, two passes
/// in f64.
pub(crate) fn column_stats(u: &[f32], f: usize) -> (Vec<f64>, Vec<f64>) {
    let rows = u.len() / f;
    let sums = |map: &(dyn Fn(usize, f32) -> f64 + Sync)| -> Vec<f64> {
        u.par_chunks(ROWS_PER_TASK * f)
            .map(|block| {
                let mut acc = vec![0.0f64; f];
                for row in block.chunks_exact(f) {
                    acc.iter_mut().zip(row).enumerate().for_each(|(c, (a, &v))| *a += map(c, v));
                }
                acc
            })
            .reduce(
                || vec![0.0f64; f],
                |mut a, b| {
                    a.iter_mut().zip(&b).for_each(|(s, v)| *s += v);
                    a
                },
            )
    };
    let mean: Vec<f64> = sums(&|_, v| f64::from(v)).into_iter().map(|s| s / rows as f64).collect();
    let var = sums(&|c, v| (f64::from(v) - mean[c]).powi(2)).into_iter().map(|s| s / rows as f64).collect();
    (mean, var)
}

/// The ops before the BatchNorm `k` (per-element ones).
pub(crate) fn before<'a>(spec: &'a BlockSpec, params: &'a Params<f32>, k: usize) -> ChainRows<'a> {
    ChainRows {
        ops: &spec.chain.0[..k],
        params: params.ops[..k].iter().map(|p| p.iter().map(Tensor::data).collect()).collect(),
        features: (0..=k).map(|i| spec.features_at(i)).collect(),
    }
}

/// The ops from the BatchNorm on, its parameters extended by the statistics.
pub(crate) fn after<'a>(
    spec: &'a BlockSpec,
    params: &'a Params<f32>,
    k: usize,
    mean: &'a [f32],
    rstd: &'a [f32],
) -> ChainRows<'a> {
    let ops = &spec.chain.0;
    let mut p: Vec<Vec<&[f32]>> = params.ops[k..].iter().map(|p| p.iter().map(Tensor::data).collect()).collect();
    p[0].extend([mean, rstd]);
    ChainRows { ops: &ops[k..], params: p, features: (k..=ops.len()).map(|i| spec.features_at(i)).collect() }
}

/// `mean` and `rstd = 1 / sqrt(var + eps)` of the BatchNorm's input, as f32.
pub(crate) fn stats_f32(u: &[f32], f: usize, eps: f32) -> (Vec<f32>, Vec<f32>, Vec<f64>) {
    let (mean, var) = column_stats(u, f);
    let rstd = var.iter().map(|&v| (1.0 / (v + f64::from(eps)).sqrt()) as f32).collect();
    (mean.iter().map(|&m| m as f32).collect(), rstd, var)
}

//! Dispatch from a chain [`Op`] to its forward and backward, and the state a
//! forward saves for its backward.

use super::activation::{pointwise_backward, pointwise_forward};
use super::batch_norm::{BatchNormStats, batch_norm_backward, batch_norm_forward};
use super::group_norm::{GroupNormStats, group_norm_backward, group_norm_forward};
use super::reduce::{avg_pool_backward, avg_pool_forward, row_max_backward, row_max_forward};
use super::rows::*;
use super::{Real, matrix_dims};
use crate::chain::{Op, Reduce};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// What an op's backward needs from its forward.
#[derive(Clone, Debug, PartialEq)]
pub enum Saved<T> {
    /// A per-element op: its input.
    Input(Tensor<T>),
    /// GroupNorm: the input and its per-(row, group) mean and rstd.
    GroupNorm { x: Tensor<T>, stats: GroupNormStats<T> },
    /// AvgPool: the input's feature count (for the zero-gradient tail).
    AvgPool { in_features: usize },
    /// Row max: each row's arg-max and the input's feature count.
    RowMax { argmax: Vec<usize>, in_features: usize },
    /// `sum`, `mean`: the input's feature count.
    RowSum { in_features: usize },
    /// logsumexp: the input and the output.
    LogSumExp { x: Tensor<T>, y: Tensor<T> },
    /// Softmax: its output.
    Output(Tensor<T>),
    /// MaxPool: the input index of each output, and the input's feature count.
    MaxPool { from: Vec<usize>, in_features: usize },
    /// RMSNorm: the input and each row's `1 / rms`.
    RmsNorm { x: Tensor<T>, rstd: Vec<T> },
    /// BatchNorm: the input and each channel's batch statistics.
    BatchNorm { x: Tensor<T>, stats: BatchNormStats<T> },
}

/// Applies `op` to `x` (B,F) with its parameters (in [`Op::param_bases`] order).
/// Returns the output, always 2-D (a reduction gives `(B, 1)`), and what the backward needs.
pub fn op_forward<T: Real>(op: &Op, x: &Tensor<T>, params: &[Tensor<T>]) -> Result<(Tensor<T>, Saved<T>)> {
    check_param_count(op, params)?;
    let (batch, features) = matrix_dims("x", x)?;
    let c = T::from_chain_constant;
    Ok(match *op {
        Op::Pointwise(kind, [a, b]) => {
            (pointwise_forward(kind, x, params.first(), c(a), c(b))?, Saved::Input(x.clone()))
        }
        Op::GroupNorm { groups, eps } => {
            let (y, stats) = group_norm_forward(x, groups, c(eps), &params[0], &params[1])?;
            (y, Saved::GroupNorm { x: x.clone(), stats })
        }
        Op::AvgPool(k) => (avg_pool_forward(x, k)?, Saved::AvgPool { in_features: features }),
        Op::RowMax => {
            let (y, argmax) = row_max_forward(x)?;
            (y.reshape(&[batch, 1])?, Saved::RowMax { argmax, in_features: features })
        }
        Op::Reduce(Reduce::Min) => {
            let (y, argmax) = row_min_forward(x)?;
            (y.reshape(&[batch, 1])?, Saved::RowMax { argmax, in_features: features })
        }
        Op::Reduce(r @ (Reduce::Sum | Reduce::Mean)) => {
            (row_sum_forward(x, r == Reduce::Mean)?, Saved::RowSum { in_features: features })
        }
        Op::Reduce(Reduce::LogSumExp) => {
            let y = logsumexp_forward(x)?;
            (y.clone(), Saved::LogSumExp { x: x.clone(), y })
        }
        Op::Softmax => {
            let y = softmax_forward(x)?;
            (y.clone(), Saved::Output(y))
        }
        Op::MaxPool(k) => {
            let (y, from) = max_pool_forward(x, k)?;
            (y, Saved::MaxPool { from, in_features: features })
        }
        // LayerNorm over (B, F) is GroupNorm of one group (same statistics and affine).
        Op::LayerNorm { eps } => {
            let (y, stats) = group_norm_forward(x, 1, c(eps), &params[0], &params[1])?;
            (y, Saved::GroupNorm { x: x.clone(), stats })
        }
        Op::RmsNorm { eps } => {
            let (y, rstd) = rms_norm_forward(x, c(eps), &params[0])?;
            (y, Saved::RmsNorm { x: x.clone(), rstd })
        }
        Op::BatchNorm { eps } => {
            let (y, stats) = batch_norm_forward(x, c(eps), &params[0], &params[1])?;
            (y, Saved::BatchNorm { x: x.clone(), stats })
        }
        Op::Residual => {
            return Err(Error::Argument(
                "`residual` adds the chain's input, which one op does not see: the chain's forward \
                 (`super::residual`) does it"
                    .into(),
            ));
        }
    })
}

/// The backward of `op`: given what its forward saved, its parameters and `dy`
/// (the output's shape), returns `dx` and one gradient per parameter.
pub fn op_backward<T: Real>(
    op: &Op,
    saved: &Saved<T>,
    params: &[Tensor<T>],
    dy: &Tensor<T>,
) -> Result<(Tensor<T>, Vec<Tensor<T>>)> {
    check_param_count(op, params)?;
    let c = T::from_chain_constant;
    Ok(match (*op, saved) {
        (Op::Pointwise(kind, [a, b]), Saved::Input(x)) => {
            let (dx, dp) = pointwise_backward(kind, x, params.first(), dy, c(a), c(b))?;
            (dx, dp.into_iter().collect())
        }
        (Op::GroupNorm { .. } | Op::LayerNorm { .. }, Saved::GroupNorm { x, stats }) => {
            let (dx, dgamma, dbeta) = group_norm_backward(x, stats, &params[0], dy)?;
            (dx, vec![dgamma, dbeta])
        }
        (Op::AvgPool(k), Saved::AvgPool { in_features }) => (avg_pool_backward(dy, k, *in_features)?, vec![]),
        (Op::RowMax | Op::Reduce(Reduce::Min), Saved::RowMax { argmax, in_features }) => {
            let batch = argmax.len();
            if dy.shape() != [batch, 1] {
                return Err(Error::tensor("dy", format!("expected shape [{batch}, 1], got {:?}", dy.shape())));
            }
            let dy = dy.clone().reshape(&[batch])?;
            (row_max_backward(&dy, argmax, *in_features)?, vec![])
        }
        (Op::Reduce(r), Saved::RowSum { in_features }) => {
            (row_sum_backward(dy, r == Reduce::Mean, *in_features)?, vec![])
        }
        (Op::Reduce(Reduce::LogSumExp), Saved::LogSumExp { x, y }) => (logsumexp_backward(x, y, dy)?, vec![]),
        (Op::Softmax, Saved::Output(s)) => (softmax_backward(s, dy)?, vec![]),
        (Op::MaxPool(_), Saved::MaxPool { from, in_features }) => (max_pool_backward(dy, from, *in_features)?, vec![]),
        (Op::RmsNorm { .. }, Saved::RmsNorm { x, rstd }) => {
            let (dx, dw) = rms_norm_backward(x, rstd, &params[0], dy)?;
            (dx, vec![dw])
        }
        (Op::BatchNorm { .. }, Saved::BatchNorm { x, stats }) => {
            let (dx, dgamma, dbeta) = batch_norm_backward(x, stats, &params[0], dy)?;
            (dx, vec![dgamma, dbeta])
        }
        (op, _) => return Err(Error::Argument(format!("`{op}` backward was given another op's saved state"))),
    })
}

fn check_param_count<T>(op: &Op, params: &[Tensor<T>]) -> Result<()> {
    let want = op.param_bases().len();
    if params.len() != want {
        return Err(Error::Argument(format!("`{op}` takes {want} parameter(s), got {}", params.len())));
    }
    Ok(())
}

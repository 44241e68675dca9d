//! Dispatch from a chain [`Op`] to its forward and backward, and the state a
//! forward saves for its backward.

use super::activation::{pointwise_backward, pointwise_forward};
use super::group_norm::{GroupNormStats, group_norm_backward, group_norm_forward};
use super::reduce::{avg_pool_backward, avg_pool_forward, row_max_backward, row_max_forward};
use super::{Real, matrix_dims};
use crate::chain::Op;
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
}

/// Applies `op` to `x` (B,F) with its parameters (in [`Op::param_bases`] order).
/// Returns the output, always 2-D (`max` gives `(B, 1)`), and what the backward needs.
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
        (Op::GroupNorm { .. }, Saved::GroupNorm { x, stats }) => {
            let (dx, dgamma, dbeta) = group_norm_backward(x, stats, &params[0], dy)?;
            (dx, vec![dgamma, dbeta])
        }
        (Op::AvgPool(k), Saved::AvgPool { in_features }) => (avg_pool_backward(dy, k, *in_features)?, vec![]),
        (Op::RowMax, Saved::RowMax { argmax, in_features }) => {
            let batch = argmax.len();
            if dy.shape() != [batch, 1] {
                return Err(Error::tensor("dy", format!("expected shape [{batch}, 1], got {:?}", dy.shape())));
            }
            let dy = dy.clone().reshape(&[batch])?;
            (row_max_backward(&dy, argmax, *in_features)?, vec![])
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

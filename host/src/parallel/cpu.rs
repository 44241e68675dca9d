//! Tensor parallel on the CPU backend: the ranks of a [`TensorSplit`] run one after
//! another in this process and combine in memory, by the same rules the GPU ranks
//! follow over NCCL. It checks a split's arithmetic where there is no GPU (the tests);
//! on one CPU it is no faster than the unsplit block.

use super::{RowMaxKey, TensorSplit};
use crate::block::Params;
use crate::cpu::{self, Options};
use crate::error::{Error, Result};
use crate::reference::BlockGrads;
use crate::tensor::Tensor;

/// The ranks' outputs combined: row maxima reduced to the largest (ties to the lower
/// rank), or column slices gathered. Also returns the reduced keys (row max only),
/// which say which rank the backward sends each row's gradient to.
pub fn combine(split: &TensorSplit, outputs: &[Tensor<f32>]) -> Result<(Tensor<f32>, Option<Vec<RowMaxKey>>)> {
    if outputs.len() != split.ranks() {
        return Err(Error::Argument(format!("{} outputs for {} ranks", outputs.len(), split.ranks())));
    }
    if !split.reduces_row_max() {
        return Ok((split.gather_columns(outputs)?, None));
    }
    let r = split.ranks();
    let keys: Vec<RowMaxKey> = (0..outputs[0].len())
        .map(|i| outputs.iter().enumerate().map(|(rank, y)| RowMaxKey::new(y.data()[i], rank, r)).max().unwrap())
        .collect();
    let y = Tensor::new(outputs[0].shape(), keys.iter().map(|k| k.value()).collect())?;
    Ok((y, Some(keys)))
}

/// The output gradient rank `rank` backpropagates: its columns of `dy`, or (row max)
/// `dy` on the rows whose maximum it owns and 0 elsewhere.
pub fn shard_grad_output(
    split: &TensorSplit,
    dy: &Tensor<f32>,
    keys: Option<&[RowMaxKey]>,
    rank: usize,
) -> Result<Tensor<f32>> {
    match keys {
        None => split.shard_columns(dy, rank),
        Some(keys) => {
            if dy.len() != keys.len() {
                return Err(Error::tensor("dy", format!("expected {} rows, got shape {:?}", keys.len(), dy.shape())));
            }
            let data = dy
                .data()
                .iter()
                .zip(keys)
                .map(|(&g, k)| if k.owner(split.ranks()) == rank { g } else { 0.0 })
                .collect();
            Tensor::new(dy.shape(), data)
        }
    }
}

/// The block's output for `x`, each rank running its shard (`params[rank]`, from
/// [`TensorSplit::shard_params`]).
pub fn forward(split: &TensorSplit, x: &Tensor<f32>, params: &[Params<f32>], opts: &Options) -> Result<Tensor<f32>> {
    let outputs: Vec<_> = params.iter().map(|p| cpu::forward(split.shard(), x, p, opts)).collect::<Result<_>>()?;
    Ok(combine(split, &outputs)?.0)
}

/// Output and gradients of `L = sum(y * dy)`: the input's gradient summed over the
/// ranks, the parameters' gathered from their shards.
pub fn backward(
    split: &TensorSplit,
    x: &Tensor<f32>,
    params: &[Params<f32>],
    dy: &Tensor<f32>,
    opts: &Options,
) -> Result<(Tensor<f32>, BlockGrads<f32>)> {
    let saved: Vec<_> = params.iter().map(|p| cpu::forward_saving(split.shard(), x, p, opts)).collect::<Result<_>>()?;
    let outputs: Vec<_> = saved.iter().map(|(y, _)| y.clone()).collect();
    let (y, keys) = combine(split, &outputs)?;
    let mut dx: Option<Tensor<f32>> = None;
    let mut grads = Vec::new();
    for (rank, (p, (_, z))) in params.iter().zip(&saved).enumerate() {
        let dy_rank = shard_grad_output(split, dy, keys.as_deref(), rank)?;
        let g = cpu::backward_at(split.shard(), x, p, &dy_rank, z, opts)?;
        match &mut dx {
            None => dx = Some(g.x),
            Some(sum) => sum.data_mut().iter_mut().zip(g.x.data()).for_each(|(s, v)| *s += v),
        }
        grads.push(g.params);
    }
    let x_grad = dx.ok_or_else(|| Error::Argument("no ranks".into()))?;
    Ok((y, BlockGrads { x: x_grad, params: split.gather_params(&grads)? }))
}

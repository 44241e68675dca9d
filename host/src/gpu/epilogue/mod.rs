//! Launchers of the epilogue kernels (`kernels-gpu/src/epilogue`).

pub mod kinks;
pub mod lanes;
pub mod partials;
pub mod rows;

use super::{DeviceTensor, Gpu, Table};
use crate::chain::{Op, Reduce};
use crate::error::{Error, Result};
use kernel_abi::epilogue::*;

/// A chain as the kernels see it: op descriptors in device memory, pointing at
/// parameter vectors owned elsewhere (by the `GpuBlock` that also owns this chain,
/// so they outlive it).
pub struct DeviceChain {
    pub ops: Vec<OpDesc>,
    pub descs: Table,
    /// Parameter-gradient slots of the backward: 1 (the Linear bias) + one per op parameter.
    pub grad_slots: usize,
}

impl DeviceChain {
    /// `before` (ops without parameters: a fold's, `dispatch::Fold`), then `ops`;
    /// `params[i]`: the device parameters of `ops[i]` (see `Params::ops`).
    pub fn new(gpu: &Gpu, before: &[Op], ops: &[Op], params: &[Vec<DeviceTensor>]) -> Result<DeviceChain> {
        if ops.len() != params.len() {
            return Err(Error::Chain(format!("{} ops but {} parameter lists", ops.len(), params.len())));
        }
        let ptrs: Vec<[u64; 2]> = before
            .iter()
            .map(|_| [0; 2])
            .chain(params.iter().map(|op_params| {
                let mut ptrs = [0u64; 2];
                for (slot, p) in ptrs.iter_mut().zip(op_params) {
                    *slot = p.buf.device_address();
                }
                ptrs
            }))
            .collect();
        let all: Vec<Op> = before.iter().chain(ops).copied().collect();
        Self::from_ptrs(gpu, &all, &ptrs)
    }

    /// [`DeviceChain::new`] from each op's parameter addresses (0 where it has none): a
    /// chain over vectors that are no tensors of their own (a BatchNorm's statistics).
    pub fn from_ptrs(gpu: &Gpu, ops: &[Op], params: &[[u64; 2]]) -> Result<DeviceChain> {
        if ops.len() != params.len() {
            return Err(Error::Chain(format!("{} ops but {} parameter lists", ops.len(), params.len())));
        }
        let mut descs = Vec::new();
        for (op, ptrs) in ops.iter().zip(params) {
            let mut d = OpDesc { param0: ptrs[0], param1: ptrs[1], ..OpDesc::default() };
            match *op {
                Op::Pointwise(kind, [a, b]) => (d.code, d.a, d.b) = (kind as u32, a, b),
                Op::GroupNorm { groups, eps } => (d.code, d.count, d.a) = (OP_GROUP_NORM, count_u32(op, groups)?, eps),
                Op::AvgPool(k) => (d.code, d.count) = (OP_AVG_POOL, count_u32(op, k)?),
                Op::RowMax => d.code = OP_ROW_MAX,
                Op::Reduce(r) => {
                    d.code = match r {
                        Reduce::Sum => OP_ROW_SUM,
                        Reduce::Mean => OP_ROW_MEAN,
                        Reduce::Min => OP_ROW_MIN,
                        Reduce::LogSumExp => OP_LOGSUMEXP,
                    }
                }
                Op::Softmax => d.code = OP_SOFTMAX,
                Op::MaxPool(k) => (d.code, d.count) = (OP_MAX_POOL, count_u32(op, k)?),
                // The same math as a GroupNorm of one group (kernel_abi::ops).
                Op::LayerNorm { eps } => (d.code, d.count, d.a) = (OP_GROUP_NORM, 1, eps),
                Op::Residual => d.code = OP_RESIDUAL,
                Op::RmsNorm { eps } => (d.code, d.a) = (OP_RMS_NORM, eps),
                // The block runs the ops around it (`gpu/batch_norm.rs`), never a kernel.
                Op::BatchNorm { .. } => {
                    return Err(Error::Chain(format!("`{op}`: a BatchNorm is no op of the kernels' chains")));
                }
            }
            descs.push(d);
        }
        let words: Vec<u64> = descs.iter().flat_map(op_words).collect();
        let buf = gpu.words(gpu.stream(), &words)?;
        let grad_slots = 1 + ops.iter().map(|op| op.param_bases().len()).sum::<usize>();
        Ok(DeviceChain { ops: descs, descs: buf, grad_slots })
    }

    /// The row reduction this chain ends in, if it does: the TMA GEMM then stores row
    /// partials for `row_partials_finish` (`dispatch::Plan::RowPartials`), not `y`.
    pub fn reduction(&self) -> Option<u32> {
        self.ops.last().map(|op| op.code).filter(|&code| reduces_row(code))
    }
}

/// A group count or pooling kernel as the descriptor's 32-bit `count`.
fn count_u32(op: &Op, count: usize) -> Result<u32> {
    u32::try_from(count).map_err(|_| Error::Shape(format!("`{op}`: {count} does not fit the kernels' 32-bit count")))
}

/// The `repr(C)` layout of [`OpDesc`] as four little-endian 64-bit words.
fn op_words(d: &OpDesc) -> [u64; 4] {
    [d.code as u64 | (d.count as u64) << 32, d.a.to_bits() as u64 | (d.b.to_bits() as u64) << 32, d.param0, d.param1]
}

#[cfg(test)]
mod tests {
    #[test]
    fn op_desc_is_four_words() {
        assert_eq!(std::mem::size_of::<kernel_abi::epilogue::OpDesc>(), 32);
        assert_eq!(std::mem::offset_of!(kernel_abi::epilogue::OpDesc, param0), 16);
    }
}

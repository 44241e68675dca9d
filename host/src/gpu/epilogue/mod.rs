//! Launchers of the epilogue kernels (`kernels-gpu/src/epilogue`).

pub mod kinks;
pub mod lanes;
pub mod partials;
pub mod rows;

use super::elementwise::{Convert, Vector, convert_vectors};
use super::{DeviceTensor, DeviceVector, Dtype, Gpu, Table, VectorArg, VectorWord};
use crate::chain::{Op, Reduce};
use crate::error::{Error, Result};
use kernel_abi::epilogue::*;
use kernel_abi::vector::{self, Stored};

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
    pub fn new(gpu: &Gpu, before: &[Op], ops: &[Op], params: &[Vec<DeviceVector>]) -> Result<DeviceChain> {
        if ops.len() != params.len() {
            return Err(Error::Chain(format!("{} ops but {} parameter lists", ops.len(), params.len())));
        }
        let mut ptrs: Vec<[u64; 2]> = before.iter().map(|_| [0; 2]).collect();
        for op_params in params {
            let mut words = [0u64; 2];
            for (slot, p) in words.iter_mut().zip(op_params) {
                *slot = p.word()?.0;
            }
            ptrs.push(words);
        }
        let all: Vec<Op> = before.iter().chain(ops).copied().collect();
        Self::from_ptrs(gpu, &all, &ptrs)
    }

    /// [`DeviceChain::new`] from each op's parameter words (`kernel_abi::vector`; an FP32
    /// vector's is its address; 0 where it has none): a chain over vectors that are no
    /// tensors of their own (a BatchNorm's statistics).
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

    /// This chain (and `bias`, the Linear's, if given) with FP32 copies of its 16-bit
    /// parameter vectors, one launch for every eight, for a kernel that reads FP32 only
    /// (the TMA GEMM's epilogue, the chain backward), over rows of `n` features; `None`
    /// where every vector is FP32 already.
    pub fn widened(&self, gpu: &Gpu, n: usize, bias: Option<VectorArg<'_>>) -> Result<Option<Widened>> {
        widen_params(gpu, Some(self), n, bias)
    }
}

/// [`DeviceChain::widened`], of a chain or none (a bias alone).
pub fn widen_params(
    gpu: &Gpu,
    chain: Option<&DeviceChain>,
    n: usize,
    bias: Option<VectorArg<'_>>,
) -> Result<Option<Widened>> {
    // (op and slot, or `None` for the bias) and (word, length) of each vector.
    let (mut places, mut words) = (Vec::new(), Vec::new());
    if let Some(b) = bias {
        places.push(None);
        words.push((b.word.0, b.len));
    }
    let own: &[OpDesc] = chain.map_or(&[], |c| &c.ops);
    let mut f = n;
    for (i, op) in own.iter().enumerate() {
        for (slot, word) in [op.param0, op.param1].into_iter().enumerate() {
            if word != 0 {
                places.push(Some((i, slot)));
                words.push((word, f));
            }
        }
        f = features_after(op, f);
    }
    // SAFETY: the bias is a live vector of `len` values (its `VectorArg`'s borrow); the
    // chain's words are its parameter vectors, of the features their op sees, which the
    // caller keeps alive.
    let Some((copies, at)) = (unsafe { widen_words(gpu, &words)? }) else { return Ok(None) };
    let (mut ops, mut bias) = (own.to_vec(), None);
    for (place, dst) in places.into_iter().zip(at) {
        match (place, dst) {
            (_, None) => {}
            (None, Some(dst)) => bias = Some(VectorWord(dst)),
            (Some((i, 0)), Some(dst)) => ops[i].param0 = dst,
            (Some((i, _)), Some(dst)) => ops[i].param1 = dst,
        }
    }
    let chain = match chain {
        Some(c) if ops != c.ops => {
            let words: Vec<u64> = ops.iter().flat_map(op_words).collect();
            let descs = gpu.words(gpu.stream(), &words)?;
            Some(DeviceChain { ops, descs, grad_slots: c.grad_slots })
        }
        _ => None,
    };
    Ok(Some(Widened { chain, bias, _copies: copies }))
}

/// FP32 copies of the 16-bit vectors among `vectors` (each a `kernel_abi::vector` word
/// and its length), side by side in one new buffer, each at a 16-byte boundary as the
/// kernels' vector loads want, made by one launch on the GPU's stream: the buffer and
/// each vector's copy's address (`None` for an FP32 one, read as it is); `None` where
/// every vector is FP32 (no launch).
///
/// # Safety
/// Each word names a live vector of `len` values of its type, not written before the
/// launch has run.
pub unsafe fn widen_words(gpu: &Gpu, vectors: &[(u64, usize)]) -> Result<Option<(DeviceTensor, Vec<Option<u64>>)>> {
    let half = |word: u64| word != 0 && vector::stored(word) != Stored::F32;
    if !vectors.iter().any(|v| half(v.0)) {
        return Ok(None);
    }
    let total: usize = vectors.iter().filter(|v| half(v.0)).map(|v| v.1.next_multiple_of(4)).sum();
    let copies = gpu.alloc(&[total])?;
    let (mut at, mut converts, mut dsts) = (copies.buf.device_address(), Vec::new(), Vec::new());
    for &(word, len) in vectors {
        if !half(word) {
            dsts.push(None);
            continue;
        }
        let mode = if vector::stored(word) == Stored::F16 { Convert::F16ToF32 } else { Convert::Bf16ToF32 };
        converts.push(Vector { src: vector::address(word), dst: at, len, mode });
        dsts.push(Some(at));
        at += (len.next_multiple_of(4) * 4) as u64;
    }
    // SAFETY: each source as the caller's contract says; each destination inside `copies`.
    unsafe { convert_vectors(gpu, gpu.stream(), &converts)? };
    Ok(Some((copies, dsts)))
}

impl DeviceChain {
    /// Whether every parameter vector of the chain is stored as `dtype` (a 16-bit
    /// tile-wise backward reads its own type only).
    pub fn params_stored_as(&self, dtype: Dtype) -> bool {
        let stored = dtype.stored();
        self.ops.iter().flat_map(|op| [op.param0, op.param1]).all(|w| w == 0 || vector::stored(w) == stored)
    }

    /// The row reduction this chain ends in, if it does: the TMA GEMM then stores row
    /// partials for `row_partials_finish` (`dispatch::Plan::RowPartials`), not `y`.
    pub fn reduction(&self) -> Option<u32> {
        self.ops.last().map(|op| op.code).filter(|&code| reduces_row(code))
    }
}

/// FP32 copies of a chain's (and a bias's) 16-bit vectors: [`DeviceChain::widened`].
pub struct Widened {
    /// The chain over the copies (`None`: its vectors were FP32 already).
    pub chain: Option<DeviceChain>,
    /// The bias's copy (`None`: it was FP32, or not asked for).
    pub bias: Option<VectorWord>,
    _copies: DeviceTensor,
}

impl Widened {
    /// The chain a kernel is to read: the copy's, or `chain` itself.
    pub fn chain<'a>(w: &'a Option<Widened>, chain: &'a DeviceChain) -> &'a DeviceChain {
        w.as_ref().and_then(|w| w.chain.as_ref()).unwrap_or(chain)
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

//! What every GEMM launcher takes: the GEMM as its kernel reads it ([`Operands`]) and
//! the arguments all the kernels take after their operands ([`EpilogueArgs`]).

use super::super::epilogue::DeviceChain;
use super::super::{DeviceElement, DeviceTensor, VectorArg, VectorWord};
use cudarc::driver::{CudaSlice, LaunchArgs, PushKernelArg};

/// One GEMM as its kernel reads it: `y (m, n) = chain(A B^T + bias)`, or
/// with `splits > 1` that many split-K partial products into `y (splits, m, n)` (no
/// bias, no chain). `A` and `B` are in the route's layout with row pitches `lda`, `ldb`.
pub struct Operands<'a> {
    pub a: &'a CudaSlice<f32>,
    pub b: &'a CudaSlice<f32>,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub lda: usize,
    pub ldb: usize,
    pub bias: Option<VectorArg<'a>>,
    pub chain: Option<&'a DeviceChain>,
    pub splits: usize,
}

/// The arguments every GEMM kernel takes after its operands — `bias, y, save_z`, the
/// sizes, `ops, n_ops` (null pointers for absent ones) — owned here while a launch
/// builder borrows them.
pub struct EpilogueArgs {
    bias: VectorWord,
    dims: Vec<u32>,
    n_ops: u32,
    null: u64,
}

impl EpilogueArgs {
    /// `dims`: the kernel's size arguments, in order.
    pub fn new(dims: &[usize], bias: Option<VectorArg<'_>>, chain: Option<&DeviceChain>) -> EpilogueArgs {
        let dims = dims.iter().map(|&d| d as u32).collect();
        let bias = bias.map_or(VectorWord::NONE, |b| b.word);
        EpilogueArgs { bias, dims, n_ops: chain.map_or(0, |c| c.ops.len() as u32), null: 0 }
    }

    /// Pushes them onto `launch`, after the operands.
    pub fn push<'a, O: DeviceElement>(
        &'a self,
        launch: &mut LaunchArgs<'a>,
        y: &'a mut DeviceTensor<O>,
        save_z: Option<&'a mut DeviceTensor>,
        chain: Option<&'a DeviceChain>,
    ) {
        launch.arg(&self.bias);
        launch.arg(&mut y.buf);
        match save_z {
            Some(z) => launch.arg(&mut z.buf),
            None => launch.arg(&self.null),
        };
        for d in &self.dims {
            launch.arg(d);
        }
        match chain {
            Some(c) => launch.arg(&c.descs),
            None => launch.arg(&self.null),
        };
        launch.arg(&self.n_ops);
    }
}

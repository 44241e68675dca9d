//! Launcher of the `mma.sync` GEMMs `gemm_tc_{tf32,tf32x3,bf16}_{nt,nn,tn}_{vec4,scalar}`
//! (kernels-gpu/src/gemm/tensor_core.rs): tensor cores fed by a `cp.async` pipeline,
//! any alignment.

use super::super::{DeviceTensor, Gpu};
use super::args::Operands;
use crate::error::Result;
use cudarc::driver::CudaStream;
use kernel_abi::{Kernel, gemm_tc};
use std::sync::Arc;

/// Queues `kernel` (an `mma.sync` GEMM the dispatch chose) over `op` on `stream`.
pub fn launch(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    kernel: Kernel,
    op: &Operands,
    y: &mut DeviceTensor,
    save_z: Option<&mut DeviceTensor>,
) -> Result<()> {
    super::grid::launch(gpu, stream, kernel, (gemm_tc::BLOCK_K, gemm_tc::SMEM_BYTES), op, y, save_z)
}

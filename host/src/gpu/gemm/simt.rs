//! Launcher of the FMA GEMMs `gemm_f32_{nt,nn,tn}_{vec4,scalar}`
//! (kernels-gpu/src/gemm/simt.rs): strict FP32, register-blocked, any alignment.

use super::super::{DeviceTensor, Gpu};
use super::args::Operands;
use crate::error::Result;
use cudarc::driver::CudaStream;
use kernel_abi::{Kernel, gemm_simt};
use std::sync::Arc;

/// Queues `kernel` (an FMA GEMM the dispatch chose) over `op` on `stream`.
pub fn launch(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    kernel: Kernel,
    op: &Operands,
    y: &mut DeviceTensor,
    save_z: Option<&mut DeviceTensor>,
) -> Result<()> {
    super::grid::launch(gpu, stream, kernel, (gemm_simt::BLOCK_K, gemm_simt::SMEM_BYTES), op, y, save_z)
}

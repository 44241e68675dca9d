//! Launcher of the `wgmma` GEMMs `gemm_wg_{tf32,tf32x3}_{nt,dx,dw}_vec4`
//! (kernels-gpu/src/gemm/wgmma.rs): TF32 and 3xTF32 over 16-byte rows, the forward
//! (`Nt`) and the backward's `dX^T` and `dW` (`Tk`).

use super::super::{DeviceTensor, Gpu};
use super::args::Operands;
use crate::error::Result;
use cudarc::driver::CudaStream;
use kernel_abi::{Kernel, gemm_wg};
use std::sync::Arc;

/// Queues `kernel` (a `wgmma` GEMM the dispatch chose) over `op` on `stream`: the
/// 3xTF32 kernels hold `B`'s residual in a third tile per stage and more stages, so
/// their shared memory is larger.
pub fn launch(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    kernel: Kernel,
    op: &Operands,
    y: &mut DeviceTensor,
    save_z: Option<&mut DeviceTensor>,
) -> Result<()> {
    let split = matches!(kernel, Kernel::GemmWgTf32x3NtVec4 | Kernel::GemmWgTf32x3DxVec4 | Kernel::GemmWgTf32x3DwVec4);
    let smem_bytes = gemm_wg::smem_bytes(split);
    super::grid::launch(gpu, stream, kernel, (gemm_wg::BLOCK_K, smem_bytes), op, y, save_z)
}

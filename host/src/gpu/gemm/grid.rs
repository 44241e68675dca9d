//! The launch the three grid-of-tiles GEMM families share — FMA (`gemm_f32_*`),
//! `mma.sync` (`gemm_tc_*`) and `wgmma` (`gemm_wg_*`): one kernel signature (see
//! `kernels-gpu/src/gemm/mod.rs`), a block per `128 x 128` tile of `y`, `gridDim.z`
//! split-K slices. Each family's module passes its own stage depth and shared memory.

use super::super::{DeviceTensor, Gpu};
use super::args::{EpilogueArgs, Operands};
use crate::error::{Error, Result};
use cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg};
use kernel_abi::Kernel;
use kernel_abi::gemm_simt::{BLOCK_M, BLOCK_N, THREADS};
use std::sync::Arc;

// The three families tile `y` alike.
const _: () = assert!(
    kernel_abi::gemm_tc::BLOCK_M == BLOCK_M
        && kernel_abi::gemm_wg::BLOCK_N == BLOCK_N
        && kernel_abi::gemm_tc::THREADS == THREADS
        && kernel_abi::gemm_wg::THREADS == THREADS
);

/// Queues `kernel` over `op` on `stream`: `block_k` is its `k` depth per stage (split-K
/// slices are multiples of it), `smem_bytes` its dynamic shared memory. The caller has
/// checked shapes, extents and 32-bit limits.
#[allow(clippy::too_many_arguments)]
pub fn launch(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    kernel: Kernel,
    (block_k, smem_bytes): (usize, usize),
    op: &Operands,
    y: &mut DeviceTensor,
    save_z: Option<&mut DeviceTensor>,
) -> Result<()> {
    let (m, n, k, splits) = (op.m, op.n, op.k, op.splits.max(1));
    let k_split = k.div_ceil(splits).div_ceil(block_k) * block_k;
    let func = gpu.function(kernel)?;
    gpu.allow_shared(&func, kernel, smem_bytes)?;
    let grid = (n.div_ceil(BLOCK_N), m.div_ceil(BLOCK_M), splits);
    if grid.1 > 65535 || grid.2 > 65535 {
        return Err(Error::Shape(format!("GEMM grid {grid:?} exceeds the launch limits")));
    }
    let cfg = LaunchConfig {
        grid_dim: (grid.0 as u32, grid.1 as u32, grid.2 as u32),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: smem_bytes as u32,
    };
    let chain = if splits > 1 { None } else { op.chain };
    let tail = EpilogueArgs::new(&[m, n, k, op.lda, op.ldb, k_split], chain);
    let mut launch = stream.launch_builder(&func);
    launch.arg(op.a).arg(op.b);
    tail.push(&mut launch, op.bias.filter(|_| splits == 1), y, save_z, chain);
    // SAFETY: matches the kernels' shared signature; operand extents checked by the
    // caller; the chain's ops were checked fusable (`not_fusable`); grid, block and
    // shared memory follow kernel_abi::gemm_simt / gemm_tc / gemm_wg.
    unsafe { launch.launch(cfg) }.map_err(|e| Error::cuda(format!("launching `{kernel}`"), e))?;
    Ok(())
}

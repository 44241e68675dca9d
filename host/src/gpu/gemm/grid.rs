//! The launch the three grid-of-tiles GEMM families share — FMA (`gemm_fma_*`),
//! `mma.sync` (`gemm_mma_*`) and `wgmma` (`gemm_wgmma_*`): one kernel signature (see
//! `kernels-gpu/src/gemm/mod.rs`), a block per `128 x 128` tile of `y`, `gridDim.z`
//! split-K slices. Each family's stage depth and shared memory come from `kernel_abi`
//! ([`stages`]).

use super::super::dispatch::Family;
use super::super::{DeviceTensor, Gpu};
use super::args::{EpilogueArgs, Operands};
use crate::error::{Error, Result};
use cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg};
use kernel_abi::gemm_fma::{BLOCK_M, BLOCK_N, THREADS};
use kernel_abi::{Kernel, gemm_fma, gemm_mma, gemm_wgmma};
use std::sync::Arc;

// The three families tile `y` alike.
const _: () = assert!(
    kernel_abi::gemm_mma::BLOCK_M == BLOCK_M
        && kernel_abi::gemm_wgmma::BLOCK_N == BLOCK_N
        && kernel_abi::gemm_mma::THREADS == THREADS
        && kernel_abi::gemm_wgmma::THREADS == THREADS
);

/// A grid family's `k` depth per stage (split-K slices are multiples of it) and the
/// dynamic shared memory of `kernel`: the 3xTF32 `wgmma` kernels hold `B`'s residual
/// in a third tile per stage and more stages.
pub fn stages(family: Family, kernel: Kernel) -> Result<(usize, usize)> {
    match family {
        Family::Fma => Ok((gemm_fma::BLOCK_K, gemm_fma::SMEM_BYTES)),
        Family::Mma => Ok((gemm_mma::BLOCK_K, gemm_mma::SMEM_BYTES)),
        Family::Wgmma => {
            let split = matches!(
                kernel,
                Kernel::GemmWgmmaTf32x3NtVec4 | Kernel::GemmWgmmaTf32x3DxVec4 | Kernel::GemmWgmmaTf32x3DwVec4
            );
            Ok((gemm_wgmma::BLOCK_K, gemm_wgmma::smem_bytes(split)))
        }
        Family::Tma | Family::Dot => {
            Err(Error::Unsupported(format!("`{}` is not a grid-of-tiles kernel", kernel.name())))
        }
    }
}

/// Queues `kernel` (of a grid family: FMA, `mma.sync` or `wgmma`, as the dispatch
/// chose) over `op` on `stream`. The caller has checked shapes, extents and 32-bit
/// limits.
pub fn launch(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    family: Family,
    kernel: Kernel,
    op: &Operands,
    y: &mut DeviceTensor,
    save_z: Option<&mut DeviceTensor>,
) -> Result<()> {
    let (block_k, smem_bytes) = stages(family, kernel)?;
    let (m, n, k, splits) = (op.m, op.n, op.k, op.splits.max(1));
    let k_split = k.div_ceil(splits).div_ceil(block_k) * block_k;
    // Each block's range starts at z k_split (`gemm::BlockTile`): one past `k` would
    // wrap its length.
    if (splits - 1) * k_split >= k {
        return Err(Error::Unsupported(format!(
            "`{kernel}`: {splits} split-K ranges of {k_split} over a depth of {k} leave one empty"
        )));
    }
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
    let tail = EpilogueArgs::new(&[m, n, k, op.lda, op.ldb, k_split], op.bias.filter(|_| splits == 1), chain);
    let mut launch = stream.launch_builder(&func);
    launch.arg(op.a).arg(op.b);
    tail.push(&mut launch, y, save_z, chain);
    // SAFETY: matches the kernels' shared signature; operand extents checked by the
    // caller; the chain's ops were checked fusable (`not_fusable`); grid, block and
    // shared memory follow kernel_abi::gemm_fma / gemm_mma / gemm_wgmma.
    unsafe { launch.launch(cfg) }.map_err(|e| Error::cuda(format!("launching `{kernel}`"), e))?;
    Ok(())
}

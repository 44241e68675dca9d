//! Launcher of `gemm_f32_fused_{vec4,scalar}` (kernels-gpu/src/gemm/simt.rs):
//! `y = chain(x W^T + b)` in one kernel, or split-K partial products.

use super::super::epilogue::DeviceChain;
use super::super::{DeviceTensor, Gpu};
use super::tiled::{check_output, gemm_dims};
use crate::chain::Op;
use crate::error::{Error, Result};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use kernel_abi::gemm_simt::{BLOCK_K, BLOCK_M, BLOCK_N, MAX_FUSED_GROUP, MIN_FUSED_GROUP, SMEM_BYTES, THREADS};

/// Why the fused kernel cannot apply `op` to `features` channels, or `None` if it can.
pub fn not_fusable(op: &Op, features: usize) -> Option<String> {
    match *op {
        Op::AvgPool(_) | Op::RowMax => Some(format!("`{op}` reduces across tiles")),
        Op::GroupNorm { groups, .. } => {
            let g = features / groups;
            (!(g.is_power_of_two() && (MIN_FUSED_GROUP..=MAX_FUSED_GROUP).contains(&g))).then(|| {
                format!(
                    "`{op}` has groups of {g} channels; the fused kernel takes powers of two from \
                     {MIN_FUSED_GROUP} to {MAX_FUSED_GROUP}"
                )
            })
        }
        _ => None,
    }
}

/// How the GEMM runs: `Fused` applies bias and chain in the kernel; `Split(s)` writes
/// `s` partial products (`y` must be `(s, m, n)`) and applies nothing.
#[derive(Clone, Copy)]
pub enum Mode<'a> {
    Fused(Option<&'a DeviceChain>),
    Split(usize),
}

/// Kernel name for this `k` (16-byte loads need `k % 4 == 0`).
pub fn kernel_name(k: usize) -> &'static str {
    if k.is_multiple_of(4) { "gemm_f32_fused_vec4" } else { "gemm_f32_fused_scalar" }
}

/// Queues the GEMM on the GPU's stream.
pub fn gemm_f32_fused(
    gpu: &Gpu,
    x: &DeviceTensor,
    w: &DeviceTensor,
    b: &DeviceTensor,
    y: &mut DeviceTensor,
    mode: Mode,
) -> Result<()> {
    let (m, n, k) = gemm_dims(x, w, b)?;
    match mode {
        Mode::Fused(_) => check_output(y, &[m, n])?,
        Mode::Split(s) => check_output(y, &[s, m, n])?,
    }
    let (splits, chain) = match mode {
        Mode::Fused(chain) => (1, chain),
        Mode::Split(s) => (s.max(1), None),
    };
    let k_split = k.div_ceil(splits).div_ceil(BLOCK_K) * BLOCK_K;
    let name = kernel_name(k);
    let func = gpu.function(name)?;
    gpu.allow_shared(&func, name, SMEM_BYTES)?;
    let grid = (n.div_ceil(BLOCK_N), m.div_ceil(BLOCK_M), splits);
    if grid.1 > 65535 || grid.2 > 65535 {
        return Err(Error::Shape(format!("GEMM grid {grid:?} exceeds the launch limits")));
    }
    let cfg = LaunchConfig {
        grid_dim: (grid.0 as u32, grid.1 as u32, grid.2 as u32),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: SMEM_BYTES as u32,
    };
    let (m, n, k, k_split) = (m as u32, n as u32, k as u32, k_split as u32);
    let n_ops = chain.map_or(0, |c| c.ops.len() as u32);
    let empty = 0u64;
    let mut launch = gpu.stream().launch_builder(&func);
    launch.arg(&x.buf).arg(&w.buf).arg(&b.buf).arg(&mut y.buf).arg(&m).arg(&n).arg(&k).arg(&k_split);
    match chain {
        Some(c) => launch.arg(&c.descs),
        None => launch.arg(&empty),
    };
    launch.arg(&n_ops);
    // SAFETY: matches the kernel's signature; shapes checked above; the chain's ops
    // were checked fusable by the caller (`not_fusable`); grid, block and shared memory
    // follow kernel_abi::gemm_simt.
    unsafe { launch.launch(cfg) }.map_err(|e| Error::cuda(format!("launching `{name}`"), e))?;
    Ok(())
}

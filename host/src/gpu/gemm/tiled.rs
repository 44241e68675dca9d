//! Launcher of `gemm_bias_tiled` (kernels-gpu/src/gemm/tiled.rs): `y = x W^T + b`.

use super::super::{DeviceTensor, Gpu};
use crate::error::{Error, Result};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use kernel_abi::gemm_tiled::{BLOCK_M, BLOCK_N, SMEM_BYTES, THREADS};

const KERNEL: &str = "gemm_bias_tiled";

/// Checks `x (m, k)`, `w (n, k)`, `b (n,)` and returns `(m, n, k)`.
pub fn gemm_dims(x: &DeviceTensor, w: &DeviceTensor, b: &DeviceTensor) -> Result<(usize, usize, usize)> {
    let (m, n, k) = super::linear_dims(x, w)?;
    if b.shape != [n] {
        return Err(Error::tensor("lin.bias", format!("expected shape ({n},), got {:?}", b.shape)));
    }
    check_gemm_size(m, n, k)?;
    Ok((m, n, k))
}

/// Refuses GEMM sizes the kernels cannot take: empty, or beyond their u32 `m, n, k`.
pub fn check_gemm_size(m: usize, n: usize, k: usize) -> Result<()> {
    if [m, n, k].iter().any(|&d| d == 0 || d > u32::MAX as usize) || m.checked_mul(k.max(n)).is_none() {
        return Err(Error::Shape(format!("GEMM size ({m}, {n}, {k}) outside what the kernel indexes (1 to 2^32 - 1)")));
    }
    Ok(())
}

/// Checks that `y` has `shape`.
pub fn check_output(y: &DeviceTensor, shape: &[usize]) -> Result<()> {
    if y.shape != shape {
        return Err(Error::Shape(format!("GEMM output must be {shape:?}, got {:?}", y.shape)));
    }
    Ok(())
}

/// Queues `y = x W^T + b` on the GPU's stream.
pub fn gemm_bias_tiled(
    gpu: &Gpu,
    x: &DeviceTensor,
    w: &DeviceTensor,
    b: &DeviceTensor,
    y: &mut DeviceTensor,
) -> Result<()> {
    let (m, n, k) = gemm_dims(x, w, b)?;
    check_output(y, &[m, n])?;
    let func = gpu.function(KERNEL)?;
    gpu.allow_shared(&func, KERNEL, SMEM_BYTES)?;
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(BLOCK_N) as u32, m.div_ceil(BLOCK_M) as u32, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: SMEM_BYTES as u32,
    };
    if cfg.grid_dim.1 > 65535 {
        return Err(Error::Shape(format!("batch {m} exceeds the tiled GEMM's grid limit of {} rows", 65535 * BLOCK_M)));
    }
    let (m, n, k) = (m as u32, n as u32, k as u32);
    let mut launch = gpu.stream().launch_builder(&func);
    launch.arg(&x.buf).arg(&w.buf).arg(&b.buf).arg(&mut y.buf).arg(&m).arg(&n).arg(&k);
    // SAFETY: argument list matches the kernel's signature; buffer sizes were checked
    // against (m, n, k) above; grid and shared memory follow kernel_abi::gemm_tiled.
    unsafe { launch.launch(cfg) }.map_err(|e| Error::cuda(format!("launching `{KERNEL}`"), e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::check_gemm_size;

    #[test]
    fn sizes_that_would_truncate_are_refused() {
        let big = u32::MAX as usize + 1;
        for (m, n, k) in [(big, 8, 8), (8, big, 8), (8, 8, big), (0, 8, 8), (8, 0, 8), (8, 8, 0)] {
            assert!(check_gemm_size(m, n, k).is_err(), "({m}, {n}, {k})");
        }
        assert!(check_gemm_size(u32::MAX as usize, 1, 1).is_ok());
    }
}

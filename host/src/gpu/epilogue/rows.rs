//! Launcher of `epilogue_rows` (kernels-gpu/src/epilogue/rows.rs): any chain, one block per row.

use super::super::{DeviceTensor, Gpu};
use super::DeviceChain;
use crate::error::{Error, Result};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use kernel_abi::epilogue::{ROW_THREADS, row_smem_bytes};

const KERNEL: &str = "epilogue_rows";

/// Refuses what the kernel cannot launch: one block per row (`gridDim.x` < 2^31),
/// `n` and `splits` as u32 (at most 64 split-K parts).
fn check_rows_size(splits: usize, rows: usize, n: usize) -> Result<()> {
    if rows == 0 || rows > i32::MAX as usize || n == 0 || n > u32::MAX as usize || splits == 0 || splits > 64 {
        return Err(Error::Shape(format!("epilogue over {splits} x {rows} rows of {n} is outside the kernel's range")));
    }
    Ok(())
}

/// Queues `y = chain(sum_s z[s] + bias)` row by row. `z` is `(rows, n)`, or
/// `(splits, rows, n)` holding split-K parts; `y` has the chain's output width.
pub fn epilogue_rows(
    gpu: &Gpu,
    chain: &DeviceChain,
    z: &DeviceTensor,
    bias: Option<&CudaSlice<f32>>,
    y: &mut DeviceTensor,
) -> Result<()> {
    let (splits, rows, n) = match z.shape[..] {
        [rows, n] => (1, rows, n),
        [splits, rows, n] => (splits, rows, n),
        _ => return Err(Error::Shape(format!("epilogue input must be 2-D or 3-D, got {:?}", z.shape))),
    };
    check_rows_size(splits, rows, n)?;
    if bias.is_some_and(|b| b.len() != n) {
        return Err(Error::Shape(format!("epilogue bias must have {n} entries")));
    }
    let func = gpu.function(KERNEL)?;
    let smem = row_smem_bytes(n);
    gpu.allow_shared(&func, KERNEL, smem)
        .map_err(|e| Error::Unsupported(format!("{e}: rows of {n} features are too wide for the row-wise epilogue")))?;
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (ROW_THREADS as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let (splits, n, n_ops) = (splits as u32, n as u32, chain.ops.len() as u32);
    let null = 0u64;
    let mut launch = gpu.stream().launch_builder(&func);
    launch.arg(&z.buf).arg(&splits);
    match bias {
        Some(b) => launch.arg(b),
        None => launch.arg(&null),
    };
    launch.arg(&mut y.buf).arg(&n).arg(&chain.descs).arg(&n_ops);
    // SAFETY: matches the kernel's signature; z holds splits * rows * n values; the
    // chain was validated against n when its BlockSpec was built, and its parameter
    // vectors have the matching lengths.
    unsafe { launch.launch(cfg) }.map_err(|e| Error::cuda(format!("launching `{KERNEL}`"), e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn sizes_outside_the_launch_are_refused() {
        use super::check_rows_size;
        assert!(check_rows_size(1, i32::MAX as usize + 1, 8).is_err());
        assert!(check_rows_size(1, 8, u32::MAX as usize + 1).is_err());
        assert!(check_rows_size(65, 8, 8).is_err());
        assert!(check_rows_size(1, 0, 8).is_err());
        assert!(check_rows_size(16, i32::MAX as usize, u32::MAX as usize).is_ok());
    }
}

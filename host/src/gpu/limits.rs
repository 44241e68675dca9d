//! Sizes the kernels and the device can take, refused before anything is allocated.

use crate::error::{Error, Result};

/// The largest batch the GEMM kernels launch: the fused kernel's grid has at most
/// 65535 row tiles (`gridDim.y`).
pub const MAX_BATCH: usize = 65535 * kernel_abi::gemm_fma::BLOCK_M;

/// Refuses sizes the launchers would refuse, before anything is allocated (and
/// without a GPU): the kernels take `m`, `n`, `k` as u32 and the batch is bounded by
/// the grid ([`MAX_BATCH`]).
pub fn check_launch_sizes(batch: usize, in_features: usize, out_features: usize) -> Result<()> {
    for (what, d) in [("batch", batch), ("in_features", in_features), ("out_features", out_features)] {
        if d > u32::MAX as usize {
            return Err(Error::Shape(format!(
                "{what} {d} does not fit the GPU kernels' 32-bit size arguments (at most {})",
                u32::MAX
            )));
        }
    }
    // The GEMM kernels keep 32-bit element offsets into each operand (x, W, dZ, dX).
    for (what, elements) in [
        ("x (batch x in_features)", batch as u128 * in_features as u128),
        ("lin.weight (out_features x in_features)", out_features as u128 * in_features as u128),
        ("y (batch x out_features)", batch as u128 * out_features as u128),
    ] {
        if elements > u32::MAX as u128 {
            return Err(Error::Shape(format!(
                "{what} has {elements} elements; the GPU GEMM indexes operands of at most {} elements",
                u32::MAX
            )));
        }
    }
    if batch > MAX_BATCH {
        return Err(Error::Shape(format!(
            "the batch {batch} exceeds the GPU GEMM's grid: at most {MAX_BATCH} rows (65535 tiles of {})",
            kernel_abi::gemm_fma::BLOCK_M
        )));
    }
    Ok(())
}

/// Refuses work whose buffers (`needed_bytes`) exceed the device's memory, with the
/// same words as an allocation that fails.
pub fn check_device_memory(needed_bytes: u128, total_bytes: usize) -> Result<()> {
    if needed_bytes > total_bytes as u128 {
        return Err(Error::Cuda {
            context: "planning the block's device buffers".into(),
            message: format!("{} (the device has {} MB)", out_of_memory(needed_bytes), total_bytes >> 20),
        });
    }
    Ok(())
}

fn out_of_memory(bytes: u128) -> String {
    format!("out of device memory for {} MB", bytes.div_ceil(1 << 20))
}

/// A failed allocation or copy of `elements` f32 values: out of memory says how much
/// was asked for, anything else is passed on.
pub(super) fn oom_or(context: &str, elements: usize, e: cudarc::driver::DriverError) -> Error {
    use cudarc::driver::sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY;
    if e.0 == CUDA_ERROR_OUT_OF_MEMORY {
        Error::Cuda { context: context.into(), message: out_of_memory(elements as u128 * 4) }
    } else {
        Error::cuda(context, e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudarc::driver::{DriverError, sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY};

    #[test]
    fn out_of_memory_says_how_much() {
        // Formatting other driver errors asks the driver for their text; this one does not.
        let e = oom_or("allocating", 3 << 20, DriverError(CUDA_ERROR_OUT_OF_MEMORY)).to_string();
        assert_eq!(e, "CUDA error in allocating: out of device memory for 12 MB");
        let e = oom_or("allocating", 1, DriverError(CUDA_ERROR_OUT_OF_MEMORY)).to_string();
        assert!(e.ends_with("for 1 MB"), "{e}");
        let e = check_device_memory(80 << 30, 1 << 30).unwrap_err().to_string();
        assert!(e.contains("out of device memory for 81920 MB (the device has 1024 MB)"), "{e}");
        assert!(check_device_memory(1 << 20, 1 << 30).is_ok());
    }

    #[test]
    fn sizes_beyond_32_bit_arguments_are_refused() {
        let e = check_launch_sizes(1 << 32, 2, 2).unwrap_err().to_string();
        assert!(e.contains("batch 4294967296") && e.contains("32-bit"), "{e}");
        assert!(check_launch_sizes(8, 1 << 32, 2).unwrap_err().to_string().contains("in_features 4294967296"));
        assert!(check_launch_sizes(8, 2, 1 << 32).unwrap_err().to_string().contains("out_features 4294967296"));
        assert!(check_launch_sizes(MAX_BATCH + 1, 2, 2).unwrap_err().to_string().contains("grid"));
        assert!(check_launch_sizes(65536, 65536, 1).unwrap_err().to_string().contains("x (batch x in_features)"));
        assert!(check_launch_sizes(MAX_BATCH, 512, 512).is_ok());
    }
}

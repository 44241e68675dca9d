//! The launcher of the small-batch forward (`kernels-gpu/src/gemm/gemv.rs`): at most
//! `gemv::ROWS` rows of `y = chain(x W^T + bias)`, `W` streamed once across the GPU.

use super::super::epilogue::DeviceChain;
use super::super::{DeviceElement, DeviceTensor, Gpu};
use super::args::EpilogueArgs;
use crate::error::{Error, Result};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use kernel_abi::Kernel;
use kernel_abi::gemv::{ROWS, SLAB, SMEM_BYTES, THREADS};

/// Queues the small-batch `kernel` ([`gemv_kernel`](super::super::dispatch::gemv_kernel)):
/// `y (m, n)` from `x (m, k)` and `w (n, k)` (in the kernel's dtypes), plus `bias`; with
/// `chain` (which the dispatch found to fit the slabs), the chain too, else `y` is the
/// chain's input `z`. `save_z` receives `z` (FP32).
#[allow(clippy::too_many_arguments)]
pub fn launch_gemv<E: DeviceElement, O: DeviceElement>(
    gpu: &Gpu,
    kernel: Kernel,
    x: &DeviceTensor<E>,
    w: &DeviceTensor<E>,
    bias: Option<&CudaSlice<f32>>,
    chain: Option<&DeviceChain>,
    y: &mut DeviceTensor<O>,
    save_z: Option<&mut DeviceTensor>,
) -> Result<()> {
    let (&[m, k], &[n, wk]) = (&x.shape[..], &w.shape[..]) else {
        return Err(Error::Shape(format!("small-batch GEMM: x {:?}, W {:?}", x.shape, w.shape)));
    };
    if wk != k
        || y.shape != [m, n]
        || save_z.as_ref().is_some_and(|z| z.shape != [m, n])
        || bias.is_some_and(|b| b.len() != n)
        || !(1..=ROWS).contains(&m)
        || n == 0
        || !k.is_multiple_of(8)
        || !w.buf.device_address().is_multiple_of(16)
        || (chain.is_some() && !n.is_multiple_of(SLAB))
        || [m * k, n * k].iter().any(|&d| d > u32::MAX as usize)
    {
        return Err(Error::Shape(format!(
            "small-batch GEMM `{kernel}`: x {:?}, W {:?}, y {:?}",
            x.shape, w.shape, y.shape
        )));
    }
    let func = gpu.function(kernel)?;
    gpu.allow_shared(&func, kernel, SMEM_BYTES)?;
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(SLAB) as u32, 1, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: SMEM_BYTES as u32,
    };
    let tail = EpilogueArgs::new(&[m, n, k], chain);
    let mut launch = gpu.stream().launch_builder(&func);
    launch.arg(&x.buf).arg(&w.buf);
    tail.push(&mut launch, bias, y, save_z, chain);
    // SAFETY: matches the kernel's signature; shapes, the depth's multiple of 8 and
    // W's 16-byte alignment checked above; a chain fits the slab (dispatch::gemv_chain_fits).
    unsafe { launch.launch(cfg) }.map_err(|e| Error::cuda(format!("launching `{kernel}`"), e))?;
    Ok(())
}

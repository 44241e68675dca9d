//! The launcher of the small-batch forwards: `gemv_*` (`kernels-gpu/src/gemm/gemv.rs`,
//! FP32 FMAs, at most `gemv::ROWS` rows) and `gemv_tc_*` (`gemm/gemv_tc.rs`, `mma.sync`,
//! at most `gemv_tc::ROWS` rows): `y = chain(x W^T + bias)`, `W` streamed once across
//! the GPU.

use super::super::epilogue::DeviceChain;
use super::super::{DeviceElement, DeviceTensor, Gpu, VectorArg};
use super::args::EpilogueArgs;
use crate::error::{Error, Result};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use kernel_abi::Kernel;
use kernel_abi::{gemv, gemv_tc};

/// Whether `kernel` is a tensor-core small-batch kernel (`gemv_tc_*`).
fn tensor_cores(kernel: Kernel) -> bool {
    matches!(
        kernel,
        Kernel::GemvTcBf16 | Kernel::GemvTcBf16ToBf16 | Kernel::GemvTcF16 | Kernel::GemvTcF16ToF16 | Kernel::GemvTcTf32
    )
}

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
    bias: Option<VectorArg<'_>>,
    chain: Option<&DeviceChain>,
    y: &mut DeviceTensor<O>,
    save_z: Option<&mut DeviceTensor>,
) -> Result<()> {
    let (&[m, k], &[n, wk]) = (&x.shape[..], &w.shape[..]) else {
        return Err(Error::Shape(format!("small-batch GEMM: x {:?}, W {:?}", x.shape, w.shape)));
    };
    let tc = tensor_cores(kernel);
    let (rows, smem) = if tc { (gemv_tc::ROWS, gemv_tc::smem_bytes(m)) } else { (gemv::ROWS, gemv::SMEM_BYTES) };
    const { assert!(gemv::SLAB == gemv_tc::SLAB && gemv::THREADS == gemv_tc::THREADS) };
    let (slab, threads) = (gemv::SLAB, gemv::THREADS);
    if wk != k
        || y.shape != [m, n]
        || save_z.as_ref().is_some_and(|z| z.shape != [m, n])
        || bias.is_some_and(|b| b.len != n)
        || !(1..=rows).contains(&m)
        || n == 0
        || !k.is_multiple_of(8)
        || !(k * size_of::<E>()).is_multiple_of(16)
        || !w.buf.device_address().is_multiple_of(16)
        || (chain.is_some() && !n.is_multiple_of(slab))
        || [m * k, n * k].iter().any(|&d| d > u32::MAX as usize)
    {
        return Err(Error::Shape(format!(
            "small-batch GEMM `{kernel}`: x {:?}, W {:?}, y {:?}",
            x.shape, w.shape, y.shape
        )));
    }
    // `gemv_tc` copies `x` by 16-byte chunks: a view at another offset (a framework's)
    // runs on an aligned copy, `m k` values.
    let x_copy;
    let x = if tc && !x.buf.device_address().is_multiple_of(16) {
        let mut copy = gpu.alloc_as::<E>(&x.shape)?;
        gpu.stream()
            .memcpy_dtod(&*x.buf, &mut *copy.buf)
            .map_err(|e| Error::cuda("copying x to an aligned buffer", e))?;
        x_copy = copy;
        &x_copy
    } else {
        x
    };
    let func = gpu.function(kernel)?;
    gpu.allow_shared(&func, kernel, smem)?;
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(slab) as u32, 1, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let tail = EpilogueArgs::new(&[m, n, k], bias, chain);
    let mut launch = gpu.stream().launch_builder(&func);
    launch.arg(&x.buf).arg(&w.buf);
    tail.push(&mut launch, y, save_z, chain);
    // SAFETY: matches the kernel's signature (both families share it); shapes, the
    // depth's multiple of 8 (16-byte rows), W's and (for `gemv_tc`) x's 16-byte
    // alignment checked above; a chain fits the slab (dispatch::gemv_chain_fits).
    unsafe { launch.launch(cfg) }.map_err(|e| Error::cuda(format!("launching `{kernel}`"), e))?;
    Ok(())
}

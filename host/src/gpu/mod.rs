//! The CUDA backend: driver detection, the loaded kernel module, device buffers and
//! the launchers of the kernels in `kernels-gpu` (each in the file mirroring its kernel's).
//!
//! cudarc loads `libcuda` at run time and panics when it is missing, so [`Gpu::open`]
//! checks for the library first and turns every failure into an [`Error`].

pub mod cublas;
pub mod epilogue;
pub mod forward;
pub mod gemm;

use crate::error::{Error, Result};
use crate::tensor::Tensor;
use cudarc::driver::sys::CUdevice_attribute as Attr;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream};
use cudarc::nvrtc::Ptx;
use std::sync::Arc;

/// The kernels, compiled to PTX for sm_90 by `build.rs`.
pub const KERNELS_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/kernels_sm90.ptx"));

/// What the backend read off the device at start.
#[derive(Clone, Debug)]
pub struct DeviceProps {
    pub name: String,
    pub compute_capability: (i32, i32),
    pub multiprocessors: usize,
    /// Shared memory a block may opt into (above the default 48 KiB).
    pub max_shared_per_block_optin: usize,
    pub shared_per_multiprocessor: usize,
    pub total_memory: usize,
}

/// An open GPU: context, one stream, the kernel module.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    module: Arc<CudaModule>,
    pub props: DeviceProps,
}

/// Why there is no usable GPU, or `Ok` if the driver library is present.
pub fn driver_present() -> Result<()> {
    // SAFETY: only tries to dlopen the driver library under its usual names.
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(Error::NoGpu("the CUDA driver library (libcuda.so) was not found".into()))
    }
}

impl Gpu {
    /// Opens device `ordinal` and loads the kernels. Never panics: a missing driver,
    /// no device or a device older than Hopper are errors saying so.
    pub fn open(ordinal: usize) -> Result<Gpu> {
        driver_present()?;
        // cudarc panics on a missing driver symbol (a driver older than it expects).
        let opened = std::panic::catch_unwind(|| Self::open_unchecked(ordinal));
        opened.unwrap_or_else(|_| Err(Error::NoGpu("the CUDA driver is missing functions cudarc needs".into())))
    }

    fn open_unchecked(ordinal: usize) -> Result<Gpu> {
        let count =
            CudaContext::device_count().map_err(|e| Error::NoGpu(format!("cuInit/device count failed: {e}")))?;
        if ordinal >= count.max(0) as usize {
            return Err(Error::NoGpu(format!("device {ordinal} requested, {count} present")));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| Error::cuda("creating the context", e))?;
        let attr = |a| ctx.attribute(a).map_err(|e| Error::cuda("reading device attributes", e));
        let props = DeviceProps {
            name: ctx.name().map_err(|e| Error::cuda("reading the device name", e))?,
            compute_capability: (
                attr(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                attr(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            ),
            multiprocessors: attr(Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as usize,
            max_shared_per_block_optin: attr(Attr::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)? as usize,
            shared_per_multiprocessor: attr(Attr::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)? as usize,
            total_memory: ctx.total_mem().map_err(|e| Error::cuda("reading the memory size", e))?,
        };
        if props.compute_capability.0 < 9 {
            let (major, minor) = props.compute_capability;
            return Err(Error::NoGpu(format!(
                "{} has compute capability {major}.{minor}; the kernels are built for sm_90 (Hopper) or newer",
                props.name
            )));
        }
        // One stream only: cudarc's cross-stream event tracking would be pure overhead.
        // SAFETY: nothing in this crate uses a second stream.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let module =
            ctx.load_module(Ptx::from_src(KERNELS_PTX)).map_err(|e| Error::cuda("loading the kernel module", e))?;
        Ok(Gpu { ctx, stream, module, props })
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// A kernel of the module, by its exported name.
    pub fn function(&self, name: &str) -> Result<CudaFunction> {
        self.module.load_function(name).map_err(|e| Error::cuda(format!("loading kernel `{name}`"), e))
    }

    /// Prepares `func` to take `bytes` of dynamic shared memory, or explains why it can't.
    pub fn allow_shared(&self, func: &CudaFunction, name: &str, bytes: usize) -> Result<()> {
        if bytes > self.props.max_shared_per_block_optin {
            return Err(Error::Unsupported(format!(
                "`{name}` needs {bytes} bytes of shared memory per block; {} allows {}",
                self.props.name, self.props.max_shared_per_block_optin
            )));
        }
        if bytes > 48 * 1024 {
            use cudarc::driver::sys::CUfunction_attribute as F;
            func.set_attribute(F::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32)
                .map_err(|e| Error::cuda(format!("raising the shared-memory limit of `{name}`"), e))?;
        }
        Ok(())
    }

    /// Copies a host tensor to the device.
    pub fn upload(&self, t: &Tensor<f32>) -> Result<DeviceTensor> {
        let buf = self.stream.clone_htod(t.data()).map_err(|e| oom_or("copying to the device", t.len(), e))?;
        Ok(DeviceTensor { shape: t.shape().to_vec(), buf })
    }

    /// A device tensor filled with NaN, so an element a kernel fails to write shows up.
    pub fn poisoned(&self, shape: &[usize]) -> Result<DeviceTensor> {
        let poison = Tensor::full(shape, f32::NAN)?;
        let buf = self.stream.clone_htod(poison.data()).map_err(|e| oom_or("allocating", poison.len(), e))?;
        Ok(DeviceTensor { shape: shape.to_vec(), buf })
    }

    /// Copies a device tensor back (waits for the stream: kernel faults surface here).
    pub fn download(&self, t: &DeviceTensor) -> Result<Tensor<f32>> {
        let data = self.stream.clone_dtoh(&t.buf).map_err(|e| Error::cuda("copying from the device", e))?;
        Tensor::new(&t.shape, data)
    }

    /// Waits for all queued work; reports any fault of an earlier launch.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(|e| Error::cuda("synchronizing the stream", e))
    }

    /// Milliseconds the stream takes to run `work`, measured with CUDA events.
    pub fn time_ms(&self, work: impl FnOnce() -> Result<()>) -> Result<f64> {
        use cudarc::driver::sys::CUevent_flags;
        let err = |e| Error::cuda("timing with events", e);
        let start = self.stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(err)?;
        work()?;
        let end = self.stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(err)?;
        Ok(start.elapsed_ms(&end).map_err(err)? as f64)
    }
}

/// The largest batch the GEMM kernels launch: the fused kernel's grid has at most
/// 65535 row tiles (`gridDim.y`).
pub const MAX_BATCH: usize = 65535 * kernel_abi::gemm_simt::BLOCK_M;

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
    if batch > MAX_BATCH {
        return Err(Error::Shape(format!(
            "the batch {batch} exceeds the GPU GEMM's grid: at most {MAX_BATCH} rows (65535 tiles of {})",
            kernel_abi::gemm_simt::BLOCK_M
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
fn oom_or(context: &str, elements: usize, e: cudarc::driver::DriverError) -> Error {
    use cudarc::driver::sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY;
    if e.0 == CUDA_ERROR_OUT_OF_MEMORY {
        Error::Cuda { context: context.into(), message: out_of_memory(elements as u128 * 4) }
    } else {
        Error::cuda(context, e)
    }
}

/// A row-major f32 tensor in device memory.
pub struct DeviceTensor {
    pub shape: Vec<usize>,
    pub buf: CudaSlice<f32>,
}

impl DeviceTensor {
    pub fn len(&self) -> usize {
        self.buf.len()
    }
    pub fn is_empty(&self) -> bool {
        self.buf.len() == 0
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
        assert!(check_launch_sizes(MAX_BATCH, u32::MAX as usize, u32::MAX as usize).is_ok());
    }
}

//! The CUDA backend: driver detection, the loaded kernel module, device buffers and
//! the launchers of the kernels in `kernels-gpu` (each in the file mirroring its kernel's).
//!
//! cudarc loads `libcuda` at run time and panics when it is missing, so [`Gpu::open`]
//! checks for the library first and turns every failure into an [`Error`].

pub mod block;
pub mod cublas;
pub mod elementwise;
pub mod epilogue;
pub mod gemm;
pub mod optim;
pub mod tape;

use crate::error::{Error, Result};
use crate::tensor::Tensor;
use cudarc::driver::sys::CUdevice_attribute as Attr;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtrMut, LaunchConfig};
use cudarc::nvrtc::Ptx;
use std::sync::Arc;

/// The kernels, compiled to PTX for sm_90a (Hopper: H100, H200) by `build.rs`; the
/// `a` features (`wgmma`) tie the module to compute capability 9.0 exactly.
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

/// An open GPU: context, one stream, the kernel module. Cloning shares them.
#[derive(Clone)]
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// A second stream for independent work that can overlap the first (the backward's
    /// two GEMMs); ordered against `stream` with events by whoever uses it.
    side: Arc<CudaStream>,
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
        if props.compute_capability != (9, 0) {
            let (major, minor) = props.compute_capability;
            return Err(Error::NoGpu(format!(
                "{} has compute capability {major}.{minor}; the kernels are built for sm_90a (Hopper, 9.0)",
                props.name
            )));
        }
        // cudarc's automatic cross-stream event tracking would be pure overhead: the one
        // place that uses the side stream orders it explicitly (`Gpu::order`).
        // SAFETY: see `GpuBlock::backward_timed`, the side stream's only user.
        unsafe { ctx.disable_event_tracking() };
        // Two explicit streams rather than the legacy default stream, whose implicit
        // synchronisation rules differ from the events `Gpu::order` relies on. The main
        // stream gets the higher priority: the side stream's work (the backward's dW)
        // fills the SMs the main stream's (dX) leaves idle instead of competing for them.
        let (least, greatest) =
            cudarc::driver::result::stream::get_priority_range().map_err(|e| Error::cuda("stream priorities", e))?;
        let stream = ctx.new_stream_with_priority(greatest).map_err(|e| Error::cuda("creating a stream", e))?;
        keep_freed_memory(&ctx)?;
        let side = ctx.new_stream_with_priority(least).map_err(|e| Error::cuda("creating a stream", e))?;
        let module =
            ctx.load_module(Ptx::from_src(KERNELS_PTX)).map_err(|e| Error::cuda("loading the kernel module", e))?;
        Ok(Gpu { ctx, stream, side, module, props })
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn side_stream(&self) -> &Arc<CudaStream> {
        &self.side
    }

    /// Makes `later` wait for everything queued on `earlier` so far.
    pub fn order(&self, earlier: &CudaStream, later: &CudaStream) -> Result<()> {
        let e = earlier.record_event(None).map_err(|e| Error::cuda("recording an event", e))?;
        later.wait(&e).map_err(|e| Error::cuda("waiting for an event", e))
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

    /// A kernel and a 1-D launch configuration (256-thread blocks) covering `len` elements.
    pub fn kernel_1d(&self, name: &str, len: usize, shared_bytes: u32) -> Result<(CudaFunction, LaunchConfig)> {
        if len > u32::MAX as usize {
            return Err(Error::Shape(format!("`{name}` over {len} elements exceeds 32-bit indexing")));
        }
        let cfg = LaunchConfig {
            grid_dim: (len.div_ceil(256).max(1) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: shared_bytes,
        };
        Ok((self.function(name)?, cfg))
    }

    /// Copies a host tensor to the device.
    pub fn upload(&self, t: &Tensor<f32>) -> Result<DeviceTensor> {
        let buf = self.stream.clone_htod(t.data()).map_err(|e| oom_or("copying to the device", t.len(), e))?;
        Ok(DeviceTensor { shape: t.shape().to_vec(), buf })
    }

    /// An uninitialised device tensor, for outputs a kernel writes in full.
    pub fn alloc(&self, shape: &[usize]) -> Result<DeviceTensor> {
        let len = crate::tensor::numel::<f32>(shape)?;
        // SAFETY: every caller passes the tensor to a kernel that writes all of it
        // before anything reads it (outputs and scratch of our launchers).
        let buf = unsafe { self.stream.alloc::<f32>(len.max(1)) }.map_err(|e| oom_or("allocating", len, e))?;
        Ok(DeviceTensor { shape: shape.to_vec(), buf })
    }

    /// A device tensor of zeros.
    pub fn zeros(&self, shape: &[usize]) -> Result<DeviceTensor> {
        let len = crate::tensor::numel::<f32>(shape)?;
        let buf = self.stream.alloc_zeros::<f32>(len.max(1)).map_err(|e| oom_or("allocating", len, e))?;
        Ok(DeviceTensor { shape: shape.to_vec(), buf })
    }

    /// A device tensor filled with NaN (on the device), so an element a kernel fails
    /// to write shows up.
    pub fn poisoned(&self, shape: &[usize]) -> Result<DeviceTensor> {
        let mut t = self.alloc(shape)?;
        let ptr = t.buf.device_ptr_mut(&self.stream).0;
        // SAFETY: fills exactly the allocation's len 32-bit words on our stream.
        unsafe { cudarc::driver::sys::cuMemsetD32Async(ptr, f32::NAN.to_bits(), t.buf.len(), self.stream.cu_stream()) }
            .result()
            .map_err(|e| Error::cuda("filling with NaN", e))?;
        Ok(t)
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

/// Keeps memory freed to the device's default pool cached in the pool instead of
/// returning it to the driver at every synchronisation: a training step frees and
/// reallocates the same large buffers each time (PyTorch's caching allocator does
/// the same job).
fn keep_freed_memory(ctx: &CudaContext) -> Result<()> {
    use cudarc::driver::sys;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut threshold = u64::MAX;
    // SAFETY: the context's device; the attribute takes a pointer to a u64.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
            .result()
            .map_err(|e| Error::cuda("memory pool", e))?;
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut threshold as *mut u64 as *mut std::ffi::c_void,
        )
        .result()
        .map_err(|e| Error::cuda("memory pool", e))
    }
}

/// Maps a launch's result to the crate's error, naming the kernel.
pub fn launched<T>(name: &str, r: std::result::Result<T, cudarc::driver::DriverError>) -> Result<()> {
    r.map(|_| ()).map_err(|e| Error::cuda(format!("launching `{name}`"), e))
}

/// CUDA events recorded between the phases of a piece of work, for a breakdown of
/// where its time goes (`host bench --backward` prints one).
pub struct Phases {
    marks: Vec<(&'static str, cudarc::driver::CudaEvent)>,
}

impl Phases {
    /// Starts timing at the current point of the GPU's stream.
    pub fn start(gpu: &Gpu) -> Result<Phases> {
        let mut p = Phases { marks: Vec::new() };
        p.mark(gpu, "start")?;
        Ok(p)
    }

    /// Ends the phase named `name` here.
    pub fn mark(&mut self, gpu: &Gpu, name: &'static str) -> Result<()> {
        use cudarc::driver::sys::CUevent_flags;
        let e = gpu.stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(|e| Error::cuda("timing", e))?;
        self.marks.push((name, e));
        Ok(())
    }

    /// Milliseconds of each phase, in order (waits for the stream).
    pub fn millis(&self) -> Result<Vec<(&'static str, f64)>> {
        self.marks
            .windows(2)
            .map(|w| Ok((w[1].0, w[0].1.elapsed_ms(&w[1].1).map_err(|e| Error::cuda("timing", e))? as f64)))
            .collect()
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

    /// The same buffer under another shape of equal size.
    pub fn reshape(self, shape: &[usize]) -> Result<DeviceTensor> {
        if shape.iter().product::<usize>() != self.buf.len() {
            return Err(Error::Shape(format!("cannot view {} values as {shape:?}", self.buf.len())));
        }
        Ok(DeviceTensor { shape: shape.to_vec(), buf: self.buf })
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

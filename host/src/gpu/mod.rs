//! The CUDA backend: driver detection, the loaded kernel module, device buffers and
//! the launchers of the kernels in `kernels-gpu` (each in the file mirroring its kernel's).
//!
//! cudarc loads `libcuda` at run time and panics when it is missing, so [`Gpu::open`]
//! checks for the library first and turns every failure into an [`Error`].

pub mod block;
pub mod block_bf16;
pub mod collective;
pub mod cublas;
pub mod elementwise;
pub mod epilogue;
pub mod gemm;
pub mod optim;
pub mod parallel;
pub mod tape;
pub mod tuning;

use crate::error::{Error, Result};
use crate::tensor::{Bf16, Tensor};
use cudarc::driver::sys::CUdevice_attribute as Attr;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, LaunchArgs,
    LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use kernel_abi::Kernel;
use std::any::Any;
use std::mem::ManuallyDrop;
use std::sync::Arc;
pub use tuning::Tuning;

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

/// Device memory owned by someone other than cudarc — a framework's caching
/// allocator — handed out in bytes on the GPU's stream (in that stream's order).
///
/// The keep-alive handle returned with the pointer owns the memory: dropping it gives
/// the memory back (to the allocator, in the order of the stream it was allocated on).
pub trait DeviceAllocator: Send + Sync {
    /// Device memory for `shape`'s values of `element` (`Bytes`: `shape` counts bytes),
    /// at least 16-byte aligned. The shape is what the caller will use: an allocator
    /// that hands out framework tensors makes them in it, so none needs reshaping later.
    fn allocate(&self, shape: &[usize], element: ElementKind) -> Result<(u64, Box<dyn Any + Send + Sync>)>;
}

/// What an allocation holds, so an allocator can hand out a typed buffer (a framework
/// tensor of that dtype) that its caller can use as it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ElementKind {
    F32,
    /// A bf16 tensor's values.
    Bf16,
    /// Anything else: 16-bit words, 32-bit indices, 64-bit table words.
    Bytes,
}

/// An open GPU: context, one stream, the kernel module. Cloning shares them.
#[derive(Clone)]
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// Where buffers come from: cudarc's stream-ordered allocations when `None`.
    allocator: Option<Arc<dyn DeviceAllocator>>,
    /// Small tables the main stream's launches read, by content ([`Gpu::words`]).
    tables: Tables,
    /// Those of the other streams a framework lent ([`Gpu::on_stream`]), by stream.
    lent_tables: Arc<std::sync::Mutex<std::collections::HashMap<u64, Tables>>>,
    /// The allocator's handles of buffers allocated for the side stream, held until the
    /// main stream is ordered after it ([`Gpu::order`]): an allocator hands freed memory
    /// out again in the order of the stream it belongs to (the main one), not of the
    /// side stream that may still be reading or writing it.
    side_frees: SideFrees,
    /// A second stream for independent work that can overlap the first (the backward's
    /// two GEMMs); ordered against `stream` with events by whoever uses it.
    side: Arc<CudaStream>,
    module: Arc<CudaModule>,
    /// Each kernel's handle once loaded, with the dynamic shared memory it was last
    /// allowed: looked up and raised once, not on every launch.
    functions: Arc<Functions>,
    pub props: DeviceProps,
    /// Which production paths the work on this GPU may take ([`Gpu::with_tuning`]).
    tuning: Tuning,
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

/// How many CUDA devices there are (0 where there is no driver).
pub fn device_count() -> Result<usize> {
    driver_present()?;
    let count = std::panic::catch_unwind(CudaContext::device_count)
        .map_err(|_| Error::NoGpu("the CUDA driver is missing functions cudarc needs".into()))?
        .map_err(|e| Error::NoGpu(format!("cuInit/device count failed: {e}")))?;
    Ok(count.max(0) as usize)
}

/// GPUs `0..n`, each opened with `tuning`: the ranks of a process that drives `n`.
pub fn open_ranks(n: usize, tuning: Tuning) -> Result<Vec<Gpu>> {
    let present = device_count()?;
    if n > present {
        return Err(Error::NoGpu(format!("{n} GPUs asked for, {present} present")));
    }
    (0..n).map(|i| Ok(Gpu::open(i)?.with_tuning(tuning))).collect()
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
        let (tables, lent_tables, side_frees) = Default::default();
        let tuning = Tuning::default();
        let functions = Arc::new(Functions::default());
        Ok(Gpu {
            ctx,
            stream,
            allocator: None,
            tables,
            lent_tables,
            side_frees,
            side,
            module,
            functions,
            props,
            tuning,
        })
    }

    /// The same GPU with `tuning`'s production paths (a clone shares the context,
    /// streams and kernels; each carries its own tuning).
    pub fn with_tuning(mut self, tuning: Tuning) -> Gpu {
        self.tuning = tuning;
        self
    }

    /// Which production paths the work on this GPU may take.
    pub fn tuning(&self) -> Tuning {
        self.tuning
    }

    /// The same GPU working on another library's stream `cu_stream` (of this device's
    /// primary context) with buffers from `allocator` where given: how a framework
    /// (PyTorch) calls the blocks on its current stream, its allocator owning the memory.
    ///
    /// # Safety
    /// `cu_stream` must be a live stream of this device's primary context and stay so
    /// while the returned `Gpu` (or anything allocated through it) is used.
    pub unsafe fn on_stream(&self, cu_stream: u64, allocator: Option<Arc<dyn DeviceAllocator>>) -> Gpu {
        // SAFETY: the caller's contract.
        let stream = unsafe { self.ctx.wrap_borrowed_stream(cu_stream as cudarc::driver::sys::CUstream) };
        let tables = self.lent_tables.lock().unwrap_or_else(|p| p.into_inner()).entry(cu_stream).or_default().clone();
        Gpu { stream, allocator, tables, side_frees: SideFrees::default(), ..self.clone() }
    }

    /// A device tensor over memory someone else owns (`ptr`, row-major `shape`); this
    /// crate never frees it. The caller checked the pointer (alignment, device).
    ///
    /// # Safety
    /// `ptr` must address `shape`'s product of f32 values on this device, live and not
    /// written by anyone else while the returned tensor is used.
    pub unsafe fn borrow_tensor<T: DeviceElement>(&self, ptr: u64, shape: &[usize]) -> Result<DeviceTensor<T>> {
        let len = crate::tensor::numel::<T>(shape)?;
        // SAFETY: the caller's contract; `Owner::Borrowed` leaks instead of freeing.
        let slice = unsafe { self.stream.upgrade_device_ptr::<T>(ptr, len) };
        Ok(DeviceTensor { shape: shape.to_vec(), buf: DeviceBuf::new(slice, Owner::Borrowed, None) })
    }

    /// An uninitialised buffer of `len` values of `T` (at least one), from the
    /// allocator if there is one, else from cudarc on `stream`.
    ///
    /// # Safety
    /// Nothing may read the buffer before a write to it.
    pub unsafe fn alloc_buf<T: DeviceRepr + 'static>(
        &self,
        stream: &Arc<CudaStream>,
        len: usize,
    ) -> Result<DeviceBuf<T>> {
        // SAFETY: the caller's contract.
        unsafe { self.alloc_buf_shaped(stream, &[len]) }
    }

    /// [`Gpu::alloc_buf`] for a tensor of `shape`: an allocator that makes framework
    /// tensors makes it in this shape.
    ///
    /// # Safety
    /// Nothing may read the buffer before a write to it.
    pub unsafe fn alloc_buf_shaped<T: DeviceRepr + 'static>(
        &self,
        stream: &Arc<CudaStream>,
        shape: &[usize],
    ) -> Result<DeviceBuf<T>> {
        let len = shape.iter().product::<usize>().max(1);
        let bytes = crate::tensor::numel::<T>(&[len])? * std::mem::size_of::<T>();
        match &self.allocator {
            None => {
                // SAFETY: the caller's contract.
                let slice = unsafe { stream.alloc::<T>(len) }.map_err(|e| oom_or("allocating", bytes / 4, e))?;
                Ok(DeviceBuf::new(slice, Owner::Cudarc, None))
            }
            Some(alloc) => {
                let kind = if std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>() {
                    ElementKind::F32
                } else if std::any::TypeId::of::<T>() == std::any::TypeId::of::<Bf16>() {
                    ElementKind::Bf16
                } else {
                    ElementKind::Bytes
                };
                let whole = [len];
                let shape = if shape.iter().product::<usize>() == len { shape } else { &whole };
                let (ptr, keep) = match kind {
                    ElementKind::Bytes => alloc.allocate(&[bytes], kind)?,
                    _ => alloc.allocate(shape, kind)?,
                };
                // SAFETY: the allocator handed out `bytes` on this device; the slice is
                // leaked, not freed, when the buffer drops, and `keep` frees it then.
                let slice = unsafe { stream.upgrade_device_ptr::<T>(ptr, len) };
                let defer = (!Arc::ptr_eq(stream, &self.stream)).then(|| self.side_frees.clone());
                Ok(DeviceBuf::new(slice, Owner::External(keep), defer))
            }
        }
    }

    /// A zero-filled buffer of `len` values of `T` (a memset queued on `stream`).
    pub fn zeroed_buf<T: DeviceRepr + 'static>(&self, stream: &Arc<CudaStream>, len: usize) -> Result<DeviceBuf<T>> {
        // SAFETY: filled with zeros below before anything else is queued.
        let mut buf = unsafe { self.alloc_buf::<T>(stream, len)? };
        let bytes = buf.len() * std::mem::size_of::<T>();
        let ptr = buf.slice.device_ptr_mut(stream).0;
        // A raw driver call: the context must be current on this thread (see `capturing`).
        self.ctx.bind_to_thread().map_err(|e| Error::cuda("making the context current", e))?;
        // SAFETY: exactly the buffer's bytes, on `stream`.
        unsafe { cudarc::driver::sys::cuMemsetD8Async(ptr, 0, bytes, stream.cu_stream()) }
            .result()
            .map_err(|e| Error::cuda("zero-filling a buffer", e))?;
        Ok(buf)
    }

    /// A small table of 64-bit words (TMA tensor maps, op descriptors) in device
    /// memory. Written by the `store_words` kernel from its launch arguments rather
    /// than copied from host memory: a CUDA graph captures the words with the launch,
    /// and no pageable host copy is queued on the stream.
    ///
    /// Tables of the main stream are kept and handed out again for the same words
    /// (by content), except while the stream is being captured into a graph: a
    /// captured `store_words` writes nothing until the graph is replayed.
    pub fn words(&self, stream: &Arc<CudaStream>, words: &[u64]) -> Result<Table> {
        let reusable = Arc::ptr_eq(stream, &self.stream) && !self.capturing(stream)?;
        if reusable && let Some(table) = self.tables.get(words) {
            return Ok(table);
        }
        let table = Table(Arc::new(self.write_words(stream, words)?));
        if reusable {
            self.tables.insert(words, &table);
        }
        Ok(table)
    }

    /// Whether `stream` is being captured into a CUDA graph.
    fn capturing(&self, stream: &CudaStream) -> Result<bool> {
        use cudarc::driver::sys::{CUstreamCaptureStatus, cuStreamIsCapturing};
        // A raw driver call: the calling thread (PyTorch's autograd engine runs the
        // backward on threads of its own) needs the context current first.
        self.ctx.bind_to_thread().map_err(|e| Error::cuda("making the context current", e))?;
        let mut status = CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: a live stream of the current context; writes one status.
        unsafe { cuStreamIsCapturing(stream.cu_stream(), &mut status) }
            .result()
            .map_err(|e| Error::cuda("asking whether the stream is being captured", e))?;
        Ok(status != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    fn write_words(&self, stream: &Arc<CudaStream>, words: &[u64]) -> Result<DeviceBuf<u64>> {
        use kernel_abi::STORE_WORDS;
        // SAFETY: every word below `words.len()` is written by the launches below; the
        // one word of an empty table is never read.
        let mut buf = unsafe { self.alloc_buf::<u64>(stream, words.len())? };
        let func = self.function(Kernel::StoreWords)?;
        let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (32, 1, 1), shared_mem_bytes: 0 };
        for (i, chunk) in words.chunks(STORE_WORDS).enumerate() {
            let mut batch = [0u64; STORE_WORDS];
            batch[..chunk.len()].copy_from_slice(chunk);
            let (offset, count) = ((i * STORE_WORDS) as u32, chunk.len() as u32);
            let mut l = stream.launch_builder(&func);
            l.arg(&mut buf).arg(&offset).arg(&count).arg(&batch);
            // SAFETY: (out, offset, count, words) as the kernel takes; out holds
            // offset + count words.
            launched(Kernel::StoreWords, unsafe { l.launch(cfg) })?;
        }
        Ok(buf)
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
        later.wait(&e).map_err(|e| Error::cuda("waiting for an event", e))?;
        if std::ptr::eq(earlier, &*self.side) && std::ptr::eq(later, &*self.stream) {
            // The main stream now follows the side stream's work: its buffers may go.
            self.side_frees.release();
        }
        Ok(())
    }

    /// Orders the main stream after the side stream if buffers of the side stream are
    /// still held (a call that failed between the two): for the end of a call.
    pub fn join_side(&self) -> Result<()> {
        if self.side_frees.is_empty() { Ok(()) } else { self.order(&self.side, &self.stream) }
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// A kernel of the module: a [`Kernel`] identifier (launches name kernels by
    /// identifier; the epilogue's launchers still pass the name itself).
    pub fn function(&self, kernel: Kernel) -> Result<CudaFunction> {
        let mut loaded = self.functions.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((f, _)) = loaded.get(&kernel) {
            return Ok(f.clone());
        }
        let name = kernel.name();
        let f = self.module.load_function(name).map_err(|e| Error::cuda(format!("loading kernel `{name}`"), e))?;
        loaded.insert(kernel, (f.clone(), 48 * 1024));
        Ok(f)
    }

    /// Prepares `func` to take `bytes` of dynamic shared memory, or explains why it can't.
    pub fn allow_shared(&self, func: &CudaFunction, kernel: Kernel, bytes: usize) -> Result<()> {
        let name = kernel.name();
        if bytes > self.props.max_shared_per_block_optin {
            return Err(Error::Unsupported(format!(
                "`{name}` needs {bytes} bytes of shared memory per block; {} allows {}",
                self.props.name, self.props.max_shared_per_block_optin
            )));
        }
        let mut loaded = self.functions.0.lock().unwrap_or_else(|p| p.into_inner());
        let allowed = loaded.get(&kernel).map_or(48 * 1024, |(_, a)| *a);
        if bytes > allowed {
            use cudarc::driver::sys::CUfunction_attribute as F;
            func.set_attribute(F::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32)
                .map_err(|e| Error::cuda(format!("raising the shared-memory limit of `{name}`"), e))?;
            loaded.insert(kernel, (func.clone(), bytes));
        }
        Ok(())
    }

    /// A kernel and a 1-D launch configuration (256-thread blocks) covering `len` elements.
    pub fn kernel_1d(&self, kernel: Kernel, len: usize, shared_bytes: u32) -> Result<(CudaFunction, LaunchConfig)> {
        let name = kernel.name();
        if len > u32::MAX as usize {
            return Err(Error::Shape(format!("`{name}` over {len} elements exceeds 32-bit indexing")));
        }
        let cfg = LaunchConfig {
            grid_dim: (len.div_ceil(256).max(1) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: shared_bytes,
        };
        Ok((self.function(kernel)?, cfg))
    }

    /// Copies a host tensor to the device.
    pub fn upload<T: DeviceElement>(&self, t: &Tensor<T>) -> Result<DeviceTensor<T>> {
        // SAFETY: written in full by the copy below.
        let mut buf = unsafe { self.alloc_buf::<T>(&self.stream, t.len())? };
        if !t.is_empty() {
            self.stream.memcpy_htod(t.data(), &mut *buf).map_err(|e| Error::cuda("copying to the device", e))?;
        }
        Ok(DeviceTensor { shape: t.shape().to_vec(), buf })
    }

    /// An uninitialised device tensor, for outputs a kernel writes in full.
    pub fn alloc(&self, shape: &[usize]) -> Result<DeviceTensor> {
        self.alloc_as::<f32>(shape)
    }

    /// [`Gpu::alloc`] for any element type.
    pub fn alloc_as<T: DeviceElement>(&self, shape: &[usize]) -> Result<DeviceTensor<T>> {
        crate::tensor::numel::<T>(shape)?;
        // SAFETY: every caller passes the tensor to a kernel that writes all of it
        // before anything reads it (outputs and scratch of our launchers).
        let buf = unsafe { self.alloc_buf_shaped::<T>(&self.stream, shape)? };
        Ok(DeviceTensor { shape: shape.to_vec(), buf })
    }

    /// Values `range` of `src` as a new 1-D tensor (a device-to-device copy).
    pub fn copy_range(&self, src: &DeviceTensor, range: std::ops::Range<usize>) -> Result<DeviceTensor> {
        let mut out = self.alloc(&[range.len()])?;
        if !range.is_empty() {
            self.stream
                .memcpy_dtod(&src.buf.slice(range), &mut *out.buf)
                .map_err(|e| Error::cuda("copying on the device", e))?;
        }
        Ok(out)
    }

    /// A device tensor of zeros.
    pub fn zeros(&self, shape: &[usize]) -> Result<DeviceTensor> {
        let len = crate::tensor::numel::<f32>(shape)?;
        Ok(DeviceTensor { shape: shape.to_vec(), buf: self.zeroed_buf::<f32>(&self.stream, len)? })
    }

    /// A device tensor filled with NaN (on the device), so an element a kernel fails
    /// to write shows up.
    pub fn poisoned(&self, shape: &[usize]) -> Result<DeviceTensor> {
        self.poisoned_as::<f32>(shape)
    }

    /// [`Gpu::poisoned`] for any element type.
    pub fn poisoned_as<T: DeviceElement>(&self, shape: &[usize]) -> Result<DeviceTensor<T>> {
        let mut t = self.alloc_as::<T>(shape)?;
        let ptr = t.buf.device_ptr_mut(&self.stream).0;
        let (len, stream) = (t.buf.len(), self.stream.cu_stream());
        // SAFETY: fills exactly the allocation's `len` elements on our stream.
        let filled = unsafe {
            match T::BF16 {
                true => cudarc::driver::sys::cuMemsetD16Async(ptr, T::NAN_BITS as u16, len, stream),
                false => cudarc::driver::sys::cuMemsetD32Async(ptr, T::NAN_BITS, len, stream),
            }
        };
        filled.result().map_err(|e| Error::cuda("filling with NaN", e))?;
        Ok(t)
    }

    /// Copies a device tensor back (waits for the stream: kernel faults surface here).
    pub fn download<T: DeviceElement>(&self, t: &DeviceTensor<T>) -> Result<Tensor<T>> {
        let data = self.stream.clone_dtoh(&*t.buf).map_err(|e| Error::cuda("copying from the device", e))?;
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
pub fn launched<T>(kernel: impl AsRef<str>, r: std::result::Result<T, cudarc::driver::DriverError>) -> Result<()> {
    r.map(|_| ()).map_err(|e| Error::cuda(format!("launching `{}`", kernel.as_ref()), e))
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
pub struct DeviceTensor<T = f32> {
    pub shape: Vec<usize>,
    pub buf: DeviceBuf<T>,
}

/// What a device tensor holds: FP32, or bf16 (a bf16 model's tensors, kept as they are).
pub trait DeviceElement: DeviceRepr + cudarc::driver::ValidAsZeroBits + Copy + Default + Send + Sync + 'static {
    /// The dtype's name in messages.
    const NAME: &'static str;
    /// The bit pattern of a quiet NaN (poisoned outputs).
    const NAN_BITS: u32;
    /// Whether the values are bf16: a bf16 model's tensors, which its own kernels read
    /// as stored (the kernels chosen by this, never by the type's size).
    const BF16: bool;
}

impl DeviceElement for f32 {
    const NAME: &'static str = "float32";
    const NAN_BITS: u32 = 0x7fc0_0000;
    const BF16: bool = false;
}

// SAFETY: `Bf16` is a `repr(transparent)` `u16`: plain bits, any pattern valid, zero included.
unsafe impl DeviceRepr for Bf16 {}
unsafe impl cudarc::driver::ValidAsZeroBits for Bf16 {}

impl DeviceElement for Bf16 {
    const NAME: &'static str = "bfloat16";
    const NAN_BITS: u32 = 0x7fc0;
    const BF16: bool = true;
}

/// Who frees a [`DeviceBuf`]'s memory.
enum Owner {
    /// cudarc, on the buffer's stream, when the buffer drops.
    Cudarc,
    /// Nobody here: the memory is a caller's (a framework tensor passed in).
    Borrowed,
    /// An allocator's keep-alive handle, dropped with the buffer.
    External(Box<dyn Any + Send + Sync>),
}

/// A small table in device memory that launches read (written once, never again):
/// shared by every launch that asks for the same words.
#[derive(Clone)]
pub struct Table(Arc<DeviceBuf<u64>>);

unsafe impl<'a, 'b: 'a> PushKernelArg<&'b Table> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b Table) -> &mut Self {
        <Self as PushKernelArg<&'b CudaSlice<u64>>>::arg(self, &arg.0.slice)
    }
}

/// The main stream's tables by content. The words hold the pointers and shapes they
/// describe, so a table found here describes exactly what was asked for; a table is
/// freed (in the main stream's order) only when the cache is cleared, at `TABLES_KEPT`.
#[derive(Clone, Default)]
struct Tables(Arc<std::sync::Mutex<std::collections::HashMap<Vec<u64>, Table>>>);

/// Tables [`Tables`] keeps before it starts again (each 256 bytes to a few KB).
const TABLES_KEPT: usize = 512;

impl Tables {
    fn get(&self, words: &[u64]) -> Option<Table> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).get(words).cloned()
    }
    fn insert(&self, words: &[u64], table: &Table) {
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if map.len() >= TABLES_KEPT {
            map.clear();
        }
        map.insert(words.to_vec(), table.clone());
    }
}

/// Loaded kernels by identifier, each with the dynamic shared memory it is allowed.
#[derive(Default)]
struct Functions(std::sync::Mutex<std::collections::HashMap<Kernel, (CudaFunction, usize)>>);

/// Handles of an allocator's buffers whose memory the side stream may still use.
#[derive(Clone, Default)]
struct SideFrees(Arc<std::sync::Mutex<Vec<Box<dyn Any + Send + Sync>>>>);

impl SideFrees {
    fn hold(&self, keep: Box<dyn Any + Send + Sync>) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).push(keep);
    }
    fn release(&self) {
        let held = std::mem::take(&mut *self.0.lock().unwrap_or_else(|p| p.into_inner()));
        drop(held);
    }
    fn is_empty(&self) -> bool {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).is_empty()
    }
}

/// Device memory for the kernels: a cudarc slice that frees itself, or one over memory
/// an allocator or a caller owns (leaked, never freed, when the buffer drops). Derefs
/// to the slice, so the launchers take either.
pub struct DeviceBuf<T> {
    slice: ManuallyDrop<CudaSlice<T>>,
    owner: Owner,
    /// For an allocator's buffer of the side stream: where its handle waits when the
    /// buffer drops, instead of freeing the memory at once.
    defer: Option<SideFrees>,
}

impl<T> DeviceBuf<T> {
    fn new(slice: CudaSlice<T>, owner: Owner, defer: Option<SideFrees>) -> Self {
        DeviceBuf { slice: ManuallyDrop::new(slice), owner, defer }
    }

    /// The allocator's keep-alive handle of this memory (its framework tensor), if it
    /// came from one: the buffer is given up and the handle now owns the memory.
    pub fn into_external(mut self) -> Option<Box<dyn Any + Send + Sync>> {
        match std::mem::replace(&mut self.owner, Owner::Borrowed) {
            Owner::External(keep) => Some(keep),
            other => {
                self.owner = other;
                None
            }
        }
    }

    /// The device address of the first element.
    pub fn device_address(&self) -> u64 {
        // With event tracking off (`Gpu::open`), reading the address records nothing.
        self.slice.device_ptr(self.slice.stream()).0
    }
}

impl<T> Drop for DeviceBuf<T> {
    fn drop(&mut self) {
        // SAFETY: the slice is not touched again (`drop` runs once).
        let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
        match self.owner {
            Owner::Cudarc => drop(slice),
            // Not ours to free: forget the slice; `owner` (dropped next) frees it, if anyone here does.
            Owner::Borrowed | Owner::External(_) => {
                slice.leak();
            }
        }
        if let Some(side) = self.defer.take()
            && let Owner::External(keep) = std::mem::replace(&mut self.owner, Owner::Borrowed)
        {
            side.hold(keep);
        }
    }
}

impl<T> std::ops::Deref for DeviceBuf<T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        &self.slice
    }
}

impl<T> std::ops::DerefMut for DeviceBuf<T> {
    fn deref_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.slice
    }
}

// Kernel arguments: a buffer passes as its slice does.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b DeviceBuf<T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b DeviceBuf<T>) -> &mut Self {
        <Self as PushKernelArg<&'b CudaSlice<T>>>::arg(self, &arg.slice)
    }
}

unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b mut DeviceBuf<T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut DeviceBuf<T>) -> &mut Self {
        <Self as PushKernelArg<&'b mut CudaSlice<T>>>::arg(self, &mut arg.slice)
    }
}

impl<T> DeviceTensor<T> {
    pub fn len(&self) -> usize {
        self.buf.len()
    }
    pub fn is_empty(&self) -> bool {
        self.buf.len() == 0
    }

    /// The same buffer under another shape of equal size.
    pub fn reshape(self, shape: &[usize]) -> Result<DeviceTensor<T>> {
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

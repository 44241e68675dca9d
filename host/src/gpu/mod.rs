//! The CUDA backend: driver detection, the loaded kernel module, device buffers and
//! the launchers of the kernels in `kernels-gpu` (each in the file mirroring its kernel's).
//!
//! cudarc loads `libcuda` at run time and panics when it is missing, so [`Gpu::open`]
//! checks for the library first and turns every failure into an [`Error`].

pub mod batch_norm;
pub mod block;
pub mod block_half;
pub mod collective;
pub mod cublas;
pub mod dispatch;
pub mod dot;
pub mod elementwise;
pub mod epilogue;
pub mod gemm;
mod limits;
mod memory;
pub mod optim;
pub mod parallel;
pub mod tape;
pub mod tuning;

use crate::error::{Error, Result};
use crate::tensor::{Bf16, Tensor};
use cudarc::driver::sys::CUdevice_attribute as Attr;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaStream, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use kernel_abi::Kernel;
use limits::oom_or;
pub use limits::{MAX_BATCH, check_device_memory, check_launch_sizes};
pub use memory::{
    DeviceAllocator, DeviceBuf, DeviceElement, DeviceTensor, DeviceVector, Dtype, ElementKind, HalfElement, Table,
    VectorArg, VectorWord,
};
use memory::{Owner, SPARE_MAX_BYTES, SideFrees, Spares, Tables};
use std::sync::Arc;
pub use tuning::Tuning;

/// The kernels, compiled to PTX for sm_90a (Hopper: H100, H200) by `build.rs`; the
/// `a` features (`wgmma`) tie the module to compute capability 9.0 exactly.
pub const KERNELS_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/kernels_sm90.ptx"));

/// The same kernels assembled for sm_90a by `ptxas` at build time (`build.rs`), or empty
/// where the build had none. Loaded first: the driver compiles the PTX before the first
/// launch, 60 s on an H100 machine until its cache holds the result.
pub const KERNELS_CUBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/kernels_sm90.cubin"));

/// Which image of the kernels a [`Gpu`] loaded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelImage {
    /// [`KERNELS_CUBIN`]: ready to run.
    Cubin,
    /// [`KERNELS_PTX`], compiled by the driver: the build had no `ptxas`, or this driver
    /// refused the cubin (one older than the `ptxas` that built it).
    Ptx,
}

/// Loads the kernels into `ctx`: the cubin where there is one the driver takes, else the PTX.
fn load_kernels(ctx: &Arc<CudaContext>) -> Result<(Arc<CudaModule>, KernelImage)> {
    if !KERNELS_CUBIN.is_empty()
        && let Ok(module) = ctx.load_module(Ptx::from_binary(KERNELS_CUBIN.to_vec()))
    {
        return Ok((module, KernelImage::Cubin));
    }
    let module =
        ctx.load_module(Ptx::from_src(KERNELS_PTX)).map_err(|e| Error::cuda("loading the kernel module", e))?;
    Ok((module, KernelImage::Ptx))
}

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

/// What [`Gpu::on_stream`] keeps for each stream a framework lent: its tables, its
/// side-stream tables and its spare buffers.
#[derive(Clone, Default)]
struct Lent {
    tables: Tables,
    side_tables: Tables,
    spares: Spares,
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
    /// Those the side stream's launches read for work ordered after this main stream's.
    side_tables: Tables,
    /// The allocator's small buffers this main stream dropped, for its next calls.
    spares: Spares,
    /// The tables and spare buffers of each stream a framework lent ([`Gpu::on_stream`]).
    lent: Arc<std::sync::Mutex<std::collections::HashMap<u64, Lent>>>,
    /// The allocator's handles of buffers allocated for the side stream, held until the
    /// main stream is ordered after it ([`Gpu::order`]): an allocator hands freed memory
    /// out again in the order of the stream it belongs to (the main one), not of the
    /// side stream that may still be reading or writing it.
    side_frees: SideFrees,
    /// A second stream for independent work that can overlap the first (the backward's
    /// two GEMMs); ordered against `stream` with events by whoever uses it.
    side: Arc<CudaStream>,
    module: Arc<CudaModule>,
    /// Which image `module` came from.
    image: KernelImage,
    /// Each kernel's handle once loaded, with the dynamic shared memory it was last
    /// allowed: looked up and raised once, not on every launch.
    functions: Arc<Functions>,
    pub props: DeviceProps,
    /// Which production paths the work on this GPU may take ([`Gpu::with_tuning`]).
    tuning: Tuning,
}

/// Whether cudarc can reach a CUDA library: loaded at run time (`cuda-loading`), it tries
/// `present`, which dlopens it under its usual names; linked at build time (`candle-cuda`),
/// the program would not have started without it.
pub(crate) fn cuda_library_present(present: unsafe fn() -> bool) -> bool {
    // SAFETY: the presence probes only try to dlopen their library.
    cfg!(not(feature = "cuda-loading")) || unsafe { present() }
}

/// The presence probe of one of cudarc's library modules (`driver`, `cublas`, `nccl`), or
/// a constant where cudarc links CUDA (it has no probe then).
#[cfg(feature = "cuda-loading")]
macro_rules! presence_probe {
    ($module:ident) => {
        cudarc::$module::sys::is_culib_present
    };
}
#[cfg(not(feature = "cuda-loading"))]
macro_rules! presence_probe {
    ($module:ident) => {{
        unsafe fn linked() -> bool {
            true
        }
        linked
    }};
}
pub(crate) use presence_probe;

/// Why there is no usable GPU, or `Ok` if the driver library is present.
pub fn driver_present() -> Result<()> {
    if cuda_library_present(presence_probe!(driver)) {
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

/// Each device's [`Gpu`] as [`Gpu::shared`] opened it, by ordinal.
static SHARED: std::sync::Mutex<Vec<Option<Gpu>>> = std::sync::Mutex::new(Vec::new());

impl Gpu {
    /// Device `ordinal`'s `Gpu`, opened once per process (the kernels' module loaded once:
    /// before any graph capture, for a framework that captures): what the framework
    /// adapters share, each running its calls on the framework's stream
    /// ([`Gpu::on_stream`]).
    pub fn shared(ordinal: usize) -> Result<Gpu> {
        let mut gpus = SHARED.lock().unwrap_or_else(|p| p.into_inner());
        if gpus.len() <= ordinal {
            gpus.resize(ordinal + 1, None);
        }
        if let Some(g) = &gpus[ordinal] {
            return Ok(g.clone());
        }
        let g = Gpu::open(ordinal)?;
        gpus[ordinal] = Some(g.clone());
        Ok(g)
    }

    /// Gives back to their allocators what the calls on lent streams keep between calls
    /// (spare buffers, tables), on every GPU [`Gpu::shared`] opened: memory a
    /// framework's own cache emptying cannot reach while these hold it. Each buffer is
    /// freed in its stream's order; the next calls allocate and write tables afresh.
    pub fn release_kept() {
        let gpus: Vec<Gpu> = SHARED.lock().unwrap_or_else(|p| p.into_inner()).iter().flatten().cloned().collect();
        for g in gpus {
            let lent = std::mem::take(&mut *g.lent.lock().unwrap_or_else(|p| p.into_inner()));
            drop(lent);
        }
    }

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
        let (module, image) = load_kernels(&ctx)?;
        let (tables, side_tables, spares, lent, side_frees) = Default::default();
        let tuning = Tuning::default();
        let functions = Arc::new(Functions::default());
        Ok(Gpu {
            ctx,
            stream,
            allocator: None,
            tables,
            side_tables,
            spares,
            lent,
            side_frees,
            side,
            module,
            image,
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

    /// Which image of the kernels this GPU runs: the build's cubin, or the PTX the driver
    /// compiled (see [`KERNELS_CUBIN`]).
    pub fn kernel_image(&self) -> KernelImage {
        self.image
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
        let Lent { tables, side_tables, spares } =
            self.lent.lock().unwrap_or_else(|p| p.into_inner()).entry(cu_stream).or_default().clone();
        Gpu { stream, allocator, tables, side_tables, spares, side_frees: SideFrees::default(), ..self.clone() }
    }

    /// A buffer of `len` values of `T` over memory someone else owns (raw bytes, scales:
    /// what [`Gpu::borrow_tensor`] does for tensors of a [`DeviceElement`]).
    ///
    /// # Safety
    /// As [`Gpu::borrow_tensor`]: `ptr` addresses `len` values of `T` on this device.
    pub unsafe fn borrow_buf<T: cudarc::driver::DeviceRepr>(&self, ptr: u64, len: usize) -> DeviceBuf<T> {
        // SAFETY: the caller's contract; `Owner::Borrowed` leaks instead of freeing.
        let slice = unsafe { self.stream.upgrade_device_ptr::<T>(ptr, len) };
        DeviceBuf::new(slice, Owner::Borrowed, None)
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
                } else if std::any::TypeId::of::<T>() == std::any::TypeId::of::<crate::tensor::F16>() {
                    ElementKind::F16
                } else {
                    ElementKind::Bytes
                };
                let whole = [len];
                let shape = if shape.iter().product::<usize>() == len { shape } else { &whole };
                let main = Arc::ptr_eq(stream, &self.stream);
                // A small buffer of the main stream comes from (and goes back to) the
                // spares, except while the stream is captured into a graph.
                let spares =
                    (main && bytes <= SPARE_MAX_BYTES && !self.capturing(stream)?).then(|| self.spares.clone());
                let (ptr, keep) = match spares.as_ref().and_then(|s| s.take(bytes, kind)) {
                    Some(kept) => kept,
                    None if kind == ElementKind::Bytes => alloc.allocate(&[bytes], kind)?,
                    None => alloc.allocate(shape, kind)?,
                };
                // SAFETY: the allocator handed out `bytes` on this device; the slice is
                // leaked, not freed, when the buffer drops, and `keep` frees it then.
                let slice = unsafe { stream.upgrade_device_ptr::<T>(ptr, len) };
                let defer = (!main).then(|| self.side_frees.clone());
                let buf = DeviceBuf::new(slice, Owner::External(keep), defer);
                Ok(match spares {
                    Some(spares) => buf.kept_by(spares, bytes, kind),
                    None => buf,
                })
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
    /// Tables of the main stream, and of the side stream, are kept and handed out
    /// again for the same words (by content) on the same stream, except while the
    /// stream is being captured into a graph: a captured `store_words` writes nothing
    /// until the graph is replayed.
    pub fn words(&self, stream: &Arc<CudaStream>, words: &[u64]) -> Result<Table> {
        let kept = if Arc::ptr_eq(stream, &self.stream) {
            Some(&self.tables)
        } else if Arc::ptr_eq(stream, &self.side) {
            Some(&self.side_tables)
        } else {
            None
        };
        let kept = match kept {
            Some(tables) if !self.capturing(stream)? => Some(tables),
            _ => None,
        };
        if let Some(table) = kept.and_then(|t| t.get(words)) {
            return Ok(table);
        }
        let table = Table(Arc::new(self.write_words(stream, words)?));
        if let Some(tables) = kept {
            tables.insert(words, &table);
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
            match T::DTYPE {
                Dtype::Bf16 | Dtype::F16 => cudarc::driver::sys::cuMemsetD16Async(ptr, T::NAN_BITS as u16, len, stream),
                Dtype::F32 => cudarc::driver::sys::cuMemsetD32Async(ptr, T::NAN_BITS, len, stream),
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

/// Loaded kernels by identifier, each with the dynamic shared memory it is allowed.
#[derive(Default)]
struct Functions(std::sync::Mutex<std::collections::HashMap<Kernel, (CudaFunction, usize)>>);

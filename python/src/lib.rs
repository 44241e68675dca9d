//! `fused_linear._native`: the blocks of the `host` crate for PyTorch tensors.
//!
//! The Python package (`fused_linear/`) registers these functions as a
//! `torch.library.custom_op` with autograd; this module does the work of one call:
//! it checks the tensors (type, dtype, device, shape, contiguity, alignment), runs the
//! block on the CUDA backend (on the caller's stream, over the tensors' own memory,
//! with every buffer it needs allocated through the caller's `allocate` — PyTorch's
//! caching allocator) or on the CPU backend, and returns new tensors.
//!
//! Errors are Python exceptions naming the argument; a Rust panic is caught at this
//! boundary and raised as a `RuntimeError`, so the interpreter lives on.

use host::Precision;
use host::block::{BlockSpec, Params};
use host::chain::Chain;
use host::gpu::block::{DeviceParams, GpuBlock, Saved};
use host::gpu::elementwise::{Convert, Vector, convert_vectors};
use host::gpu::epilogue::lanes::GradOuts;
use host::gpu::epilogue::widen_words;
use host::gpu::{DeviceAllocator, DeviceElement, DeviceTensor, DeviceVector, ElementKind, Gpu, KernelImage};
use host::reference::{self, BlockGrads, Real};
use host::tensor::{Bf16, F16, Tensor};
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyTuple, PyType};
use std::any::Any;
use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// Alignment the kernels assume of every operand (16-byte vector accesses, TMA).
const ALIGNMENT: u64 = 16;

/// `host`'s error as the Python exception a PyTorch user expects: bad input is a
/// `ValueError`, the GPU's failures are `RuntimeError`s.
fn to_py(e: host::Error) -> PyErr {
    use host::Error as E;
    match e {
        E::Shape(_) | E::Chain(_) | E::Argument(_) | E::Tensor { .. } | E::File { .. } => {
            PyValueError::new_err(e.to_string())
        }
        E::NoGpu(_) | E::Cuda { .. } | E::Unsupported(_) => PyRuntimeError::new_err(e.to_string()),
    }
}

/// Runs `f`, turning a panic into a `RuntimeError` (a panic would otherwise reach
/// Python as `PanicException`, a `BaseException` that `except Exception` misses).
fn guarded<T>(f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    std::panic::catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        let what = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "no message".into());
        Err(PyRuntimeError::new_err(format!("fused_linear: internal error (a Rust panic: {what}); please report it")))
    })
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DType {
    F32,
    F64,
    /// A bf16 model's `x`, Linear weight and `dy`, and its bias and chain parameters
    /// (CUDA only: the package runs CPU bf16 on float32 copies).
    Bf16,
    /// An fp16 model's, as bf16's.
    F16,
}

impl DType {
    /// A 16-bit model's type, and the precision its GEMMs run in.
    fn half_precision(self) -> Option<Precision> {
        match self {
            DType::Bf16 => Some(Precision::Bf16),
            DType::F16 => Some(Precision::Fp16),
            DType::F32 | DType::F64 => None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Device {
    Cpu,
    Cuda(usize),
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// One tensor argument, read and checked: what the kernels need to know of it.
struct Arg<'py> {
    name: String,
    _tensor: std::marker::PhantomData<Bound<'py, PyAny>>,
    dtype: DType,
    device: Device,
    shape: Vec<usize>,
    ptr: u64,
}

fn tensor_type(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    static TENSOR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
    TENSOR.import(py, "torch", "Tensor")
}

/// `torch.float32`, `torch.float64`, `torch.bfloat16` and `torch.float16`, compared by
/// identity (dtypes are singletons).
type Dtypes<'py> = (&'py Bound<'py, PyAny>, &'py Bound<'py, PyAny>, &'py Bound<'py, PyAny>, &'py Bound<'py, PyAny>);
fn float_dtypes(py: Python<'_>) -> PyResult<Dtypes<'_>> {
    static F32: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    static F64: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    static BF16: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    static F16: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let get = |cell: &'static PyOnceLock<Py<PyAny>>, name: &str| -> PyResult<&Bound<'_, PyAny>> {
        Ok(cell.get_or_try_init(py, || py.import("torch")?.getattr(name).map(Bound::unbind))?.bind(py))
    };
    Ok((get(&F32, "float32")?, get(&F64, "float64")?, get(&BF16, "bfloat16")?, get(&F16, "float16")?))
}

impl<'py> Arg<'py> {
    fn read(name: impl Into<String>, obj: &Bound<'py, PyAny>) -> PyResult<Arg<'py>> {
        let name = name.into();
        let py = obj.py();
        if !obj.is_instance(tensor_type(py)?)? {
            return Err(PyTypeError::new_err(format!("{name} must be a torch.Tensor, got {}", obj.get_type().name()?)));
        }
        // The cheapest reads PyTorch offers (each a few hundred ns): this runs for every
        // tensor of every call.
        let (f32_, f64_, bf16_, f16_) = float_dtypes(py)?;
        let dt = obj.getattr(intern!(py, "dtype"))?;
        let dtype = if dt.is(f32_) {
            DType::F32
        } else if dt.is(f64_) {
            DType::F64
        } else if dt.is(bf16_) {
            DType::Bf16
        } else if dt.is(f16_) {
            DType::F16
        } else {
            return Err(PyTypeError::new_err(format!(
                "{name} has dtype {}; expected torch.float32, torch.bfloat16, torch.float16 (or torch.float64 on \
                 the CPU)",
                dt.str()?
            )));
        };
        // -1 on the CPU, the CUDA ordinal on CUDA: one call for the common cases.
        let index = obj.call_method0(intern!(py, "get_device"))?.extract::<i64>()?;
        let device = if index >= 0 && obj.getattr(intern!(py, "is_cuda"))?.extract::<bool>()? {
            Device::Cuda(index as usize)
        } else if index < 0 && obj.getattr(intern!(py, "is_cpu"))?.extract::<bool>()? {
            Device::Cpu
        } else {
            return Err(PyRuntimeError::new_err(format!(
                "{name} is on a `{}` device; fused_linear runs on CUDA and on the CPU",
                obj.getattr("device")?.getattr("type")?.str()?
            )));
        };
        let shape: Vec<usize> = obj.getattr(intern!(py, "shape"))?.extract()?;
        if !obj.call_method0(intern!(py, "is_contiguous"))?.extract::<bool>()? {
            let stride: Vec<isize> = obj.call_method0("stride")?.extract()?;
            return Err(PyValueError::new_err(format!(
                "{name} is not contiguous (shape {shape:?}, strides {stride:?}); pass {name}.contiguous()"
            )));
        }
        let ptr: u64 = obj.call_method0(intern!(py, "data_ptr"))?.extract()?;
        Ok(Arg { name, _tensor: std::marker::PhantomData, dtype, device, shape, ptr })
    }

    /// For the GPU: the kernels' 16-byte vector accesses and TMA need aligned memory.
    fn expect_aligned(&self) -> PyResult<()> {
        if !self.ptr.is_multiple_of(ALIGNMENT) {
            return Err(PyValueError::new_err(format!(
                "{}: its memory (0x{:x}) is not {ALIGNMENT}-byte aligned, as the GPU kernels need \
                 (a view at an offset?); pass {}.clone()",
                self.name, self.ptr, self.name
            )));
        }
        Ok(())
    }

    fn expect_shape(&self, want: &[usize], what: &str) -> PyResult<()> {
        if self.shape != want {
            return Err(PyValueError::new_err(format!(
                "{}: expected shape {} ({what}), got {}",
                self.name,
                shape_str(want),
                shape_str(&self.shape)
            )));
        }
        Ok(())
    }
}

fn shape_str(s: &[usize]) -> String {
    match s {
        [one] => format!("({one},)"),
        _ => format!("({})", s.iter().map(usize::to_string).collect::<Vec<_>>().join(", ")),
    }
}

/// A chain applied to `Linear(in_features, out_features)`: parsed and checked once, as
/// every call of a module asks for the same one (parsing and checking cost more host
/// time than a small block's launches).
struct Block {
    spec: BlockSpec,
    /// `spec.param_specs()`: the weight's, the bias's, then the ops' parameters'.
    params: Vec<host::block::ParamSpec>,
}

/// Blocks made so far, by (chain as written, in, out). Bounded: a program that makes
/// chains without end starts again rather than grow.
type Blocks = HashMap<(String, usize, usize), Arc<Block>>;
static BLOCKS: Mutex<Option<Blocks>> = Mutex::new(None);
const BLOCKS_KEPT: usize = 1024;

impl Block {
    fn of(ops: &str, in_features: usize, out_features: usize) -> PyResult<Arc<Block>> {
        let key = (ops.to_string(), in_features, out_features);
        if let Some(b) = BLOCKS.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert_default().get(&key) {
            return Ok(b.clone());
        }
        let chain: Chain = ops.parse().map_err(|e| PyValueError::new_err(format!("ops: {e}")))?;
        let spec = BlockSpec::new(in_features, out_features, chain).map_err(|e| match e {
            host::Error::Chain(_) => PyValueError::new_err(format!("ops: {e}")),
            e => to_py(e),
        })?;
        let block = Arc::new(Block { params: spec.param_specs(), spec });
        let mut blocks = BLOCKS.lock().unwrap_or_else(|p| p.into_inner());
        let blocks = blocks.get_or_insert_default();
        if blocks.len() >= BLOCKS_KEPT {
            blocks.clear();
        }
        blocks.insert(key, block.clone());
        Ok(block)
    }
}

/// Every tensor argument of a call, checked against one another and the chain.
struct Call<'py> {
    block: Arc<Block>,
    precision: Precision,
    batch: usize,
    device: Device,
    dtype: DType,
    x: Arg<'py>,
    weight: Arg<'py>,
    bias: Arg<'py>,
    params: Vec<Arg<'py>>,
}

fn parse_precision(s: &str) -> PyResult<Precision> {
    match s.to_ascii_lowercase().as_str() {
        "fp32" => Ok(Precision::Fp32),
        "tf32x3" => Ok(Precision::Tf32x3),
        "tf32" => Ok(Precision::Tf32),
        "bf16" => Ok(Precision::Bf16),
        "fp16" => Ok(Precision::Fp16),
        "fp8" => Ok(Precision::Fp8),
        "fp8_gw_bf16" => Ok(Precision::Fp8GwBf16),
        _ => Err(PyValueError::new_err(format!(
            "precision `{s}` is not one of fp32, tf32x3, tf32, bf16, fp16, fp8, fp8_gw_bf16"
        ))),
    }
}

impl<'py> Call<'py> {
    fn new(
        x: &Bound<'py, PyAny>,
        weight: &Bound<'py, PyAny>,
        bias: &Bound<'py, PyAny>,
        params: &[Bound<'py, PyAny>],
        ops: &str,
        precision: &str,
    ) -> PyResult<Call<'py>> {
        let precision = parse_precision(precision)?;
        let x = Arg::read("x", x)?;
        let weight = Arg::read("weight", weight)?;
        let bias = Arg::read("bias", bias)?;
        let params = params
            .iter()
            .enumerate()
            .map(|(i, p)| Arg::read(format!("params[{i}]"), p))
            .collect::<PyResult<Vec<_>>>()?;
        let (device, dtype) = (x.device.clone(), x.dtype);
        match (&device, dtype) {
            (Device::Cuda(_), DType::F64) => {
                return Err(PyTypeError::new_err(
                    "x has dtype torch.float64 on CUDA; the GPU kernels take torch.float32, torch.bfloat16 or \
                     torch.float16 (float64 runs on the CPU)",
                ));
            }
            (Device::Cpu, DType::Bf16 | DType::F16) => {
                return Err(PyTypeError::new_err(format!(
                    "x has dtype {} on the CPU; the native CPU path takes float32 or float64 \
                     (fused_linear() runs CPU 16-bit models on float32 copies)",
                    dtype_name(dtype)
                )));
            }
            _ => {}
        }
        if let Some(p) = dtype.half_precision()
            && precision != p
            && !precision.is_fp8()
        {
            return Err(PyValueError::new_err(format!(
                "precision `{precision}` with {} tensors: a {p} model's GEMMs read its {p} values as they \
                 are (precision {p}) or quantise them to fp8; pass precision=\"{p}\", \"fp8\" or \
                 \"fp8_gw_bf16\", or float32 tensors for {precision}",
                dtype_name(dtype)
            )));
        }
        for a in [&weight, &bias].into_iter().chain(&params) {
            if a.device != device {
                return Err(PyRuntimeError::new_err(format!(
                    "{} is on {} but x is on {device}: all tensors of the block must be on one device",
                    a.name, a.device
                )));
            }
            // A 16-bit model: the weight is of x's type; the bias and the chain's
            // parameters are of that type or float32 each (read as stored, widened on load
            // into the FP32 epilogue).
            let half = dtype.half_precision().is_some();
            let fits = match (half, a.name.as_str()) {
                (true, "weight") => a.dtype == dtype,
                (true, _) => a.dtype == dtype || a.dtype == DType::F32,
                (false, _) => a.dtype == dtype,
            };
            if !fits {
                let rule = if half {
                    format!(
                        "a 16-bit block takes x and weight in {0} and the bias and chain parameters in {0} or \
                         torch.float32",
                        dtype_name(dtype)
                    )
                } else {
                    "all tensors of the block must have one dtype".to_string()
                };
                return Err(PyTypeError::new_err(format!(
                    "{} has dtype {} but x has {}: {rule}",
                    a.name,
                    dtype_name(a.dtype),
                    dtype_name(dtype)
                )));
            }
        }
        let (batch, in_features) = match x.shape[..] {
            [0, _] => return Err(PyValueError::new_err("x: the batch is empty (0 rows)")),
            [b, i] if i > 0 => (b, i),
            _ => {
                return Err(PyValueError::new_err(format!(
                    "x: expected a 2-D (batch, in_features) tensor with in_features >= 1, got shape {}",
                    shape_str(&x.shape)
                )));
            }
        };
        let out_features = match weight.shape[..] {
            [o, i] if i == in_features && o > 0 => o,
            _ => {
                return Err(PyValueError::new_err(format!(
                    "weight: expected shape (out_features, {in_features}) to match x's {in_features} features, got {}",
                    shape_str(&weight.shape)
                )));
            }
        };
        bias.expect_shape(&[out_features], "out_features, as the weight's rows")?;
        let block = Block::of(ops, in_features, out_features)?;
        let spec = &block.spec;
        spec.check_batch(batch).map_err(to_py)?;
        let wanted = &block.params[2..];
        if params.len() != wanted.len() {
            let names: Vec<&str> = wanted.iter().map(|s| s.name.as_str()).collect();
            return Err(PyValueError::new_err(format!(
                "params: the chain `{}` takes {} tensor(s) ({}), got {}",
                spec.chain,
                wanted.len(),
                if names.is_empty() { "none".to_string() } else { names.join(", ") },
                params.len()
            )));
        }
        for (p, s) in params.iter().zip(wanted) {
            p.expect_shape(&s.shape, &s.name)?;
        }
        if let Device::Cuda(_) = device {
            host::gpu::check_launch_sizes(batch, in_features, out_features).map_err(to_py)?;
            for a in [&x, &weight, &bias].into_iter().chain(&params) {
                a.expect_aligned()?;
            }
        }
        Ok(Call { block, precision, batch, device, dtype, x, weight, bias, params })
    }

    /// The tensors in [`BlockSpec::param_specs`] order: weight, bias, then the ops'.
    fn param_args(&self) -> impl Iterator<Item = &Arg<'py>> {
        [&self.weight, &self.bias].into_iter().chain(&self.params)
    }

    /// Shape of a saved `z` on this call's device: the Linear output, or on the GPU the
    /// folded one where the chain starts with a reduction it folds (`avgpool(k)`, or a
    /// `sum` or `mean` after scalings: `host::gpu::dispatch::fold`). A chain with a BatchNorm
    /// appends [`BATCH_STATS_ROWS`] rows: its batch mean and biased variance, which
    /// the package reads to update the running statistics.
    fn z_shape(&self) -> Vec<usize> {
        let width = match &self.device {
            Device::Cuda(_) => host::gpu::dispatch::gemm_width(&self.block.spec),
            _ => self.block.spec.out_features,
        };
        vec![self.batch + self.stats_rows(), width]
    }

    fn stats_rows(&self) -> usize {
        if self.block.spec.chain.batch_norm().is_some() { BATCH_STATS_ROWS } else { 0 }
    }
}

/// Rows a saved `z` carries after the batch's for a chain with a BatchNorm: the
/// BatchNorm input's mean and biased variance per feature.
const BATCH_STATS_ROWS: usize = 2;

fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "torch.float32",
        DType::F64 => "torch.float64",
        DType::Bf16 => "torch.bfloat16",
        DType::F16 => "torch.float16",
    }
}

// ---------------------------------------------------------------------------------
// CUDA

/// The GPU of CUDA ordinal `index`, opened once ([`Gpu::shared`]).
fn gpu(index: usize) -> PyResult<Gpu> {
    let gpu = Gpu::shared(index).map_err(to_py)?;
    if gpu.kernel_image() == KernelImage::Ptx && !PTX_WARNED.swap(true, Ordering::Relaxed) {
        Python::attach(|py| {
            let category = py.get_type::<pyo3::exceptions::PyRuntimeWarning>();
            PyErr::warn(
                py,
                &category,
                c"fused_linear: this build has no cubin, so the driver compiled the kernels from PTX \
                  (up to a minute on a machine whose CUDA cache does not hold them yet); a wheel built \
                  with PTXAS set to CUDA's ptxas loads at once",
                1,
            )
        })?;
    }
    Ok(gpu)
}

/// Whether the PTX warning was given (once per process).
static PTX_WARNED: AtomicBool = AtomicBool::new(false);

/// Which image of the kernels CUDA device `index` runs, opening it if needed: `"cubin"`
/// (assembled by `ptxas` when the wheel was built) or `"ptx"` (compiled by the driver at
/// first use).
#[pyfunction]
fn kernel_image(index: usize) -> PyResult<&'static str> {
    guarded(|| {
        Ok(match gpu(index)?.kernel_image() {
            KernelImage::Cubin => "cubin",
            KernelImage::Ptx => "ptx",
        })
    })
}

/// PyTorch's caching allocator, through the package's `allocate(numel, kind)`
/// callable (a `torch.empty` on the call's device): the returned tensor owns the memory.
struct TorchAllocator {
    allocate: Py<PyAny>,
}

/// A tensor the allocator made, and the shape it was made in.
struct TorchBuffer {
    tensor: Py<PyAny>,
    shape: Vec<usize>,
}

impl DeviceAllocator for TorchAllocator {
    fn allocate(&self, shape: &[usize], element: ElementKind) -> host::Result<(u64, Box<dyn Any + Send + Sync>)> {
        Python::attach(|py| {
            let kind = match element {
                ElementKind::F32 => 0,
                ElementKind::Bytes => 1,
                ElementKind::Bf16 => 2,
                ElementKind::F16 => 3,
            };
            let t = self.allocate.call1(py, (PyTuple::new(py, shape)?, kind))?;
            let ptr: u64 = t.call_method0(py, intern!(py, "data_ptr"))?.extract(py)?;
            Ok((ptr, Box::new(TorchBuffer { tensor: t, shape: shape.to_vec() }) as Box<dyn Any + Send + Sync>))
        })
        .map_err(|e: PyErr| host::Error::cuda("allocating through PyTorch", e))
    }
}

/// A buffer the block allocated through PyTorch, as the tensor it is, viewed as `shape`
/// (where it was not made in that shape already).
fn into_torch<'py, T>(py: Python<'py>, t: DeviceTensor<T>, shape: &[usize]) -> PyResult<Bound<'py, PyAny>> {
    let keep = t.buf.into_external().ok_or_else(|| {
        PyRuntimeError::new_err("fused_linear: internal error: an output was not allocated through PyTorch")
    })?;
    let made = keep
        .downcast::<TorchBuffer>()
        .map_err(|_| PyRuntimeError::new_err("fused_linear: internal error: an output of another allocator"))?;
    let tensor = made.tensor.into_bound(py);
    if made.shape == shape {
        return Ok(tensor);
    }
    tensor.call_method1(intern!(py, "view"), (PyTuple::new(py, shape)?,))
}

struct GpuCall<W> {
    gpu: Gpu,
    block: GpuBlock<W>,
    x: DeviceTensor<W>,
    /// FP32 copies of a 16-bit model's bias and chain parameters, which `block`
    /// borrows (a backward's: [`Vectors::Backward`]).
    _widened: Option<DeviceTensor>,
}

/// How [`gpu_call`] hands a 16-bit model's bias and chain parameters to the block.
#[derive(Clone, Copy, PartialEq)]
enum Vectors {
    /// As stored: the forward's kernels widen them on load (no copy, no launch).
    AsStored,
    /// As the backward reads them: as stored where its chain backward runs tile-wise on
    /// vectors of the model's own type; otherwise FP32 copies side by side in one
    /// buffer, made by one launch (the other chain backwards read FP32 only, and one
    /// launch per call costs less than one in each chain-backward launch, each with a
    /// table of its own: 1.5-3.4 us per training step at 1-8 rows on the H200,
    /// docs/PERFORMANCE.md).
    Backward,
}

/// The call's block on its GPU: `x` and the Linear weight borrowed as `W` (float32, or a
/// 16-bit model's type), the bias and chain parameters as `vectors` says.
fn gpu_call<W: DeviceElement>(
    call: &Call<'_>,
    index: usize,
    stream: u64,
    allocate: &Bound<'_, PyAny>,
    fp8_weight: Option<&[Bound<'_, PyAny>]>,
    vectors: Vectors,
) -> PyResult<GpuCall<W>> {
    let opened = gpu(index)?;
    let allocator = Arc::new(TorchAllocator { allocate: allocate.clone().unbind() });
    // SAFETY: `stream` is PyTorch's current stream of the tensors' device (the package
    // passes `torch.cuda.current_stream(device).cuda_stream`), alive for this call.
    let gpu = unsafe { opened.on_stream(stream, Some(allocator)) };
    // SAFETY (each borrow): the arguments were checked to be contiguous tensors of these
    // shapes and dtypes (x and the weight `W`, the others float32 or the 16-bit model's
    // type) on this device, 16-byte aligned; the caller holds them for the call.
    let borrow_w = |a: &Arg<'_>| unsafe { gpu.borrow_tensor::<W>(a.ptr, &a.shape) }.map_err(to_py);
    let borrow_param = |a: &Arg<'_>| -> PyResult<DeviceVector> {
        // SAFETY: as above.
        unsafe {
            match a.dtype {
                DType::Bf16 => gpu.borrow_tensor::<Bf16>(a.ptr, &a.shape).map(DeviceVector::Bf16),
                DType::F16 => gpu.borrow_tensor::<F16>(a.ptr, &a.shape).map(DeviceVector::F16),
                _ => gpu.borrow_tensor::<f32>(a.ptr, &a.shape).map(DeviceVector::F32),
            }
        }
        .map_err(to_py)
    };
    let borrow_params = || [&call.bias].into_iter().chain(&call.params).map(borrow_param).collect::<PyResult<Vec<_>>>();
    let mut flat = borrow_params()?.into_iter();
    let linear_bias = flat.next().ok_or_else(|| PyRuntimeError::new_err("fused_linear: internal error: no bias"))?;
    let ops = call
        .block
        .spec
        .chain
        .0
        .iter()
        .map(|op| op.param_bases().iter().map(|_| flat.next().unwrap()).collect())
        .collect();
    let params = DeviceParams { linear_weight: borrow_w(&call.weight)?, linear_bias, ops };
    let mut block = GpuBlock::from_device_in(&gpu, &call.block.spec, params, call.precision).map_err(to_py)?;
    let mut widened = None;
    if vectors == Vectors::Backward && !block.backward_reads_params_as_stored() {
        let mut params = borrow_params()?;
        let words = params.iter().map(|v| Ok((v.word()?.0, v.len()))).collect::<host::Result<Vec<_>>>();
        // SAFETY: each word is a vector borrowed here, which the caller holds for the call.
        if let Some((copies, at)) = unsafe { widen_words(&gpu, &words.map_err(to_py)?) }.map_err(to_py)? {
            for (v, dst) in params.iter_mut().zip(at) {
                if let Some(dst) = dst {
                    // SAFETY: its FP32 copy inside `copies`, which the returned call keeps.
                    *v = DeviceVector::F32(unsafe { gpu.borrow_tensor::<f32>(dst, v.shape()) }.map_err(to_py)?);
                }
            }
            // The same block over the copies (a folded weight is not made again).
            block = block.with_vectors(&gpu, params).map_err(to_py)?;
            widened = Some(copies);
        }
    }
    // (A leading AvgPool, sum or mean is folded into the weight: the block quantises the
    // folded one.)
    let folds = host::gpu::dispatch::fold(&call.block.spec).is_some();
    if let Some(quantised) = fp8_weight.filter(|_| !folds) {
        let (n, k) = (call.block.spec.out_features, call.block.spec.in_features);
        let [rows, rows_s, rows_t, rows_t_s, dz_scales] = quantised else {
            return Err(PyValueError::new_err(
                "fp8_weight: expected [rows, rows_scales, rows_t, rows_t_scales, dz_scales] (made by fp8_weight())",
            ));
        };
        let rows = fp8_matrix(&gpu, (rows, rows_s), (n, k, k), &call.device)?;
        let rows_t = fp8_matrix(&gpu, (rows_t, rows_t_s), (k, n, n), &call.device)?;
        let dz_scales = fp8_part(dz_scales, "float32", n, &call.device)?;
        // SAFETY: checked by `fp8_part`; the caller holds the tensor for the call.
        let dz_scales = unsafe { gpu.borrow_buf::<f32>(dz_scales, n) };
        let weight = host::gpu::gemm::fp8::Fp8Weight { rows, rows_t, dz_scales };
        block = block.with_fp8_weight(weight).map_err(to_py)?;
    }
    let x = borrow_w(&call.x)?;
    Ok(GpuCall { gpu, block, x, _widened: widened })
}

/// An e4m3 matrix `(rows, pitch)` and its `rows` inverse scales, as [`fp8_weight`]
/// made them (uint8 and float32 tensors on the block's device), borrowed.
fn fp8_matrix(
    gpu: &Gpu,
    (values, scales): (&Bound<'_, PyAny>, &Bound<'_, PyAny>),
    (rows, cols, pitch): (usize, usize, usize),
    device: &Device,
) -> PyResult<host::gpu::gemm::fp8::Fp8Matrix> {
    let values = fp8_part(values, "uint8", rows * pitch, device)?;
    let inv_scales = fp8_part(scales, "float32", rows, device)?;
    // SAFETY: `fp8_part` checked both: contiguous tensors of these lengths and types on
    // the block's device, which the caller holds for the call.
    let (values, inv_scales) =
        unsafe { (gpu.borrow_buf::<u8>(values, rows * pitch), gpu.borrow_buf::<f32>(inv_scales, rows)) };
    Ok(host::gpu::gemm::fp8::Fp8Matrix { values, inv_scales, rows, cols, pitch })
}

/// The address of one tensor of [`fp8_weight`]'s list, once it is checked to hold `len`
/// contiguous `dtype` values on the block's device.
fn fp8_part(t: &Bound<'_, PyAny>, dtype: &str, len: usize, device: &Device) -> PyResult<u64> {
    let torch = t.py().import("torch")?;
    let ok = (
        t.getattr("dtype")?.eq(torch.getattr(dtype)?)?,
        t.call_method0("numel")?.extract::<usize>()? == len,
        t.call_method0("is_contiguous")?.extract::<bool>()?,
        t.getattr("device")?.str()?.to_string() == device.to_string(),
    );
    if ok != (true, true, true, true) {
        return Err(PyValueError::new_err(format!(
            "fp8_weight: expected {len} contiguous {dtype} values on {device} (made by fp8_weight() for this weight)"
        )));
    }
    t.call_method0("data_ptr")?.extract()
}

/// The GPU forward and backward of [`forward`] and [`backward`], for a block over
/// float32 tensors and for a bf16 model's (the same calls on `GpuBlock<f32>` and
/// `GpuBlock<Bf16>`).
macro_rules! gpu_entry_points {
    ($forward:ident, $backward:ident, $w:ty) => {
        fn $forward<'py>(
            call: &Call<'py>,
            index: usize,
            stream: u64,
            allocate: &Bound<'py, PyAny>,
            save: bool,
            fp8_weight: Option<&[Bound<'py, PyAny>]>,
        ) -> PyResult<(Bound<'py, PyAny>, Option<Bound<'py, PyAny>>)> {
            let g = gpu_call::<$w>(call, index, stream, allocate, fp8_weight, Vectors::AsStored)?;
            let py = allocate.py();
            let out_shape = call.block.spec.output_shape(call.batch);
            if !save {
                let mut ws = g.block.workspace_with(&g.gpu, call.batch, false).map_err(to_py)?;
                g.block.forward_into(&g.gpu, &g.x, &mut ws, None).map_err(to_py)?;
                return Ok((into_torch(py, ws.y, &out_shape)?, None));
            }
            if call.stats_rows() == 0 {
                let (y, saved) = g.block.forward_train(&g.gpu, &g.x, false).map_err(to_py)?;
                return Ok((into_torch(py, y, &out_shape)?, Some(into_torch(py, saved.z, &call.z_shape())?)));
            }
            // A BatchNorm's statistics follow `z` in the saved state: the forward writes
            // `z` into the first rows of that buffer (no copy of it afterwards).
            let mut z = g.gpu.alloc(&call.z_shape()).map_err(to_py)?;
            let mut ws = g.block.workspace_with(&g.gpu, call.batch, false).map_err(to_py)?;
            // SAFETY: the first `batch` rows of `z`, which outlives the view.
            let mut rows = unsafe { g.gpu.borrow_tensor::<f32>(z.buf.device_address(), &[call.batch, z.shape[1]]) }
                .map_err(to_py)?;
            g.block.forward_into(&g.gpu, &g.x, &mut ws, Some(&mut rows)).map_err(to_py)?;
            let stats = ws
                .stats
                .take()
                .ok_or_else(|| PyRuntimeError::new_err("fused_linear: internal error: no batch statistics"))?;
            append_batch_stats(&g.gpu, &mut z, call.batch, &stats).map_err(to_py)?;
            Ok((into_torch(py, ws.y, &out_shape)?, Some(into_torch(py, z, &call.z_shape())?)))
        }

        fn $backward<'py>(
            call: &Call<'py>,
            (z, dy): (&Arg<'py>, &Arg<'py>),
            index: usize,
            stream: u64,
            allocate: &Bound<'py, PyAny>,
            fp8_weight: Option<&[Bound<'py, PyAny>]>,
            input_grad: bool,
        ) -> PyResult<Grads<'py>> {
            let mut g = gpu_call::<$w>(call, index, stream, allocate, fp8_weight, Vectors::Backward)?;
            g.block = g.block.with_input_grad(input_grad);
            // SAFETY: z and dy were checked as the other arguments were (z float32, dy
            // of the block's type).
            // Without a BatchNorm's statistics rows (the backward recomputes them from z).
            let z_rows = [call.batch, z.shape[1]];
            let z_dev = unsafe { g.gpu.borrow_tensor::<f32>(z.ptr, &z_rows) }.map_err(to_py)?;
            let dy_dev = unsafe { g.gpu.borrow_tensor::<$w>(dy.ptr, &dy.shape) }.map_err(to_py)?;
            let dtypes: Vec<DType> = [&call.bias].into_iter().chain(&call.params).map(|a| a.dtype).collect();
            let (made, outs) = small_grad_outputs(&g.block, &g.gpu, &dtypes).map_err(to_py)?;
            let small = |block: &GpuBlock<$w>, gpu: &Gpu, slots: Option<&DeviceTensor>| match slots {
                Some(slots) => small_grads(block, gpu, slots, &dtypes, made),
                None => made.ok_or_else(|| host::Error::Shape("the chain backward kept no gradient sums".into())),
            };
            let mut saved = Saved::kept_by_caller(z_dev);
            if call.stats_rows() > 0 {
                // SAFETY: the rows after the batch's in `z` (its shape was checked): the
                // forward's mean and variance.
                let at = z.ptr + (call.batch * z.shape[1] * 4) as u64;
                let stats =
                    unsafe { g.gpu.borrow_tensor::<f32>(at, &[BATCH_STATS_ROWS, z.shape[1]]) }.map_err(to_py)?;
                saved = saved.with_batch_stats(Some(stats));
            }
            let grads = g.block.backward_parts(&g.gpu, &g.x, saved, &dy_dev, None, outs.as_ref(), small);
            // A backward that failed half way may leave side-stream buffers held.
            g.gpu.join_side().map_err(to_py)?;
            let (dx, dw, small) = grads.map_err(to_py)?;
            let py = allocate.py();
            let specs = &call.block.params;
            let dx = dx.map(|dx| into_torch(py, dx, &call.x.shape)).transpose()?;
            let dw = into_torch(py, dw, &specs[0].shape)?;
            let mut small = small.into_iter().zip(&specs[1..]).map(|(t, s)| match t {
                DeviceVector::F32(t) => into_torch(py, t, &s.shape),
                DeviceVector::Bf16(t) => into_torch(py, t, &s.shape),
                DeviceVector::F16(t) => into_torch(py, t, &s.shape),
            });
            let db = small
                .next()
                .ok_or_else(|| PyRuntimeError::new_err("fused_linear: internal error: no bias gradient"))??;
            let dparams = small.collect::<PyResult<Vec<_>>>()?;
            Ok((dx, dw, db, dparams))
        }
    };
}

/// Writes the BatchNorm's batch mean and biased variance (the first two rows of `stats`)
/// into the rows of `z` after its first `batch`: the saved state a chain with a
/// BatchNorm hands the package. (It copied `z` itself once, 32 MB of KernelBench 33's,
/// 0.23 ms of its 0.58 ms bf16 forward at build `9507446` through the conversion kernel.)
fn append_batch_stats(gpu: &Gpu, z: &mut DeviceTensor, batch: usize, stats: &DeviceTensor) -> host::Result<()> {
    let n = stats.shape[1];
    let (from, len) = (batch * n, BATCH_STATS_ROWS * n);
    if z.len() != from + len {
        return Err(host::Error::Shape(format!("a saved state of {} values for {batch} rows of {n}", z.len())));
    }
    let copy = |e| host::Error::cuda("copying the batch statistics on the device", e);
    gpu.stream().memcpy_dtod(&stats.buf.slice(0..len), &mut z.buf.slice_mut(from..from + len)).map_err(copy)
}

/// A new vector of `len` values of `dtype` (float32 unless bf16 or fp16).
fn new_vector(gpu: &Gpu, len: usize, dtype: DType) -> host::Result<DeviceVector> {
    Ok(match dtype {
        DType::Bf16 => DeviceVector::Bf16(gpu.alloc_as::<Bf16>(&[len])?),
        DType::F16 => DeviceVector::F16(gpu.alloc_as::<F16>(&[len])?),
        _ => DeviceVector::F32(gpu.alloc(&[len])?),
    })
}

/// The bias's and the chain parameters' gradients, new tensors in their parameters'
/// dtypes (`dtypes`: the bias's, then the chain's), made before the backward, and the
/// `GradOuts` over them where its chain backward writes them itself (tile-wise: each
/// rounded once from its FP32 sums, no launch after). `None` where an AvgPool is folded
/// (its bias gradient is spread back after).
fn small_grad_outputs<W: DeviceElement>(
    block: &GpuBlock<W>,
    gpu: &Gpu,
    dtypes: &[DType],
) -> host::Result<(Option<Vec<DeviceVector>>, Option<GradOuts>)> {
    let Some(places) = block.small_grad_slots() else { return Ok((None, None)) };
    if places.len() != dtypes.len() {
        return Err(host::Error::Shape(format!("{} gradient slots for {} parameters", places.len(), dtypes.len())));
    }
    let made = places
        .iter()
        .zip(dtypes)
        .map(|(&(_, len), &dtype)| new_vector(gpu, len, dtype))
        .collect::<host::Result<Vec<_>>>()?;
    let outs = if block.writes_small_grads() {
        let words = made.iter().map(|v| Ok((v.word()?, v.len()))).collect::<host::Result<Vec<_>>>()?;
        // SAFETY: new vectors of their lengths, returned with the outs for the backward.
        unsafe { GradOuts::new(words) }
    } else {
        None
    };
    Ok((Some(made), outs))
}

/// The bias's and the chain parameters' gradients out of the backward's `slots`, each in
/// its parameter's dtype (`dtypes`: the bias's, then the chain's), into `made`
/// ([`small_grad_outputs`]'s tensors): one launch copies or rounds them all. Where an
/// AvgPool is folded (its bias gradient is spread back by a kernel; no `made`) through
/// the block's FP32 ones into new tensors, 16-bit ones rounded after.
fn small_grads<W: DeviceElement>(
    block: &GpuBlock<W>,
    gpu: &Gpu,
    slots: &DeviceTensor,
    dtypes: &[DType],
    made: Option<Vec<DeviceVector>>,
) -> host::Result<Vec<DeviceVector>> {
    let mode = |v: &DeviceVector| match v {
        DeviceVector::Bf16(_) => Convert::F32ToBf16,
        DeviceVector::F16(_) => Convert::F32ToF16,
        DeviceVector::F32(_) => Convert::F32,
    };
    // The block's FP32 gradients where it spreads them back: alive until after the launch.
    let mut fp32 = Vec::new();
    let (sources, out): (Vec<(u64, usize)>, Vec<DeviceVector>) = match block.small_grad_slots() {
        Some(places) => {
            if let Some(&(at, len)) = places.last()
                && slots.len() < at + len
            {
                return Err(host::Error::Shape(format!(
                    "gradient slots of {} values, {at} + {len} wanted",
                    slots.len()
                )));
            }
            let out =
                made.ok_or_else(|| host::Error::Shape("no gradient tensors made for the block's slots".into()))?;
            (places.iter().map(|&(at, len)| (slots.buf.device_address() + (at * 4) as u64, len)).collect(), out)
        }
        None => {
            let (db, ops) = block.small_grads(gpu, slots)?;
            fp32.extend(std::iter::once(db).chain(ops.into_iter().flatten()));
            let out = fp32
                .iter()
                .zip(dtypes)
                .map(|(t, &dtype)| new_vector(gpu, t.len(), dtype))
                .collect::<host::Result<Vec<_>>>()?;
            (fp32.iter().map(|t| (t.buf.device_address(), t.len())).collect(), out)
        }
    };
    if sources.len() != out.len() {
        return Err(host::Error::Shape(format!("{} gradients for {} parameters", sources.len(), out.len())));
    }
    let vectors: Vec<Vector> = sources
        .iter()
        .zip(&out)
        .map(|(&(src, len), v)| Vector { src, dst: v.address(), len: len.min(v.len()), mode: mode(v) })
        .collect();
    // SAFETY: sources inside `slots` (checked) or the block's FP32 gradients (alive until
    // the launch in stream order), destinations the returned tensors, at most their length.
    unsafe { convert_vectors(gpu, gpu.stream(), &vectors)? };
    drop(fp32);
    Ok(out)
}

gpu_entry_points!(gpu_forward_f32, gpu_backward_f32, f32);
gpu_entry_points!(gpu_forward_bf16, gpu_backward_bf16, Bf16);
gpu_entry_points!(gpu_forward_f16, gpu_backward_f16, F16);

// ---------------------------------------------------------------------------------
// CPU

/// The CPU element types and what computes in each: float32 on the CPU backend
/// (`host::cpu`, FP32 on every core whatever the precision), float64 on the f64
/// reference.
trait Element: Real {
    /// `(y, z)`: the output and the Linear output the backward takes, the GEMMs in
    /// `precision` where the CPU emulates it (FP8), else FP32.
    fn forward_saving(
        spec: &BlockSpec,
        x: &Tensor<Self>,
        params: &Params<Self>,
        precision: Precision,
    ) -> host::Result<(Tensor<Self>, Tensor<Self>)>;
    /// The gradients at the forward's `z`.
    fn backward_at(
        spec: &BlockSpec,
        x: &Tensor<Self>,
        params: &Params<Self>,
        dy: &Tensor<Self>,
        z: &Tensor<Self>,
        precision: Precision,
    ) -> host::Result<BlockGrads<Self>>;
    /// The BatchNorm's batch mean and biased variance at `z`, if the chain has one.
    fn batch_norm_stats(
        spec: &BlockSpec,
        params: &Params<Self>,
        z: &Tensor<Self>,
    ) -> host::Result<Option<(Vec<Self>, Vec<Self>)>>;
}

/// The CPU backend's options for a call's precision: FP8's emulation, else FP32.
fn cpu_options(precision: Precision) -> host::cpu::Options {
    host::cpu::Precision::emulating(precision).map_or_else(Default::default, host::cpu::Options::new)
}

impl Element for f32 {
    fn forward_saving(
        spec: &BlockSpec,
        x: &Tensor<f32>,
        params: &Params<f32>,
        precision: Precision,
    ) -> host::Result<(Tensor<f32>, Tensor<f32>)> {
        host::cpu::forward_saving(spec, x, params, &cpu_options(precision))
    }
    fn backward_at(
        spec: &BlockSpec,
        x: &Tensor<f32>,
        params: &Params<f32>,
        dy: &Tensor<f32>,
        z: &Tensor<f32>,
        precision: Precision,
    ) -> host::Result<BlockGrads<f32>> {
        host::cpu::backward_at(spec, x, params, dy, z, &cpu_options(precision))
    }
    fn batch_norm_stats(
        spec: &BlockSpec,
        params: &Params<f32>,
        z: &Tensor<f32>,
    ) -> host::Result<Option<(Vec<f32>, Vec<f32>)>> {
        host::cpu::batch_norm_stats(spec, params, z)
    }
}

impl Element for f64 {
    fn forward_saving(
        spec: &BlockSpec,
        x: &Tensor<f64>,
        params: &Params<f64>,
        _precision: Precision,
    ) -> host::Result<(Tensor<f64>, Tensor<f64>)> {
        reference::block_forward_saving(spec, x, params)
    }
    fn backward_at(
        spec: &BlockSpec,
        x: &Tensor<f64>,
        params: &Params<f64>,
        dy: &Tensor<f64>,
        z: &Tensor<f64>,
        _precision: Precision,
    ) -> host::Result<BlockGrads<f64>> {
        Ok(reference::block_backward_at(spec, x, params, dy, z)?.1)
    }
    fn batch_norm_stats(
        spec: &BlockSpec,
        params: &Params<f64>,
        z: &Tensor<f64>,
    ) -> host::Result<Option<(Vec<f64>, Vec<f64>)>> {
        Ok(reference::batch_norm_stats(spec, params, z)?.map(|s| (s.mean, s.var)))
    }
}

/// A copy of a checked CPU tensor's values.
fn read_cpu<T: Copy>(a: &Arg<'_>) -> PyResult<Tensor<T>> {
    let len: usize = a.shape.iter().product();
    // SAFETY: a contiguous CPU tensor of `a.dtype` (= T, checked by the caller) holds
    // `len` values at `ptr`, kept alive by the caller during this call.
    let data =
        if len == 0 { Vec::new() } else { unsafe { std::slice::from_raw_parts(a.ptr as *const T, len) }.to_vec() };
    Tensor::new(&a.shape, data).map_err(to_py)
}

/// `t` as a new CPU tensor of the call's dtype, allocated by `allocate`, viewed as `shape`.
fn write_cpu<'py, T: Copy>(
    allocate: &Bound<'py, PyAny>,
    t: &Tensor<T>,
    shape: &[usize],
) -> PyResult<Bound<'py, PyAny>> {
    let py = allocate.py();
    let out = allocate.call1((t.len(), 0))?;
    let ptr: u64 = out.call_method0("data_ptr")?.extract()?;
    // SAFETY: `out` is a new contiguous tensor of `t.len()` values of T.
    unsafe { std::ptr::copy_nonoverlapping(t.data().as_ptr(), ptr as *mut T, t.len()) };
    out.call_method1("view", (PyTuple::new(py, shape)?,))
}

fn cpu_params<T: Element>(call: &Call<'_>) -> PyResult<Params<T>> {
    let tensors = call.param_args().map(read_cpu::<T>).collect::<PyResult<Vec<_>>>()?;
    Params::from_flat(&call.block.spec, tensors).map_err(to_py)
}

fn cpu_forward<'py, T: Element>(
    call: &Call<'py>,
    allocate: &Bound<'py, PyAny>,
    save: bool,
) -> PyResult<(Bound<'py, PyAny>, Option<Bound<'py, PyAny>>)> {
    let (x, params) = (read_cpu::<T>(&call.x)?, cpu_params::<T>(call)?);
    let (y, z) = T::forward_saving(&call.block.spec, &x, &params, call.precision).map_err(to_py)?;
    let z = match T::batch_norm_stats(&call.block.spec, &params, &z).map_err(to_py)? {
        Some((mean, var)) if save => {
            let mut data = z.into_data();
            data.extend(mean.into_iter().chain(var));
            Tensor::new(&call.z_shape(), data).map_err(to_py)?
        }
        _ => z,
    };
    let z = if save { Some(write_cpu(allocate, &z, z.shape())?) } else { None };
    Ok((write_cpu(allocate, &y, y.shape())?, z))
}

/// `(dx, dweight, dbias, [d params...])`; `dx` is `None` where the caller asked for none.
type Grads<'py> = (Option<Bound<'py, PyAny>>, Bound<'py, PyAny>, Bound<'py, PyAny>, Vec<Bound<'py, PyAny>>);

fn cpu_backward<'py, T: Element>(
    call: &Call<'py>,
    z: &Arg<'py>,
    dy: &Arg<'py>,
    allocate: &Bound<'py, PyAny>,
) -> PyResult<Grads<'py>> {
    let (x, params) = (read_cpu::<T>(&call.x)?, cpu_params::<T>(call)?);
    let (z, dy) = (read_cpu::<T>(z)?, read_cpu::<T>(dy)?);
    // Without the batch statistics' rows (the backward recomputes them from `z`).
    let width = call.block.spec.out_features;
    let z = match call.stats_rows() {
        0 => z,
        _ => Tensor::new(&[call.batch, width], z.data()[..call.batch * width].to_vec()).map_err(to_py)?,
    };
    let grads = T::backward_at(&call.block.spec, &x, &params, &dy, &z, call.precision).map_err(to_py)?;
    let flat = grads.params.flat();
    let mut out = flat.iter().map(|g| write_cpu(allocate, g, g.shape())).collect::<PyResult<Vec<_>>>()?.into_iter();
    let (dw, db) = (out.next().unwrap(), out.next().unwrap());
    Ok((Some(write_cpu(allocate, &grads.x, grads.x.shape())?), dw, db, out.collect()))
}

// ---------------------------------------------------------------------------------
// The functions the package registers as custom ops.

/// The block's forward: `(y, z)`, `z` the state the backward takes, or `(y, None)`
/// without `save` (inference: `z` is then neither written nor allocated).
#[pyfunction]
#[pyo3(signature = (x, weight, bias, params, ops, precision, stream, allocate, save = true, fp8_weight = None))]
#[allow(clippy::too_many_arguments)]
fn forward<'py>(
    x: &Bound<'py, PyAny>,
    weight: &Bound<'py, PyAny>,
    bias: &Bound<'py, PyAny>,
    params: Vec<Bound<'py, PyAny>>,
    ops: &str,
    precision: &str,
    stream: u64,
    allocate: &Bound<'py, PyAny>,
    save: bool,
    fp8_weight: Option<Vec<Bound<'py, PyAny>>>,
) -> PyResult<(Bound<'py, PyAny>, Option<Bound<'py, PyAny>>)> {
    guarded(|| {
        let call = Call::new(x, weight, bias, &params, ops, precision)?;
        let fp8 = fp8_weight.as_deref();
        match (call.device.clone(), call.dtype) {
            (Device::Cpu, DType::F32) => cpu_forward::<f32>(&call, allocate, save),
            (Device::Cpu, DType::F64) => cpu_forward::<f64>(&call, allocate, save),
            (Device::Cpu, DType::Bf16 | DType::F16) => unreachable!("Call::new refuses CPU 16-bit tensors"),
            (Device::Cuda(index), DType::Bf16) => gpu_forward_bf16(&call, index, stream, allocate, save, fp8),
            (Device::Cuda(index), DType::F16) => gpu_forward_f16(&call, index, stream, allocate, save, fp8),
            (Device::Cuda(index), _) => gpu_forward_f32(&call, index, stream, allocate, save, fp8),
        }
    })
}

/// The block's backward from the forward's `z` and the output's gradient `dy`:
/// `(dx, dweight, dbias, [d params...])`. Without `input_grad` the GPU computes no `dx`
/// (`None`; an input that needs no gradient saves the `dX` GEMM).
#[pyfunction]
#[pyo3(signature = (x, weight, bias, params, z, dy, ops, precision, stream, allocate, fp8_weight = None, input_grad = true))]
#[allow(clippy::too_many_arguments)]
fn backward<'py>(
    x: &Bound<'py, PyAny>,
    weight: &Bound<'py, PyAny>,
    bias: &Bound<'py, PyAny>,
    params: Vec<Bound<'py, PyAny>>,
    z: &Bound<'py, PyAny>,
    dy: &Bound<'py, PyAny>,
    ops: &str,
    precision: &str,
    stream: u64,
    allocate: &Bound<'py, PyAny>,
    fp8_weight: Option<Vec<Bound<'py, PyAny>>>,
    input_grad: bool,
) -> PyResult<Grads<'py>> {
    guarded(|| {
        let call = Call::new(x, weight, bias, &params, ops, precision)?;
        let fp8 = fp8_weight.as_deref();
        let (z, dy) = (Arg::read("z", z)?, Arg::read("dy", dy)?);
        // `z` is float32 on the GPU whatever the block's type; `dy` is of the block's.
        let z_dtype = if call.dtype.half_precision().is_some() { DType::F32 } else { call.dtype };
        for (a, dtype) in [(&z, z_dtype), (&dy, call.dtype)] {
            if a.device != call.device || a.dtype != dtype {
                return Err(PyRuntimeError::new_err(format!(
                    "{} is a {} tensor on {}; the block's takes {} on {}",
                    a.name,
                    dtype_name(a.dtype),
                    a.device,
                    dtype_name(dtype),
                    call.device
                )));
            }
        }
        z.expect_shape(&call.z_shape(), "the saved state of the forward")?;
        dy.expect_shape(&call.block.spec.output_shape(call.batch), "the block's output")?;
        match (call.device.clone(), call.dtype) {
            (Device::Cpu, DType::F32) => cpu_backward::<f32>(&call, &z, &dy, allocate),
            (Device::Cpu, DType::F64) => cpu_backward::<f64>(&call, &z, &dy, allocate),
            (Device::Cpu, DType::Bf16 | DType::F16) => unreachable!("Call::new refuses CPU 16-bit tensors"),
            (Device::Cuda(index), dtype) => {
                z.expect_aligned()?;
                dy.expect_aligned()?;
                match dtype {
                    DType::Bf16 => gpu_backward_bf16(&call, (&z, &dy), index, stream, allocate, fp8, input_grad),
                    DType::F16 => gpu_backward_f16(&call, (&z, &dy), index, stream, allocate, fp8, input_grad),
                    _ => gpu_backward_f32(&call, (&z, &dy), index, stream, allocate, fp8, input_grad),
                }
            }
        }
    })
}

/// A Linear weight `(out, in)` on a GPU (float32, bf16 or fp16) quantised for the fp8
/// GEMMs, once, for the package's cache: `[rows (out, in) uint8, their inverse scales
/// (out,), rows_t (in, out) uint8 (the same bytes transposed, for dX), its column factors
/// (in,), dZ's column multipliers (out,)]`. Passed back as `fp8_weight` to `forward`
/// and `backward`.
#[pyfunction]
fn fp8_weight<'py>(
    weight: &Bound<'py, PyAny>,
    stream: u64,
    allocate: &Bound<'py, PyAny>,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    guarded(|| {
        let w = Arg::read("weight", weight)?;
        let (n, k) = match w.shape[..] {
            [n, k] => (n, k),
            _ => return Err(PyValueError::new_err(format!("weight: expected 2 dimensions, got {:?}", w.shape))),
        };
        let Device::Cuda(index) = w.device else {
            return Err(PyValueError::new_err("fp8_weight: the weight is on the CPU (the cache is for the GPU)"));
        };
        if let Some(why) = host::gpu::gemm::fp8::unsupported(k, n) {
            return Err(PyValueError::new_err(why));
        }
        w.expect_aligned()?;
        let opened = gpu(index)?;
        let allocator = Arc::new(TorchAllocator { allocate: allocate.clone().unbind() });
        // SAFETY: as in `gpu_call`: PyTorch's current stream of the weight's device.
        let gpu = unsafe { opened.on_stream(stream, Some(allocator)) };
        use host::gpu::gemm::fp8::{Fp8Weight, quantise_weight};
        // The weight's copies, read as `T` (its dtype, matched below).
        fn quantised<T: DeviceElement>(gpu: &Gpu, w: &Arg<'_>) -> host::Result<Fp8Weight> {
            // SAFETY: `w` was checked to be a contiguous, aligned tensor of this shape on
            // this device, of `T` (the caller's match on its dtype), held for the call.
            let t = unsafe { gpu.borrow_tensor::<T>(w.ptr, &w.shape) }?;
            quantise_weight(gpu, gpu.stream(), &t, "weight")
        }
        let quantised = match w.dtype {
            DType::Bf16 => quantised::<Bf16>(&gpu, &w),
            DType::F16 => quantised::<F16>(&gpu, &w),
            DType::F32 => quantised::<f32>(&gpu, &w),
            DType::F64 => {
                return Err(PyTypeError::new_err("fp8_weight: a float64 weight (fp8 takes float32, bf16, fp16)"));
            }
        };
        let Fp8Weight { rows, rows_t, dz_scales } = quantised.map_err(to_py)?;
        let py = weight.py();
        let torch_of = |buf: host::gpu::DeviceBuf<u8>| -> PyResult<Bound<'py, PyAny>> {
            let len = buf.len();
            into_torch(py, DeviceTensor { shape: vec![len], buf }, &[len])
        };
        let scales_of = |buf: host::gpu::DeviceBuf<f32>| -> PyResult<Bound<'py, PyAny>> {
            let len = buf.len();
            into_torch(py, DeviceTensor { shape: vec![len], buf }, &[len])
        };
        Ok(vec![
            torch_of(rows.values)?,
            scales_of(rows.inv_scales)?,
            torch_of(rows_t.values)?,
            scales_of(rows_t.inv_scales)?,
            scales_of(dz_scales)?,
        ])
    })
}

/// A chain applied to `Linear(in_features, out_features)`, for shape inference
/// (`register_fake`) and the module's parameters: the output shape after the batch,
/// `z`'s width on the GPU and on the CPU, each op in canonical form, and each op
/// parameter as `(name, shape, index of its op)`; or a `ValueError` saying why the
/// chain does not apply.
#[pyfunction]
fn describe(in_features: usize, out_features: usize, ops: &str) -> PyResult<Description> {
    guarded(|| {
        let chain: Chain = ops.parse().map_err(|e| PyValueError::new_err(format!("ops: {e}")))?;
        let spec = BlockSpec::new(in_features, out_features, chain).map_err(to_py)?;
        let out = spec.output_shape(1)[1..].to_vec();
        let gpu_width = host::gpu::dispatch::gemm_width(&spec);
        let owners = spec.chain.0.iter().enumerate().flat_map(|(i, op)| op.param_bases().iter().map(move |_| i));
        let params = spec.param_specs().into_iter().skip(2).zip(owners).map(|(s, i)| (s.name, s.shape, i)).collect();
        let ops = spec.chain.0.iter().map(|op| op.to_string()).collect();
        Ok((out, gpu_width, out_features, ops, params))
    })
}

type Description = (Vec<usize>, usize, usize, Vec<String>, Vec<(String, Vec<usize>, usize)>);

/// Why the GPU cannot run this chain on `Linear(in_features, out_features)` (an op that
/// needs whole rows, over rows wider than the row-wise kernels take), or `None`.
/// `fuse()` leaves such chains to PyTorch.
#[pyfunction]
fn gpu_limit(in_features: usize, out_features: usize, ops: &str) -> PyResult<Option<String>> {
    guarded(|| Ok(host::gpu::dispatch::rows_too_wide(&Block::of(ops, in_features, out_features)?.spec)))
}

/// The chain syntax's parse, for Python code that needs each op's kind and arguments
/// (the tests' references, the benchmark's peer) without a parser of its own: every op
/// as `(kind, args)`, its canonical name (an alias, `double`, resolved) and every
/// argument written out (defaults filled in): `groupnorm` `(groups, eps)`, `avgpool`
/// `(k,)`, `maxpool` `(k,)`, `layernorm` and `rmsnorm` `(eps,)`, `max`, `min`, `sum`,
/// `mean`, `logsumexp`, `softmax` `()`. Arguments are the kernels' f32 values as their
/// shortest decimals (`0.01`, not 0.009999999776). A `ValueError` says why a chain does
/// not parse.
#[pyfunction]
fn parse_chain(ops: &str) -> PyResult<Vec<(String, Vec<f64>)>> {
    guarded(|| {
        let chain: Chain = ops.parse().map_err(|e| PyValueError::new_err(format!("ops: {e}")))?;
        // An f32 as the f64 of its shortest decimal: what was written.
        let decimal = |v: f32| v.to_string().parse::<f64>().unwrap_or(v as f64);
        Ok(chain
            .0
            .iter()
            .map(|op| match *op {
                host::chain::Op::Pointwise(kind, [a, b]) => {
                    let n = kind.info().args.len();
                    (kind.name().to_string(), [decimal(a), decimal(b)][..n].to_vec())
                }
                host::chain::Op::GroupNorm { groups, eps } => ("groupnorm".into(), vec![groups as f64, decimal(eps)]),
                host::chain::Op::AvgPool(k) => ("avgpool".into(), vec![k as f64]),
                host::chain::Op::RowMax => ("max".into(), vec![]),
                host::chain::Op::Reduce(r) => (r.name().into(), vec![]),
                host::chain::Op::Softmax => ("softmax".into(), vec![]),
                host::chain::Op::MaxPool(k) => ("maxpool".into(), vec![k as f64]),
                host::chain::Op::LayerNorm { eps } => ("layernorm".into(), vec![decimal(eps)]),
                host::chain::Op::RmsNorm { eps } => ("rmsnorm".into(), vec![decimal(eps)]),
                host::chain::Op::BatchNorm { eps } => ("batchnorm".into(), vec![decimal(eps)]),
                host::chain::Op::Residual => ("residual".into(), vec![]),
            })
            .collect())
    })
}

/// The op registry (`host::chain::registry`), one dict per op: `name`, `aliases`,
/// `args` (`(name, default or None)`), `params` (parameter base names), `kink` (its
/// derivative jumps), `saturates` (a row's largest values can tie in FP32 after it),
/// `per_element`, `meaning`.
#[pyfunction]
fn ops(py: Python<'_>) -> PyResult<Vec<Bound<'_, pyo3::types::PyDict>>> {
    host::chain::registry()
        .into_iter()
        .map(|op| {
            let d = pyo3::types::PyDict::new(py);
            d.set_item("name", op.name)?;
            d.set_item("aliases", op.aliases.to_vec())?;
            d.set_item("args", op.args)?;
            d.set_item("params", op.params.to_vec())?;
            d.set_item("kink", op.kink)?;
            d.set_item("saturates", op.saturates)?;
            d.set_item("per_element", op.per_element)?;
            d.set_item("meaning", op.meaning)?;
            Ok(d)
        })
        .collect()
}

/// Frees the buffers and tables the GPU calls keep between calls ([`Gpu::release_kept`]).
#[pyfunction]
fn release_buffers() -> PyResult<()> {
    guarded(|| {
        Gpu::release_kept();
        Ok(())
    })
}

/// Raises a Rust panic inside the boundary, for the tests of the boundary itself.
#[pyfunction]
fn _raise_panic(message: &str) -> PyResult<()> {
    guarded(|| panic!("{message}"))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // A panic's message reaches Python in the RuntimeError `guarded` raises; the default
    // hook would print it (and a backtrace) to stderr as well. This hook is this
    // extension's own: Rust's runtime is linked into each extension separately.
    std::panic::set_hook(Box::new(|_| {}));
    m.add_function(wrap_pyfunction!(forward, m)?)?;
    m.add_function(wrap_pyfunction!(backward, m)?)?;
    m.add_function(wrap_pyfunction!(describe, m)?)?;
    m.add_function(wrap_pyfunction!(fp8_weight, m)?)?;
    m.add_function(wrap_pyfunction!(parse_chain, m)?)?;
    m.add_function(wrap_pyfunction!(gpu_limit, m)?)?;
    m.add_function(wrap_pyfunction!(kernel_image, m)?)?;
    m.add_function(wrap_pyfunction!(ops, m)?)?;
    m.add_function(wrap_pyfunction!(release_buffers, m)?)?;
    m.add_function(wrap_pyfunction!(_raise_panic, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}

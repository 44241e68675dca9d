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
use host::gpu::{DeviceAllocator, DeviceTensor, ElementKind, Gpu};
use host::reference::{self, BlockGrads, Real};
use host::tensor::Tensor;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyTuple, PyType};
use std::any::Any;
use std::panic::AssertUnwindSafe;
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

/// `torch.float32` and `torch.float64`, compared by identity (dtypes are singletons).
fn float_dtypes(py: Python<'_>) -> PyResult<(&Bound<'_, PyAny>, &Bound<'_, PyAny>)> {
    static F32: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    static F64: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let get = |cell: &'static PyOnceLock<Py<PyAny>>, name: &str| -> PyResult<&Bound<'_, PyAny>> {
        Ok(cell.get_or_try_init(py, || py.import("torch")?.getattr(name).map(Bound::unbind))?.bind(py))
    };
    Ok((get(&F32, "float32")?, get(&F64, "float64")?))
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
        let (f32_, f64_) = float_dtypes(py)?;
        let dt = obj.getattr("dtype")?;
        let dtype = if dt.is(f32_) {
            DType::F32
        } else if dt.is(f64_) {
            DType::F64
        } else {
            return Err(PyTypeError::new_err(format!(
                "{name} has dtype {}; expected torch.float32 (or torch.float64 on the CPU)",
                dt.str()?
            )));
        };
        let device = if obj.getattr("is_cuda")?.extract::<bool>()? {
            Device::Cuda(obj.call_method0("get_device")?.extract::<usize>()?)
        } else if obj.getattr("is_cpu")?.extract::<bool>()? {
            Device::Cpu
        } else {
            return Err(PyRuntimeError::new_err(format!(
                "{name} is on a `{}` device; fused_linear runs on CUDA and on the CPU",
                obj.getattr("device")?.getattr("type")?.str()?
            )));
        };
        let shape: Vec<usize> = obj.getattr("shape")?.extract()?;
        if !obj.call_method0("is_contiguous")?.extract::<bool>()? {
            let stride: Vec<isize> = obj.call_method0("stride")?.extract()?;
            return Err(PyValueError::new_err(format!(
                "{name} is not contiguous (shape {shape:?}, strides {stride:?}); pass {name}.contiguous()"
            )));
        }
        let ptr: u64 = obj.call_method0("data_ptr")?.extract()?;
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

/// Every tensor argument of a call, checked against one another and the chain.
struct Call<'py> {
    spec: BlockSpec,
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
        _ => Err(PyValueError::new_err(format!("precision `{s}` is not one of fp32, tf32x3, tf32, bf16"))),
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
        let chain: Chain = ops.parse().map_err(|e| PyValueError::new_err(format!("ops: {e}")))?;
        let x = Arg::read("x", x)?;
        let weight = Arg::read("weight", weight)?;
        let bias = Arg::read("bias", bias)?;
        let params = params
            .iter()
            .enumerate()
            .map(|(i, p)| Arg::read(format!("params[{i}]"), p))
            .collect::<PyResult<Vec<_>>>()?;
        let (device, dtype) = (x.device.clone(), x.dtype);
        if let (Device::Cuda(_), DType::F64) = (&device, dtype) {
            return Err(PyTypeError::new_err(
                "x has dtype torch.float64 on CUDA; the GPU kernels take torch.float32 (float64 runs on the CPU)",
            ));
        }
        for a in [&weight, &bias].into_iter().chain(&params) {
            if a.device != device {
                return Err(PyRuntimeError::new_err(format!(
                    "{} is on {} but x is on {device}: all tensors of the block must be on one device",
                    a.name, a.device
                )));
            }
            if a.dtype != dtype {
                return Err(PyTypeError::new_err(format!(
                    "{} has dtype {} but x has {}: all tensors of the block must have one dtype",
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
        let spec = BlockSpec::new(in_features, out_features, chain).map_err(|e| match e {
            host::Error::Chain(_) => PyValueError::new_err(format!("ops: {e}")),
            e => to_py(e),
        })?;
        spec.check_batch(batch).map_err(to_py)?;
        let specs = spec.param_specs();
        let wanted = &specs[2..];
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
        Ok(Call { spec, precision, batch, device, dtype, x, weight, bias, params })
    }

    /// The tensors in [`BlockSpec::param_specs`] order: weight, bias, then the ops'.
    fn param_args(&self) -> impl Iterator<Item = &Arg<'py>> {
        [&self.weight, &self.bias].into_iter().chain(&self.params)
    }

    /// Shape of a saved `z` on this call's device: the Linear output, or on the GPU the
    /// folded one where the chain starts with `avgpool(k)`.
    fn z_shape(&self) -> Vec<usize> {
        let width = match (&self.device, self.spec.chain.0.first()) {
            (Device::Cuda(_), Some(host::chain::Op::AvgPool(k))) => self.spec.out_features / k,
            _ => self.spec.out_features,
        };
        vec![self.batch, width]
    }
}

fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "torch.float32",
        DType::F64 => "torch.float64",
    }
}

// ---------------------------------------------------------------------------------
// CUDA

/// The opened GPUs, by CUDA ordinal: module loaded once, before any graph capture.
static GPUS: Mutex<Vec<Option<Gpu>>> = Mutex::new(Vec::new());

fn gpu(index: usize) -> PyResult<Gpu> {
    let mut gpus = GPUS.lock().unwrap_or_else(|p| p.into_inner());
    if gpus.len() <= index {
        gpus.resize(index + 1, None);
    }
    if let Some(g) = &gpus[index] {
        return Ok(g.clone());
    }
    let g = Gpu::open(index).map_err(to_py)?;
    gpus[index] = Some(g.clone());
    Ok(g)
}

/// PyTorch's caching allocator, through the package's `allocate(numel, kind)`
/// callable (a `torch.empty` on the call's device): the returned tensor owns the memory.
struct TorchAllocator {
    allocate: Py<PyAny>,
}

impl DeviceAllocator for TorchAllocator {
    fn allocate(&self, bytes: usize, element: ElementKind) -> host::Result<(u64, Box<dyn Any + Send + Sync>)> {
        Python::attach(|py| {
            let (numel, kind) = match element {
                ElementKind::F32 => (bytes / 4, 0),
                ElementKind::Bytes => (bytes, 1),
                ElementKind::Bf16 => (bytes / 2, 2),
            };
            let t = self.allocate.call1(py, (numel, kind))?;
            let ptr: u64 = t.call_method0(py, "data_ptr")?.extract(py)?;
            Ok((ptr, Box::new(t) as Box<dyn Any + Send + Sync>))
        })
        .map_err(|e: PyErr| host::Error::cuda("allocating through PyTorch", e))
    }
}

/// A buffer the block allocated through PyTorch, as the tensor it is, viewed as `shape`.
fn into_torch<'py>(py: Python<'py>, t: DeviceTensor, shape: &[usize]) -> PyResult<Bound<'py, PyAny>> {
    let keep = t.buf.into_external().ok_or_else(|| {
        PyRuntimeError::new_err("fused_linear: internal error: an output was not allocated through PyTorch")
    })?;
    let tensor = keep
        .downcast::<Py<PyAny>>()
        .map_err(|_| PyRuntimeError::new_err("fused_linear: internal error: an output of another allocator"))?;
    tensor.bind(py).call_method1("view", (PyTuple::new(py, shape)?,))
}

struct GpuCall {
    gpu: Gpu,
    block: GpuBlock,
    x: DeviceTensor,
}

fn gpu_call(call: &Call<'_>, index: usize, stream: u64, allocate: &Bound<'_, PyAny>) -> PyResult<GpuCall> {
    let opened = gpu(index)?;
    let allocator = Arc::new(TorchAllocator { allocate: allocate.clone().unbind() });
    // SAFETY: `stream` is PyTorch's current stream of the tensors' device (the package
    // passes `torch.cuda.current_stream(device).cuda_stream`), alive for this call.
    let gpu = unsafe { opened.on_stream(stream, Some(allocator)) };
    // SAFETY (each borrow): the arguments were checked to be contiguous f32 tensors of
    // these shapes on this device, 16-byte aligned; the caller holds them for the call.
    let borrow = |a: &Arg<'_>| unsafe { gpu.borrow_tensor(a.ptr, &a.shape) }.map_err(to_py);
    let mut flat = call.param_args().map(borrow).collect::<PyResult<Vec<_>>>()?.into_iter();
    let (linear_weight, linear_bias) = (flat.next().unwrap(), flat.next().unwrap());
    let ops =
        call.spec.chain.0.iter().map(|op| op.param_bases().iter().map(|_| flat.next().unwrap()).collect()).collect();
    let params = DeviceParams { linear_weight, linear_bias, ops };
    let block = GpuBlock::from_device(&gpu, &call.spec, params).map_err(to_py)?.with_precision(call.precision);
    let x = borrow(&call.x)?;
    Ok(GpuCall { gpu, block, x })
}

// ---------------------------------------------------------------------------------
// CPU

/// The CPU element types and what computes in each: float32 on the CPU backend
/// (`host::cpu`, FP32 on every core whatever the precision), float64 on the f64
/// reference.
trait Element: Real {
    /// `(y, z)`: the output and the Linear output the backward takes.
    fn forward_saving(
        spec: &BlockSpec,
        x: &Tensor<Self>,
        params: &Params<Self>,
    ) -> host::Result<(Tensor<Self>, Tensor<Self>)>;
    /// The gradients at the forward's `z`.
    fn backward_at(
        spec: &BlockSpec,
        x: &Tensor<Self>,
        params: &Params<Self>,
        dy: &Tensor<Self>,
        z: &Tensor<Self>,
    ) -> host::Result<BlockGrads<Self>>;
}

impl Element for f32 {
    fn forward_saving(
        spec: &BlockSpec,
        x: &Tensor<f32>,
        params: &Params<f32>,
    ) -> host::Result<(Tensor<f32>, Tensor<f32>)> {
        host::cpu::forward_saving(spec, x, params, &Default::default())
    }
    fn backward_at(
        spec: &BlockSpec,
        x: &Tensor<f32>,
        params: &Params<f32>,
        dy: &Tensor<f32>,
        z: &Tensor<f32>,
    ) -> host::Result<BlockGrads<f32>> {
        host::cpu::backward_at(spec, x, params, dy, z, &Default::default())
    }
}

impl Element for f64 {
    fn forward_saving(
        spec: &BlockSpec,
        x: &Tensor<f64>,
        params: &Params<f64>,
    ) -> host::Result<(Tensor<f64>, Tensor<f64>)> {
        reference::block_forward_saving(spec, x, params)
    }
    fn backward_at(
        spec: &BlockSpec,
        x: &Tensor<f64>,
        params: &Params<f64>,
        dy: &Tensor<f64>,
        z: &Tensor<f64>,
    ) -> host::Result<BlockGrads<f64>> {
        Ok(reference::block_backward_at(spec, x, params, dy, z)?.1)
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
    Params::from_flat(&call.spec, tensors).map_err(to_py)
}

fn cpu_forward<'py, T: Element>(
    call: &Call<'py>,
    allocate: &Bound<'py, PyAny>,
    save: bool,
) -> PyResult<(Bound<'py, PyAny>, Option<Bound<'py, PyAny>>)> {
    let (x, params) = (read_cpu::<T>(&call.x)?, cpu_params::<T>(call)?);
    let (y, z) = T::forward_saving(&call.spec, &x, &params).map_err(to_py)?;
    let z = if save { Some(write_cpu(allocate, &z, z.shape())?) } else { None };
    Ok((write_cpu(allocate, &y, y.shape())?, z))
}

type Grads<'py> = (Bound<'py, PyAny>, Bound<'py, PyAny>, Bound<'py, PyAny>, Vec<Bound<'py, PyAny>>);

fn cpu_backward<'py, T: Element>(
    call: &Call<'py>,
    z: &Arg<'py>,
    dy: &Arg<'py>,
    allocate: &Bound<'py, PyAny>,
) -> PyResult<Grads<'py>> {
    let (x, params) = (read_cpu::<T>(&call.x)?, cpu_params::<T>(call)?);
    let (z, dy) = (read_cpu::<T>(z)?, read_cpu::<T>(dy)?);
    let grads = T::backward_at(&call.spec, &x, &params, &dy, &z).map_err(to_py)?;
    let flat = grads.params.flat();
    let mut out = flat.iter().map(|g| write_cpu(allocate, g, g.shape())).collect::<PyResult<Vec<_>>>()?.into_iter();
    let (dw, db) = (out.next().unwrap(), out.next().unwrap());
    Ok((write_cpu(allocate, &grads.x, grads.x.shape())?, dw, db, out.collect()))
}

// ---------------------------------------------------------------------------------
// The functions the package registers as custom ops.

/// The block's forward: `(y, z)`, `z` the state the backward takes, or `(y, None)`
/// without `save` (inference: `z` is then neither written nor allocated).
#[pyfunction]
#[pyo3(signature = (x, weight, bias, params, ops, precision, stream, allocate, save = true))]
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
) -> PyResult<(Bound<'py, PyAny>, Option<Bound<'py, PyAny>>)> {
    guarded(|| {
        let call = Call::new(x, weight, bias, &params, ops, precision)?;
        match (call.device.clone(), call.dtype) {
            (Device::Cpu, DType::F32) => cpu_forward::<f32>(&call, allocate, save),
            (Device::Cpu, DType::F64) => cpu_forward::<f64>(&call, allocate, save),
            (Device::Cuda(index), _) => {
                let g = gpu_call(&call, index, stream, allocate)?;
                let py = x.py();
                let out_shape = call.spec.output_shape(call.batch);
                if !save {
                    let mut ws = g.block.workspace_with(&g.gpu, call.batch, false).map_err(to_py)?;
                    g.block.forward_into(&g.gpu, &g.x, &mut ws, None).map_err(to_py)?;
                    return Ok((into_torch(py, ws.y, &out_shape)?, None));
                }
                let (y, saved) = g.block.forward_train(&g.gpu, &g.x, false).map_err(to_py)?;
                Ok((into_torch(py, y, &out_shape)?, Some(into_torch(py, saved.z, &call.z_shape())?)))
            }
        }
    })
}

/// The block's backward from the forward's `z` and the output's gradient `dy`:
/// `(dx, dweight, dbias, [d params...])`.
#[pyfunction]
#[pyo3(signature = (x, weight, bias, params, z, dy, ops, precision, stream, allocate))]
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
) -> PyResult<Grads<'py>> {
    guarded(|| {
        let call = Call::new(x, weight, bias, &params, ops, precision)?;
        let (z, dy) = (Arg::read("z", z)?, Arg::read("dy", dy)?);
        for a in [&z, &dy] {
            if a.device != call.device || a.dtype != call.dtype {
                return Err(PyRuntimeError::new_err(format!(
                    "{} is a {} tensor on {}; the block's are {} on {}",
                    a.name,
                    dtype_name(a.dtype),
                    a.device,
                    dtype_name(call.dtype),
                    call.device
                )));
            }
        }
        z.expect_shape(&call.z_shape(), "the saved state of the forward")?;
        dy.expect_shape(&call.spec.output_shape(call.batch), "the block's output")?;
        match (call.device.clone(), call.dtype) {
            (Device::Cpu, DType::F32) => cpu_backward::<f32>(&call, &z, &dy, allocate),
            (Device::Cpu, DType::F64) => cpu_backward::<f64>(&call, &z, &dy, allocate),
            (Device::Cuda(index), _) => {
                z.expect_aligned()?;
                dy.expect_aligned()?;
                let g = gpu_call(&call, index, stream, allocate)?;
                // SAFETY: z and dy were checked as the other arguments were.
                let z_dev = unsafe { g.gpu.borrow_tensor(z.ptr, &z.shape) }.map_err(to_py)?;
                let dy_dev = unsafe { g.gpu.borrow_tensor(dy.ptr, &dy.shape) }.map_err(to_py)?;
                let grads = g.block.backward(&g.gpu, &g.x, Saved::kept_by_caller(z_dev), &dy_dev);
                // A backward that failed half way may leave side-stream buffers held.
                g.gpu.join_side().map_err(to_py)?;
                let grads = grads.map_err(to_py)?;
                let py = x.py();
                let specs = call.spec.param_specs();
                let dx = into_torch(py, grads.x, &call.x.shape)?;
                let p = grads.params;
                let dw = into_torch(py, p.linear_weight, &specs[0].shape)?;
                let db = into_torch(py, p.linear_bias, &specs[1].shape)?;
                let dparams = p
                    .ops
                    .into_iter()
                    .flatten()
                    .zip(&specs[2..])
                    .map(|(t, s)| into_torch(py, t, &s.shape))
                    .collect::<PyResult<Vec<_>>>()?;
                Ok((dx, dw, db, dparams))
            }
        }
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
        let gpu_width = match spec.chain.0.first() {
            Some(host::chain::Op::AvgPool(k)) => out_features / k,
            _ => out_features,
        };
        let owners = spec.chain.0.iter().enumerate().flat_map(|(i, op)| op.param_bases().iter().map(move |_| i));
        let params = spec.param_specs().into_iter().skip(2).zip(owners).map(|(s, i)| (s.name, s.shape, i)).collect();
        let ops = spec.chain.0.iter().map(|op| op.to_string()).collect();
        Ok((out, gpu_width, out_features, ops, params))
    })
}

type Description = (Vec<usize>, usize, usize, Vec<String>, Vec<(String, Vec<usize>, usize)>);

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
    m.add_function(wrap_pyfunction!(_raise_panic, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}

//! candle's CUDA tensors (feature `candle-cuda`): the block's GPU kernels on candle's
//! device and stream, reading candle's buffers where they lie and allocating every output
//! and workspace through candle's device, so that the outputs become candle storage as
//! they are (no copies; only the packed parameter gradient is assembled from the small
//! gradients, a few vectors). f32, bf16 and f16 tensors: a 16-bit model's `x`,
//! `lin.weight`, `y` and their gradients stay in its type (the bf16 blocks' kernels), the
//! packed parameters are f32 (candle widens them, and narrows their gradients back).
//!
//! Both sides' cudarc contexts are the device's primary context, so addresses pass from
//! one to the other; the host's `Gpu` is opened once per device (`Gpu::shared`) and runs
//! each call on candle's stream (`Gpu::on_stream`).

use super::{BlockOp, host_err, packed_offsets};
use crate::BlockSpec;
use crate::gpu::block::{DeviceParams, GpuBlock};
use crate::gpu::{DeviceAllocator, DeviceElement, DeviceTensor, ElementKind, Gpu};
use crate::tensor::{Bf16, F16};
use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::cuda::CudaDType;
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, DeviceLocation, Error, Layout, Result, Shape, Storage, Tensor};
use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr};
use std::any::Any;
use std::sync::Arc;

/// The host's `Gpu` on `dev`'s stream, allocating through `dev`.
fn gpu_on(dev: &CudaDevice) -> Result<Gpu> {
    let DeviceLocation::Cuda { gpu_id } = dev.location() else {
        return Err(Error::Msg("FusedLinear: not a CUDA device".into()));
    };
    let gpu = Gpu::shared(gpu_id).map_err(|e| host_err("opening the GPU", e))?;
    let stream = dev.cuda_stream();
    let allocator: Arc<dyn DeviceAllocator> = Arc::new(CandleAllocator { dev: dev.clone() });
    // SAFETY: candle's stream of this device, which candle keeps alive beyond the call.
    Ok(unsafe { gpu.on_stream(stream.cu_stream() as u64, Some(allocator)) })
}

/// Device memory from candle's device: a `CudaSlice` the returned handle owns, which
/// becomes candle storage as it is.
struct CandleAllocator {
    dev: CudaDevice,
}

impl CandleAllocator {
    /// `n` values of `T` from candle's device: their address and the slice that owns them.
    fn alloc<T: DeviceRepr + Send + Sync + 'static>(
        &self,
        n: usize,
    ) -> crate::Result<(u64, Box<dyn Any + Send + Sync>)> {
        // SAFETY: the caller writes the memory before reading it.
        let s = unsafe { self.dev.alloc::<T>(n) }
            .map_err(|e| crate::Error::cuda("allocating through candle's device", e))?;
        let ptr = s.device_ptr(&self.dev.cuda_stream()).0;
        Ok((ptr, Box::new(s)))
    }
}

impl DeviceAllocator for CandleAllocator {
    fn allocate(&self, shape: &[usize], element: ElementKind) -> crate::Result<(u64, Box<dyn Any + Send + Sync>)> {
        let n: usize = shape.iter().product::<usize>().max(1);
        match element {
            ElementKind::F32 => self.alloc::<f32>(n),
            ElementKind::Bf16 => self.alloc::<half::bf16>(n),
            ElementKind::F16 => self.alloc::<half::f16>(n),
            ElementKind::Bytes => self.alloc::<u8>(n),
        }
    }
}

/// The contiguous tensor `s` as laid out by `l`, of candle's element `C` (the host's `T`),
/// borrowed (16-byte aligned, as the kernels read rows).
fn borrowed<T: DeviceElement, C: CudaDType + DeviceRepr>(
    gpu: &Gpu,
    name: &str,
    s: &CudaStorage,
    l: &Layout,
) -> Result<DeviceTensor<T>> {
    let slice = s
        .as_cuda_slice::<C>()
        .map_err(|_| Error::Msg(format!("FusedLinear: {name} has dtype {:?}, expected {:?}", s.dtype(), T::DTYPE)))?;
    let Some((start, end)) = l.contiguous_offsets() else {
        return Err(Error::Msg(format!("FusedLinear: {name} is not contiguous")));
    };
    let stream = s.device().cuda_stream();
    let ptr = slice.device_ptr(&stream).0 + (start * std::mem::size_of::<C>()) as u64;
    if !ptr.is_multiple_of(16) || end - start != l.shape().elem_count() {
        return Err(Error::Msg(format!("FusedLinear: {name} does not start at a 16-byte boundary (a narrowed view?)")));
    }
    // SAFETY: `end - start` values of candle's buffer on this device, held by the caller's
    // tensor for the call.
    unsafe { gpu.borrow_tensor::<T>(ptr, l.dims()) }.map_err(|e| host_err(name, e))
}

/// The block's parameters on the GPU: `w`, and the others inside `packed` (as
/// [`packed_offsets`] lays them out), borrowed.
fn device_params<W>(gpu: &Gpu, spec: &BlockSpec, w: DeviceTensor<W>, packed: &DeviceTensor) -> Result<DeviceParams<W>> {
    let (starts, len) = packed_offsets(spec);
    if packed.len() != len {
        return Err(Error::Msg(format!("FusedLinear: {} packed values, the block needs {len}", packed.len())));
    }
    let base = packed.buf.device_address();
    let mut flat = Vec::new();
    for (p, &at) in spec.param_specs()[1..].iter().zip(&starts) {
        // SAFETY: inside `packed` (its length checked), 16-byte aligned (`at` is a
        // multiple of 4 values), held by the caller for the call.
        flat.push(
            unsafe { gpu.borrow_tensor::<f32>(base + (at * 4) as u64, &p.shape) }.map_err(|e| host_err(&p.name, e))?,
        );
    }
    let mut flat = flat.into_iter();
    let linear_bias = flat.next().expect("a block has a Linear bias");
    let ops = spec
        .chain
        .0
        .iter()
        .map(|op| op.param_bases().iter().map(|_| flat.next().expect("one per parameter")).collect())
        .collect();
    Ok(DeviceParams { linear_weight: w, linear_bias, ops })
}

/// A tensor the allocator made, as candle storage of its element `C`.
fn into_storage<T, C: CudaDType + 'static>(t: DeviceTensor<T>, dev: &CudaDevice) -> Result<CudaStorage> {
    let keep =
        t.buf.into_external().ok_or_else(|| Error::Msg("FusedLinear: an output not from candle's device".into()))?;
    let slice = keep
        .downcast::<CudaSlice<C>>()
        .map_err(|_| Error::Msg("FusedLinear: an output of another element type than its tensor's".into()))?;
    Ok(CudaStorage::wrap_cuda_slice(*slice, dev.clone()))
}

fn into_tensor<T, C: CudaDType + 'static>(t: DeviceTensor<T>, dims: &[usize], dev: &CudaDevice) -> Result<Tensor> {
    let storage = into_storage::<T, C>(t, dev)?;
    Ok(Tensor::from_storage(Storage::Cuda(storage), dims.to_vec(), BackpropOp::none(), false))
}

/// The packed parameters' gradient `(len)`: the bias's and the chain parameters' FP32
/// gradients (`small`, in [`BlockSpec::param_specs`] order) at their places, zeros in the
/// padding.
fn packed_gradient<'a>(
    gpu: &Gpu,
    dev: &CudaDevice,
    spec: &BlockSpec,
    small: impl Iterator<Item = &'a DeviceTensor>,
    dims: &[usize],
) -> Result<Tensor> {
    let (starts, len) = packed_offsets(spec);
    let dp = dev.alloc_zeros::<f32>(len)?;
    let base = dp.device_ptr(&dev.cuda_stream()).0;
    for (g, &at) in small.zip(&starts) {
        // (Raw addresses: the two buffers belong to different cudarc context objects of the
        // one primary context.)
        // SAFETY: `g.len()` floats from a gradient into `dp`'s range at `at` (`packed_offsets`
        // sized `dp` for every parameter), queued on the stream that made both.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                base + (at * 4) as u64,
                g.buf.device_address(),
                g.len() * 4,
                gpu.stream().cu_stream(),
            )
        }
        .map_err(|e| host_err("packing the gradients", crate::Error::cuda("a device copy", e)))?;
    }
    Ok(Tensor::from_storage(
        Storage::Cuda(CudaStorage::wrap_cuda_slice(dp, dev.clone())),
        dims.to_vec(),
        BackpropOp::none(),
        false,
    ))
}

/// The op's forward and backward for one element type: `$w` the host's (its block type
/// `GpuBlock<$w>`), `$c` candle's. (A macro: the FP32 and the 16-bit blocks have the same
/// calls in two impls.)
macro_rules! typed {
    ($forward:ident, $backward:ident, $w:ty, $c:ty) => {
        /// The op's forward on candle's CUDA storage: `(x, lin.weight, packed) -> y`.
        fn $forward(
            op: &BlockOp,
            (s1, l1): (&CudaStorage, &Layout),
            (s2, l2): (&CudaStorage, &Layout),
            (s3, l3): (&CudaStorage, &Layout),
        ) -> Result<(CudaStorage, Shape)> {
            let dev = s1.device().clone();
            let gpu = gpu_on(&dev)?;
            let x = borrowed::<$w, $c>(&gpu, "x", s1, l1)?;
            let w = borrowed::<$w, $c>(&gpu, "lin.weight", s2, l2)?;
            let packed = borrowed::<f32, f32>(&gpu, "the packed parameters", s3, l3)?;
            let params = device_params(&gpu, &op.spec, w, &packed)?;
            let block = GpuBlock::<$w>::from_device_in(&gpu, &op.spec, params, op.precision)
                .map_err(|e| host_err("block", e))?;
            let batch = x.shape[0];
            let y = if op.train {
                let (y, saved) = block.forward_train(&gpu, &x, false).map_err(|e| host_err("forward", e))?;
                *op.saved.lock().unwrap_or_else(|p| p.into_inner()) = Some(saved);
                y
            } else {
                let mut ws = block.workspace_with(&gpu, batch, false).map_err(|e| host_err("workspace", e))?;
                block.forward_into(&gpu, &x, &mut ws, None).map_err(|e| host_err("forward", e))?;
                ws.y
            };
            let shape = Shape::from(op.spec.output_shape(batch));
            Ok((into_storage::<$w, $c>(y, &dev)?, shape))
        }

        /// The op's backward on candle's CUDA tensors (contiguous): the fused backward
        /// from the state the forward kept (or, when it kept none, the forward again);
        /// `(dx, dW, packed gradient)`, without `dx` (nor its GEMM) where `x` tracks no
        /// gradient.
        fn $backward(
            op: &BlockOp,
            x: &Tensor,
            w: &Tensor,
            packed: &Tensor,
            dy: &Tensor,
        ) -> Result<(Option<Tensor>, Tensor, Tensor)> {
            let (xs, xl) = x.storage_and_layout();
            let (ws_, wl) = w.storage_and_layout();
            let (ps, pl) = packed.storage_and_layout();
            let (ds, dl) = dy.storage_and_layout();
            let (Storage::Cuda(xs), Storage::Cuda(ws_), Storage::Cuda(ps), Storage::Cuda(ds)) =
                (&*xs, &*ws_, &*ps, &*ds)
            else {
                return Err(Error::Msg("FusedLinear: the backward's tensors are not all on the CUDA device".into()));
            };
            let dev = xs.device().clone();
            let gpu = gpu_on(&dev)?;
            let xd = borrowed::<$w, $c>(&gpu, "x", xs, xl)?;
            let wd = borrowed::<$w, $c>(&gpu, "lin.weight", ws_, wl)?;
            let pd = borrowed::<f32, f32>(&gpu, "the packed parameters", ps, pl)?;
            let dyd = borrowed::<$w, $c>(&gpu, "dy", ds, dl)?;
            let params = device_params(&gpu, &op.spec, wd, &pd)?;
            let block = GpuBlock::<$w>::from_device_in(&gpu, &op.spec, params, op.precision)
                .map_err(|e| host_err("block", e))?
                .with_input_grad(x.track_op());
            let kept = op.saved.lock().unwrap_or_else(|p| p.into_inner()).take();
            let saved = match kept {
                Some(saved) => saved,
                None => block.forward_train(&gpu, &xd, false).map_err(|e| host_err("forward", e))?.1,
            };
            let (outs, small) = block.small_grads_by_backward(&gpu).map_err(|e| host_err("backward", e))?;
            let grads = block.backward_parts(&gpu, &xd, saved, &dyd, None, outs.as_ref(), small);
            // A backward that failed half way may leave side-stream buffers held.
            gpu.join_side().map_err(|e| host_err("backward", e))?;
            let (dx, dw, (db, ops)) = grads.map_err(|e| host_err("backward", e))?;
            let small = std::iter::once(&db).chain(ops.iter().flatten());
            let dp = packed_gradient(&gpu, &dev, &op.spec, small, packed.dims())?;
            let dx = dx.map(|dx| into_tensor::<$w, $c>(dx, x.dims(), &dev)).transpose()?;
            let dw = into_tensor::<$w, $c>(dw, w.dims(), &dev)?;
            Ok((dx, dw, dp))
        }
    };
}

typed!(forward_f32, backward_f32, f32, f32);
typed!(forward_bf16, backward_bf16, Bf16, half::bf16);
typed!(forward_f16, backward_f16, F16, half::f16);

/// The op's forward on candle's CUDA storage, in `x`'s element type.
pub(super) fn forward(
    op: &BlockOp,
    a1: (&CudaStorage, &Layout),
    a2: (&CudaStorage, &Layout),
    a3: (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Shape)> {
    match a1.0.dtype() {
        DType::F32 => forward_f32(op, a1, a2, a3),
        DType::BF16 => forward_bf16(op, a1, a2, a3),
        DType::F16 => forward_f16(op, a1, a2, a3),
        other => Err(Error::Msg(format!("FusedLinear: x has dtype {other:?} (f32, bf16 or f16 on CUDA)"))),
    }
}

/// The op's backward on candle's CUDA tensors, in `x`'s element type.
pub(super) fn backward(
    op: &BlockOp,
    x: &Tensor,
    w: &Tensor,
    packed: &Tensor,
    dy: &Tensor,
) -> Result<(Option<Tensor>, Tensor, Tensor)> {
    match x.dtype() {
        DType::F32 => backward_f32(op, x, w, packed, dy),
        DType::BF16 => backward_bf16(op, x, w, packed, dy),
        DType::F16 => backward_f16(op, x, w, packed, dy),
        other => Err(Error::Msg(format!("FusedLinear: x has dtype {other:?} (f32, bf16 or f16 on CUDA)"))),
    }
}

//! Launcher of the persistent, TMA-fed GEMMs (kernels-gpu/src/gemm/tma/): the TF32,
//! 3xTF32 and bf16 forwards `gemm_tma_{tf32,tf32x3,bf16}_nt` and the TF32 and 3xTF32
//! backward `gemm_tma_{tf32,tf32x3}_tk{,_t}`. Their two tensor maps (the TMA unit's
//! description of each operand: base, sizes, row pitch, box, swizzle) are encoded here
//! and uploaded beside the launch; what each kernel's maps look like follows from the
//! kernel the dispatch chose.

use super::super::dispatch::{Layout, Route};
use super::super::elementwise::slice_to_half;
use super::super::epilogue::{DeviceChain, Widened, widen_params};
use super::super::{DeviceElement, DeviceTensor, Dtype, Gpu, HalfElement, Table, VectorArg};
use super::args::{EpilogueArgs, Operands};
use crate::error::{Error, Result};
use crate::tensor::{Bf16, F16};
use cudarc::driver::sys::{self, CUtensorMap};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use kernel_abi::Kernel;
use kernel_abi::fp8::E4M3_BLOCK_K;
use kernel_abi::gemm_tma::{
    BF16_BLOCK_K, BF16_OUT_SMEM_BYTES, BLOCK_K, BLOCK_M, BLOCK_N, SMEM_BYTES, SPLIT_BLOCK_K, SPLIT_SMEM_BYTES, THREADS,
};
use std::sync::Arc;

/// The arithmetic of a TMA kernel, which shapes its tensor maps and stages.
#[derive(Clone, Copy, PartialEq)]
enum Arith {
    /// 32-deep stages, the 128-byte swizzle.
    Tf32,
    /// 16-deep stages beside their residuals, the 64-byte swizzle.
    Tf32x3,
    /// bf16 copies of the operands, 64-deep stages of the same 128-byte rows.
    Bf16,
    /// fp16 copies, as bf16's.
    F16,
    /// e4m3 operands (quantised by [`super::fp8`]), 128-deep stages of the same rows.
    E4m3,
}

/// The forward kernels: `Nt`, both operands `k`-contiguous.
fn forward_arith(kernel: Kernel) -> Result<Arith> {
    match kernel {
        Kernel::GemmTmaTf32Nt => Ok(Arith::Tf32),
        Kernel::GemmTmaTf32x3Nt => Ok(Arith::Tf32x3),
        Kernel::GemmTmaBf16Nt => Ok(Arith::Bf16),
        Kernel::GemmTmaF16Nt => Ok(Arith::F16),
        _ => Err(Error::Unsupported(format!("`{kernel}` is not a TMA forward GEMM"))),
    }
}

/// The `Tk` kernels (`A` stored transposed; the `_t` ones store `y^T`).
fn tk_arith(kernel: Kernel) -> Result<Arith> {
    match kernel {
        Kernel::GemmTmaTf32Tk | Kernel::GemmTmaTf32TkT => Ok(Arith::Tf32),
        Kernel::GemmTmaTf32x3Tk | Kernel::GemmTmaTf32x3TkT => Ok(Arith::Tf32x3),
        _ => Err(Error::Unsupported(format!("`{kernel}` is not a TMA `Tk` GEMM"))),
    }
}

/// A tensor map for the `(rows, k)` row-major `f32` matrix at `buf` (row pitch `pitch`
/// floats), read in boxes of `box_rows x BLOCK_K` with the 128-byte swizzle (3xTF32:
/// `box_rows x SPLIT_BLOCK_K` with the 64-byte swizzle), zeros
/// outside.
fn tensor_map(
    stream: &CudaStream,
    buf: &CudaSlice<f32>,
    (rows, k, pitch): (usize, usize, usize),
    box_rows: usize,
    arith: Arith,
) -> Result<CUtensorMap> {
    let (box_k, swizzle) = if arith == Arith::Tf32x3 {
        (SPLIT_BLOCK_K, sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_64B)
    } else {
        (BLOCK_K, sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B)
    };
    encode_map(stream, buf, (rows, k, pitch), (box_rows, box_k), swizzle)
}

/// The tensor map of a `(rows, cols)` row-major `f32` matrix (row pitch `pitch` floats)
/// read in `box_rows x box_cols` boxes with `swizzle`, zeros outside.
fn encode_map(
    stream: &CudaStream,
    buf: &CudaSlice<f32>,
    shape: (usize, usize, usize),
    boxes: (usize, usize),
    swizzle: sys::CUtensorMapSwizzle,
) -> Result<CUtensorMap> {
    encode_map_typed(buf.device_ptr(stream).0, Dtype::F32, shape, boxes, swizzle)
}

/// [`encode_map`] for the matrix at device address `ptr` of `dtype`.
fn encode_map_typed(
    ptr: u64,
    dtype: Dtype,
    shape: (usize, usize, usize),
    boxes: (usize, usize),
    swizzle: sys::CUtensorMapSwizzle,
) -> Result<CUtensorMap> {
    let data_type = match dtype {
        Dtype::Bf16 => (sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2),
        Dtype::F16 => (sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2),
        Dtype::F32 => (sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4),
    };
    encode_map_raw(ptr, data_type, shape, boxes, swizzle)
}

/// [`encode_map_typed`] for elements of the TMA unit's `data_type` of `elem_bytes`.
fn encode_map_raw(
    ptr: u64,
    (data_type, elem_bytes): (sys::CUtensorMapDataType, usize),
    (rows, k, pitch): (usize, usize, usize),
    (box_rows, box_k): (usize, usize),
    swizzle: sys::CUtensorMapSwizzle,
) -> Result<CUtensorMap> {
    let mut map = CUtensorMap { opaque: [0; 16] };
    let dims = [k as u64, rows as u64];
    let boxes = [box_k as u32, box_rows as u32];
    let steps = [1u32, 1];
    let pitch = [(pitch * elem_bytes) as u64];
    // SAFETY: every array has the rank's length (2; the pitch 1); `map` is writable
    // and 64-byte aligned; the driver only encodes (nothing is read from `ptr`).
    let result = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            data_type,
            2,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            pitch.as_ptr(),
            boxes.as_ptr(),
            steps.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if result != sys::CUresult::CUDA_SUCCESS {
        return Err(Error::Unsupported(format!(
            "the TMA unit cannot describe a ({rows}, {k}) operand: cuTensorMapEncodeTiled returned {result:?}"
        )));
    }
    Ok(map)
}

/// The layout a 16-bit kernel of `H` reads (`None`: not one of `H`'s kernels).
fn half_layout<H: HalfElement>(kernel: Kernel) -> Option<Layout> {
    let h = H::KERNELS;
    match kernel {
        _ if [h.tma_nt, h.tma_nt_split, h.tma_nt_to_half].contains(&kernel) => Some(Layout::Nt),
        _ if kernel == h.tma_nn_to_half || kernel == h.tma_nn => Some(Layout::Nn),
        _ if kernel == h.tma_tn || kernel == h.tma_tn_to_half => Some(Layout::Tn),
        _ => None,
    }
}

/// Whether `kernel` stores a 16-bit `y` through the TMA unit: its table holds a third
/// map (of `y`), and it stages half tiles in more shared memory.
fn stores_by_tma(kernel: Kernel) -> bool {
    [Kernel::GemmTmaE4m3NtToBf16, Kernel::GemmTmaE4m3NtToF16].contains(&kernel)
        || [&super::super::dispatch::HalfKernels::BF16, &super::super::dispatch::HalfKernels::F16]
            .iter()
            .any(|h| [h.tma_nt_to_half, h.tma_nn_to_half, h.tma_tn_to_half].contains(&kernel))
}

/// What every launch of the persistent kernels needs: the tensor maps uploaded
/// (freed in stream order after the kernel: cudarc frees asynchronously on `stream`),
/// the function with its shared memory allowed, and `min(units, SMs)` blocks (a unit:
/// a tile, or with split-K one of its `k` ranges).
struct Persistent {
    maps: Table,
    func: CudaFunction,
    cfg: LaunchConfig,
}

/// [`Persistent`] for `kernel` of `arith` over an `(m, n)` output.
fn persistent(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    kernel: Kernel,
    arith: Arith,
    maps: &[CUtensorMap],
    (m, n): (usize, usize),
    splits: usize,
) -> Result<Persistent> {
    let words: Vec<u64> = maps.iter().flat_map(|map| map.opaque).collect();
    let maps = gpu.words(stream, &words)?;
    let smem_bytes = match arith {
        _ if stores_by_tma(kernel) => BF16_OUT_SMEM_BYTES,
        Arith::Tf32x3 => SPLIT_SMEM_BYTES,
        Arith::Tf32 | Arith::Bf16 | Arith::F16 | Arith::E4m3 => SMEM_BYTES,
    };
    let func = gpu.function(kernel)?;
    gpu.allow_shared(&func, kernel, smem_bytes)?;
    let units = m.div_ceil(BLOCK_M) * n.div_ceil(BLOCK_N) * splits;
    let cfg = LaunchConfig {
        grid_dim: (units.min(gpu.props.multiprocessors) as u32, 1, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: smem_bytes as u32,
    };
    Ok(Persistent { maps, func, cfg })
}

/// Queues `route`'s forward kernel (`gemm_tma_{tf32,tf32x3,bf16}_nt`): `y (m, n) = chain(x
/// W^T + bias)` with `x (m, k)` in `op.a` and `W (n, k)` in `op.b`, both `k`-contiguous
/// (row pitches `op.lda`, `op.ldb`), or with `op.splits > 1` the split-K partial products
/// into `y (splits, m, n)`. The bf16 kernel reads bf16 copies of both, rounded
/// here first (freed in stream order after the GEMM). The caller has checked shapes and
/// extents, and that the pitches suit the kernel (16 bytes of its operands' elements).
pub fn launch_forward(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    route: &Route,
    op: &Operands,
    y: &mut DeviceTensor,
    save_z: Option<&mut DeviceTensor>,
) -> Result<()> {
    let (m, n, k, lda, ldb, kernel) = (op.m, op.n, op.k, op.lda, op.ldb, route.kernel);
    let arith = forward_arith(kernel)?;
    if arith == Arith::Bf16 {
        let (a16, b16) = (slice_to_half::<Bf16>(gpu, stream, op.a)?, slice_to_half::<Bf16>(gpu, stream, op.b)?);
        let (ab, dims, lds) = ((&*a16, &*b16), (m, n, k), (lda, ldb));
        return launch_half(gpu, stream, route, ab, dims, lds, (op.bias, op.chain), y, save_z, op.splits);
    }
    if arith == Arith::F16 {
        let (a16, b16) = (slice_to_half::<F16>(gpu, stream, op.a)?, slice_to_half::<F16>(gpu, stream, op.b)?);
        let (ab, dims, lds) = ((&*a16, &*b16), (m, n, k), (lda, ldb));
        return launch_half(gpu, stream, route, ab, dims, lds, (op.bias, op.chain), y, save_z, op.splits);
    }
    let maps = [
        tensor_map(stream, op.a, (m, k, lda), BLOCK_M, arith)?,
        tensor_map(stream, op.b, (n, k, ldb), BLOCK_N, arith)?,
    ];
    let splits = op.splits.max(1);
    launch_with_maps(gpu, stream, kernel, arith, &maps, (m, n, k, splits), op.bias, op.chain, y, save_z, None)
}

/// Launches the forward-signature `kernel` (`y` of type `O`) over its tensor maps, its
/// `k` in `splits` ranges (kernels-gpu's `gemm::tma::forward`): then `y` is FP32
/// `(splits, m, n)`, each range's raw sums in its slice, with no bias, chain or saved `z`.
#[allow(clippy::too_many_arguments)]
fn launch_with_maps<O: DeviceElement>(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    kernel: Kernel,
    arith: Arith,
    maps: &[CUtensorMap],
    (m, n, k, splits): (usize, usize, usize, usize),
    bias: Option<VectorArg<'_>>,
    chain: Option<&DeviceChain>,
    y: &mut DeviceTensor<O>,
    save_z: Option<&mut DeviceTensor>,
    scales: Option<(&CudaSlice<f32>, &CudaSlice<f32>)>,
) -> Result<()> {
    let split_k = kernel_abi::gemm_tma::SPLIT_K_KERNELS.contains(&kernel);
    if splits > 1 && (!split_k || bias.is_some() || chain.is_some() || save_z.is_some()) {
        return Err(Error::Unsupported(format!(
            "`{kernel}` split {splits} ways: only the bf16, fp16 and 3xTF32 forwards and the 16-bit `dX` \
             split, into raw FP32 partial products (no bias, chain or saved `z`)"
        )));
    }
    // A chain ending in a row reduction: row partials into an FP32 `y` (`Plan::RowPartials`).
    let partials = chain.and_then(|c| c.reduction()).is_some();
    if partials && (O::DTYPE != Dtype::F32 || matches!(arith, Arith::E4m3 | Arith::Tf32x3) || splits > 1) {
        return Err(Error::Unsupported(format!(
            "`{kernel}` ends no chain in a row reduction (that takes an unsplit FP32-output forward, not \
             3xTF32's, which adds its runs of `k` up in `y`)"
        )));
    }
    let want = match (partials, splits > 1) {
        (true, _) => vec![kernel_abi::epilogue::row_partials(n), m, 2],
        (false, true) => vec![splits, m, n],
        (false, false) => vec![m, n],
    };
    if y.shape != want || splits * m * n > u32::MAX as usize {
        return Err(Error::Shape(format!(
            "`{kernel}`'s output must be {want:?} (at most 2^32 values), got {:?}",
            y.shape
        )));
    }
    // The epilogue reads FP32 vectors only (`fragments`): a 16-bit model's bias and chain
    // parameters are widened first, by one launch (on the main stream, where the
    // forward runs).
    let widened = widen_params(gpu, chain, n, bias)?;
    if widened.is_some() && !Arc::ptr_eq(stream, gpu.stream()) {
        return Err(Error::Unsupported(format!("`{kernel}` with 16-bit parameter vectors off the main stream")));
    }
    let chain = chain.map(|c| Widened::chain(&widened, c));
    let bias_word = widened.as_ref().and_then(|w| w.bias);
    let bias = bias.map(|b| bias_word.map_or(b, |word| b.read_from(word)));
    let Persistent { maps, func, cfg } = persistent(gpu, stream, kernel, arith, maps, (m, n), splits)?;
    let tail = EpilogueArgs::new(&[m, n, k], bias, chain);
    let splits32 = splits as u32;
    let mut launch = stream.launch_builder(&func);
    launch.arg(&maps);
    tail.push(&mut launch, y, save_z, chain);
    launch.arg(&splits32);
    if let Some((rows, cols)) = scales {
        launch.arg(rows).arg(cols);
    }
    // SAFETY: matches the kernel's signature; the maps describe `a` and `b` within the
    // extents the caller checked; grid, block and shared memory follow kernel_abi::gemm_tma.
    unsafe { launch.launch(cfg) }.map_err(|e| Error::cuda(format!("launching `{kernel}`"), e))?;
    Ok(())
}

/// Queues the `Tk` `kernel` (`gemm_tma_{tf32,tf32x3}_tk{,_t}`): `y (m, n) = A B^T` (or,
/// for the `_t` kernels, `y^T (n, m)`), `A` stored as `(k, m)` (`m`-contiguous, pitch
/// `op.lda`) and `B` as `(n, k)` (pitch `op.ldb`); no bias, chain or saved output. The
/// caller has checked shapes, extents and pitches.
pub fn launch_tk(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    kernel: Kernel,
    op: &Operands,
    y: &mut DeviceTensor,
) -> Result<()> {
    let arith = tk_arith(kernel)?;
    if op.bias.is_some() || op.chain.is_some() {
        return Err(Error::Unsupported(format!("`{kernel}` takes no bias or chain")));
    }
    let (m, n, k) = (op.m, op.n, op.k);
    let block_k = if arith == Arith::Tf32x3 { SPLIT_BLOCK_K } else { BLOCK_K };
    let swizzle = sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B;
    // `A` in boxes of one stage's `k` rows x 32 `m` (one 128-byte swizzle row), four
    // per tile; `B` as in the forward.
    let maps = [
        encode_map(stream, op.a, (k, m, op.lda), (block_k, 32), swizzle)?,
        tensor_map(stream, op.b, (n, k, op.ldb), BLOCK_N, arith)?,
    ];
    let Persistent { maps, func, cfg } = persistent(gpu, stream, kernel, arith, &maps, (m, n), 1)?;
    let (m32, n32, k32) = (m as u32, n as u32, k as u32);
    let mut launch = stream.launch_builder(&func);
    launch.arg(&maps).arg(&mut y.buf).arg(&m32).arg(&n32).arg(&k32);
    // SAFETY: matches the kernel's signature; the maps describe `a` and `b` within the
    // extents the caller checked; `y` holds `m n` floats; grid, block and shared memory
    // follow kernel_abi::gemm_tma.
    unsafe { launch.launch(cfg) }.map_err(|e| Error::cuda(format!("launching `{kernel}`"), e))?;
    Ok(())
}

/// Queues `route`'s 16-bit TMA kernel (see `kernels-gpu/src/gemm/tma/forward.rs`) on
/// tensors of `H`: `y (m, n)` (`H` or FP32, as the kernel writes, in `O`) from `a` and `b`, in
/// the route's layout (`Nt`: `A (m, k)`, `B (n, k)`; `Nn`: `B (k, n)`; `Tn`: `A (k, m)`
/// too), with pitches `lda`, `ldb` (elements) and depth `k`; the forward (`Nt`) with
/// its bias, chain and saved `z`, or split `splits` ways into FP32 `y (splits, m, n)`.
#[allow(clippy::too_many_arguments)]
pub fn launch_half<H: HalfElement, O: DeviceElement>(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    route: &Route,
    (a, b): (&CudaSlice<H>, &CudaSlice<H>),
    (m, n, k): (usize, usize, usize),
    (lda, ldb): (usize, usize),
    (bias, chain): (Option<VectorArg<'_>>, Option<&DeviceChain>),
    y: &mut DeviceTensor<O>,
    save_z: Option<&mut DeviceTensor>,
    splits: usize,
) -> Result<()> {
    let (kernel, splits) = (route.kernel, splits.max(1));
    let half_out = O::DTYPE == H::DTYPE;
    if half_layout::<H>(kernel) != Some(route.layout) || stores_by_tma(kernel) != half_out {
        return Err(Error::Unsupported(format!(
            "`{kernel}` is no {} {:?} kernel writing {}",
            H::NAME,
            route.layout,
            O::NAME
        )));
    }
    // Extents: `A` is (m, k) or, MN-major, (k, m); `B` (n, k) or (k, n).
    let (a_rows, a_cols, b_rows, b_cols) = match route.layout {
        Layout::Nt => (m, k, n, k),
        Layout::Nn => (m, k, k, n),
        Layout::Tn | Layout::Tk => (k, m, k, n),
    };
    let fits = |len: usize, rows: usize, cols: usize, pitch: usize| pitch >= cols && len >= (rows - 1) * pitch + cols;
    if [m, n, k].contains(&0)
        || !lda.is_multiple_of(8)
        || !ldb.is_multiple_of(8)
        || !fits(a.len(), a_rows, a_cols, lda)
        || !fits(b.len(), b_rows, b_cols, ldb)
        || save_z.as_ref().is_some_and(|z| z.shape != [m, n])
    {
        return Err(Error::Shape(format!(
            "16-bit GEMM `{kernel}` ({m}, {n}, {k}): operands of {} and {} values at pitches {lda}, {ldb}, output {:?}",
            a.len(),
            b.len(),
            y.shape
        )));
    }
    if route.layout != Layout::Nt && (bias.is_some() || chain.is_some() || save_z.is_some()) {
        return Err(Error::Unsupported(format!("`{kernel}` takes no bias, chain or saved output")));
    }
    if [m, n, k, lda, ldb, a.len(), b.len()].iter().any(|&d| d > u32::MAX as usize) {
        return Err(Error::Shape(format!("16-bit GEMM ({m}, {n}, {k}) exceeds the kernel's 32-bit arguments")));
    }
    let swizzle = sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B;
    let (pa, pb) = (a.device_ptr(stream).0, b.device_ptr(stream).0);
    // `k`-major: boxes of a tile's rows x 64 of `k`; MN-major: 64 of `k` x 64 of M or N
    // (one 128-byte swizzle row), several per tile.
    let k_major = |ptr, rows, pitch, box_rows| {
        encode_map_typed(ptr, H::DTYPE, (rows, k, pitch), (box_rows, BF16_BLOCK_K), swizzle)
    };
    let mn_major = |ptr, cols, pitch| encode_map_typed(ptr, H::DTYPE, (k, cols, pitch), (BF16_BLOCK_K, 64), swizzle);
    let mut maps = match route.layout {
        Layout::Nt => vec![k_major(pa, m, lda, BLOCK_M)?, k_major(pb, n, ldb, BLOCK_N)?],
        Layout::Nn => vec![k_major(pa, m, lda, BLOCK_M)?, mn_major(pb, n, ldb)?],
        Layout::Tn | Layout::Tk => vec![mn_major(pa, m, lda)?, mn_major(pb, n, ldb)?],
    };
    if stores_by_tma(kernel) {
        // `y` in `64 x 64` boxes, the halves of a warpgroup's staged half tile.
        let py = y.buf.device_address();
        if !(n.is_multiple_of(8) && py.is_multiple_of(16)) {
            return Err(Error::Unsupported(format!(
                "`{kernel}` stores a 16-bit `y` of {n} columns by TMA: it needs a multiple of 8 columns and a 16-byte aligned start"
            )));
        }
        maps.push(encode_map_typed(py, H::DTYPE, (m, n, n), (64, 64), swizzle)?);
    }
    // Split, the forward runs its twin that walks ranges of `k` (and runs no chain).
    let kernel = super::super::dispatch::split_kernel(kernel, splits);
    launch_with_maps(gpu, stream, kernel, Arith::Bf16, &maps, (m, n, k, splits), bias, chain, y, save_z, None)
}

/// Queues `gemm_tma_e4m3_nt` (FP32 `y`) or `gemm_tma_e4m3_nt_to_{bf16,f16}` (16-bit `y`,
/// stored through a third map): `y (m, n) = chain(unscale(A B^T) + bias)` over the e4m3
/// matrices `a (m, k)` and `b (n, k)` (depth: their common pitch), the scales undone in
/// the epilogue; `save_z` as in the other forwards.
pub fn launch_e4m3<O: DeviceElement>(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    a: &super::fp8::Fp8Matrix,
    b: &super::fp8::Fp8Matrix,
    (bias, chain): (Option<VectorArg<'_>>, Option<&DeviceChain>),
    y: &mut DeviceTensor<O>,
    save_z: Option<&mut DeviceTensor>,
) -> Result<()> {
    let kernel = match O::DTYPE {
        Dtype::F32 => Kernel::GemmTmaE4m3Nt,
        Dtype::Bf16 => Kernel::GemmTmaE4m3NtToBf16,
        Dtype::F16 => Kernel::GemmTmaE4m3NtToF16,
    };
    let (m, n, k) = (a.rows, b.rows, a.pitch);
    if y.shape != [m, n] || save_z.as_ref().is_some_and(|z| z.shape != [m, n]) || [m, n, k].contains(&0) {
        return Err(Error::Shape(format!("fp8 GEMM ({m}, {n}, {k}): output {:?}", y.shape)));
    }
    if [m, n, k, m * k, n * k].iter().any(|&d| d > u32::MAX as usize) {
        return Err(Error::Shape(format!("fp8 GEMM ({m}, {n}, {k}) exceeds the kernel's 32-bit arguments")));
    }
    let swizzle = sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B;
    let bytes = (sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8, 1);
    let map = |m: &super::fp8::Fp8Matrix, box_rows| {
        encode_map_raw(m.values.device_address(), bytes, (m.rows, k, k), (box_rows, E4M3_BLOCK_K), swizzle)
    };
    let mut maps = vec![map(a, BLOCK_M)?, map(b, BLOCK_N)?];
    if stores_by_tma(kernel) {
        let py = y.buf.device_address();
        if !(n.is_multiple_of(8) && py.is_multiple_of(16)) {
            return Err(Error::Unsupported(format!(
                "`{kernel}` stores a bf16 `y` of {n} columns by TMA: it needs a multiple of 8 columns and a 16-byte aligned start"
            )));
        }
        maps.push(encode_map_typed(py, O::DTYPE, (m, n, n), (64, 64), swizzle)?);
    }
    let scales = Some((&*a.inv_scales, &*b.inv_scales));
    launch_with_maps(gpu, stream, kernel, Arith::E4m3, &maps, (m, n, k, 1), bias, chain, y, save_z, scales)
}

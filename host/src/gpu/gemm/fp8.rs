//! The FP8 GEMMs of a Linear layer (`Precision::Fp8`, `Precision::Fp8GwBf16`): each
//! operand quantised to e4m3 on the GPU, scaled by a power of two along the dimension
//! its product keeps (kernels-gpu/src/fp8.rs, the CPU emulation's recipe in
//! `crate::fp8`), then `gemm_tma_e4m3_*` with the scales undone in its epilogue.
//!
//! FP8 `wgmma` reads `k`-major operands only, so every operand is quantised into a
//! `k`-contiguous copy: the forward's `x` and `W` by rows as stored; `dX = dZ W` takes
//! the forward's quantised `W` transposed (the same bytes), its per-output-channel scales
//! moved onto `dZ`'s columns before `dZ` is quantised by rows ([`Fp8Weight`]); `dW =
//! dZ^T X` takes `dZ^T` and `X^T` (scaled per output and input feature), both
//! transposed, their depth (the batch) padded with zeros to a multiple of 16.

use super::super::epilogue::DeviceChain;
use super::super::{DeviceBuf, DeviceElement, DeviceTensor, Dtype, Gpu, VectorArg, launched};
use crate::error::{Error, Result};
use cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg};
use kernel_abi::Kernel;
use kernel_abi::fp8::{
    COLUMN_AMAX_COLS, COLUMN_AMAX_SMEM_BYTES, COLUMN_BLOCK_ROWS, ROW_SMEM_BYTES, ROW_THREADS, TILE, TILE_SMEM_BYTES,
};
use std::sync::Arc;

/// A matrix quantised to e4m3 for the GEMM: `rows x pitch` bytes, row-major (the
/// columns from `cols` to `pitch` zero), and each row's inverse scale.
pub struct Fp8Matrix {
    pub values: DeviceBuf<u8>,
    pub inv_scales: DeviceBuf<f32>,
    pub rows: usize,
    pub cols: usize,
    pub pitch: usize,
}

/// The quantisation kernels reading `dtype`: by rows, the column amax, by columns transposed.
fn kernels(dtype: Dtype) -> [Kernel; 3] {
    match dtype {
        Dtype::F32 => [Kernel::Fp8QuantiseRowsF32, Kernel::Fp8ColumnAmaxF32, Kernel::Fp8QuantiseColumnsTF32],
        Dtype::Bf16 => [Kernel::Fp8QuantiseRowsBf16, Kernel::Fp8ColumnAmaxBf16, Kernel::Fp8QuantiseColumnsTBf16],
        Dtype::F16 => [Kernel::Fp8QuantiseRowsF16, Kernel::Fp8ColumnAmaxF16, Kernel::Fp8QuantiseColumnsTF16],
    }
}

/// Why the FP8 kernels cannot take a Linear layer of `in_features -> out_features`,
/// if they cannot: its rows must be whole 16-byte rows of e4m3 values.
pub fn unsupported(in_features: usize, out_features: usize) -> Option<String> {
    (!(in_features.is_multiple_of(16) && out_features.is_multiple_of(16)) || in_features == 0).then(|| {
        format!(
            "fp8 on the GPU takes in and out features that are multiples of 16 (the e4m3 GEMM's \
             16-byte rows); this layer is {in_features} -> {out_features}"
        )
    })
}

fn check_2d<T>(src: &DeviceTensor<T>, what: &str) -> Result<(usize, usize)> {
    match src.shape[..] {
        [rows, cols] if rows > 0 && cols > 0 && rows * cols <= u32::MAX as usize => Ok((rows, cols)),
        _ => Err(Error::tensor(what, format!("fp8 quantisation takes a non-empty 2-D tensor, got {:?}", src.shape))),
    }
}

/// `src (rows, cols)` quantised with one scale per row (`cols` a multiple of 16).
pub fn quantise_rows<T: DeviceElement>(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    src: &DeviceTensor<T>,
    what: &str,
) -> Result<Fp8Matrix> {
    quantise_rows_with(gpu, stream, src, (None, None), what)
}

/// [`quantise_rows`] of `src` with its columns multiplied by `col_mult` first, and the
/// largest inverse scale's bits raised into `inv_max` (both where given).
fn quantise_rows_with<T: DeviceElement>(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    src: &DeviceTensor<T>,
    (col_mult, inv_max): (Option<&DeviceBuf<f32>>, Option<&DeviceBuf<u32>>),
    what: &str,
) -> Result<Fp8Matrix> {
    let (rows, cols) = check_2d(src, what)?;
    if let Some(m) = col_mult.filter(|m| m.len() != cols) {
        return Err(Error::tensor(what, format!("{cols} columns against {} multipliers", m.len())));
    }
    if !cols.is_multiple_of(16) || !src.buf.device_address().is_multiple_of(16) {
        return Err(Error::tensor(
            what,
            format!(
                "fp8 quantisation by rows takes rows of a multiple of 16 values, 16-byte aligned ({:?})",
                src.shape
            ),
        ));
    }
    // SAFETY: the kernel writes every byte and every scale.
    let (mut values, mut inv_scales) =
        unsafe { (gpu.alloc_buf::<u8>(stream, rows * cols)?, gpu.alloc_buf::<f32>(stream, rows)?) };
    let [kernel, ..] = kernels(T::DTYPE);
    let func = gpu.function(kernel)?;
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (ROW_THREADS as u32, 1, 1),
        shared_mem_bytes: ROW_SMEM_BYTES as u32,
    };
    let (r, c) = (rows as u32, cols as u32);
    let (mult, max) = (col_mult.map_or(0, |m| m.device_address()), inv_max.map_or(0, |m| m.device_address()));
    let mut l = stream.launch_builder(&func);
    l.arg(&src.buf).arg(&r).arg(&c).arg(&mult).arg(&max).arg(&mut values).arg(&mut inv_scales);
    // SAFETY: (src, rows, cols, col_mult, inv_max_bits, dst, inv_scales) as the kernel
    // takes, sized above (null pointers where not given; cudarc's buffers are 256-byte
    // aligned); `col_mult` and `inv_max` are read and written in stream order.
    launched(kernel, unsafe { l.launch(cfg) })?;
    Ok(Fp8Matrix { values, inv_scales, rows, cols, pitch: cols })
}

/// `src (rows, cols)` quantised with one scale per column, transposed: a `(cols, rows)`
/// matrix whose rows are padded with zeros to a multiple of 16.
pub fn quantise_columns_t<T: DeviceElement>(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    src: &DeviceTensor<T>,
    what: &str,
) -> Result<Fp8Matrix> {
    let (rows, cols) = check_2d(src, what)?;
    // The column amax reads four adjacent values per load.
    let align = 4 * std::mem::size_of::<T>() as u64;
    if !cols.is_multiple_of(4) || !src.buf.device_address().is_multiple_of(align) {
        return Err(Error::tensor(
            what,
            format!(
                "fp8 quantisation by columns takes rows of a multiple of 4 values, {align}-byte aligned ({:?})",
                src.shape
            ),
        ));
    }
    let pitch = rows.next_multiple_of(16);
    if pitch.div_ceil(TILE) > 65535 || cols * pitch > u32::MAX as usize {
        return Err(Error::tensor(what, format!("too many rows ({rows}) for the fp8 transposing quantisation")));
    }
    let amax = gpu.zeroed_buf::<u32>(stream, cols)?;
    // SAFETY: the second kernel writes every byte (zeros past `rows`) and every scale.
    let (mut values, mut inv_scales) =
        unsafe { (gpu.alloc_buf::<u8>(stream, cols * pitch)?, gpu.alloc_buf::<f32>(stream, cols)?) };
    let (r, c, p) = (rows as u32, cols as u32, pitch as u32);
    let [_, amax_kernel, columns_kernel] = kernels(T::DTYPE);
    let func = gpu.function(amax_kernel)?;
    let cfg = LaunchConfig {
        grid_dim: (cols.div_ceil(COLUMN_AMAX_COLS) as u32, rows.div_ceil(COLUMN_BLOCK_ROWS) as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: COLUMN_AMAX_SMEM_BYTES as u32,
    };
    if rows.div_ceil(COLUMN_BLOCK_ROWS) > 65535 {
        return Err(Error::tensor(what, format!("too many rows ({rows}) for the fp8 column amax")));
    }
    let mut l = stream.launch_builder(&func);
    l.arg(&src.buf).arg(&r).arg(&c).arg(&amax);
    // SAFETY: (src, rows, cols, amax_bits) as the kernel takes.
    launched(amax_kernel, unsafe { l.launch(cfg) })?;
    let func = gpu.function(columns_kernel)?;
    let cfg = LaunchConfig {
        grid_dim: (cols.div_ceil(TILE) as u32, pitch.div_ceil(TILE) as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: TILE_SMEM_BYTES as u32,
    };
    let mut l = stream.launch_builder(&func);
    l.arg(&src.buf).arg(&r).arg(&c).arg(&amax).arg(&mut values).arg(&p).arg(&mut inv_scales);
    // SAFETY: (src, rows, cols, amax_bits, dst_t, pitch, inv_scales) as the kernel takes;
    // `values` holds `cols * pitch` bytes (16-byte aligned: cudarc's allocations are).
    launched(columns_kernel, unsafe { l.launch(cfg) })?;
    Ok(Fp8Matrix { values, inv_scales, rows: cols, cols: rows, pitch })
}

/// A Linear weight `(n, k)` quantised once for the three FP8 GEMMs.
///
/// `dX = dZ W` reads the forward's quantised bytes, transposed: `W ~ diag(1 / s) Wq`
/// (`s` its per-output-channel scales), so `dZ W ~ (dZ diag(1 / s)) Wq`, and `dZ`'s
/// columns take the inverse scales before `dZ` is quantised by rows. Dividing them by
/// their largest, `m`, keeps `dZ`'s products from overflowing; `dX`'s columns take `m`
/// back in the GEMM's epilogue. Against a copy scaled per input feature this makes one
/// quantisation of the weight instead of two (a column-amax pass and a quantising pass
/// fewer per optimizer step), and `dX` is the gradient of the forward's own quantised
/// weight. The CPU emulation's recipe is the same (`crate::fp8::moved_scales`).
pub struct Fp8Weight {
    /// By rows, one scale per output channel: the forward's `B`.
    pub rows: Fp8Matrix,
    /// `rows`' bytes transposed, `(k, n)`: `dX`'s `B`; its inverse scales are all `m`.
    pub rows_t: Fp8Matrix,
    /// `dZ`'s column multipliers: `rows`' inverse scales over `m` (powers of two, at most 1).
    pub dz_scales: DeviceBuf<f32>,
}

/// `w (n, k)` quantised by rows, and transposed for `dX` ([`Fp8Weight`]).
pub fn quantise_weight<T: DeviceElement>(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    w: &DeviceTensor<T>,
    what: &str,
) -> Result<Fp8Weight> {
    let (n, k) = check_2d(w, what)?;
    if let Some(why) = unsupported(k, n) {
        return Err(Error::tensor(what, why));
    }
    let inv_max = gpu.zeroed_buf::<u32>(stream, 1)?;
    let rows = quantise_rows_with(gpu, stream, w, (None, Some(&inv_max)), what)?;
    // SAFETY: the kernel writes every byte and every scale.
    let (mut values, mut inv_t, mut dz_scales) = unsafe {
        (gpu.alloc_buf::<u8>(stream, n * k)?, gpu.alloc_buf::<f32>(stream, k)?, gpu.alloc_buf::<f32>(stream, n)?)
    };
    let kernel = Kernel::Fp8TransposeWeight;
    let func = gpu.function(kernel)?;
    let cfg = LaunchConfig {
        grid_dim: (k.div_ceil(TILE) as u32, n.div_ceil(TILE) as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: TILE_SMEM_BYTES as u32,
    };
    let (r, c) = (n as u32, k as u32);
    let mut l = stream.launch_builder(&func);
    l.arg(&rows.values)
        .arg(&r)
        .arg(&c)
        .arg(&rows.inv_scales)
        .arg(&inv_max)
        .arg(&mut values)
        .arg(&mut inv_t)
        .arg(&mut dz_scales);
    // SAFETY: (src, rows, cols, inv_scales, inv_max_bits, dst_t, inv_t, dz_scales) as the
    // kernel takes, sized above; `n` and `k` multiples of 16 (`unsupported`).
    launched(kernel, unsafe { l.launch(cfg) })?;
    let rows_t = Fp8Matrix { values, inv_scales: inv_t, rows: k, cols: n, pitch: n };
    Ok(Fp8Weight { rows, rows_t, dz_scales })
}

/// `dz (m, n)` quantised for `dX = dz W` against `w` ([`quantise_weight`]'s): its
/// columns multiplied by `w.dz_scales`, then by rows.
pub fn quantise_grad<D: DeviceElement>(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    dz: &DeviceTensor<D>,
    w: &Fp8Weight,
) -> Result<Fp8Matrix> {
    quantise_rows_with(gpu, stream, dz, (Some(&w.dz_scales), None), "dz")
}

/// `dx (m, k) = dz (m, n) W (n, k)` for `W` quantised by [`quantise_weight`].
pub fn grad_input<D: DeviceElement, O: DeviceElement>(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    dz: &DeviceTensor<D>,
    w: &Fp8Weight,
    dx: &mut DeviceTensor<O>,
) -> Result<()> {
    let dzq = quantise_grad(gpu, stream, dz, w)?;
    gemm(gpu, stream, &dzq, &w.rows_t, None, None, dx, None)
}

/// `y (m, n) = chain(unscale(A B^T) + bias)` for `A (m, k)` and `B (n, k)` quantised by
/// rows (their pitches equal: the GEMM's depth), `y` FP32, bf16 or fp16; `save_z` gets the
/// values before the chain.
#[allow(clippy::too_many_arguments)]
pub fn gemm<O: DeviceElement>(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    a: &Fp8Matrix,
    b: &Fp8Matrix,
    bias: Option<VectorArg<'_>>,
    chain: Option<&DeviceChain>,
    y: &mut DeviceTensor<O>,
    save_z: Option<&mut DeviceTensor>,
) -> Result<()> {
    if a.pitch != b.pitch || !a.pitch.is_multiple_of(16) {
        return Err(Error::Shape(format!(
            "fp8 GEMM: operands of depth {} and {} (both the same multiple of 16)",
            a.pitch, b.pitch
        )));
    }
    super::tma::launch_e4m3(gpu, stream, a, b, (bias, chain), y, save_z)
}

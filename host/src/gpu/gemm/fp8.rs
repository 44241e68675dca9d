//! The FP8 GEMMs of a Linear layer (`Precision::Fp8`, `Precision::Fp8GwBf16`): each
//! operand quantised to e4m3 on the GPU, scaled by a power of two along the dimension
//! its product keeps (kernels-gpu/src/fp8.rs, the CPU emulation's recipe in
//! `crate::fp8`), then `gemm_tma_e4m3_*` with the scales undone in its epilogue.
//!
//! FP8 `wgmma` reads `k`-major operands only, so every operand is quantised into a
//! `k`-contiguous copy: the forward's `x` and `W` by rows as stored; `dX = dZ W` takes
//! `dZ` by rows and `W^T` (scaled per input feature, written transposed); `dW = dZ^T X`
//! takes `dZ^T` and `X^T` (scaled per output and input feature), both transposed, their
//! depth (the batch) padded with zeros to a multiple of 16.

use super::super::epilogue::DeviceChain;
use super::super::{DeviceBuf, DeviceElement, DeviceTensor, Dtype, Gpu, launched};
use crate::error::{Error, Result};
use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use kernel_abi::Kernel;
use kernel_abi::fp8::{COLUMN_BLOCK_ROWS, ROW_SMEM_BYTES, ROW_THREADS, TILE, TILE_SMEM_BYTES};
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
    let (rows, cols) = check_2d(src, what)?;
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
    let mut l = stream.launch_builder(&func);
    l.arg(&src.buf).arg(&r).arg(&c).arg(&mut values).arg(&mut inv_scales);
    // SAFETY: (src, rows, cols, dst, inv_scales) as the kernel takes, sized above.
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
        grid_dim: (cols.div_ceil(256) as u32, rows.div_ceil(COLUMN_BLOCK_ROWS) as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
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

/// Which copy of a Linear weight a GEMM reads: by rows (the forward's, one scale per
/// output channel) or by columns, transposed (`dX`'s, one scale per input feature).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightCopy {
    Rows,
    ColumnsT,
}

/// `cached` where there is one, else `w`'s `copy` quantised now and kept in `made`.
pub fn cached_or_quantised<'a, T: DeviceElement>(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    cached: Option<&'a Fp8Matrix>,
    w: &DeviceTensor<T>,
    copy: WeightCopy,
    made: &'a mut Option<Fp8Matrix>,
) -> Result<&'a Fp8Matrix> {
    if let Some(c) = cached {
        return Ok(c);
    }
    let m = match copy {
        WeightCopy::Rows => quantise_rows(gpu, stream, w, "lin.weight")?,
        WeightCopy::ColumnsT => quantise_columns_t(gpu, stream, w, "lin.weight")?,
    };
    Ok(made.insert(m))
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
    bias: Option<&CudaSlice<f32>>,
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

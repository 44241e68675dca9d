//! Launchers of `kernels-gpu/src/elementwise.rs`: gradient accumulation, the AvgPool
//! fold of a Linear layer (forward) and its transpose (backward), and a matrix
//! transpose.

use super::{DeviceBuf, DeviceElement, DeviceTensor, Gpu, HalfElement, dispatch, launched};
use crate::error::{Error, Result};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use kernel_abi::Kernel;
use std::sync::Arc;

/// `a += b` (same shape).
pub fn add_assign(gpu: &Gpu, a: &mut DeviceTensor, b: &DeviceTensor) -> Result<()> {
    if a.shape != b.shape {
        return Err(Error::Shape(format!("adding {:?} to {:?}", b.shape, a.shape)));
    }
    let len = a.len() as u32;
    {
        let (func, cfg) = gpu.kernel_1d(Kernel::AddAssign, a.len(), 0)?;
        let mut l = gpu.stream().launch_builder(&func);
        l.arg(&mut a.buf).arg(&b.buf).arg(&len);
        // SAFETY: (a, b, len) as the kernel takes; both hold len floats.
        launched(Kernel::AddAssign, unsafe { l.launch(cfg) })
    }
}

/// Rows of `input (rows, cols)` averaged in blocks of `k`: `(rows / k, cols)` (a 1-D
/// input is one column).
pub fn fold_rows_mean<T: DeviceElement>(gpu: &Gpu, input: &DeviceTensor<T>, k: usize) -> Result<DeviceTensor> {
    let rows = input.shape[0];
    check_window(rows, k)?;
    match fold_passes(rows, k) {
        (_, 1) => fold_pass(gpu, input, k),
        (first, rest) => fold_rows_mean(gpu, &fold_pass(gpu, input, first)?, rest),
    }
}

/// A fold's window `k` over `rows` rows: at least one row, at most all of them.
fn check_window(rows: usize, k: usize) -> Result<()> {
    if k == 0 || k > rows {
        return Err(Error::Chain(format!("avgpool({k}) over {rows} features")));
    }
    Ok(())
}

/// Output rows below which a fold's one block per window leaves the GPU idle.
const FOLD_BLOCKS: usize = 128;

/// How a fold of `rows` rows in windows of `k` runs: `(k, 1)`, one pass, where the
/// windows give [`FOLD_BLOCKS`] blocks or are short; else `(d, k / d)`, windows of `d`
/// (the largest divisor of `k` up to 32) first, then the rest over their means. A
/// row `sum` folds all 8192 rows of a weight into one: one block would read 128 MB
/// alone. (The mean of equal windows' means is the mean; trailing rows fall out of
/// the last pass's windows as they do of one.)
fn fold_passes(rows: usize, k: usize) -> (usize, usize) {
    if rows / k >= FOLD_BLOCKS || k <= 32 {
        return (k, 1);
    }
    match short_window(k) {
        Some(d) => (d, k / d),
        None => (k, 1),
    }
}

/// The largest divisor of `k` from 2 to 32, if any.
fn short_window(k: usize) -> Option<usize> {
    (2..=32).rev().find(|d| k.is_multiple_of(*d))
}

/// One pass of [`fold_rows_mean`]: a block per window.
fn fold_pass<T: DeviceElement>(gpu: &Gpu, input: &DeviceTensor<T>, k: usize) -> Result<DeviceTensor> {
    let (rows, cols) = (input.shape[0], input.shape.get(1).copied().unwrap_or(1));
    let mut shape = input.shape.clone();
    shape[0] = rows / k;
    let mut out = gpu.alloc(&shape)?;
    let (r, c, k32) = (rows as u32, cols as u32, k as u32);
    let kernel = dispatch::fold_kernel(T::DTYPE);
    {
        let (func, cfg) = row_blocks(gpu, kernel, rows / k, cols)?;
        let mut l = gpu.stream().launch_builder(&func);
        l.arg(&input.buf).arg(&r).arg(&c).arg(&k32).arg(&mut out.buf);
        // SAFETY: (input, rows, cols, k, out) as the kernel takes (its element type
        // `T`'s); out holds (rows / k) * cols.
        launched(kernel, unsafe { l.launch(cfg) })
    }?;
    Ok(out)
}

/// A 16-bit weight `input (rows, cols)` averaged in blocks of `k` rows as two 16-bit
/// matrices `(hi, lo)`, each `(rows / k, cols)`: `hi` the FP32 means rounded to `H`,
/// `lo` what is left, rounded. Their sum holds the means to FP32's accuracy, so two GEMMs
/// in `H` give the folded layer without widening its input.
pub fn fold_rows_mean_halves<H: DeviceElement>(
    gpu: &Gpu,
    input: &DeviceTensor<H>,
    k: usize,
) -> Result<(DeviceTensor<H>, DeviceTensor<H>)> {
    let Some(kernels) = dispatch::HalfKernels::of(H::DTYPE) else {
        return Err(Error::Unsupported(format!("folding an {} weight into 16-bit halves", H::NAME)));
    };
    let [rows, cols] = input.shape[..] else {
        return Err(Error::Shape(format!("folding a weight of shape {:?} (not 2-D)", input.shape)));
    };
    check_window(rows, k)?;
    let shape = [rows / k, cols];
    let (mut hi, mut lo) = (gpu.alloc_as::<H>(&shape)?, gpu.alloc_as::<H>(&shape)?);
    // Long windows: FP32 means of all but a last short window, then its halves.
    let last = match fold_passes(rows, k) {
        (_, 1) => None,
        _ => short_window(k),
    };
    let means = last.map(|d| fold_rows_mean(gpu, input, k / d)).transpose()?;
    let (rows, k) = match (&means, last) {
        (Some(m), Some(d)) => (m.shape[0], d),
        _ => (rows, k),
    };
    let (r, c, k32) = (rows as u32, cols as u32, k as u32);
    let kernel = if means.is_some() { kernels.fold_f32_halves } else { kernels.fold_halves };
    {
        let (func, cfg) = row_blocks(gpu, kernel, rows / k, cols)?;
        let mut l = gpu.stream().launch_builder(&func);
        match &means {
            Some(m) => l.arg(&m.buf),
            None => l.arg(&input.buf),
        };
        l.arg(&r).arg(&c).arg(&k32).arg(&mut hi.buf).arg(&mut lo.buf);
        // SAFETY: (input, rows, cols, k, hi, lo) as the kernel takes (`H`'s words); hi
        // and lo hold (rows / k) * cols values each.
        launched(kernel, unsafe { l.launch(cfg) })
    }?;
    Ok((hi, lo))
}

/// The launch of a one-block-per-row kernel over `rows` rows of `cols` columns: up to
/// 256 threads, each taking 4 columns at a time.
fn row_blocks(gpu: &Gpu, kernel: Kernel, rows: usize, cols: usize) -> Result<(CudaFunction, LaunchConfig)> {
    if rows * cols > u32::MAX as usize || rows > i32::MAX as usize {
        return Err(Error::Shape(format!("`{kernel}` over {rows} x {cols} exceeds its 32-bit launch")));
    }
    let threads = cols.div_ceil(4).next_multiple_of(32).clamp(32, 256) as u32;
    let cfg = LaunchConfig { grid_dim: (rows.max(1) as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
    Ok((gpu.function(kernel)?, cfg))
}

/// The gradient of [`fold_rows_mean`]: `g (rows / k, cols)` spread back over `rows` rows.
pub fn unfold_rows_mean_grad<T: DeviceElement>(
    gpu: &Gpu,
    g: &DeviceTensor,
    rows: usize,
    k: usize,
) -> Result<DeviceTensor<T>> {
    let cols = g.shape.get(1).copied().unwrap_or(1);
    if g.shape[0] != rows / k {
        return Err(Error::Shape(format!("folded gradient {:?} for {rows} rows pooled by {k}", g.shape)));
    }
    let mut shape = g.shape.clone();
    shape[0] = rows;
    let mut out = gpu.alloc_as::<T>(&shape)?;
    let (r, c, k32) = (rows as u32, cols as u32, k as u32);
    let kernel = dispatch::unfold_kernel(T::DTYPE);
    {
        let (func, cfg) = row_blocks(gpu, kernel, rows, cols)?;
        let mut l = gpu.stream().launch_builder(&func);
        l.arg(&g.buf).arg(&r).arg(&c).arg(&k32).arg(&mut out.buf);
        // SAFETY: (g, rows, cols, k, out) as the kernel takes; out holds rows * cols
        // values of `T`.
        launched(kernel, unsafe { l.launch(cfg) })
    }?;
    Ok(out)
}

/// `input (rows, cols)^T` as a new `(cols, rows)` tensor, allocated and queued on
/// `stream` (the tensor-core `dW` runs it on the side stream before its GEMM; the
/// result is freed in that stream's order too).
pub fn transpose_on(gpu: &Gpu, stream: &Arc<CudaStream>, input: &DeviceTensor) -> Result<DeviceTensor> {
    let (rows, cols) = matrix_dims(input)?;
    // 16-byte rows both ways (allocations are 256-byte aligned): the vectorised kernel.
    let buf = if rows % 4 == 0 && cols % 4 == 0 {
        launch_transpose::<f32>(gpu, stream, input, Kernel::TransposeVec4, 64, (256, 1))?
    } else {
        launch_transpose::<f32>(gpu, stream, input, Kernel::Transpose, 32, (32, 8))?
    };
    Ok(DeviceTensor { shape: vec![cols, rows], buf })
}

/// `input (rows, cols)^T` rounded to the 16-bit `H`, a new `cols x rows` buffer
/// allocated and queued on `stream`, in one pass (`transpose_vec4_to_{bf16,f16}`);
/// `None` unless `rows` and `cols` are multiples of 4 (the caller then transposes and
/// rounds in two).
pub fn transpose_to_half_on<H: HalfElement>(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    input: &DeviceTensor,
) -> Result<Option<DeviceBuf<H>>> {
    let (rows, cols) = matrix_dims(input)?;
    if rows % 4 != 0 || cols % 4 != 0 {
        return Ok(None);
    }
    launch_transpose::<H>(gpu, stream, input, H::KERNELS.transpose_to_half, 64, (256, 1)).map(Some)
}

/// The `(rows, cols)` of a matrix to transpose.
fn matrix_dims(input: &DeviceTensor) -> Result<(usize, usize)> {
    match input.shape[..] {
        [rows, cols] => Ok((rows, cols)),
        _ => Err(Error::Shape(format!("transpose of a {:?} tensor", input.shape))),
    }
}

/// Queues transpose kernel `kernel` (`tile x tile` tiles, `threads` per block, a
/// `tile x (tile + 1)` float tile of shared memory: `(input, rows, cols, out)`) over the
/// matrix `input` into a new `cols x rows` buffer of `T` allocated on `stream`.
fn launch_transpose<T: cudarc::driver::DeviceRepr + 'static>(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    input: &DeviceTensor,
    kernel: Kernel,
    tile: usize,
    threads: (u32, u32),
) -> Result<DeviceBuf<T>> {
    let (rows, cols) = matrix_dims(input)?;
    let grid = (cols.div_ceil(tile), rows.div_ceil(tile));
    if grid.1 > 65535 || rows * cols > u32::MAX as usize {
        return Err(Error::Shape(format!("transpose of {rows} x {cols} exceeds the kernel's limits")));
    }
    // SAFETY: the kernel below writes every element before anything reads it.
    let mut buf = unsafe { gpu.alloc_buf::<T>(stream, rows * cols)? };
    let func = gpu.function(kernel)?;
    let cfg = LaunchConfig {
        grid_dim: (grid.0 as u32, grid.1 as u32, 1),
        block_dim: (threads.0, threads.1, 1),
        shared_mem_bytes: (tile * (tile + 1) * 4) as u32,
    };
    let (r, c) = (rows as u32, cols as u32);
    let mut l = stream.launch_builder(&func);
    l.arg(&input.buf).arg(&r).arg(&c).arg(&mut buf);
    // SAFETY: (input, rows, cols, out) as the kernels take; out holds rows * cols
    // elements of the kernel's output type; block, grid and shared memory as they
    // document (the vectorised ones only for dimensions divisible by 4, on whole,
    // aligned allocations: the callers check).
    launched(kernel, unsafe { l.launch(cfg) })?;
    Ok(buf)
}

/// `input` rounded to the 16-bit `H` (to nearest, ties to even), queued on the GPU's stream.
pub fn to_half<H: HalfElement>(gpu: &Gpu, input: &DeviceTensor) -> Result<DeviceTensor<H>> {
    Ok(DeviceTensor { shape: input.shape.clone(), buf: slice_to_half(gpu, gpu.stream(), &input.buf)? })
}

/// A 16-bit tensor's values as FP32 (exact), queued on `stream`: for the paths that
/// compute from FP32 operands (shapes the 16-bit kernels do not take).
pub fn widen_on<H: HalfElement>(gpu: &Gpu, stream: &Arc<CudaStream>, input: &DeviceTensor<H>) -> Result<DeviceTensor> {
    let len = input.len();
    // SAFETY: the kernel below writes all `len` floats before anything reads them.
    let mut buf = unsafe { gpu.alloc_buf::<f32>(stream, len)? };
    let n = u32::try_from(len).map_err(|_| Error::Shape(format!("{len} values exceed a 32-bit launch")))?;
    let kernel = H::KERNELS.widen;
    let (func, cfg) = gpu.kernel_1d(kernel, len, 0)?;
    let mut l = stream.launch_builder(&func);
    l.arg(&input.buf).arg(&n).arg(&mut buf);
    // SAFETY: (input, len, out) as the kernel takes; out holds len floats.
    launched(kernel, unsafe { l.launch(cfg) })?;
    Ok(DeviceTensor { shape: input.shape.clone(), buf })
}

/// [`widen_on`] on the GPU's stream.
pub fn widen<H: HalfElement>(gpu: &Gpu, input: &DeviceTensor<H>) -> Result<DeviceTensor> {
    widen_on(gpu, gpu.stream(), input)
}

/// Every float of `input` rounded to the 16-bit `H` (to nearest, ties to even), in a
/// new buffer, queued on `stream`.
pub fn slice_to_half<H: HalfElement>(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    input: &CudaSlice<f32>,
) -> Result<DeviceBuf<H>> {
    let len = input.len();
    let n = u32::try_from(len).map_err(|_| Error::Shape(format!("{len} values exceed a 32-bit launch")))?;
    // SAFETY: the kernel below writes all `len` values before anything reads them.
    let mut buf = unsafe { gpu.alloc_buf::<H>(stream, len)? };
    let kernel = H::KERNELS.narrow;
    let (func, cfg) = gpu.kernel_1d(kernel, len, 0)?;
    let mut l = stream.launch_builder(&func);
    l.arg(input).arg(&n).arg(&mut buf);
    // SAFETY: (input, len, out) as the kernel takes; out holds len 16-bit values.
    launched(kernel, unsafe { l.launch(cfg) })?;
    Ok(buf)
}

/// What [`convert_vectors`] does to one vector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Convert {
    /// FP32 copied.
    F32,
    /// bf16 widened to FP32 (exact).
    Bf16ToF32,
    /// FP32 rounded to bf16 (to nearest even).
    F32ToBf16,
    /// fp16 widened to FP32 (exact).
    F16ToF32,
    /// FP32 rounded to fp16 (to nearest even).
    F32ToF16,
}

impl Convert {
    /// Widening from the 16-bit `H`.
    pub fn widen<H: HalfElement>() -> Convert {
        if H::KERNELS.widen == Kernel::F16ToF32 { Convert::F16ToF32 } else { Convert::Bf16ToF32 }
    }
    /// Rounding to the 16-bit `H`.
    pub fn narrow<H: HalfElement>() -> Convert {
        if H::KERNELS.narrow == Kernel::F32ToF16 { Convert::F32ToF16 } else { Convert::F32ToBf16 }
    }
}

impl Convert {
    fn code(self) -> u32 {
        match self {
            Convert::F32 => kernel_abi::CONVERT_F32,
            Convert::Bf16ToF32 => kernel_abi::CONVERT_BF16_TO_F32,
            Convert::F32ToBf16 => kernel_abi::CONVERT_F32_TO_BF16,
            Convert::F16ToF32 => kernel_abi::CONVERT_F16_TO_F32,
            Convert::F32ToF16 => kernel_abi::CONVERT_F32_TO_F16,
        }
    }
}

/// One vector of [`convert_vectors`]: device addresses, length in values, and what is done.
#[derive(Clone, Copy, Debug)]
pub struct Vector {
    pub src: u64,
    pub dst: u64,
    pub len: usize,
    pub mode: Convert,
}

/// Queues the copies or conversions of `vectors` on `stream`: one launch per
/// `kernel_abi::VECTORS` of them (a block's small parameters or gradients), where a
/// copy or a cast each would cost a launch and its host time each.
///
/// # Safety
/// Each vector's source and destination are live device memory of this GPU holding
/// `len` values of the mode's input and output types, not written by anything else
/// until the launch has run.
pub unsafe fn convert_vectors(gpu: &Gpu, stream: &Arc<CudaStream>, vectors: &[Vector]) -> Result<()> {
    use kernel_abi::VECTORS;
    if vectors.is_empty() {
        return Ok(());
    }
    let func = gpu.function(Kernel::ConvertVectors)?;
    for chunk in vectors.chunks(VECTORS) {
        let mut words = [0u64; 3 * VECTORS];
        let mut longest = 0;
        for (i, v) in chunk.iter().enumerate() {
            let len =
                u32::try_from(v.len).map_err(|_| Error::Shape(format!("{} values exceed a 32-bit launch", v.len)))?;
            words[3 * i..3 * i + 3].copy_from_slice(&[v.src, v.dst, len as u64 | (v.mode.code() as u64) << 32]);
            longest = longest.max(v.len);
        }
        let cfg = LaunchConfig {
            grid_dim: (longest.div_ceil(256).clamp(1, 64) as u32, chunk.len() as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let count = chunk.len() as u32;
        let mut l = stream.launch_builder(&func);
        l.arg(&count).arg(&words);
        // SAFETY: (count, words) as the kernel takes; the vectors as the caller's contract says.
        launched(Kernel::ConvertVectors, unsafe { l.launch(cfg) })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One pass where the windows give the GPU enough blocks or are short; else a first
    /// pass of short windows (the largest divisor up to 32), the rest after.
    #[test]
    fn long_folds_run_in_passes() {
        assert_eq!(fold_passes(8192, 16), (16, 1));
        assert_eq!(fold_passes(8192, 8192), (32, 256));
        assert_eq!(fold_passes(256, 256), (32, 8));
        assert_eq!(fold_passes(300, 300), (30, 10));
        assert_eq!(fold_passes(100, 20), (20, 1));
        assert_eq!(fold_passes(8191, 8191), (8191, 1)); // a prime: one pass
        assert_eq!(fold_passes(64 * 128, 64), (64, 1)); // 128 windows
    }
}

//! Launchers of `kernels-gpu/src/dot.rs`: a Linear layer folded to one output column (a
//! whole row's sum or mean after it, [`dispatch::fold`]) runs as a dot product per row
//! of `x` (forward), an outer product (`dX`) and a weighted sum of `x`'s rows (its weight
//! gradient), and its fold as the mean of the weight's rows.

use super::dispatch::HalfKernels;
use super::epilogue::lanes::epilogue_split_tiles;
use super::{DeviceElement, DeviceTensor, Dtype, Gpu, dispatch, launched};
use crate::error::{Error, Result};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use kernel_abi::Kernel;
use kernel_abi::dot::{
    COLUMN_DOT_SMEM_BYTES, COLUMN_DOT_STEP_ROWS, COLUMN_DOTS_BLOCK_COLS, COLUMN_DOTS_BLOCKS_PER_SM,
    COLUMN_DOTS_MAX_RANGE_ROWS, COLUMN_DOTS_SMEM_BYTES, OUTER_BLOCK_COLS, OUTER_MAX_BLOCK_ROWS, OUTER_MAX_RANK,
    OUTER_SMEM_BYTES, ROW_DOT_SMEM_BYTES, THREADS, column_dot_cols,
};
use kernel_abi::gemv_tc::{self, DX_UNIT_ROWS};
use std::sync::Arc;

/// Blocks per SM `column_dot` aims at.
const BLOCKS_PER_SM: usize = 8;

/// A 2-D tensor's `(rows, cols)`, each within the kernels' 32-bit arguments.
fn matrix<T>(t: &DeviceTensor<T>, what: &str) -> Result<(usize, usize)> {
    match t.shape[..] {
        [rows, cols] if rows <= u32::MAX as usize && cols <= u32::MAX as usize => Ok((rows, cols)),
        _ => Err(Error::Shape(format!("{what} of shape {:?}: a matrix of at most 2^32 - 1 rows and columns", t.shape))),
    }
}

/// Whether `t`'s rows of `cols` values can be read in 16-byte chunks: `cols` a multiple
/// of a chunk's values and `t` starting on a 16-byte boundary (a caller's view may not).
fn vector<T>(t: &DeviceTensor<T>, cols: usize) -> u32 {
    let aligned = t.buf.device_address().is_multiple_of(16);
    u32::from(cols.is_multiple_of(16 / size_of::<T>()) && aligned)
}

/// `scale * sum_r weights[r] a[r, :]` as a `(1, cols)` FP32 tensor (`weights`: `rows`
/// values, or `None` for all 1), on the GPU's stream. Where the column blocks alone
/// would leave SMs idle, ranges of rows go to blocks of their own and a second launch
/// adds their sums (in range order: the same bits every call).
pub fn column_dot<T: DeviceElement>(
    gpu: &Gpu,
    a: &DeviceTensor<T>,
    weights: Option<&DeviceTensor<T>>,
    scale: f32,
) -> Result<DeviceTensor> {
    let (rows, cols) = matrix(a, "a column dot's matrix")?;
    if let Some(w) = weights
        && w.len() != rows
    {
        return Err(Error::Shape(format!("{} row weights for a {rows}-row matrix", w.len())));
    }
    let (ranges, per_range) = row_ranges(rows, cols, size_of::<T>(), gpu.props.multiprocessors);
    let mut out = gpu.alloc(&[1, cols])?;
    let kernel = dispatch::dot_kernels(T::DTYPE).column_dot;
    if ranges == 1 {
        launch_column_dot(gpu, kernel, a, weights, (rows, cols, per_range), scale, &mut out)?;
        return Ok(out);
    }
    let mut parts = gpu.alloc(&[ranges, cols])?;
    launch_column_dot(gpu, kernel, a, weights, (rows, cols, per_range), scale, &mut parts)?;
    let sum = dispatch::dot_kernels(super::Dtype::F32).column_dot;
    launch_column_dot(gpu, sum, &parts, None, (ranges, cols, ranges), 1.0, &mut out)?;
    Ok(out)
}

/// How `column_dot` splits `rows` rows of `cols` values of `element_bytes` among blocks
/// on `sms` SMs: `(ranges, rows per range)`, about [`BLOCKS_PER_SM`] blocks per SM with
/// the column blocks, at most 64 ranges, each a whole number of the block's steps
/// ([`COLUMN_DOT_STEP_ROWS`]; the weight fold of 8192 rows in 33 ranges of 249 left each
/// warp 7 rows of single loads after three full steps) but the last, none empty.
fn row_ranges(rows: usize, cols: usize, element_bytes: usize, sms: usize) -> (usize, usize) {
    let column_blocks = cols.div_ceil(column_dot_cols(element_bytes));
    let wanted = (BLOCKS_PER_SM * sms).div_ceil(column_blocks.max(1));
    let ranges = wanted.min(rows.div_ceil(COLUMN_DOT_STEP_ROWS)).clamp(1, 64);
    let per_range = rows.div_ceil(ranges).next_multiple_of(COLUMN_DOT_STEP_ROWS).min(rows).max(1);
    (rows.div_ceil(per_range).max(1), per_range)
}

/// One `column_dot` launch: `out` gets `ceil(rows / per_range)` rows of sums.
fn launch_column_dot<T: DeviceElement>(
    gpu: &Gpu,
    kernel: kernel_abi::Kernel,
    a: &DeviceTensor<T>,
    weights: Option<&DeviceTensor<T>>,
    (rows, cols, per_range): (usize, usize, usize),
    scale: f32,
    out: &mut DeviceTensor,
) -> Result<()> {
    let ranges = rows.div_ceil(per_range).max(1);
    let cfg = LaunchConfig {
        grid_dim: (cols.div_ceil(column_dot_cols(size_of::<T>())).max(1) as u32, ranges as u32, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: COLUMN_DOT_SMEM_BYTES as u32,
    };
    let func = gpu.function(kernel)?;
    let (r, c, p, q, null) = (rows as u32, cols as u32, per_range as u32, vector(a, cols), 0u64);
    let mut l = gpu.stream().launch_builder(&func);
    l.arg(&a.buf);
    match weights {
        Some(w) => l.arg(&w.buf),
        None => l.arg(&null),
    };
    l.arg(&r).arg(&c).arg(&p).arg(&scale).arg(&q).arg(&mut out.buf);
    // SAFETY: (a, weights, rows, cols, rows per block, scale, vector, out) as the kernel
    // takes; `a` holds rows * cols values, `weights` rows, `out` ranges * cols floats;
    // `vector` only where the rows allow it.
    launched(kernel, unsafe { l.launch(cfg) })
}

/// `z[r] = x[r, :] . w` for `x (rows, k)` and the FP32 `w` (`k` values) into the FP32 `z`
/// (`rows` values, any shape), on the GPU's stream.
pub fn row_dot<T: DeviceElement>(gpu: &Gpu, x: &DeviceTensor<T>, w: &DeviceTensor, z: &mut DeviceTensor) -> Result<()> {
    let (rows, k) = matrix(x, "x")?;
    if w.len() != k || z.len() != rows {
        return Err(Error::Shape(format!("a row dot of x {:?} with {} weights into {:?}", x.shape, w.len(), z.shape)));
    }
    let kernel = dispatch::dot_kernels(T::DTYPE).row_dot;
    if rows > i32::MAX as usize {
        return Err(Error::Shape(format!("a row dot of {rows} rows exceeds its grid")));
    }
    let cfg = LaunchConfig {
        grid_dim: (rows.max(1) as u32, 1, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: ROW_DOT_SMEM_BYTES as u32,
    };
    let func = gpu.function(kernel)?;
    // (`w` is read in the same chunks: a caller's weight may start anywhere.)
    let q = vector(x, k) & vector(w, k);
    let (r, k32) = (rows as u32, k as u32);
    let mut l = gpu.stream().launch_builder(&func);
    l.arg(&x.buf).arg(&w.buf).arg(&r).arg(&k32).arg(&q).arg(&mut z.buf);
    // SAFETY: (x, w, rows, k, vector, out) as the kernel takes; `x` holds rows * k values,
    // `w` k floats, `z` rows; `vector` only where both are aligned.
    launched(kernel, unsafe { l.launch(cfg) })
}

/// `u (rows values) * v (cols values)` as a new `(rows, cols)` tensor of `u`'s type, on
/// the GPU's stream: a one-column layer's `dX = dZ w`.
pub fn outer<T: DeviceElement>(gpu: &Gpu, u: &DeviceTensor<T>, v: &DeviceTensor) -> Result<DeviceTensor<T>> {
    let (rows, cols) = (u.len(), v.len());
    let mut out = gpu.alloc_as::<T>(&[rows, cols])?;
    outer_sum(gpu, gpu.stream(), (&u.buf, rows), (&v.buf, cols), (1, rows, cols), &mut out.buf)?;
    Ok(out)
}

/// `dX (m, k) = dZ W` of a batch of at most `OUTER_MAX_RANK` rows (`dZ (m, n)`, `W (n,
/// k)`), in `T`: `W`'s rows weighted by each row of `dZ` and summed, over ranges of
/// `W`'s rows (`column_dot` for one row, `column_dots` for more), the ranges' FP32 sums
/// added in a fixed order and rounded once (`split_sums*`, through `epilogue_split_tiles`): one
/// pass over `W` ([`dispatch::Family::Dot`]).
pub fn weighted_rows<T: DeviceElement>(
    gpu: &Gpu,
    w: &DeviceTensor<T>,
    dz: &DeviceTensor<T>,
) -> Result<DeviceTensor<T>> {
    let (rows, cols) = matrix(w, "dX = dZ W's W")?;
    let m = dz.len() / rows.max(1);
    if !(1..=OUTER_MAX_RANK).contains(&m) || dz.len() != m * rows || rows == 0 || cols == 0 {
        return Err(Error::Shape(format!(
            "dX = dZ W of at most {OUTER_MAX_RANK} rows: dZ {:?}, W {:?}",
            dz.shape, w.shape
        )));
    }
    let storage = dispatch::Storage::half(T::DTYPE, T::DTYPE, super::block_half::aligned(&[w, dz]));
    if let Some(half) = HalfKernels::of(T::DTYPE)
        && dispatch::dx_tc((m, rows, cols), storage)
    {
        return weighted_rows_tc(gpu, half, w, dz, (m, rows, cols));
    }
    let kernels = dispatch::dot_kernels(T::DTYPE);
    let sms = gpu.props.multiprocessors;
    let (ranges, per_range) = match m {
        1 => row_ranges(rows, cols, size_of::<T>(), sms),
        _ => {
            // About COLUMN_DOTS_BLOCKS_PER_SM blocks per SM with the column blocks, each
            // range a whole number of the warps' steps, at most COLUMN_DOTS_MAX_RANGE_ROWS.
            let wanted = (COLUMN_DOTS_BLOCKS_PER_SM * sms).div_ceil(cols.div_ceil(COLUMN_DOTS_BLOCK_COLS));
            let per = rows.div_ceil(wanted.max(1)).next_multiple_of(COLUMN_DOT_STEP_ROWS);
            let per = per.min(COLUMN_DOTS_MAX_RANGE_ROWS).min(rows);
            (rows.div_ceil(per), per)
        }
    };
    let mut parts = gpu.alloc(&[ranges, m, cols])?;
    if m == 1 {
        launch_column_dot(gpu, kernels.column_dot, w, Some(dz), (rows, cols, per_range), 1.0, &mut parts)?;
    } else {
        if ranges > u16::MAX as usize || [rows, cols].iter().any(|&d| d > u32::MAX as usize) {
            return Err(Error::Shape(format!("dX = dZ W with W {:?} exceeds its launch", w.shape)));
        }
        let cfg = LaunchConfig {
            grid_dim: (cols.div_ceil(COLUMN_DOTS_BLOCK_COLS) as u32, ranges as u32, 1),
            block_dim: (THREADS as u32, 1, 1),
            shared_mem_bytes: COLUMN_DOTS_SMEM_BYTES as u32,
        };
        let func = gpu.function(kernels.column_dots)?;
        let quad = w.buf.device_address().is_multiple_of(4 * size_of::<T>() as u64) && cols.is_multiple_of(4);
        let args = [rows, m, rows, cols, per_range, usize::from(quad)].map(|a| a as u32);
        let mut l = gpu.stream().launch_builder(&func);
        l.arg(&w.buf).arg(&dz.buf);
        for a in &args {
            l.arg(a);
        }
        l.arg(&mut parts.buf);
        // SAFETY: (a, u, ldu, rank, rows, cols, rows per block, vector, out) as the kernel
        // takes: `W` holds rows * cols values, `dZ` m rows of `rows` (its pitch), `parts`
        // ranges * m * cols floats; per_range <= COLUMN_DOTS_MAX_RANGE_ROWS; `vector` only
        // where `W`'s quads are aligned.
        launched(kernels.column_dots, unsafe { l.launch(cfg) })?;
    }
    let mut dx = gpu.alloc_as::<T>(&[m, cols])?;
    epilogue_split_tiles(gpu, None, &parts, None, &mut dx, None)?;
    Ok(dx)
}

/// Fewest rows of `W` one split of [`weighted_rows_tc`] sums: a unit per warp.
const DX_TC_MIN_SPLIT_ROWS: usize = DX_UNIT_ROWS * gemv_tc::WARPS;

/// [`weighted_rows`] on the tensor cores (`dx_tc_*`; [`dispatch::dx_tc`] says where):
/// one block per 32 columns of `dX` over all of `W`'s rows, written in `T`; where those
/// blocks would leave half the SMs idle, over ranges of `W`'s rows instead (at most
/// two blocks per SM, each range a unit per warp or more), their FP32 sums added in
/// range order by `split_sums`.
fn weighted_rows_tc<T: DeviceElement>(
    gpu: &Gpu,
    half: &HalfKernels,
    w: &DeviceTensor<T>,
    dz: &DeviceTensor<T>,
    (m, rows, cols): (usize, usize, usize),
) -> Result<DeviceTensor<T>> {
    if [m * rows, rows * cols].iter().any(|&d| d > u32::MAX as usize) {
        return Err(Error::Shape(format!("dX = dZ W with W {:?} exceeds its launch", w.shape)));
    }
    let (blocks, sms) = (cols.div_ceil(gemv_tc::SLAB), gpu.props.multiprocessors);
    let splits =
        if 2 * blocks >= sms { 1 } else { (2 * sms).div_ceil(blocks).min(rows.div_ceil(DX_TC_MIN_SPLIT_ROWS)) };
    let per_split = rows.div_ceil(splits).next_multiple_of(DX_TC_MIN_SPLIT_ROWS);
    let splits = rows.div_ceil(per_split);
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, splits as u32, 1),
        block_dim: (gemv_tc::THREADS as u32, 1, 1),
        shared_mem_bytes: gemv_tc::DX_SMEM_BYTES as u32,
    };
    let args = [m, rows, cols, per_split].map(|a| a as u32);
    let mut dx = gpu.alloc_as::<T>(&[m, cols])?;
    if splits == 1 {
        launch_dx_tc(gpu, half.dx_tc, cfg, (w, dz), args, &mut dx)?;
    } else {
        let mut parts = gpu.alloc(&[splits, m, cols])?;
        launch_dx_tc(gpu, half.dx_tc_parts, cfg, (w, dz), args, &mut parts)?;
        epilogue_split_tiles(gpu, None, &parts, None, &mut dx, None)?;
    }
    Ok(dx)
}

/// One launch of `dx_tc_*` (`args`: `m, n, k, per_split`) into `out`.
fn launch_dx_tc<T: DeviceElement, O: DeviceElement>(
    gpu: &Gpu,
    kernel: Kernel,
    cfg: LaunchConfig,
    (w, dz): (&DeviceTensor<T>, &DeviceTensor<T>),
    args: [u32; 4],
    out: &mut DeviceTensor<O>,
) -> Result<()> {
    let func = gpu.function(kernel)?;
    gpu.allow_shared(&func, kernel, cfg.shared_mem_bytes as usize)?;
    let mut l = gpu.stream().launch_builder(&func);
    l.arg(&dz.buf).arg(&w.buf).arg(&mut out.buf);
    for a in &args {
        l.arg(a);
    }
    // SAFETY: (dz, w, out, m, n, k, per_split) as `dx_tc_*` take: `dZ` holds m * n values
    // and `W` n * k, both 16-byte aligned with n and k multiples of 8 (dispatch::dx_tc);
    // `out` m * k values of the kernel's output type, or splits * m * k floats.
    launched(kernel, unsafe { l.launch(cfg) })
}

/// `out (rows, cols) = sum_{r < rank} u[r, :]^T v[r, :]` on `stream`, summed in FP32 and
/// rounded once into `U`: `u` holds `rank` rows of `rows` values at pitch `ldu`, `v`
/// `rank` rows of `cols` at pitch `ldv` (FP32, or `U` itself for a 16-bit `U`). With
/// `u = dZ (m, n)` and `v = X (m, k)` it is `dW` of an `m`-row batch
/// ([`dispatch::Family::Dot`]).
pub fn outer_sum<U: DeviceElement, V: DeviceElement>(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    (u, ldu): (&CudaSlice<U>, usize),
    (v, ldv): (&CudaSlice<V>, usize),
    (rank, rows, cols): (usize, usize, usize),
    out: &mut CudaSlice<U>,
) -> Result<()> {
    let kernel = match (U::DTYPE, V::DTYPE) {
        (u, Dtype::F32) => dispatch::dot_kernels(u).outer,
        (u, v) if u == v => HalfKernels::of(u).map_or(Kernel::Outer, |h| h.outer_sum),
        (u, v) => return Err(Error::Unsupported(format!("an outer product of {u:?} and {v:?} values"))),
    };
    let fits = |len: usize, ld: usize, width: usize| ld >= width && len >= (rank - 1) * ld + width;
    if !(1..=OUTER_MAX_RANK).contains(&rank)
        || !fits(u.len(), ldu, rows)
        || !fits(v.len(), ldv, cols)
        || out.len() < rows * cols
    {
        return Err(Error::Shape(format!(
            "a sum of {rank} outer products (at most {OUTER_MAX_RANK}) into {rows} x {cols} from {} values at \
             pitch {ldu} and {} at pitch {ldv}, into {}",
            u.len(),
            v.len(),
            out.len()
        )));
    }
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    if [rows, cols, ldu, ldv].iter().any(|&d| d > u32::MAX as usize) {
        return Err(Error::Shape(format!("an outer product of {rows} x {cols} exceeds its 32-bit launch")));
    }
    // Blocks of up to OUTER_MAX_BLOCK_ROWS rows (each thread's quads of `v` serve them
    // all), spread over half the SMs where the rows allow: 2048 blocks for 8192^2, and a
    // small `dW` on half the SMs, which leaves the rest to `dX` beside it. (H200,
    // 2026-11-29, graph training step at 1-8 rows of 1024^2: 32 blocks of 32 rows,
    // outer_sum_bf16 4.5 us; 64 of 16, 3.1 us, the bf16 step 4-5% shorter; 128 of 8, 2.5
    // us, the step 2-4% longer: dX waits for SMs. Over every SM, 342 blocks of 3 rows,
    // TF32's step at one row took 4 us longer.)
    let col_blocks = cols.div_ceil(OUTER_BLOCK_COLS);
    let per_col_block = (gpu.props.multiprocessors / 2 / col_blocks).max(1);
    let block_rows = rows.div_ceil(per_col_block).clamp(1, OUTER_MAX_BLOCK_ROWS);
    let row_blocks = rows.div_ceil(block_rows);
    if col_blocks > u16::MAX as usize || row_blocks > i32::MAX as usize {
        return Err(Error::Shape(format!("an outer product of {rows} x {cols} exceeds its launch grid")));
    }
    let cfg = LaunchConfig {
        grid_dim: (row_blocks as u32, col_blocks as u32, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: OUTER_SMEM_BYTES as u32,
    };
    let func = gpu.function(kernel)?;
    // Quads where every row of `v` and `out` starts on one (`v` may be a caller's tensor
    // or view, starting anywhere).
    let quad = |addr: u64, size: usize| addr.is_multiple_of(4 * size as u64);
    let vector = cols.is_multiple_of(4)
        && ldv.is_multiple_of(4)
        && quad(v.device_ptr(stream).0, size_of::<V>())
        && quad(out.device_ptr(stream).0, size_of::<U>());
    let args = [ldu, ldv, rows, cols, rank, block_rows, usize::from(vector)].map(|a| a as u32);
    let mut l = stream.launch_builder(&func);
    l.arg(u).arg(&args[0]).arg(v);
    for a in &args[1..] {
        l.arg(a);
    }
    l.arg(out);
    // SAFETY: (u, ldu, v, ldv, rows, cols, rank, block_rows, vector, out) as the kernel
    // takes, its types `kernel`'s; the extents checked above; `vector` only where every
    // quad is aligned; the grid and shared memory as its launch wants.
    launched(kernel, unsafe { l.launch(cfg) })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ranges cover the rows, none empty, at most 64, each but the last a whole
    /// number of steps; the KernelBench shapes split as measured (the 8192-row weight
    /// fold in 32 ranges of 256, a 1024-row batch's `dW` row in 16 of 64).
    #[test]
    fn row_ranges_cover_the_rows_in_whole_steps() {
        for rows in [0, 1, 63, 64, 65, 300, 1024, 2100, 8192, 65536, 1 << 20] {
            for cols in [1, 7, 1023, 4096, 8192, 32768] {
                for bytes in [2, 4] {
                    let (ranges, per) = row_ranges(rows, cols, bytes, 132);
                    assert!((1..=64).contains(&ranges) && per >= 1, "{rows} x {cols}: {ranges} x {per}");
                    assert!(ranges * per >= rows && (ranges - 1) * per < rows.max(1), "{rows}: {ranges} x {per}");
                    assert!(per.is_multiple_of(COLUMN_DOT_STEP_ROWS) || per == rows.max(1), "{rows}: {per}");
                }
            }
        }
        assert_eq!(row_ranges(8192, 8192, 2, 132), (32, 256));
        assert_eq!(row_ranges(1024, 8192, 2, 132), (16, 64));
    }
}

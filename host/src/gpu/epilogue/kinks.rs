//! Launchers of `kink_scan`, `kink_scan_tiles`, `refine_values` and `refine_z`
//! (kernels-gpu/src/epilogue/kinks.rs): the saved `z` recomputed exactly where its
//! rounding could flip a kink's derivative.

use super::super::dispatch::values_one_by_one;
use super::super::{DeviceTensor, Gpu, VectorArg, launched};
use super::{DeviceChain, widen_params};
use crate::error::{Error, Result};
use crate::precision::Precision;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use kernel_abi::epilogue::{
    OP_AVG_POOL, OP_GROUP_NORM, OP_MAX_POOL, OP_ROW_MAX, OP_ROW_MIN, OpDesc, ROW_THREADS, features_after,
};
use kernel_abi::kernels::Kernel;
use kernel_abi::kinks::{
    CHUNK, ELEMENT_CAP, ORDER_BUCKETS, REFINE_SMEM_BYTES, REFINE_THREADS, REFINE_VALUES_BLOCKS_PER_SM, scan_smem_bytes,
    tiles_scan_layout,
};
use kernel_abi::ops::{ErrorRule, Pointwise};

/// GroupNorm groups of at most this many channels are scanned for ill-conditioning
/// (a spread under a quarter of the row's magnifies `z`'s error 4x or more): likely
/// for a few channels (3% of random groups of 4), about 1e-6 of groups of 16.
pub const SMALL_GROUP: usize = 8;

/// Ops of a chain over `n` features up to and including its last kinked one
/// (LeakyReLU, Hardtanh, row max or min, MaxPool), GroupNorm of small groups, or GroupNorm after a
/// Hardtanh (the clamp can leave a group of any size with all but a few channels at
/// one bound, its spread far under the others' radius): what the scan must walk. 0
/// when the chain has none of them.
pub fn scanned_prefix(ops: &[OpDesc], n: usize) -> usize {
    let mut f = n;
    let mut last = 0;
    let mut clamped = false;
    for (i, d) in ops.iter().enumerate() {
        let sensitive = kinked(d.code)
            || d.code == OP_GROUP_NORM && d.count > 0 && (clamped || f / d.count as usize <= SMALL_GROUP);
        if sensitive {
            last = i + 1;
        }
        clamped |= rule(d.code) == Some(ErrorRule::Clamp);
        f = features_after(d, f);
    }
    last
}

/// Whether op `code`'s derivative jumps (a per-element op's kink, as the registry
/// says: LeakyReLU, Hardtanh; or a tie: the row max or min, MaxPool).
pub(crate) fn kinked(code: u32) -> bool {
    matches!(code, OP_ROW_MAX | OP_ROW_MIN | OP_MAX_POOL) || rule(code).is_some_and(ErrorRule::has_kink)
}

/// A per-element op's error rule (`None` for the other ops).
fn rule(code: u32) -> Option<ErrorRule> {
    Pointwise::from_code(code).map(|p| p.info().error)
}

/// What [`refine_near_kinks`] did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Refined {
    /// Turned off (`Tuning::kink_refinement`, `--no-kink-refinement`), or done already for this `z`.
    Off,
    /// The chain has no kink and no GroupNorm of small groups: nothing to do.
    NoKinks,
    /// Rows of `n` features do not fit the row-wise scan's shared memory (about 28 K
    /// features, 14 K when the chain pools; the tile path's chains have no limit): `z`
    /// is left as computed.
    TooWide,
    /// Scanned, and the listed chunks of `z` recomputed.
    Done,
}

/// Which scan walks a chain.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scan {
    /// `kink_scan`: the row in shared memory (any chain).
    Rows,
    /// `kink_scan_tiles`: the chains the tile-wise path takes, in registers. With
    /// `values`, where [`values_one_by_one`] says it pays, a row's doubtful values (up
    /// to `ELEMENT_CAP` of them) go to `refine_values` one by one instead of to
    /// `refine_z` by chunks (`--kink-chunks-only` turns that off, for A/B measurements).
    Tiles { values: bool },
}
/// Recomputes, in f64, the chunks of `z = x w^T + b` (`(w, b)` the Linear layer the
/// GEMM ran, folded or not) whose rounding could put one of
/// `chain`'s kinked ops' inputs on the other side of its kink, so that the backward
/// takes the exact function's derivatives there (and the groups a GroupNorm of small
/// groups would magnify that rounding in). `precision` is the arithmetic that
/// computed `z`; `scan` says which scan walks the chain ([`Scan::Tiles`] only for one
/// the tile-wise path takes: pointwise ops, GroupNorm over power-of-two groups of
/// 4..=128 channels).
pub fn refine_near_kinks(
    gpu: &Gpu,
    chain: &DeviceChain,
    scan: Scan,
    precision: Precision,
    x: &DeviceTensor,
    (w, b): (&DeviceTensor, VectorArg<'_>),
    z: &mut DeviceTensor,
) -> Result<Refined> {
    let n_ops = scanned_prefix(&chain.ops, z.shape.get(1).copied().unwrap_or(0));
    if n_ops == 0 {
        return Ok(Refined::NoKinks);
    }
    let (rows, n, k) = match (&x.shape[..], &w.shape[..], &z.shape[..]) {
        (&[m, k], &[n, wk], &[zm, zn]) if wk == k && zm == m && zn == n && b.len == n => (m, n, k),
        _ => {
            return Err(Error::Shape(format!(
                "refining z {:?} from x {:?}, w {:?} and b [{}]: the shapes disagree",
                z.shape, x.shape, w.shape, b.len
            )));
        }
    };
    let chunks = n.div_ceil(CHUNK);
    if rows > i32::MAX as usize || chunks * rows > u32::MAX as usize || k > u32::MAX as usize {
        return Err(Error::Shape(format!("refining a {rows} x {n} z (k = {k}) is outside the kernels' range")));
    }
    // The refinement's kernels read an FP32 bias (a 16-bit model's, widened here once:
    // at their 128 registers the stored-type reads spilled).
    let widened = widen_params(gpu, None, n, Some(b))?;
    let b = match widened.as_ref().and_then(|w| w.bias) {
        Some(copy) => b.read_from(copy),
        None => b,
    };
    let (rel, abs) = precision.z_error(k);
    let stream = gpu.stream();
    let (n32, ops32) = (n as u32, n_ops as u32);
    // Both scans: one block per row, the row-wise one holding the row (twice over
    // where the chain pools) in shared memory.
    let (name, cap, smem) = match scan {
        Scan::Tiles { values } => {
            let one_by_one = values && values_one_by_one(&chain.ops[..n_ops], precision);
            let cap = if one_by_one { ELEMENT_CAP } else { 0 };
            (Kernel::KinkScanTiles, cap, tiles_scan_layout(n, cap)[5])
        }
        Scan::Rows => {
            let pooled = chain.ops[..n_ops].iter().any(|d| matches!(d.code, OP_AVG_POOL | OP_MAX_POOL));
            (Kernel::KinkScan, 0, scan_smem_bytes(n, pooled))
        }
    };
    if smem > gpu.props.max_shared_per_block_optin {
        return Ok(Refined::TooWide);
    }
    let mut counts = gpu.zeroed_buf::<u32>(stream, chunks)?;
    // SAFETY: the scan writes every entry that refine_z reads (those below counts).
    let mut lists = unsafe { gpu.alloc_buf::<u32>(stream, chunks * rows)? };
    // (row, column) pairs for refine_values, up to `cap` per row, and their count.
    // SAFETY: the scan writes every pair below the count before refine_values reads it.
    let mut values = unsafe { gpu.alloc_buf::<u32>(stream, 2 * cap * rows)? };
    let mut value_count = gpu.zeroed_buf::<u32>(stream, 1)?;
    let func = gpu.function(name)?;
    gpu.allow_shared(&func, name, smem)?;
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (ROW_THREADS as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let cap32 = cap as u32;
    let mut l = stream.launch_builder(&func);
    l.arg(&z.buf).arg(&n32).arg(&chain.descs).arg(&ops32).arg(&rel).arg(&abs).arg(&mut counts).arg(&mut lists);
    if matches!(scan, Scan::Tiles { .. }) {
        l.arg(&cap32).arg(&mut values).arg(&mut value_count);
    }
    // SAFETY: matches the scan's signature; z is rows x n; the chain's first n_ops ops
    // were validated against n (and, for kink_scan_tiles, are ones the tile path
    // takes: the caller's `scan`); counts (zeroed) and lists have chunks and
    // chunks * rows entries, values 2 * cap per row; the shared memory is the
    // layout for (n, cap).
    launched(name, unsafe { l.launch(cfg) })?;
    if cap > 0 {
        let func = gpu.function(Kernel::RefineValues)?;
        let cfg = LaunchConfig {
            grid_dim: ((gpu.props.multiprocessors * REFINE_VALUES_BLOCKS_PER_SM) as u32, 1, 1),
            block_dim: (ROW_THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let k32 = k as u32;
        let mut l = stream.launch_builder(&func);
        l.arg(&x.buf).arg(&w.buf).arg(&b.word).arg(&mut z.buf).arg(&values).arg(&value_count).arg(&n32).arg(&k32);
        // SAFETY: matches refine_values' signature; x, w, b are z's operands (shapes
        // checked above); the scan left value_count pairs inside z in values.
        launched(Kernel::RefineValues, unsafe { l.launch(cfg) })?;
    }
    refine(gpu, x, w, b, z, &counts, &lists, &value_count, (rows, n, k), cap == 0)
}

/// Queues `refine_z` over the chunks and rows a scan listed.
#[allow(clippy::too_many_arguments)]
fn refine(
    gpu: &Gpu,
    x: &DeviceTensor,
    w: &DeviceTensor,
    b: VectorArg<'_>,
    z: &mut DeviceTensor,
    counts: &CudaSlice<u32>,
    lists: &CudaSlice<u32>,
    value_count: &CudaSlice<u32>,
    (rows, n, k): (usize, usize, usize),
    ordered: bool,
) -> Result<Refined> {
    let stream = gpu.stream();
    let chunks = n.div_ceil(CHUNK);
    // The chunks most listed first (refine_order), so the grid's last blocks are short;
    // where rows went to refine_values, the few rows past its cap in column order (the
    // order costs ~4 us, all refine_z then has to do).
    let order = if ordered {
        // SAFETY: refine_order writes all `chunks` entries before refine_z reads them.
        let mut order = unsafe { gpu.alloc_buf::<u32>(stream, chunks)? };
        let func = gpu.function(Kernel::RefineOrder)?;
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (ROW_THREADS as u32, 1, 1),
            shared_mem_bytes: (ORDER_BUCKETS * 4) as u32,
        };
        let chunks32 = chunks as u32;
        let mut l = stream.launch_builder(&func);
        l.arg(counts).arg(&chunks32).arg(&mut order);
        // SAFETY: matches refine_order's signature; counts and order hold `chunks` entries.
        launched(Kernel::RefineOrder, unsafe { l.launch(cfg) })?;
        Some(order)
    } else {
        None
    };
    let func = gpu.function(Kernel::RefineZ)?;
    gpu.allow_shared(&func, Kernel::RefineZ, REFINE_SMEM_BYTES)?;
    let cfg = LaunchConfig {
        grid_dim: (chunks as u32, 1, 1),
        block_dim: (REFINE_THREADS as u32, 1, 1),
        shared_mem_bytes: REFINE_SMEM_BYTES as u32,
    };
    let (rows32, n32, k32) = (rows as u32, n as u32, k as u32);
    let mut l = stream.launch_builder(&func);
    l.arg(&x.buf).arg(&w.buf).arg(&b.word).arg(&mut z.buf).arg(counts).arg(lists);
    let identity = 0u64;
    match &order {
        Some(order) => l.arg(order),
        None => l.arg(&identity),
    };
    l.arg(&rows32).arg(&n32).arg(&k32);
    // SAFETY: matches refine_z's signature; shapes checked above; counts and lists as
    // kink_scan leaves them, order as refine_order leaves it (or null: column order),
    // in stream order.
    launched(Kernel::RefineZ, unsafe { l.launch(cfg) })?;
    if gpu.tuning().kink_stats {
        // How much was recomputed (waits for the stream): for tuning the error model.
        let counts = stream.clone_dtoh(counts).map_err(|e| Error::cuda("reading the kink counts", e))?;
        let values = stream.clone_dtoh(value_count).map_err(|e| Error::cuda("reading the kink counts", e))?[0];
        let listed: u64 = counts.iter().map(|&c| u64::from(c)).sum();
        eprintln!(
            "kink refinement: {values} values one by one; {listed} (row, chunk) pairs of {} ({:.2}%), \
             {} of {chunks} chunks, at most {} rows in one",
            rows * chunks,
            100.0 * listed as f64 / (rows * chunks) as f64,
            counts.iter().filter(|&&c| c > 0).count(),
            counts.iter().max().unwrap_or(&0)
        );
    }
    Ok(Refined::Done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scan_walks_the_chain_up_to_its_last_kink_or_small_group() {
        use kernel_abi::ops::code::{
            Hardtanh as OP_HARDTANH, LeakyRelu as OP_LEAKY_RELU, Mish as OP_MISH, Swish as OP_SWISH,
        };
        let op = |code| OpDesc { code, ..OpDesc::default() };
        let gn = |groups| OpDesc { code: OP_GROUP_NORM, count: groups, ..OpDesc::default() };
        let pool = |k| OpDesc { code: OP_AVG_POOL, count: k, ..OpDesc::default() };
        // Groups of 64 channels need no scan; of 8 they do.
        assert_eq!(scanned_prefix(&[op(OP_SWISH), gn(4)], 256), 0);
        assert_eq!(scanned_prefix(&[op(OP_SWISH), gn(32)], 256), 2);
        // After a pool of 4, 32 groups of 256 / 4 features hold 2 channels each.
        assert_eq!(scanned_prefix(&[pool(4), gn(32), op(OP_MISH)], 256), 2);
        assert_eq!(scanned_prefix(&[gn(4), op(OP_LEAKY_RELU), op(OP_SWISH)], 256), 2);
        // A GroupNorm after a clamp, whatever its groups (M5's chain).
        assert_eq!(scanned_prefix(&[op(OP_HARDTANH), op(OP_MISH), gn(4)], 256), 3);
        assert_eq!(scanned_prefix(&[op(OP_LEAKY_RELU), op(OP_MISH), gn(4)], 256), 1);
        assert_eq!(scanned_prefix(&[op(OP_SWISH), op(OP_ROW_MAX)], 256), 2);
        // The row min and MaxPool have ties; softmax none.
        use kernel_abi::epilogue::{OP_MAX_POOL, OP_SOFTMAX};
        assert_eq!(scanned_prefix(&[op(OP_SOFTMAX), op(OP_ROW_MIN), op(OP_SWISH)], 256), 2);
        assert_eq!(scanned_prefix(&[op(OP_MAX_POOL), op(OP_SOFTMAX)], 256), 1);
        assert_eq!(scanned_prefix(&[op(OP_SOFTMAX)], 256), 0);
    }

    #[test]
    fn values_go_one_by_one_where_kinks_come_before_groups() {
        use kernel_abi::ops::code::{Bias, Hardtanh, LeakyRelu, Mish};
        let op = |code| OpDesc { code, ..OpDesc::default() };
        let gn = OpDesc { code: OP_GROUP_NORM, count: 32, ..OpDesc::default() };
        let m5 = [op(Bias), op(Hardtanh), op(Mish), gn];
        let m3 = [gn, op(LeakyRelu)];
        assert!(values_one_by_one(&m5, Precision::Tf32) && values_one_by_one(&m5, Precision::Tf32x3));
        assert!(!values_one_by_one(&m5, Precision::Bf16));
        assert!(!values_one_by_one(&m3, Precision::Tf32));
    }
}

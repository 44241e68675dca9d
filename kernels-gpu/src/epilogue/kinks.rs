//! Refining the saved GEMM output `z` where the chain backward would read a kink.
//!
//! LeakyReLU, Hardtanh and the row max have derivatives that jump. Where the forward's
//! rounded `z` (TF32, bf16, even FP32 at large `k`) puts an op's input within its
//! rounding error of a kink, the backward may take the other side's derivative: with
//! TF32 about 1e-4 of the elements do, 1e-2 of the gradients' norm (docs/PERFORMANCE.md).
//! `kink_scan` finds those places, row by row, by carrying an error radius with each
//! value through the chain up to its last kinked op, and lists the 16-column chunks of
//! `z` that each doubtful decision depends on (its GroupNorm group, pooling window or
//! whole row). `refine_z` recomputes those chunks of `z` as dot products accumulated
//! in f64 (the products of two f32 are exact there), so the backward decides every
//! kink as the exact function does. Where a row's decisions depend on a few values
//! only (M5's Hardtanh before its GroupNorm), `kink_scan_tiles` lists those values and
//! `refine_values` recomputes them one by one instead: a weight row each, not a chunk.

use super::pointwise::{PointwiseMath, match_pointwise, param_count};
use crate::prelude::math::{fabs, fma, max_nan, rsqrt, sqrt};
use crate::prelude::async_copy::{
    cp_async_4, cp_async_16_hint, cp_async_commit, cp_async_wait, cp_async_wait_all, l2_policy, shared_address,
};
use crate::prelude::global::load_v4_nc;
use crate::prelude::tensor_core::ld_shared_v4;
use crate::prelude::tensor_core::mma_f64_m16n8k16;
use crate::prelude::warp::{segment_sum, shfl_xor, warp_max, warp_sum, warp_sum_f64};
use super::lanes::column_params;
use crate::prelude::*;
use crate::unroll;
use kernel_abi::epilogue::*;
use kernel_abi::kinks::*;
use kernel_abi::ops::ErrorRule;

const WARPS: usize = ROW_THREADS / WARP_SIZE as usize;
const WARP: usize = WARP_SIZE as usize;
/// A dependency that spans the whole row (`dep` below).
const WHOLE_ROW: usize = 0;
/// A GroupNorm group is recomputed whole when its normalised values' radius exceeds
/// this many times `z`'s own relative error (`rel_err`: for a GroupNorm first in the
/// chain, a group whose spread is below a quarter of the row's rms): its gradients
/// would carry the forward's error magnified as much.
const ILL_CONDITIONED: f32 = 4.0;

/// The smallest aligned block of `z` columns holding both an aligned block of `a` and
/// one of `b` (each a multiple of the other), or the whole row.
#[inline(always)]
fn nest(a: usize, b: usize) -> usize {
    if a == WHOLE_ROW || b == WHOLE_ROW {
        WHOLE_ROW
    } else if b.is_multiple_of(a) {
        b
    } else if a.is_multiple_of(b) {
        a
    } else {
        WHOLE_ROW
    }
}

/// One value through a per-element op: its output, its radius, and whether the op's
/// kink lies within that radius of the input (the one rule both scans apply: the op's
/// [`ErrorRule`] in the registry). `p` is the op's parameter at the value's column,
/// `rc = rx + c |x|` its radius with the common relative error `c` the input still
/// carries.
#[inline(always)]
fn pointwise_radius<P: PointwiseMath>(op: &OpDesc, p: f32, x: f32, rx: f32, rc: f32) -> (f32, f32, bool) {
    let y = P::forward(x, p, op.a, op.b);
    match const { P::OP.info().error } {
        ErrorRule::Shift => (y, rc, false),
        ErrorRule::Linear => (y, rx * fabs(P::grad(x, p, op.a, op.b)), false),
        ErrorRule::Smooth { lipschitz } => (y, rc * lipschitz, false),
        ErrorRule::KinkAtZero => (y, rx * fabs(op.a).max(1.0), fabs(x) <= rx),
        ErrorRule::Clamp => (y, rc, fabs(x - op.a) <= rc || fabs(x - op.b) <= rc),
    }
}

/// Whether the common relative error is gone after op `code`: folded into the radius
/// (see [`ErrorRule::clears_common`]) or divided out (GroupNorm).
#[inline(always)]
fn clears_common(code: u32) -> bool {
    code == OP_GROUP_NORM || match_pointwise!(code, P => const { P::OP.info().error.clears_common() }, _ => false)
}

/// A group's statistics for the radius rules: `size` values, `r2` the sum of their
/// squared radii, `rstd` their `1 / std`.
#[derive(Clone, Copy)]
struct GroupRadius {
    mean: f32,
    rstd: f32,
    /// The statistics' own radius: the rms of the group's radii over sqrt(size)
    /// (independent roundings average out in the mean and the variance).
    r_stat: f32,
    /// The group's spread is small against its values' radius: the error is magnified
    /// into every normalised value and its gradients, so the group is recomputed whole.
    ill_conditioned: bool,
}

impl GroupRadius {
    #[inline(always)]
    fn new(mean: f32, rstd: f32, r2: f32, size: usize, rel_err: f32) -> Self {
        let inv = 1.0 / size as f32;
        let ill_conditioned = size > 1 && rstd * sqrt(r2 * inv) > ILL_CONDITIONED * rel_err;
        GroupRadius { mean, rstd, r_stat: sqrt(r2) * inv, ill_conditioned }
    }

    /// One value through the normalisation and the affine `gamma`, `beta`: its output
    /// and radius (its own radius plus the statistics', through the mean and `1 / std`).
    #[inline(always)]
    fn apply(&self, x: f32, rx: f32, gamma: f32, beta: f32) -> (f32, f32) {
        let d = (x - self.mean) * self.rstd;
        (fma(d, gamma, beta), fabs(gamma) * self.rstd * (rx + self.r_stat * (1.0 + fabs(d))))
    }
}

/// `v` reduced over the block, in every thread: `in_warp` over each warp, then the
/// warps' results folded by `fold` from `init` (`red` holds `WARPS` floats; ends with
/// a barrier).
///
/// # Safety
/// Called by the whole block.
#[inline(always)]
unsafe fn block_reduce(v: f32, red: *mut f32, in_warp: fn(f32) -> f32, init: f32, fold: fn(f32, f32) -> f32) -> f32 {
    let (warp, lane) = (warp_id() as usize, lane_id() as usize);
    let s = in_warp(v);
    unsafe {
        if lane == 0 {
            *red.add(warp) = s;
        }
        sync_threads();
        let mut total = init;
        for w in 0..WARPS {
            total = fold(total, *red.add(w));
        }
        sync_threads();
        total
    }
}

/// Sum of `v` over the block, in every thread (see [`block_reduce`]).
///
/// # Safety
/// Called by the whole block.
#[inline(always)]
unsafe fn block_sum(v: f32, red: *mut f32) -> f32 {
    unsafe { block_reduce(v, red, warp_sum, 0.0, |a, b| a + b) }
}

/// Maximum of `v` over the block, NaN propagating, in every thread (see [`block_reduce`]).
///
/// # Safety
/// Called by the whole block.
#[inline(always)]
unsafe fn block_max(v: f32, red: *mut f32) -> f32 {
    unsafe { block_reduce(v, red, warp_max, f32::NEG_INFINITY, max_nan) }
}

/// `(v[j], r[j]) = op(j, v[j], r[j])` for the block's values `j < f`.
///
/// # Safety
/// `v` and `r` hold `f` floats of shared memory; `op` reads only inside its contract.
#[inline(always)]
unsafe fn each(v: *mut f32, r: *mut f32, f: usize, mut op: impl FnMut(usize, f32, f32) -> (f32, f32)) {
    let mut j = thread_idx_x() as usize;
    while j < f {
        // SAFETY: j < f.
        unsafe {
            let (y, ry) = op(j, *v.add(j), *r.add(j));
            *v.add(j) = y;
            *r.add(j) = ry;
        }
        j += ROW_THREADS;
    }
}

/// Where [`kink_scan`] marks the chunks a doubtful decision depends on, for the op
/// being scanned: `pool` columns of `z` per feature of its input, decisions depending
/// on aligned blocks of `dep` columns (or the whole row).
#[derive(Clone, Copy)]
struct Marks {
    flags: *mut u8,
    row_flag: *mut u32,
    pool: usize,
    dep: usize,
    n: usize,
}

impl Marks {
    /// Marks the chunks of `z` columns that feature `j` of the op's input depends on.
    ///
    /// # Safety
    /// `flags` holds `n.div_ceil(CHUNK)` bytes; `j * pool < n`.
    #[inline(always)]
    unsafe fn flag(&self, j: usize) {
        unsafe {
            if self.dep == WHOLE_ROW {
                *self.row_flag = 1;
                return;
            }
            let start = j * self.pool / self.dep * self.dep;
            let end = (start + self.dep).min(self.n);
            let mut c = start / CHUNK;
            while c * CHUNK < end {
                *self.flags.add(c) = 1;
                c += 1;
            }
        }
    }
}

/// [`each`] through one per-element op `P`, marking the values whose kink is within
/// reach (the op a constant here, so the loop has no dispatch).
///
/// # Safety
/// As [`each`] and [`Marks::flag`]; the op's parameter holds `f` floats.
#[inline(always)]
unsafe fn pointwise_pass<P: PointwiseMath>(op: &OpDesc, v: *mut f32, r: *mut f32, f: usize, c: f32, marks: Marks) {
    let p0 = op.param0 as *const f32;
    unsafe {
        each(v, r, f, |j, x, rx| {
            let p = if P::HAS_PARAM { *p0.add(j) } else { 0.0 };
            let (y, ry, doubtful) = pointwise_radius::<P>(op, p, x, rx, rx + c * fabs(x));
            if doubtful {
                marks.flag(j);
            }
            (y, ry)
        })
    }
}

/// Lists, for every row of `z`, the chunks of `z` whose rounding could move a kinked
/// op's input across its kink, or that feed an ill-conditioned GroupNorm group:
/// `lists[c * rows + i]`, `i < counts[c]`, are the rows whose chunk `c` needs its
/// exact values.
///
/// Each value of `z` starts with the radius `rel_err * rms(z row)` and a relative
/// error `abs_err` common to the row (the host's model of its precision's GEMM error,
/// already scaled to a bound), which each op carries forward: Lipschitz bounds for
/// the pointwise ops, and for GroupNorm the element's own radius plus its group
/// statistics' (`rms radius / sqrt(size)`, through the mean and through `1 / std`).
/// An input within its radius of a kink (LeakyReLU's 0, Hardtanh's bounds, a second
/// candidate for a row max) is doubtful.
///
/// # Safety
/// Device pointers; `ops[..n_ops]` well formed. `counts` zeroed, `n.div_ceil(CHUNK)`
/// entries; `lists` `n.div_ceil(CHUNK) * rows`. Launch: grid `(rows, 1, 1)`,
/// `ROW_THREADS` threads, `scan_smem_bytes(n)` dynamic shared memory.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "ptx-kernel" fn kink_scan(
    z: *const f32,
    n: u32,
    ops: *const OpDesc,
    n_ops: u32,
    rel_err: f32,
    abs_err: f32,
    counts: *mut u32,
    lists: *mut u32,
) {
    let row = block_idx_x() as usize;
    let rows = grid_dim_x() as usize;
    let t = thread_idx_x() as usize;
    let (warp, lane) = (warp_id() as usize, lane_id() as usize);
    let n = n as usize;
    let chunks = n.div_ceil(CHUNK);
    let base = dynamic_shared::<f32>();
    // SAFETY (whole body): scan_smem_bytes(n, pooled) covers [v: n][r: n] (and, when
    // the ops pool, [v_alt: n][r_alt: n]) [red: WARPS][row flag: 1][flags: chunks
    // bytes]; every index below is inside its array; barriers are reached by the whole block.
    unsafe {
        let mut pooled = false;
        for i in 0..n_ops as usize {
            pooled |= (*ops.add(i)).code == OP_AVG_POOL;
        }
        let (mut v, mut r) = (base, base.add(n));
        let (mut v_alt, mut r_alt) = if pooled { (base.add(2 * n), base.add(3 * n)) } else { (v, r) };
        let red = base.add(if pooled { 4 * n } else { 2 * n });
        let row_flag = red.add(WARPS) as *mut u32;
        let flags = row_flag.add(1) as *mut u8;
        let mut sq = 0.0;
        let mut j = t;
        while j < n {
            let x = *z.add(row * n + j);
            *v.add(j) = x;
            if x == x {
                sq += x * x;
            }
            j += ROW_THREADS;
        }
        let mut c = t;
        while c < chunks {
            *flags.add(c) = 0;
            c += ROW_THREADS;
        }
        if t == 0 {
            *row_flag = 0;
        }
        let rms = sqrt(block_sum(sq, red) / n as f32);
        let base = rel_err * rms;
        let mut j = t;
        while j < n {
            *r.add(j) = base;
            j += ROW_THREADS;
        }
        sync_threads();

        // `r` holds each value's radius; `c` a relative error common to all values
        // (TF32's truncation shrinks every product alike): a GroupNorm divides it out,
        // a sign or a row max's pick does not see it, and where it matters (an added
        // bias, a Hardtanh bound, a curved activation) it joins `r` as `c |v|`.
        let mut c = abs_err;
        let (mut f, mut pool, mut dep) = (n, 1usize, 1usize);
        for i in 0..n_ops as usize {
            let op = &*ops.add(i);
            let (p0, p1) = (op.param0 as *const f32, op.param1 as *const f32);
            let f_out = features_after(op, f);
            let marks = Marks { flags, row_flag, pool, dep, n };
            match op.code {
                OP_GROUP_NORM => {
                    let (groups, size) = (op.count as usize, f / op.count as usize);
                    // Lanes per group: a power-of-two group of up to 32 channels takes
                    // that many lanes (a warp does 32 / size groups at once), larger or
                    // odd ones the whole warp.
                    let seg = if size <= WARP && size.is_power_of_two() { size } else { WARP };
                    let per_warp = WARP >> seg.trailing_zeros();
                    let (sub, sl) = (lane >> seg.trailing_zeros(), lane & (seg - 1));
                    let inv = 1.0 / size as f32;
                    let mut g0 = warp * per_warp;
                    while g0 < groups {
                        let g = g0 + sub;
                        let live = g < groups;
                        let (vs, rs) = (v.add(g.min(groups - 1) * size), r.add(g.min(groups - 1) * size));
                        let (mut s1, mut s2) = (0.0, 0.0);
                        let mut j = sl;
                        while live && j < size {
                            s1 += *vs.add(j);
                            s2 += *rs.add(j) * *rs.add(j);
                            j += seg;
                        }
                        let mean = segment_sum(s1, seg as u32) * inv;
                        let r2 = segment_sum(s2, seg as u32);
                        let mut sq = 0.0;
                        let mut j = sl;
                        while live && j < size {
                            let d = *vs.add(j) - mean;
                            sq += d * d;
                            j += seg;
                        }
                        let rstd = rsqrt(fma(segment_sum(sq, seg as u32), inv, op.a));
                        let stats = GroupRadius::new(mean, rstd, r2, size, rel_err);
                        if live && sl == 0 && stats.ill_conditioned {
                            Marks { dep: nest(dep, size * pool), ..marks }.flag(g * size);
                        }
                        let mut j = sl;
                        while live && j < size {
                            let ch = g * size + j;
                            let (y, ry) = stats.apply(*vs.add(j), *rs.add(j), *p0.add(ch), *p1.add(ch));
                            *vs.add(j) = y;
                            *rs.add(j) = ry;
                            j += seg;
                        }
                        g0 += WARPS * per_warp;
                    }
                    dep = nest(dep, size * pool);
                }
                OP_AVG_POOL => {
                    let k = op.count as usize;
                    let mut j = t;
                    while j < f_out {
                        let (mut sv, mut sr) = (0.0, 0.0);
                        for e in 0..k {
                            sv += *v.add(j * k + e);
                            sr += *r.add(j * k + e);
                        }
                        *v_alt.add(j) = sv / k as f32;
                        *r_alt.add(j) = sr / k as f32;
                        j += ROW_THREADS;
                    }
                    core::mem::swap(&mut v, &mut v_alt);
                    core::mem::swap(&mut r, &mut r_alt);
                    pool *= k;
                    dep = nest(dep, pool);
                }
                OP_ROW_MAX => {
                    // Doubtful when another element's upper bound reaches the largest
                    // lower bound: the arg-max could be either.
                    let mut lo = f32::NEG_INFINITY;
                    let mut j = t;
                    while j < f {
                        lo = max_nan(lo, *v.add(j) - *r.add(j));
                        j += ROW_THREADS;
                    }
                    let top = block_max(lo, red);
                    let (mut near, mut m, mut rm) = (0.0, f32::NEG_INFINITY, 0.0f32);
                    let mut j = t;
                    while j < f {
                        let (x, rx) = (*v.add(j), *r.add(j));
                        if x + rx >= top {
                            near += 1.0;
                        }
                        m = max_nan(m, x);
                        rm = rm.max(rx);
                        j += ROW_THREADS;
                    }
                    let near = block_sum(near, red);
                    let m = block_max(m, red);
                    // A bound on the max's own radius, for any op after it.
                    let rm = block_reduce(rm, red, warp_max, 0.0, f32::max);
                    if t == 0 {
                        *v = m;
                        *r = rm;
                        if near >= 2.0 && top == top {
                            *row_flag = 1;
                        }
                    }
                    dep = WHOLE_ROW;
                }
                // One loop per op, its code a constant there (a `match` per value would
                // dispatch in the loop).
                code => match_pointwise!(code, P => pointwise_pass::<P>(op, v, r, f, c, marks),
                    _ => each(v, r, f, |_, _, _| (f32::NAN, f32::NAN))), // unknown code: poison
            }
            if clears_common(op.code) {
                c = 0.0;
            }
            f = f_out;
            sync_threads();
        }

        let whole = *row_flag != 0;
        let mut c = t;
        while c < chunks {
            if whole || *flags.add(c) != 0 {
                let i = atomic_add_global(counts.add(c), 1);
                *lists.add(c * rows + i as usize) = row as u32;
            }
            c += ROW_THREADS;
        }
    }
}

/// Bits of the chunks (of the 8 in a 128-column segment starting at `seg0`) that the
/// decision at column `col` depends on: its aligned block of `dep` columns (a power
/// of two up to 128), cut at `n`.
#[inline(always)]
fn chunk_bits(col: usize, dep: usize, seg0: usize, n: usize) -> u32 {
    let start = col & !(dep - 1);
    let end = (start + dep).min(n);
    let (first, last) = ((start - seg0) / CHUNK, (end - 1 - seg0) / CHUNK);
    ((2u32 << last) - 1) & !((1u32 << first) - 1)
}

/// [`kink_scan`] for the chains the tile-wise path takes (pointwise ops and GroupNorm
/// over groups of a power of two from 4 to 128 channels, so a group never crosses a
/// 128-column segment): one warp per row, a lane holding 4 consecutive columns of
/// each segment, values and radii in registers, a group's statistics by shuffles
/// among its lanes. The same radii and tests as the row-wise scan.
///
/// The block's warps take every 8th segment of one row. A row whose decisions depend
/// on at most `cap` values of `z` (M5's under TF32: its Hardtanh's doubtful values
/// alone, now and then a whole group of its GroupNorm) appends them to `values` as
/// (row, column) pairs, `value_count` of them, for [`refine_values`]: `refine_z` would
/// read a 16-column chunk of weights and `x`'s row for each. A row with more (M3's:
/// every kink after its GroupNorm takes a group) lists the chunks for `refine_z`, each
/// (row, chunk) once.
///
/// # Safety
/// As [`kink_scan`], and the chain as said; `values` has room for `2 * cap` u32 per
/// row. Launch: grid `(rows, 1, 1)`, `ROW_THREADS` threads, `tiles_scan_layout(n,
/// cap)[5]` bytes of shared memory.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "ptx-kernel" fn kink_scan_tiles(
    z: *const f32,
    n: u32,
    ops: *const OpDesc,
    n_ops: u32,
    rel_err: f32,
    abs_err: f32,
    counts: *mut u32,
    lists: *mut u32,
    cap: u32,
    values: *mut u32,
    value_count: *mut u32,
) {
    let (rows, n, cap) = (grid_dim_x() as usize, n as usize, cap as usize);
    let row = block_idx_x() as usize;
    let t = thread_idx_x() as usize;
    let (warp, lane) = (warp_id() as usize, lane_id() as usize);
    let vec = n.is_multiple_of(4);
    let [first, red, count, list, marks, _] = tiles_scan_layout(n, cap);
    // SAFETY (whole body): columns are read below n only; ops[..n_ops] as the contract
    // says; the shared memory is laid out as tiles_scan_layout says, `list` written
    // below `cap`, `marks` once per segment by its warp; the barriers are reached by
    // the whole block (`found` is read by every thread after the last atomic).
    unsafe {
        let smem = dynamic_shared::<u8>();
        let (red, count) = (smem.add(red) as *mut f32, smem.add(count) as *mut u32);
        let (list, marks) = (smem.add(list) as *mut u32, smem.add(marks) as *mut u32);
        if t == 0 {
            *count = 0;
        }
        let zr = z.add(row * n);
        let mut sq = 0.0;
        let mut c = 4 * (warp * WARP + lane);
        while c < n {
            let v = load4(zr, c, n, vec);
            unroll!(e in 0..4 => {
                if v[e] == v[e] {
                    sq = fma(v[e], v[e], sq);
                }
            });
            c += 4 * ROW_THREADS;
        }
        // (Its barriers also order the count's reset before the atomics below.)
        let base = rel_err * sqrt(block_sum(sq, red) / n as f32);
        let mut seg0 = 4 * WARP * warp;
        while seg0 < n {
            let c = seg0 + 4 * lane;
            let mut v = load4(zr, c, n, vec);
            let mut r = [base; 4];
            let mut cc = abs_err;
            let mut dep = 1usize;
            // Chunks of decisions over whole groups; this lane's values doubtful alone.
            let mut bits = 0u32;
            let mut alone = 0u32;
            for i in 0..n_ops as usize {
                let op = &*ops.add(i);
                let (p0, p1) = (op.param0 as *const f32, op.param1 as *const f32);
                match op.code {
                    OP_GROUP_NORM => {
                        let size = n / op.count as usize;
                        let lanes = (size / 4) as u32;
                        let inv = 1.0 / size as f32;
                        let (mut s1, mut s2) = (0.0, 0.0);
                        unroll!(e in 0..4 => {
                            s1 += v[e];
                            s2 = fma(r[e], r[e], s2);
                        });
                        let mean = segment_sum(s1, lanes) * inv;
                        let r2 = segment_sum(s2, lanes);
                        let mut s3 = 0.0;
                        unroll!(e in 0..4 => {
                            let d = v[e] - mean;
                            s3 = fma(d, d, s3);
                        });
                        let rstd = rsqrt(fma(segment_sum(s3, lanes), inv, op.a));
                        let stats = GroupRadius::new(mean, rstd, r2, size, rel_err);
                        dep = dep.max(size);
                        if c < n && stats.ill_conditioned {
                            bits |= chunk_bits(c, dep, seg0, n);
                        }
                        // (Last, as in M5's chain, only its conditioning is asked.)
                        if i + 1 < n_ops as usize {
                            let gamma = column_params(p0, n, c);
                            let beta = column_params(p1, n, c);
                            unroll!(e in 0..4 => {
                                (v[e], r[e]) = stats.apply(v[e], r[e], gamma[e], beta[e]);
                            });
                        }
                    }
                    code => {
                        let p = if param_count(op) > 0 { column_params(p0, n, c) } else { [0.0; 4] };
                        unroll!(e in 0..4 => {
                            let rc = r[e] + cc * fabs(v[e]);
                            let (y, ry, doubtful) = match_pointwise!(code,
                                P => pointwise_radius::<P>(op, p[e], v[e], r[e], rc),
                                _ => (f32::NAN, f32::NAN, false)); // unknown code: poison
                            if doubtful && c + e < n {
                                if dep == 1 {
                                    alone |= 1 << e;
                                } else {
                                    bits |= chunk_bits(c + e, dep, seg0, n);
                                }
                            }
                            v[e] = y;
                            r[e] = ry;
                        });
                    }
                }
                if clears_common(op.code) {
                    cc = 0.0;
                }
            }
            let mut alone_bits = 0u32;
            unroll!(e in 0..4 => {
                if alone & (1 << e) != 0 {
                    alone_bits |= chunk_bits(c + e, 1, seg0, n);
                    if cap > 0 {
                        let i = atomic_add_shared(count, 1) as usize;
                        if i < cap {
                            *list.add(i) = (c + e) as u32;
                        }
                    }
                }
            });
            // The segment's chunks any lane flagged, kept for after the count is known.
            let mut m = 1;
            while m < WARP as u32 {
                bits |= shfl_xor(f32::from_bits(bits), m).to_bits();
                alone_bits |= shfl_xor(f32::from_bits(alone_bits), m).to_bits();
                m <<= 1;
            }
            if lane == 0 {
                *marks.add(seg0 / (4 * WARP)) = bits | alone_bits << 8;
            }
            seg0 += 4 * ROW_THREADS;
        }
        sync_threads();
        // The whole groups' values join the list (a chunk at a time), so that a row with
        // few doubtful values in all goes to refine_values whole.
        let segs = n.div_ceil(4 * WARP);
        if cap > 0 {
            let mut s = t;
            while s < segs {
                let mut todo = *marks.add(s) & 0xff;
                while todo != 0 {
                    let c0 = (s * 8 + todo.trailing_zeros() as usize) * CHUNK;
                    todo &= todo - 1;
                    for c in c0..(c0 + CHUNK).min(n) {
                        let i = atomic_add_shared(count, 1) as usize;
                        if i < cap {
                            *list.add(i) = c as u32;
                        }
                    }
                }
                s += ROW_THREADS;
            }
            sync_threads();
        }
        let found = if cap > 0 { *count as usize } else { 0 };
        if found > 0 && found <= cap {
            // The row's values appended to [`refine_values`]'s list as (row, column).
            let first = smem.add(first) as *mut u32;
            if t == 0 {
                *first = atomic_add_global(value_count, found as u32);
            }
            sync_threads();
            if t < found {
                let at = 2 * (*first as usize + t);
                *values.add(at) = row as u32;
                *values.add(at + 1) = *list.add(t);
            }
        } else {
            // Else every chunk a decision depends on, once per row (its list has room
            // for every row).
            let mut s = t;
            while s < segs {
                let m = *marks.add(s);
                let mut todo = (m | m >> 8) & 0xff;
                while todo != 0 {
                    let chunk = s * 8 + todo.trailing_zeros() as usize;
                    todo &= todo - 1;
                    let i = atomic_add_global(counts.add(chunk), 1);
                    *lists.add(chunk * rows + i as usize) = row as u32;
                }
                s += ROW_THREADS;
            }
        }
    }
}

/// `z[row, c] = bias[c] + sum_k x[row, k] w[c, k]` in f64 (the products of two f32
/// are exact there), rounded once to f32, for the `count` (row, column) pairs that
/// [`kink_scan_tiles`] left in `values`.
///
/// # Safety
/// Device pointers: `x` `(rows, k)`, `w` `(n, k)`, `bias` `(n,)`, `z` `(rows, n)`;
/// `values` holds `*count` pairs inside `z`. Launch: any grid of `ROW_THREADS`-thread
/// blocks, no shared memory.
///
/// # Thread mapping
/// A warp per value, the grid's warps striding over the list: each lane takes every
/// 32nd 4 of `k`, with 4 16-byte loads each of `x` and `w` in flight, so that the
/// grid streams the listed weight rows at once (a row's values stand together in the
/// list, so the warps of a block mostly share `x`'s row, from L1).
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "ptx-kernel" fn refine_values(
    x: *const f32,
    w: *const f32,
    bias: *const f32,
    z: *mut f32,
    values: *const u32,
    count: *const u32,
    n: u32,
    k: u32,
) {
    const UNROLL: usize = 4;
    let (n, k) = (n as usize, k as usize);
    let lane = lane_id() as usize;
    let warps = grid_dim_x() as usize * WARPS;
    let quads = k / 4;
    // SAFETY (whole body): pairs below *count are inside z (the scan's contract); reads
    // below k of the row of x and of the weight row (16-byte aligned when k is
    // divisible by 4: the allocations are, and rows are k floats).
    unsafe {
        let total = *count as usize;
        let mut v = block_idx_x() as usize * WARPS + warp_id() as usize;
        while v < total {
            let (row, c) = (*values.add(2 * v) as usize, *values.add(2 * v + 1) as usize);
            let (xr, wr) = (x.add(row * k), w.add(c * k));
            let mut acc = [0.0f64; 4];
            if k.is_multiple_of(4) {
                let mut q = lane;
                while q + WARP * (UNROLL - 1) < quads {
                    let mut xv = [[0.0f32; 4]; UNROLL];
                    let mut wv = [[0.0f32; 4]; UNROLL];
                    unroll!(u in 0..4 => {
                        xv[u] = load_v4_nc(xr.add(4 * (q + WARP * u)));
                        wv[u] = load_v4_nc(wr.add(4 * (q + WARP * u)));
                    });
                    unroll!(u in 0..4 => {
                        unroll!(e in 0..4 => { acc[e] += xv[u][e] as f64 * wv[u][e] as f64; });
                    });
                    q += WARP * UNROLL;
                }
                while q < quads {
                    let (xv, wv) = (load_v4_nc(xr.add(4 * q)), load_v4_nc(wr.add(4 * q)));
                    unroll!(e in 0..4 => { acc[e] += xv[e] as f64 * wv[e] as f64; });
                    q += WARP;
                }
            } else {
                let mut kk = lane;
                while kk < k {
                    acc[0] += *xr.add(kk) as f64 * *wr.add(kk) as f64;
                    kk += WARP;
                }
            }
            let s = warp_sum_f64((acc[0] + acc[1]) + (acc[2] + acc[3]));
            if lane == 0 {
                *z.add(row * n + c) = (*bias.add(c) as f64 + s) as f32;
            }
            v += warps;
        }
    }
}

/// `p[kk..kk + 4]` (zero past `k`): one 16-byte load when `vec` (rows 16-byte aligned).
///
/// # Safety
/// `p` points at a row of `k` floats of global memory that nothing writes meanwhile.
#[inline(always)]
unsafe fn load4(p: *const f32, kk: usize, k: usize, vec: bool) -> [f32; 4] {
    unsafe {
        if vec && kk + 4 <= k {
            load_v4_nc(p.add(kk))
        } else {
            let mut v = [0.0; 4];
            unroll!(e in 0..4 => {
                if kk + e < k {
                    v[e] = *p.add(kk + e);
                }
            });
            v
        }
    }
}

/// The order in which [`refine_z`]'s blocks take the chunks: most listed rows first
/// (counts of `ORDER_BUCKETS - 1` or more together), so that the last blocks to start
/// are the shortest and the SMs finish together (longest-first list scheduling).
/// A counting sort in one block: a histogram of the counts, its prefix sums, a scatter.
///
/// # Safety
/// `counts` holds `chunks` entries, `order` room for as many. Launch: grid `(1, 1, 1)`,
/// `ROW_THREADS` threads, `ORDER_BUCKETS` u32 of dynamic shared memory.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn refine_order(counts: *const u32, chunks: u32, order: *mut u32) {
    let t = thread_idx_x() as usize;
    let chunks = chunks as usize;
    let bucket = |c: usize| ORDER_BUCKETS - 1 - (unsafe { *counts.add(c) } as usize).min(ORDER_BUCKETS - 1);
    // SAFETY (whole body): the dynamic shared memory holds ORDER_BUCKETS slots, indexed
    // below that; c < chunks; every position is written once (the slots' prefix sums
    // partition 0..chunks); the barriers are reached by the whole block.
    unsafe {
        let slots = dynamic_shared::<u32>();
        let mut b = t;
        while b < ORDER_BUCKETS {
            *slots.add(b) = 0;
            b += ROW_THREADS;
        }
        sync_threads();
        let mut c = t;
        while c < chunks {
            atomic_add_shared(slots.add(bucket(c)), 1);
            c += ROW_THREADS;
        }
        sync_threads();
        if t == 0 {
            let mut sum = 0;
            for b in 0..ORDER_BUCKETS {
                let h = *slots.add(b);
                *slots.add(b) = sum;
                sum += h;
            }
        }
        sync_threads();
        let mut c = t;
        while c < chunks {
            let at = atomic_add_shared(slots.add(bucket(c)), 1);
            *order.add(at as usize) = c as u32;
            c += ROW_THREADS;
        }
    }
}

/// `z[row, c] = bias[c] + sum_k x[row, k] w[c, k]` in f64, rounded once to f32, for the
/// rows and chunks [`kink_scan`] listed.
///
/// # Safety
/// Device pointers: `x` `(rows, k)`, `w` `(n, k)`, `bias` `(n,)`, `z` `(rows, n)`,
/// `counts` and `lists` as `kink_scan` wrote them, `order` as [`refine_order`] wrote
/// it (block `b` takes chunk `order[b]`) or null (block `b` takes chunk `b`). Launch:
/// grid `(n.div_ceil(CHUNK), 1, 1)`, `REFINE_THREADS` threads, `REFINE_SMEM_BYTES`.
///
/// # Thread mapping
/// One block per chunk of `CHUNK` columns, the most listed first (a fifth faster on
/// M3 than in column order: the SMs were idle 30% of the time at the grid's end), its
/// listed rows `REFINE_ROWS` at a time.
/// The products run on the f64 tensor cores (`mma.m16n8k16.f64`, Hopper's full-rate
/// shape: 12% faster here than `m8n8k4`; the products of two f32 are exact in f64)
/// with the chunk's 16 weight rows as `A` and four 8-row tiles of `x` as `B`, every
/// warp a 16-deep slice of `k` in turn, so the block's warps split `k` and add their
/// sums in shared memory at the end. Each lane loads 4 consecutive `k` of its weight
/// rows and `x` rows (one 16-byte `cp.async` each) and feeds them as the `k` slots
/// `4e + q` of both operands: the sum's order within a slice is the same permutation
/// for `x` and `w`. Rows past the batch are zero-filled, not loaded. The weights are
/// read once and marked first to leave L2, the rows of `x` (read again by other
/// chunks) last. No barrier in the loop.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "ptx-kernel" fn refine_z(
    x: *const f32,
    w: *const f32,
    bias: *const f32,
    z: *mut f32,
    counts: *const u32,
    lists: *const u32,
    order: *const u32,
    rows: u32,
    n: u32,
    k: u32,
) {
    const WARPS_R: usize = REFINE_THREADS / WARP;
    const TILES: usize = REFINE_ROWS / 8;
    const _: () = assert!(TILES == 4, "the unrolled loops below");
    // SAFETY: order, unless null, holds gridDim.x chunk indices (refine_order).
    let chunk = if order.is_null() {
        block_idx_x() as usize
    } else {
        unsafe { *order.add(block_idx_x() as usize) as usize }
    };
    let t = thread_idx_x() as usize;
    let (warp, lane) = (warp_id() as usize, lane_id() as usize);
    let (g, q) = (lane / 4, lane % 4);
    let (rows, n, k) = (rows as usize, n as usize, k as usize);
    let vec = k.is_multiple_of(4);
    let c0 = chunk * CHUNK;
    let cols = CHUNK.min(n - c0);
    // SAFETY (whole body): REFINE_SMEM_BYTES holds every warp's ring, which after the
    // loop holds its REFINE_ROWS x CHUNK partial sums; the list holds counts[chunk]
    // rows < rows; rows and columns are clamped to live ones before any load (dead
    // ones copy 0 bytes); the barriers are reached by the whole block.
    unsafe {
        let ring_bytes = REFINE_STAGES * REFINE_LOADS * WARP * 16;
        let ring = shared_address(dynamic_shared::<u8>()) + (warp * ring_bytes) as u32;
        let count = *counts.add(chunk) as usize;
        let list = lists.add(chunk * rows);
        let mut first = 0;
        while first < count {
            let batch = REFINE_ROWS.min(count - first);
            let tiles = batch.div_ceil(8);
            let mut x_row = [x; TILES];
            let mut x_live = [false; TILES];
            unroll!(m in 0..4 => {
                let r = m * 8 + g;
                x_live[m] = r < batch;
                x_row[m] = x.add(*list.add(first + r.min(batch - 1)) as usize * k);
            });
            let mut w_row = [w; 2];
            let mut w_live = [false; 2];
            unroll!(h in 0..2 => {
                w_live[h] = h * 8 + g < cols;
                w_row[h] = w.add((c0 + (h * 8 + g).min(cols - 1)) * k);
            });
            // acc[m]: weight rows g, g + 8 (d[0..2], d[2..4]) by x rows 8m + 2q, + 1.
            let mut acc = [[0.0f64; 4]; TILES];
            // Each lane copies its own 16 bytes of every row of a slice (`cp.async`,
            // zero past `k` and for dead rows) into its warp's ring of `REFINE_STAGES`
            // slots, `REFINE_STAGES - 1` slices ahead of the MMAs, and reads back only
            // what it copied itself (so its own wait suffices, no barrier).
            let step = 16 * WARPS_R;
            let (x_policy, w_policy) = (l2_policy(false), l2_policy(true));
            let slot_of = |i: usize, p: usize| ring + ((((i % REFINE_STAGES) * REFINE_LOADS + p) * WARP + lane) * 16) as u32;
            let issue = |i: usize| {
                let kk = warp * 16 + i * step + 4 * q;
                let copy = |dst: u32, src: *const f32, live: bool, is_w: bool| {
                    if vec {
                        let bytes = if live && kk < k { (4 * (k - kk)).min(16) as u32 } else { 0 };
                        let src = if bytes > 0 { src.add(kk) } else { src };
                        cp_async_16_hint(dst, src, bytes, if is_w { w_policy } else { x_policy });
                    } else {
                        unroll!(e in 0..4 => {
                            let inside = live && kk + e < k;
                            cp_async_4(dst + 4 * e as u32, if inside { src.add(kk + e) } else { src }, 4 * u32::from(inside));
                        });
                    }
                };
                unroll!(m in 0..4 => {
                    if m < tiles {
                        copy(slot_of(i, m), x_row[m], x_live[m], false);
                    }
                });
                unroll!(h in 0..2 => { copy(slot_of(i, TILES + h), w_row[h], w_live[h], true); });
                cp_async_commit();
            };
            let steps = (k - (warp * 16).min(k)).div_ceil(step);
            for i in 0..REFINE_STAGES - 1 {
                issue(i);
            }
            for i in 0..steps {
                issue(i + REFINE_STAGES - 1);
                cp_async_wait::<{ REFINE_STAGES as u32 - 1 }>();
                let (w_lo, w_hi) = (ld_shared_v4(slot_of(i, TILES)), ld_shared_v4(slot_of(i, TILES + 1)));
                let mut a = [0.0f64; 8];
                unroll!(e in 0..4 => {
                    a[2 * e] = f32::from_bits(w_lo[e]) as f64;
                    a[2 * e + 1] = f32::from_bits(w_hi[e]) as f64;
                });
                unroll!(m in 0..4 => {
                    if m < tiles {
                        let b = ld_shared_v4(slot_of(i, m)).map(|v| f32::from_bits(v) as f64);
                        mma_f64_m16n8k16(&mut acc[m], a, b);
                    }
                });
            }
            cp_async_wait_all();
            // The warp's ring, drained, takes its partial sums (every lane past its
            // last read of the ring first).
            sync_warp();
            let red = dynamic_shared::<u8>().add(warp * ring_bytes) as *mut f64;
            unroll!(m in 0..4 => {
                unroll!(j in 0..4 => {
                    let (col, row) = (g + 8 * (j / 2), 8 * m + 2 * q + j % 2);
                    *red.add(row * CHUNK + col) = acc[m][j];
                });
            });
            sync_threads();
            let mut o = t;
            while o < REFINE_ROWS * CHUNK {
                let (r, d) = (o / CHUNK, o % CHUNK);
                if r < batch && d < cols {
                    let mut s = *bias.add(c0 + d) as f64;
                    for wi in 0..WARPS_R {
                        s += *(dynamic_shared::<u8>().add(wi * ring_bytes) as *const f64).add(o);
                    }
                    *z.add(*list.add(first + r) as usize * n + c0 + d) = s as f32;
                }
                o += REFINE_THREADS;
            }
            sync_threads();
            first += REFINE_ROWS;
        }
    }
}

/// `*p += v` on shared memory, returning the old value (`atom.shared.add.u32`).
///
/// # Safety
/// `p` is a shared-memory address of a `u32`.
#[inline(always)]
unsafe fn atomic_add_shared(p: *mut u32, v: u32) -> u32 {
    let old: u32;
    unsafe {
        core::arch::asm!("{{ .reg .b64 s; cvta.to.shared.u64 s, {p}; atom.shared.add.u32 {o}, [s], {v}; }}",
             p = in(reg64) p as u64, v = in(reg32) v, o = out(reg32) old, options(nostack));
    }
    old
}

/// `*p += v` on global memory, returning the old value (`atom.global.add.u32`).
///
/// # Safety
/// `p` is a global-memory address of a `u32`.
#[inline(always)]
unsafe fn atomic_add_global(p: *mut u32, v: u32) -> u32 {
    let old: u32;
    unsafe {
        core::arch::asm!("{{ .reg .b64 g; cvta.to.global.u64 g, {p}; atom.global.add.u32 {o}, [g], {v}; }}",
             p = in(reg64) p as u64, v = in(reg32) v, o = out(reg32) old, options(nostack));
    }
    old
}

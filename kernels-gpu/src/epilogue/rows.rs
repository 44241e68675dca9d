//! The row-wise epilogue: runs any chain over the rows of a finished GEMM output,
//! forward (`epilogue_rows`) and backward (`epilogue_rows_backward`), side by side.
//!
//! This is the general path, used when the chain cannot be fused into the GEMM's
//! store (see docs/PERFORMANCE.md for what it costs: one extra read and write of
//! the GEMM output), and for every backward.

use super::pointwise::{PointwiseMath, match_pointwise, param_count};
use crate::prelude::math::{exp, ln, max_nan, rsqrt};
use core::ptr::null_mut;

use crate::prelude::element::{Bf16, Element, F16};
use crate::prelude::global::store_v4;
use crate::prelude::warp::{shfl_xor, warp_max, warp_sum};
use crate::prelude::*;
use crate::prelude::vector::{store1_to, with_reader};
use crate::unroll;
use kernel_abi::epilogue::*;
use kernel_abi::gemm_fma::MAX_GRAD_SLOTS;

const _: () = assert!(MAX_GRAD_SLOTS == 8, "sum_partials_to and the tile-wise backward unroll 8 slots");

/// Warps of a block of `ROW_THREADS`, the largest: the scratch's layout (`2 * WARPS`
/// words) is sized for it. Every helper below takes its block's threads as `T`
/// (`ROW_THREADS`, or `NARROW_ROW_THREADS` for narrow rows), a constant in each entry.
const WARPS: usize = ROW_THREADS / WARP_SIZE as usize;
const WARP: usize = WARP_SIZE as usize;

/// Mean and `1 / sqrt(var + eps)` of `s[..size]` (one warp, two passes, biased variance).
#[inline(always)]
fn group_stats(s: *const f32, size: usize, eps: f32, lane: usize) -> (f32, f32) {
    let mut sum = 0.0;
    let mut j = lane;
    while j < size {
        // SAFETY (both loops): j < size, inside the group.
        sum += unsafe { *s.add(j) };
        j += WARP;
    }
    let mean = warp_sum(sum) / size as f32;
    let mut sq = 0.0;
    let mut j = lane;
    while j < size {
        let d = unsafe { *s.add(j) } - mean;
        sq += d * d;
        j += WARP;
    }
    (mean, rsqrt(warp_sum(sq) / size as f32 + eps))
}

/// [`op_forward`] reading `op`'s parameter vectors as stored: one instance per storage
/// type they share ([`Typed`]: plain loads; a branch per read cost the row-wise forward
/// a fifth of its time on a bf16 model), [`AsStored`] where they differ.
///
/// # Safety
/// As [`op_forward`].
#[inline(always)]
pub(crate) unsafe fn op_forward_stored<const T: usize>(
    op: &OpDesc,
    cur: &mut *mut f32,
    alt: &mut *mut f32,
    red: *mut f32,
    f: usize,
) -> usize {
    unsafe {
        with_reader!(op, Q => op_forward::<T, Q>(op, cur, alt, red, f))
    }
}

/// [`op_forward_rows`] reading `op`'s parameter vectors as stored, as [`op_forward_stored`].
///
/// # Safety
/// As [`op_forward_rows`].
#[inline(always)]
pub(crate) unsafe fn op_forward_rows_stored<const T: usize>(op: &OpDesc, x: *mut f32, rows: usize, f: usize) {
    unsafe {
        with_reader!(op, Q => op_forward_rows::<T, Q>(op, x, rows, f))
    }
}

/// GroupNorm of one group in place, by one warp: `s[..size]` normalised by its own mean
/// and variance, then `gamma`, `beta` (the op's parameters) from channel `first` on.
///
/// # Safety
/// `s` holds `size` floats; the op's parameter vectors hold `first + size`.
#[inline(always)]
unsafe fn normalize_group<R: ReadParams>(s: *mut f32, size: usize, first: usize, op: &OpDesc, lane: usize) {
    let (gamma, beta) = (Vector(op.param0), Vector(op.param1));
    let (mean, rstd) = group_stats(s, size, op.a, lane);
    // `PARAM_LOADS` channels a step, all their parameters loaded before any store: one at
    // a time, each load waited out its round trip (LLVM cannot tell the store to `s` from
    // the next channel's parameter; KernelBench 30's groups of 512: a third of the kernel).
    let mut j = lane;
    while j + (PARAM_LOADS - 1) * WARP < size {
        let at: [usize; PARAM_LOADS] = core::array::from_fn(|u| j + u * WARP);
        // SAFETY (this loop): every channel below size; first + it below the parameters' length.
        let (g, b) = unsafe { (at.map(|c| R::get(gamma, first + c)), at.map(|c| R::get(beta, first + c))) };
        for u in 0..PARAM_LOADS {
            unsafe { *s.add(at[u]) = (*s.add(at[u]) - mean) * rstd * g[u] + b[u] };
        }
        j += PARAM_LOADS * WARP;
    }
    while j < size {
        // SAFETY: j < size; first + j below the parameters' length.
        unsafe { *s.add(j) = (*s.add(j) - mean) * rstd * R::get(gamma, first + j) + R::get(beta, first + j) };
        j += WARP;
    }
}

/// Channels whose GroupNorm parameters a thread loads at once (see [`normalize_group`]).
const PARAM_LOADS: usize = 4;

/// Where a thread alone starts in its group of `size` channels: apart from its warp's
/// neighbours' starts, so that the warp's reads of groups `size` floats apart spread
/// over the shared-memory banks (all at offset 0, 16 groups of 16 share two banks).
#[inline(always)]
fn group_start(size: usize) -> usize {
    let lane = lane_id() as usize;
    let per_bank_cycle = if WARP.is_multiple_of(size) { WARP / size } else { 1 };
    (lane / per_bank_cycle) % size
}

/// The channel after `k` in a group of `size`, wrapping to 0.
#[inline(always)]
fn next_in_group(k: usize, size: usize) -> usize {
    if k + 1 == size { 0 } else { k + 1 }
}

/// The next [`PARAM_LOADS`] channels of a thread's walk around its group of `size` from
/// `*k` (which moves past them), and which of them are among the `size - done` the walk
/// has left.
#[inline(always)]
fn next_channels(k: &mut usize, size: usize, done: usize) -> ([usize; PARAM_LOADS], [bool; PARAM_LOADS]) {
    let mut at = [0usize; PARAM_LOADS];
    for a in at.iter_mut() {
        *a = *k;
        *k = next_in_group(*k, size);
    }
    (at, core::array::from_fn(|u| done + u < size))
}

/// [`group_stats`] by one thread alone (two passes from `start`).
///
/// # Safety
/// `s` holds `size` floats.
#[inline(always)]
unsafe fn group_stats_alone(s: *const f32, size: usize, eps: f32, start: usize) -> (f32, f32) {
    let (mut sum, mut k) = (0.0, start);
    for _ in 0..size {
        // SAFETY (both loops): k < size.
        sum += unsafe { *s.add(k) };
        k = next_in_group(k, size);
    }
    let mean = sum / size as f32;
    let mut sq = 0.0;
    for _ in 0..size {
        let d = unsafe { *s.add(k) } - mean;
        sq += d * d;
        k = next_in_group(k, size);
    }
    (mean, rsqrt(sq / size as f32 + eps))
}

/// GroupNorm of `count` consecutive groups of `size` at `x` in place, group `i` with
/// the parameters of channels `(i % per_row) * size ..`: groups of at most a warp's
/// width a thread each where there are more groups than warps (with 16 channels a warp
/// took 512 groups one after another, 5 shuffles apart: KernelBench 75's epilogue 0.17
/// ms), else a warp each (`gemv_tc`'s 8 rows of a 32-channel group: 8 threads walking
/// their groups alone held the other 248 at the op's barrier, half its stall samples).
///
/// # Safety
/// `x` holds `count * size` floats; the op's parameter vectors `per_row * size`.
/// Called by the whole block (no barrier).
#[inline(always)]
unsafe fn normalize_groups<const T: usize, R: ReadParams>(x: *mut f32, count: usize, per_row: usize, size: usize, op: &OpDesc) {
    let (warp, lane) = (warp_id() as usize, lane_id() as usize);
    // SAFETY (whole body): every group below `count`, its channels below `per_row * size`.
    unsafe {
        if size <= WARP && count > T / WARP {
            let (gamma, beta) = (Vector(op.param0), Vector(op.param1));
            let start = group_start(size);
            let mut gi = thread_idx_x() as usize;
            while gi < count {
                let (s, first) = (x.add(gi * size), (gi % per_row) * size);
                let (mean, rstd) = group_stats_alone(s, size, op.a, start);
                // As `normalize_group`: a few channels' parameters loaded before their stores.
                let mut k = start;
                let mut done = 0;
                while done < size {
                    let (at, live) = next_channels(&mut k, size, done);
                    let g: [f32; PARAM_LOADS] = core::array::from_fn(|u| if live[u] { R::get(gamma, first + at[u]) } else { 0.0 });
                    let b: [f32; PARAM_LOADS] = core::array::from_fn(|u| if live[u] { R::get(beta, first + at[u]) } else { 0.0 });
                    for u in 0..PARAM_LOADS {
                        if live[u] {
                            *s.add(at[u]) = (*s.add(at[u]) - mean) * rstd * g[u] + b[u];
                        }
                    }
                    done += PARAM_LOADS;
                }
                gi += T;
            }
        } else {
            let mut gi = warp;
            while gi < count {
                normalize_group::<R>(x.add(gi * size), size, (gi % per_row) * size, op, lane);
                gi += T / WARP;
            }
        }
    }
}

/// `v` reduced over the block, the same in every thread: each warp's by `in_warp`,
/// then the warps' by `fold` (`red` holds `WARPS` floats; ends with a barrier).
///
/// # Safety
/// Called by the whole block.
#[inline(always)]
unsafe fn block_reduce<const T: usize>(v: f32, red: *mut f32, in_warp: fn(f32) -> f32, fold: fn(f32, f32) -> f32) -> f32 {
    let (warp, lane) = (warp_id() as usize, lane_id() as usize);
    let s = in_warp(v);
    // SAFETY: warp < WARPS; the barriers order the writes and the reads of `red`.
    unsafe {
        if lane == 0 {
            *red.add(warp) = s;
        }
        sync_threads();
        let mut total = *red;
        for w in 1..(T / WARP) {
            total = fold(total, *red.add(w));
        }
        sync_threads();
        total
    }
}

/// `sum_j map(x[j])` over `x[..f]`, in every thread.
///
/// # Safety
/// `x` holds `f` floats; called by the whole block.
#[inline(always)]
unsafe fn row_sum<const T: usize, M: Fn(usize, f32) -> f32>(x: *const f32, f: usize, red: *mut f32, map: M) -> f32 {
    let mut s = 0.0;
    let mut j = thread_idx_x() as usize;
    while j < f {
        // SAFETY: j < f.
        s += map(j, unsafe { *x.add(j) });
        j += T;
    }
    unsafe { block_reduce::<T>(s, red, warp_sum, |a, b| a + b) }
}

/// `max_j sign x[j]` over `x[..f]`, NaN propagating, in every thread.
///
/// # Safety
/// `x` holds `f` floats; called by the whole block.
#[inline(always)]
unsafe fn row_max<const T: usize>(x: *const f32, f: usize, red: *mut f32, sign: f32) -> f32 {
    let mut m = f32::NEG_INFINITY;
    let mut j = thread_idx_x() as usize;
    while j < f {
        // SAFETY: j < f.
        m = max_nan(m, sign * unsafe { *x.add(j) });
        j += T;
    }
    unsafe { block_reduce::<T>(m, red, warp_max, max_nan) }
}

/// What the row reduction `code` (sum, mean, max, min, logsumexp) gives for `x[..f]`, in
/// every thread. logsumexp shifts by the row max, or by 0 where that max is infinite
/// (`-inf` for a row of `-inf`, `inf` for one holding `inf`, as PyTorch).
///
/// # Safety
/// `x` holds `f > 0` floats; called by the whole block.
#[inline(always)]
unsafe fn reduce_row<const T: usize>(code: u32, x: *const f32, f: usize, red: *mut f32) -> f32 {
    unsafe {
        match code {
            OP_ROW_MAX => row_max::<T>(x, f, red, 1.0),
            OP_ROW_MIN => -row_max::<T>(x, f, red, -1.0),
            OP_LOGSUMEXP => {
                let m = row_max::<T>(x, f, red, 1.0);
                let shift = super::logsumexp_shift(m);
                shift + ln(row_sum::<T, _>(x, f, red, |_, v| exp(v - shift)))
            }
            OP_ROW_MEAN => row_sum::<T, _>(x, f, red, |_, v| v) / f as f32,
            _ => row_sum::<T, _>(x, f, red, |_, v| v),
        }
    }
}

/// Softmax of `x[..f]` in place.
///
/// # Safety
/// `x` holds `f > 0` floats; called by the whole block.
#[inline(always)]
unsafe fn softmax_in_place<const T: usize>(x: *mut f32, f: usize, red: *mut f32) {
    unsafe {
        let m = row_max::<T>(x, f, red, 1.0);
        // Each thread rewrites only its own columns: no barrier between the passes.
        let s = row_sum::<T, _>(x, f, red, |j, v| {
            let e = exp(v - m);
            *x.add(j) = e;
            e
        });
        let mut j = thread_idx_x() as usize;
        while j < f {
            *x.add(j) /= s;
            j += T;
        }
    }
}

/// RMSNorm's `1 / sqrt(mean(x^2) + eps)` of `x[..f]`, in every thread.
///
/// # Safety
/// `x` holds `f > 0` floats; called by the whole block.
#[inline(always)]
unsafe fn rms_rstd<const T: usize>(x: *const f32, f: usize, eps: f32, red: *mut f32) -> f32 {
    unsafe { rsqrt(row_sum::<T, _>(x, f, red, |_, v| v * v) / f as f32 + eps) }
}

/// A per-element op `P` over a row of `f` values in shared memory, four columns per
/// thread and step with their parameters read first: four reads of the parameter
/// vector (from L2) in flight at a time rather than one.
///
/// # Safety
/// `x` holds `f` values; `p0` holds `f` values where `P` has a parameter.
#[inline(always)]
unsafe fn pointwise_row<P: PointwiseMath, const T: usize, R: ReadParams>(x: *mut f32, p0: Vector, f: usize, a: f32, b: f32) {
    let mut j = thread_idx_x() as usize;
    // SAFETY (whole body): every index is below `f`.
    unsafe {
        while j + 3 * T < f {
            let at = [j, j + T, j + 2 * T, j + 3 * T];
            let p = if P::HAS_PARAM { at.map(|i| R::get(p0, i)) } else { [0.0; 4] };
            let v = at.map(|i| *x.add(i));
            for e in 0..4 {
                *x.add(at[e]) = P::forward(v[e], p[e], a, b);
            }
            j += 4 * T;
        }
        while j < f {
            let p = if P::HAS_PARAM { R::get(p0, j) } else { 0.0 };
            *x.add(j) = P::forward(*x.add(j), p, a, b);
            j += T;
        }
    }
}

/// Applies `op` forward to the row in `*cur` (`f` features); ops that shrink the row
/// write into `*alt` and swap the two. `red` is scratch for one value per warp.
/// Returns the features after the op. Every thread of the block calls it; it ends
/// with a barrier.
///
/// # Safety
/// `*cur` and `*alt` hold at least `f` floats each, `red` at least `WARPS`; `op`'s
/// parameter vectors hold `f` floats.
#[inline(always)]
pub(crate) unsafe fn op_forward<const T: usize, R: ReadParams>(
    op: &OpDesc,
    cur: &mut *mut f32,
    alt: &mut *mut f32,
    red: *mut f32,
    f: usize,
) -> usize {
    let t = thread_idx_x() as usize;
    let p0 = Vector(op.param0);
    let x = *cur;
    let f_out = features_after(op, f);
    // SAFETY (whole body): every index is below the extent the contract gives.
    unsafe {
        match op.code {
            OP_GROUP_NORM => {
                let groups = op.count as usize;
                normalize_groups::<T, R>(x, groups, groups, f / groups, op);
            }
            OP_AVG_POOL => {
                let k = op.count as usize;
                let mut j = t;
                while j < f_out {
                    let mut sum = 0.0;
                    for e in 0..k {
                        sum += *x.add(j * k + e);
                    }
                    *alt.add(j) = sum / k as f32;
                    j += T;
                }
                core::mem::swap(cur, alt);
            }
            OP_MAX_POOL => {
                let k = op.count as usize;
                let mut j = t;
                while j < f_out {
                    let mut m = *x.add(j * k);
                    for e in 1..k {
                        m = max_nan(m, *x.add(j * k + e));
                    }
                    *alt.add(j) = m;
                    j += T;
                }
                core::mem::swap(cur, alt);
            }
            OP_ROW_SUM | OP_ROW_MEAN | OP_ROW_MAX | OP_ROW_MIN | OP_LOGSUMEXP => {
                let v = reduce_row::<T>(op.code, x, f, red);
                if t == 0 {
                    *x = v;
                }
            }
            OP_SOFTMAX => softmax_in_place::<T>(x, f, red),
            OP_RMS_NORM => {
                let r = rms_rstd::<T>(x, f, op.a, red);
                let mut j = t;
                while j < f {
                    *x.add(j) = *x.add(j) * r * R::get(p0, j);
                    j += T;
                }
            }
            code => match_pointwise!(code, P => pointwise_row::<P, T, R>(x, p0, f, op.a, op.b), _ => {
                // An unknown code: poison rather than pass through.
                let mut j = t;
                while j < f {
                    *x.add(j) = f32::NAN;
                    j += T;
                }
            }),
        }
        // Makes this op's writes visible to the next op's readers (and frees `red`).
        sync_threads();
    }
    f_out
}

/// Float4 loads each thread keeps in flight when it copies a row into shared memory:
/// a row of 8192 floats is then two round trips per thread, not 32 dependent ones.
const ROW_LOADS: usize = 4;

/// `dst[..n] = sum_s src[s * stride + ..n] (+ bias[..n], added last)` in FP32 from
/// elements `E`, and `copy[..n]` the same
/// where `copy` is not null: a global row (or `parts` split-K parts of it) into
/// shared memory. With `n % 4 == 0` and 16-byte aligned rows every thread issues
/// `ROW_LOADS` 16-byte loads before it stores any (a plain loop waits for each load:
/// its store could alias the next load's address); otherwise one float at a time.
///
/// # Safety
/// `dst` (shared) holds `n` floats; `src` holds `parts` rows of `n`
/// floats `stride` apart, nothing writes them during the kernel; `bias` (or null)
/// `n` floats; `copy` (or null) `n` writable floats. Called by the whole block.
#[inline(always)]
unsafe fn load_row<E: Element, const T: usize>(
    dst: *mut f32,
    src: *const E,
    parts: usize,
    stride: usize,
    bias: Vector,
    copy: *mut f32,
    n: usize,
) {
    let t = thread_idx_x() as usize;
    let aligned = |p: usize| p.is_multiple_of(4 * size_of::<E>());
    let vector = n.is_multiple_of(4)
        && aligned(src as usize)
        && (parts <= 1 || stride.is_multiple_of(4))
        && (bias.is_null() || bias.quad_aligned(0))
        && (copy.is_null() || (copy as usize).is_multiple_of(16));
    // SAFETY (both paths): every index is below n, the parts below `parts`.
    unsafe {
        if vector {
            let quads = n / 4;
            let mut first = t;
            while first < quads {
                let mut v = [[0.0f32; 4]; ROW_LOADS];
                // The part loop outside, the constant one inside: unrolled, `v` in registers.
                for p in 0..parts + !bias.is_null() as usize {
                    for (u, v) in v.iter_mut().enumerate() {
                        let q = first + u * T;
                        if q < quads {
                            let w = if p < parts { E::load4_nc(src.add(p * stride + 4 * q)) } else { bias.quad(4 * q) };
                            *v = [v[0] + w[0], v[1] + w[1], v[2] + w[2], v[3] + w[3]];
                        }
                    }
                }
                for (u, v) in v.iter().enumerate() {
                    let q = first + u * T;
                    if q < quads {
                        for (e, &x) in v.iter().enumerate() {
                            *dst.add(4 * q + e) = x;
                        }
                        if !copy.is_null() {
                            store_v4(copy.add(4 * q), *v);
                        }
                    }
                }
                first += ROW_LOADS * T;
            }
        } else {
            let mut c = t;
            while c < n {
                // The vector path's order: the parts, then the bias.
                let mut v = 0.0;
                for p in 0..parts {
                    v += E::load1(src.add(p * stride + c));
                }
                if !bias.is_null() {
                    v += bias.get(c);
                }
                *dst.add(c) = v;
                if !copy.is_null() {
                    *copy.add(c) = v;
                }
                c += T;
            }
        }
    }
}

/// `y[..f] = src[..f]` from shared memory, rounded to `E`: four at a time where `f`
/// and `y` allow.
///
/// # Safety
/// `src` (shared, 16-byte aligned) holds `f` floats, `y` `f` writable elements.
#[inline(always)]
unsafe fn store_row<E: Element, const T: usize>(y: *mut E, src: *const f32, f: usize) {
    let t = thread_idx_x() as usize;
    // SAFETY (both paths): indices below f.
    unsafe {
        if f.is_multiple_of(4) && (y as usize).is_multiple_of(4 * size_of::<E>()) {
            let mut q = t;
            while q < f / 4 {
                let s = src.add(4 * q);
                E::store4(y.add(4 * q), [*s, *s.add(1), *s.add(2), *s.add(3)]);
                q += T;
            }
        } else {
            let mut j = t;
            while j < f {
                E::store1(y.add(j), *src.add(j));
                j += T;
            }
        }
    }
}

/// [`op_forward`] for the ops that stay inside a slab of a row — per-element ops and
/// GroupNorms whose groups lie in it — over `rows` rows of `f` features at `x` (row
/// pitch `f`) at once: one barrier per op however many rows. Unknown codes poison.
/// Every thread of the block calls it; it ends with a barrier.
///
/// # Safety
/// `x` holds `rows * f` floats; `op` is per-element or a GroupNorm of `op.count`
/// groups dividing `f`, its parameter vectors hold `f` floats.
#[inline(always)]
pub(crate) unsafe fn op_forward_rows<const T: usize, R: ReadParams>(op: &OpDesc, x: *mut f32, rows: usize, f: usize) {
    let t = thread_idx_x() as usize;
    let p0 = Vector(op.param0);
    // SAFETY (whole body): every index is below the extent the contract gives.
    unsafe {
        if op.code == OP_GROUP_NORM {
            // Rows `f` apart: group `i` of the slab is row `i / groups`'s group `i % groups`.
            let groups = op.count as usize;
            normalize_groups::<T, R>(x, rows * groups, groups, f / groups, op);
        } else {
            let code = op.code;
            let mut i = t;
            while i < rows * f {
                let j = i % f;
                let v = *x.add(i);
                *x.add(i) = match_pointwise!(code, P => {
                    P::forward(v, if P::HAS_PARAM { R::get(p0, j) } else { 0.0 }, op.a, op.b)
                }, _ => f32::NAN);
                i += T;
            }
        }
        sync_threads();
    }
}

/// `y[row] = chain(sum_s z[s, row] + bias)` for every row: `splits` partial GEMM
/// products (split-K) are added first, then the bias (if not null), then the chain;
/// `y` is stored as `E` (FP32, or bf16 / fp16 rounded to nearest even once).
///
/// # Safety
/// Device pointers; `ops[..n_ops]` well formed (see [`OpDesc`]), its parameter vectors
/// as long as the features at their op. Launch: grid `(rows, 1, 1)`, `ROW_THREADS`
/// threads (or fewer, a multiple of 32), `row_smem_bytes(n)` dynamic shared memory
/// (`row_smem_bytes_unpooled(n)` where the chain has no pooling op).
///
/// # Parameters
/// * `z`: `(splits, rows, n)` row-major: the GEMM output (`splits == 1`, Linear bias
///   included or passed as `bias`) or its split-K parts.
/// * `bias`: `(n,)` or null.
/// * `y`: `(rows, f_out)` row-major, `f_out` the features left after the chain.
/// * `save_z`: `(rows, n)` or null: receives the chain's input (what the backward needs).
///
/// # Thread mapping
/// One block per row; the row sits in shared memory. Elementwise ops stride the
/// block's threads over it; GroupNorm gives each thread (groups of up to 32) or each
/// warp whole groups (two-pass mean and variance); pooling writes into the second buffer;
/// the row reductions (and softmax's and RMSNorm's sums) reduce over warps, then
/// across them.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn rows_forward<E: Element, const T: usize>(
    z: *const f32,
    splits: u32,
    bias: Vector,
    y: *mut E,
    save_z: *mut f32,
    n: u32,
    ops: *const OpDesc,
    n_ops: u32,
) {
    let row = block_idx_x() as usize;
    let rows = grid_dim_x() as usize;
    let n = n as usize;
    let base = dynamic_shared::<f32>();
    // SAFETY: the launch's shared memory covers [red: 2 * WARPS][cur: n], then [alt: n]
    // where the chain pools (only pooling touches alt).
    let (red, mut cur, mut alt) = unsafe { (base, base.add(2 * WARPS), base.add(2 * WARPS + n)) };
    // SAFETY: row < rows: this row of each split-K part, of save_z.
    unsafe {
        let copy = if save_z.is_null() { save_z } else { save_z.add(row * n) };
        load_row::<_, T>(cur, z.add(row * n), splits as usize, rows * n, bias, copy, n);
        // Uniform control flow (every op is run by the whole block).
        sync_threads();
    }
    let mut f = n;
    // SAFETY: the descriptors hold n_ops ops.
    let residual = n_ops > 0 && unsafe { (*ops.add(n_ops as usize - 1)).code } == OP_RESIDUAL;
    for i in 0..n_ops as usize - usize::from(residual) {
        // SAFETY: i < n_ops; buffers as above.
        f = unsafe { op_forward_stored::<T>(&*ops.add(i), &mut cur, &mut alt, red, f) };
    }
    if residual {
        // SAFETY: the last op, the row `n` wide (`BlockSpec::new`); z and bias as loaded.
        unsafe { add_chain_input::<T>(cur, z.add(row * n), splits as usize, rows * n, bias, n) };
    }
    // SAFETY: the row's output, f wide.
    unsafe { store_row::<_, T>(y.add(row * f), cur, f) };
}

/// `g[j] += dy[j]` for this thread's columns `j` (those it reads next): the `residual`
/// op's path to `dz`.
///
/// # Safety
/// `g` holds `n` floats, `dy` `n` values.
#[inline(never)]
unsafe fn add_row<E: Element, const T: usize>(g: *mut f32, dy: *const E, n: usize) {
    let mut j = thread_idx_x() as usize;
    // SAFETY: j < n.
    unsafe {
        while j < n {
            *g.add(j) += E::load1(dy.add(j));
            j += T;
        }
    }
}

/// `cur[..n] +=` the chain's input, re-read as [`load_row`] summed it (the split-K
/// parts in order, then the bias): the `residual` op. `z`'s row was just read, so
/// this mostly hits L2. Ends with a barrier.
///
/// # Safety
/// As `load_row`'s `src`, `parts`, `stride` and `bias`; `cur` the block's row of `n`.
/// Called by the whole block.
#[inline(never)]
unsafe fn add_chain_input<const T: usize>(cur: *mut f32, z: *const f32, parts: usize, stride: usize, bias: Vector, n: usize) {
    let mut j = thread_idx_x() as usize;
    // SAFETY: every index is below n, the parts below `parts`.
    unsafe {
        while j < n {
            let mut v = 0.0f32;
            for p in 0..parts {
                v += *z.add(p * stride + j);
            }
            if !bias.is_null() {
                v += bias.get(j);
            }
            *cur.add(j) += v;
            j += T;
        }
        sync_threads();
    }
}

/// The row-wise forward's entry points, one per type of `y`: FP32, and bf16 or fp16 (a
/// 16-bit model's output without a second pass).
macro_rules! rows_forward_into {
    ($($name:ident: $t:ty, $threads:expr;)*) => {$(
        /// `rows_forward` with `y` of this entry point's type, in blocks of `$threads`.
        ///
        /// # Safety
        /// As `rows_forward`.
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "ptx-kernel" fn $name(
            z: *const f32,
            splits: u32,
            bias: Vector,
            y: *mut $t,
            save_z: *mut f32,
            n: u32,
            ops: *const OpDesc,
            n_ops: u32,
        ) {
            unsafe { rows_forward::<_, { $threads }>(z, splits, bias, y, save_z, n, ops, n_ops) }
        }
    )*};
}
rows_forward_into!(
    epilogue_rows: f32, ROW_THREADS;
    epilogue_rows_bf16: Bf16, ROW_THREADS;
    epilogue_rows_f16: F16, ROW_THREADS;
    epilogue_rows_narrow: f32, NARROW_ROW_THREADS;
    epilogue_rows_narrow_bf16: Bf16, NARROW_ROW_THREADS;
    epilogue_rows_narrow_f16: F16, NARROW_ROW_THREADS;
);

/// `(value, index)` `a` comes before `b` as the row max's pick: the larger value, the
/// first index on ties, and NaN before any number (PyTorch's `max`).
#[inline(always)]
fn max_first(av: f32, ai: u32, bv: f32, bi: u32) -> bool {
    let (an, bn) = (av.is_nan(), bv.is_nan());
    if an || bn {
        return an && (!bn || ai < bi);
    }
    av > bv || (av == bv && ai < bi)
}

/// Index of the row max of `sign x[..f]` (see [`max_first`]; `sign` -1 for the row
/// min), the same in every thread. `red` holds `2 * WARPS` floats of scratch.
///
/// # Safety
/// `x` holds `f > 0` floats; called by the whole block.
#[inline(always)]
unsafe fn arg_max<const T: usize>(x: *const f32, f: usize, red: *mut f32, sign: f32) -> usize {
    let t = thread_idx_x() as usize;
    let (warp, lane) = (warp_id() as usize, lane_id() as usize);
    let (mut bv, mut bi) = (f32::NEG_INFINITY, u32::MAX);
    let mut j = t;
    while j < f {
        // SAFETY (whole body): j < f; red indices < 2 * WARPS.
        let v = sign * unsafe { *x.add(j) };
        if max_first(v, j as u32, bv, bi) {
            (bv, bi) = (v, j as u32);
        }
        j += T;
    }
    let mut m = 1;
    while m < WARP as u32 {
        let (ov, oi) = (shfl_xor(bv, m), shfl_xor(f32::from_bits(bi), m).to_bits());
        if max_first(ov, oi, bv, bi) {
            (bv, bi) = (ov, oi);
        }
        m <<= 1;
    }
    unsafe {
        if lane == 0 {
            *red.add(warp) = bv;
            *red.add(WARPS + warp) = f32::from_bits(bi);
        }
        sync_threads();
        let (mut bv, mut bi) = (*red, (*red.add(WARPS)).to_bits());
        for w in 1..(T / WARP) {
            let (ov, oi) = (*red.add(w), (*red.add(WARPS + w)).to_bits());
            if max_first(ov, oi, bv, bi) {
                (bv, bi) = (ov, oi);
            }
        }
        sync_threads(); // everyone has read `red` before it is reused
        bi as usize
    }
}

/// Whether `op` is a per-element op (one of `match_pointwise!`'s).
#[inline(always)]
fn is_pointwise(op: &OpDesc) -> bool {
    match_pointwise!(op.code, P => {
        let _ = P::OP;
        true
    }, _ => false)
}

/// The first op of the run of per-element ops that ends at op `last`.
///
/// # Safety
/// `ops` holds at least `last + 1` descriptors; op `last` is per-element.
#[inline(always)]
unsafe fn run_start(ops: *const OpDesc, last: usize) -> usize {
    let mut first = last;
    // SAFETY: first - 1 < last.
    while first > 0 && is_pointwise(unsafe { &*ops.add(first - 1) }) {
        first -= 1;
    }
    first
}

/// Columns `at` of a row `p` in shared memory, 0 where not `live`.
///
/// # Safety
/// `p` holds every live column.
#[inline(always)]
unsafe fn columns4(p: *const f32, at: [usize; 4], live: [bool; 4]) -> [f32; 4] {
    // SAFETY: live columns only.
    [0, 1, 2, 3].map(|e| if live[e] { unsafe { *p.add(at[e]) } } else { 0.0 })
}

/// Columns `at` of a parameter vector `p`, 0 where not `live`.
///
/// # Safety
/// `p` holds every live column.
#[inline(always)]
unsafe fn param_columns4<R: ReadParams>(p: Vector, at: [usize; 4], live: [bool; 4]) -> [f32; 4] {
    // SAFETY: live columns only.
    [0, 1, 2, 3].map(|e| if live[e] { unsafe { R::get(p, at[e]) } } else { 0.0 })
}

/// Per-element op `op` forward on the values of columns `at` (decoded once for the four).
///
/// # Safety
/// `op` is per-element; its parameter (where it has one) holds every live column.
#[inline(always)]
unsafe fn forward4<R: ReadParams>(op: &OpDesc, v: [f32; 4], at: [usize; 4], live: [bool; 4]) -> [f32; 4] {
    match_pointwise!(op.code, P => {
        // SAFETY: as the contract.
        let p = if P::HAS_PARAM { unsafe { param_columns4::<R>(Vector(op.param0), at, live) } } else { [0.0; 4] };
        [0, 1, 2, 3].map(|e| P::forward(v[e], p[e], op.a, op.b))
    }, _ => [f32::NAN; 4])
}

/// The backward of the per-element ops `run` over a row of `f` columns, four columns
/// a thread at a time with their values in registers: `x` holds the run's input, `g`
/// the gradient of its output, which becomes that of its input; an op with a
/// parameter adds `g df/dp` to its slot of `part` (the run's slots end before slot
/// `slot_end`). Each op's input is the run's forward from `x` again, in registers: the
/// runs are short, and their math costs less than a pass over the row per op.
///
/// # Safety
/// `ops` holds the run's descriptors, all per-element, their parameters `f` floats;
/// `x` and `g` hold `f` floats, `part` `slot_end` slots of `n >= f`.
#[inline(never)]
#[allow(clippy::too_many_arguments)]
unsafe fn pointwise_run_backward<const T: usize, R: ReadParams>(
    ops: *const OpDesc,
    run: core::ops::Range<usize>,
    x: *const f32,
    g: *mut f32,
    part: *mut f32,
    slot_end: usize,
    n: usize,
    f: usize,
) {
    let mut j = thread_idx_x() as usize;
    // SAFETY (whole body): ops in `run`, live columns below `f`, slots below `slot_end`.
    unsafe {
        while j < f {
            // Columns a block apart: the warp's reads stay on distinct banks.
            let at = [0, 1, 2, 3].map(|e| j + e * T);
            let live = at.map(|c| c < f);
            let input = columns4(x, at, live);
            let mut d = columns4(g, at, live);
            let (mut slot, mut k) = (slot_end, run.end);
            while k > run.start {
                k -= 1;
                let mut v = input;
                for q in run.start..k {
                    v = forward4::<R>(&*ops.add(q), v, at, live);
                }
                let op = &*ops.add(k);
                d = match_pointwise!(op.code, P => {
                    let p = if P::HAS_PARAM {
                        slot -= 1;
                        for e in 0..4 {
                            if live[e] {
                                *part.add(slot * n + at[e]) += d[e] * P::param_grad(v[e]);
                            }
                        }
                        param_columns4::<R>(Vector(op.param0), at, live)
                    } else {
                        [0.0; 4]
                    };
                    [0, 1, 2, 3].map(|e| d[e] * P::grad(v[e], p[e], op.a, op.b))
                }, _ => [f32::NAN; 4]);
            }
            for e in 0..4 {
                if live[e] {
                    *g.add(at[e]) = d[e];
                }
            }
            j += 4 * T;
        }
    }
}

/// One channel `ch` of a GroupNorm's backward (groups of `size`, `gamma` the channel's,
/// `eps` the op's): adds `d xhat` and `d` to gamma's and beta's slots at `ps` and returns
/// `rstd (d gamma - m1 - xhat m2)`, `m` the group's means of `d gamma` and `d gamma xhat`.
/// (`gamma` is read by the caller, a few channels ahead: see [`normalize_group`].)
///
/// # Safety
/// `ps` holds two slots of `n > ch` floats.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn group_norm_grad(
    ps: *mut f32,
    n: usize,
    ch: usize,
    d: f32,
    gamma: f32,
    (xhat, rstd): (f32, f32),
    (m1, m2): (f32, f32),
    (size, eps): (usize, f32),
) -> f32 {
    // SAFETY: as the contract.
    unsafe {
        *ps.add(ch) += d * xhat;
        *ps.add(n + ch) += d;
    }
    if size == 2 {
        // Two channels: xhat = ±sqrt(1 - eps rstd²), and the formula's 1 - xhat²
        // cancels to noise in f32 when the variance dwarfs eps. Its exact value is
        // eps rstd².
        (d * gamma - m1) * (eps * rstd * rstd * rstd)
    } else {
        rstd * (d * gamma - m1 - xhat * m2)
    }
}

/// Backward of the chain, row by row: `dz = d(loss)/d(z)` from `dy`, and each block's
/// sums over its rows of every parameter gradient (the first level of a two-level
/// reduction; `sum_partials` is the second).
///
/// Each op's input is recomputed from the saved `z` (the chain's input) rather than
/// saved: the forward keeps one `(rows, n)` tensor however long the chain, and the
/// recomputation runs in shared memory.
///
/// # Safety
/// As [`epilogue_rows`]; `partials` zeroed. Launch: grid `(G, 1, 1)` for any
/// `G <= rows`, `ROW_THREADS` threads (or fewer, a multiple of 32),
/// `row_backward_smem_bytes(n, sums_in_smem ? slots : 0, pools)` shared memory
/// (`pools`: the chain has an AvgPool or a MaxPool).
///
/// # Parameters
/// * `z`: `(rows, n)`, the chain's input saved by the forward.
/// * `dy`: `(rows, f_out)`, the gradient of the chain's output, as `E`.
/// * `dz`: `(rows, n)`, written as `E` (bf16: rounded once; the sums are of the FP32
///   values).
/// * `partials`: `(G, slots, n)`: slot 0 sums `dz` (the Linear bias's gradient), then
///   one slot per op parameter in chain order (`bias`, `w`, GroupNorm `gamma`, `beta`).
/// * `sums_in_smem`: keep the block's sums in shared memory and write them once at the
///   end (when they fit), instead of adding into `partials` row after row.
///
/// # Thread mapping
/// Block `b` takes rows `b, b + G, ..`. Per row, for each op from the last (a run of
/// per-element ops at once): rebuild its input from `z` (ops before it, forward), then
/// turn the gradient of its output into that of its input in place. A thread always
/// owns the same columns (or, for GroupNorm, the same groups or the same lanes of
/// them), so its partial sums need no atomics.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn rows_backward<E: Element, const T: usize, R: ReadParams>(
    z: *const f32,
    dy: *const E,
    dz: *mut E,
    partials: *mut f32,
    rows: u32,
    n: u32,
    ops: *const OpDesc,
    n_ops: u32,
    sums_in_smem: u32,
) {
    let t = thread_idx_x() as usize;
    let (warp, lane) = (warp_id() as usize, lane_id() as usize);
    let (n, n_ops) = (n as usize, n_ops as usize);
    // SAFETY: the kernel's descriptors.
    unsafe { R::check(ops, n_ops) };
    // SAFETY: op descriptors are read-only and i < n_ops wherever used.
    let op_at = |i: usize| unsafe { *ops.add(i) };
    let (mut slots, mut f_out, mut pools) = (1, n, false);
    for i in 0..n_ops {
        let op = op_at(i);
        slots += param_count(&op);
        f_out = features_after(&op, f_out);
        pools |= matches!(op.code, OP_AVG_POOL | OP_MAX_POOL);
    }
    let base = dynamic_shared::<f32>();
    // SAFETY: row_backward_smem_bytes(n, .., pools) covers [red: 2 * WARPS][g: n][x: n],
    // then [alt: n] where the chain pools (only pooling moves a row between buffers),
    // then the sums where they are kept on chip.
    let (red, g_buf, x_buf) = unsafe { (base, base.add(2 * WARPS), base.add(2 * WARPS + n)) };
    let alt_buf = if pools { unsafe { x_buf.add(n) } } else { null_mut() };
    // SAFETY: this block's slice of the partial sums.
    let out = unsafe { partials.add(block_idx_x() as usize * slots * n) };
    // Where the sums accumulate: shared memory after the buffers, or `out` itself.
    let part = if sums_in_smem != 0 {
        // SAFETY: the launch provides slots * n floats after the buffers.
        let s = unsafe { x_buf.add(if pools { 2 * n } else { n }) };
        let mut j = t;
        while j < slots * n {
            unsafe { *s.add(j) = 0.0 };
            j += T;
        }
        s
    } else {
        out
    };

    let mut row = block_idx_x() as usize;
    while row < rows as usize {
        let (mut g, mut g_alt) = (g_buf, alt_buf);
        // SAFETY (whole row): indices below the buffer extents; uniform barriers.
        unsafe {
            load_row::<_, T>(g, dy.add(row * f_out), 1, 0, Vector(0), null_mut(), f_out);
            // Threads read columns that others loaded (16 bytes each): and with no op
            // below, the store of dz reads them straight away.
            sync_threads();
            let mut slot_end = slots;
            let mut i = n_ops;
            while i > 0 {
                i -= 1;
                let op = op_at(i);
                if op.code == OP_RESIDUAL {
                    // (The last op.) `g` passes on to the ops before it; `dy` joins `dz` below.
                    continue;
                }
                // A run of per-element ops ending at op i goes back in one pass from its
                // first op's input (each op's own rebuild from `z` reloaded the row and
                // redid every op before it: KernelBench 64's four ops after its
                // logsumexp took five logsumexps per row).
                let first = if is_pointwise(&op) { run_start(ops, i) } else { i };
                // Rebuild op `first`'s input in x (ops before it, forward from z);
                // shrinking ops write into the buffer the gradient is not using.
                let (mut x, mut x_alt) = (x_buf, g_alt);
                load_row::<_, T>(x, z.add(row * n), 1, 0, Vector(0), null_mut(), n);
                sync_threads();
                let mut f = n;
                for p in 0..first {
                    f = op_forward::<T, R>(&op_at(p), &mut x, &mut x_alt, red, f);
                }
                if first < i || is_pointwise(&op) {
                    pointwise_run_backward::<T, R>(ops, first..i + 1, x, g, part, slot_end, n, f);
                    for k in first..=i {
                        slot_end -= param_count(&op_at(k));
                    }
                    i = first;
                    sync_threads();
                    continue;
                }
                // `g` holds the gradient of op i's output; make it that of its input.
                let p0 = Vector(op.param0);
                slot_end -= param_count(&op);
                let ps = part.add(slot_end * n); // this op's first slot
                match op.code {
                    OP_GROUP_NORM => {
                        let groups = op.count as usize;
                        let size = f / groups;
                        let inv = 1.0 / size as f32;
                        if size <= WARP {
                            // A thread a group (as the forward's `normalize_groups` where
                            // groups outnumber warps: this kernel runs whole rows).
                            let start = group_start(size);
                            let mut gi = t;
                            while gi < groups {
                                let (xs, gs) = (x.add(gi * size), g.add(gi * size));
                                let (mean, rstd) = group_stats_alone(xs, size, op.a, start);
                                let (mut s1, mut s2, mut k) = (0.0, 0.0, start);
                                for _ in 0..size {
                                    let xhat = (*xs.add(k) - mean) * rstd;
                                    let dyg = *gs.add(k) * R::get(p0, gi * size + k);
                                    s1 += dyg;
                                    s2 += dyg * xhat;
                                    k = next_in_group(k, size);
                                }
                                let m = (s1 * inv, s2 * inv);
                                // A few channels' gamma read before their slots are written.
                                let mut done = 0;
                                while done < size {
                                    let (at, live) = next_channels(&mut k, size, done);
                                    let gamma: [f32; PARAM_LOADS] =
                                        core::array::from_fn(|u| if live[u] { R::get(p0, gi * size + at[u]) } else { 0.0 });
                                    for u in 0..PARAM_LOADS {
                                        if live[u] {
                                            let (c, xhat) = (at[u], (*xs.add(at[u]) - mean) * rstd);
                                            let d = *gs.add(c);
                                            *gs.add(c) = group_norm_grad(ps, n, gi * size + c, d, gamma[u], (xhat, rstd), m, (size, op.a));
                                        }
                                    }
                                    done += PARAM_LOADS;
                                }
                                gi += T;
                            }
                        } else {
                            let mut gi = warp;
                            while gi < groups {
                                let (xs, gs) = (x.add(gi * size), g.add(gi * size));
                                let (mean, rstd) = group_stats(xs, size, op.a, lane);
                                let (mut s1, mut s2) = (0.0, 0.0);
                                let mut j = lane;
                                while j < size {
                                    let xhat = (*xs.add(j) - mean) * rstd;
                                    let dyg = *gs.add(j) * R::get(p0, gi * size + j);
                                    s1 += dyg;
                                    s2 += dyg * xhat;
                                    j += WARP;
                                }
                                let m = (warp_sum(s1) * inv, warp_sum(s2) * inv);
                                // A few channels' gamma read before their slots are written.
                                let mut j = lane;
                                while j + (PARAM_LOADS - 1) * WARP < size {
                                    let at: [usize; PARAM_LOADS] = core::array::from_fn(|u| j + u * WARP);
                                    let gamma = at.map(|c| R::get(p0, gi * size + c));
                                    for u in 0..PARAM_LOADS {
                                        let (c, xhat) = (at[u], (*xs.add(at[u]) - mean) * rstd);
                                        let d = *gs.add(c);
                                        *gs.add(c) = group_norm_grad(ps, n, gi * size + c, d, gamma[u], (xhat, rstd), m, (size, op.a));
                                    }
                                    j += PARAM_LOADS * WARP;
                                }
                                while j < size {
                                    let (ch, xhat) = (gi * size + j, (*xs.add(j) - mean) * rstd);
                                    let gamma = R::get(p0, ch);
                                    *gs.add(j) = group_norm_grad(ps, n, ch, *gs.add(j), gamma, (xhat, rstd), m, (size, op.a));
                                    j += WARP;
                                }
                                gi += T / WARP;
                            }
                        }
                    }
                    OP_AVG_POOL => {
                        let k = op.count as usize;
                        let pooled = f / k;
                        let mut j = t;
                        while j < f {
                            *g_alt.add(j) = if j < pooled * k { *g.add(j / k) / k as f32 } else { 0.0 };
                            j += T;
                        }
                        core::mem::swap(&mut g, &mut g_alt);
                    }
                    OP_MAX_POOL => {
                        // Each window's gradient goes to its first maximum (NaN first).
                        let k = op.count as usize;
                        let pooled = f / k;
                        let mut w = t;
                        while w < pooled {
                            let mut at = 0;
                            for e in 1..k {
                                let (v, best) = (*x.add(w * k + e), *x.add(w * k + at));
                                if max_first(v, e as u32, best, at as u32) {
                                    at = e;
                                }
                            }
                            let d = *g.add(w);
                            for e in 0..k {
                                *g_alt.add(w * k + e) = if e == at { d } else { 0.0 };
                            }
                            w += T;
                        }
                        let mut j = pooled * k + t;
                        while j < f {
                            *g_alt.add(j) = 0.0;
                            j += T;
                        }
                        core::mem::swap(&mut g, &mut g_alt);
                    }
                    OP_ROW_SUM | OP_ROW_MEAN | OP_LOGSUMEXP => {
                        let lse = if op.code == OP_LOGSUMEXP { reduce_row::<T>(op.code, x, f, red) } else { 0.0 };
                        let d = *g;
                        sync_threads(); // g[0] read by all before g is rewritten in place
                        let each = if op.code == OP_ROW_MEAN { d / f as f32 } else { d };
                        let mut j = t;
                        while j < f {
                            *g.add(j) = if op.code == OP_LOGSUMEXP { d * exp(*x.add(j) - lse) } else { each };
                            j += T;
                        }
                    }
                    OP_SOFTMAX => {
                        // dx = s (dy - sum(dy s)), `s` the softmax (rebuilt in x).
                        softmax_in_place::<T>(x, f, red);
                        let dot = row_sum::<T, _>(x, f, red, |j, s| s * *g.add(j));
                        let mut j = t;
                        while j < f {
                            *g.add(j) = *x.add(j) * (*g.add(j) - dot);
                            j += T;
                        }
                    }
                    OP_RMS_NORM => {
                        // With xhat = x r: dx = r (dy w - xhat mean(dy w xhat)); dw += dy xhat.
                        let r = rms_rstd::<T>(x, f, op.a, red);
                        let m = row_sum::<T, _>(x, f, red, |j, v| *g.add(j) * R::get(p0, j) * v * r) / f as f32;
                        let mut j = t;
                        while j < f {
                            let (xhat, d) = (*x.add(j) * r, *g.add(j));
                            *ps.add(j) += d * xhat;
                            *g.add(j) = r * (d * R::get(p0, j) - xhat * m);
                            j += T;
                        }
                    }
                    OP_ROW_MAX | OP_ROW_MIN => {
                        let at = arg_max::<T>(x, f, red, if op.code == OP_ROW_MIN { -1.0 } else { 1.0 });
                        let d = *g;
                        sync_threads(); // g[0] read by all before g is rewritten in place
                        let mut j = t;
                        while j < f {
                            *g.add(j) = if j == at { d } else { 0.0 };
                            j += T;
                        }
                    }
                    _ => {
                        // An unknown code: poison rather than pass through.
                        let mut j = t;
                        while j < f {
                            *g.add(j) = f32::NAN;
                            j += T;
                        }
                    }
                }
                sync_threads();
            }
            // g now holds dz for the row (but for a `residual`'s path: `dy` itself).
            if n_ops > 0 && op_at(n_ops - 1).code == OP_RESIDUAL {
                add_row::<_, T>(g, dy.add(row * n), n);
            }
            let mut j = t;
            while j < n {
                let d = *g.add(j);
                E::store1(dz.add(row * n + j), d);
                *part.add(j) += d;
                j += T;
            }
            sync_threads();
        }
        row += grid_dim_x() as usize;
    }
    if sums_in_smem != 0 {
        // SAFETY: every thread's adds are done (the row loop ends on a barrier).
        let mut j = t;
        while j < slots * n {
            unsafe { *out.add(j) = *part.add(j) };
            j += T;
        }
    }
}

/// The row-wise backward's entry points, one per type of `dy` and `dz`: FP32, and bf16
/// or fp16 (a 16-bit model's gradients without a widening pass before and a rounding
/// pass after).
macro_rules! rows_backward_of {
    ($($name:ident: $t:ty, $threads:expr;)*) => {$(
        /// `rows_backward` with `dy` and `dz` of this entry point's type, in blocks of
        /// `$threads`.
        ///
        /// # Safety
        /// As `rows_backward`.
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "ptx-kernel" fn $name(
            z: *const f32,
            dy: *const $t,
            dz: *mut $t,
            partials: *mut f32,
            rows: u32,
            n: u32,
            ops: *const OpDesc,
            n_ops: u32,
            sums_in_smem: u32,
        ) {
            unsafe { rows_backward::<_, { $threads }, Fp32Params>(z, dy, dz, partials, rows, n, ops, n_ops, sums_in_smem) }
        }
    )*};
}
rows_backward_of!(
    epilogue_rows_backward: f32, ROW_THREADS;
    epilogue_rows_backward_bf16: Bf16, ROW_THREADS;
    epilogue_rows_backward_f16: F16, ROW_THREADS;
    epilogue_rows_backward_narrow: f32, NARROW_ROW_THREADS;
    epilogue_rows_backward_narrow_bf16: Bf16, NARROW_ROW_THREADS;
    epilogue_rows_backward_narrow_f16: F16, NARROW_ROW_THREADS;
);

/// `out[j] = sum_b partials[b, j]`: the second level of the parameter-gradient
/// reduction (the first is per block in `epilogue_rows_backward`).
///
/// # Safety
/// `partials` holds `blocks * len` floats, `out` `len`. Launch: 1-D, any grid covering `len`.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn sum_partials(partials: *const f32, blocks: u32, len: u32, out: *mut f32) {
    let j = (block_idx_x() * block_dim_x() + thread_idx_x()) as usize;
    let len = len as usize;
    if j < len {
        let mut s = 0.0;
        for b in 0..blocks as usize {
            // SAFETY: b < blocks, j < len.
            s += unsafe { *partials.add(b * len + j) };
        }
        // SAFETY: j < len.
        unsafe { *out.add(j) = s };
    }
}

/// [`sum_partials`] of the tile-wise backward's `(blocks, slots, n)` partial sums into
/// the gradients themselves: slot `k`'s `n` sums to the vector `outs[k]` (a
/// `kernel_abi::vector` word: each gradient rounded once into its own type), so no
/// launch copies them out of the slots afterwards.
///
/// # Safety
/// `partials` holds `blocks * slots * n` floats, `slots <= MAX_GRAD_SLOTS`, and each of
/// `outs[..slots]` names a vector of `n` values. Launch: 1-D, any grid covering
/// `slots * n`.
#[unsafe(no_mangle)]
// The array is a by-value kernel parameter (in PTX's parameter space, as the launcher
// pushes it), not a C value: the FFI-safety lint does not apply.
#[allow(improper_ctypes_definitions)]
pub unsafe extern "ptx-kernel" fn sum_partials_to(
    partials: *const f32,
    blocks: u32,
    n: u32,
    slots: u32,
    outs: [u64; MAX_GRAD_SLOTS],
) {
    let j = (block_idx_x() * block_dim_x() + thread_idx_x()) as usize;
    let (n, len) = (n as usize, slots as usize * n as usize);
    // (`n > 0` follows from `j < len`; said here, the division needs no zero check.)
    if j < len && n > 0 {
        let mut s = 0.0;
        for b in 0..blocks as usize {
            // SAFETY: b < blocks, j < slots * n.
            s += unsafe { *partials.add(b * len + j) };
        }
        let k = j / n;
        // The slot's word by constant index (a run-time index into the parameter array
        // would copy it to local memory).
        let mut word = 0;
        unroll!(i in 0..8 => {
            if k == i {
                word = outs[i];
            }
        });
        // SAFETY: j - k n < n, the vector's length.
        unsafe { store1_to(Vector(word), j - k * n, s) };
    }
}

//! The chain on a warp that holds whole rows of a 128-column tile, a lane holding 4
//! consecutive columns: forward (run by the GEMM on its staged output tile) and
//! backward (`epilogue_tiles_backward`), side by side.
//!
//! A GroupNorm group of `g` channels (a power of two, 4..=128, inside the tile since
//! the tile starts at a multiple of 128 and groups divide `n`) is `g / 4` neighbouring
//! lanes, so its statistics are shuffle sums and no barrier is needed. Columns past
//! `n` carry values that are never stored and never reach a group's sums.

use super::pointwise::{PointwiseMath, match_pointwise, param_count};
use crate::prelude::async_copy::{cp_async_4, cp_async_8, cp_async_16, cp_async_commit, cp_async_wait, cp_async_wait_all, shared_address};
use crate::prelude::element::{Bf16, Element, F16};
use crate::prelude::math::{fma, rsqrt};
use crate::prelude::warp::shfl_xor;
use crate::prelude::*;
use crate::prelude::vector::{check_stored, store4_to, with_reader};
use crate::unroll;
use kernel_abi::epilogue::*;
use kernel_abi::gemm_fma::{MAX_GRAD_SLOTS, MAX_TILE_OPS};

/// 16 bytes, for vector loads and stores.
#[derive(Clone, Copy)]
#[repr(C, align(16))]
pub struct F4(pub [f32; 4]);

/// Writes columns `c..c+4` of `row` of an `(.., n)` row-major matrix, 16 bytes at a time
/// when aligned, skipping columns past `n`.
///
/// # Safety
/// `row` and the columns below `n` are inside `dst`.
#[inline(always)]
pub unsafe fn store_row4<O: Element>(dst: *mut O, v: [f32; 4], row: usize, n: usize, c: usize) {
    unsafe {
        if n % 4 == 0 && c + 4 <= n {
            O::store4(dst.add(row * n + c), v);
        } else {
            unroll!(e in 0..4 => {
                if c + e < n {
                    O::store1(dst.add(row * n + c + e), v[e]);
                }
            });
        }
    }
}

/// A GroupNorm group as the lanes hold it: `g / 4` neighbouring lanes and `1 / g`.
/// The tile-wise backward works it out once per block (per pass, `n / count` and
/// `1 / g` were an integer and an IEEE division: ~50 instructions for 8 values).
#[derive(Clone, Copy, Default)]
#[repr(C)]
pub struct LaneGroup {
    pub lanes: u32,
    pub inv: f32,
}

impl LaneGroup {
    /// The group of GroupNorm `op` over `n` channels.
    #[inline(always)]
    pub fn of(op: &OpDesc, n: usize) -> LaneGroup {
        let g = n / (op.count as usize).max(1);
        LaneGroup { lanes: (g / 4) as u32, inv: 1.0 / g as f32 }
    }
}

/// GroupNorm statistics of the lanes' groups in `R` rows at once (their shuffles
/// interleaved): `(mean, 1 / sqrt(var + eps))` per row.
#[inline(always)]
fn lane_group_stats<const R: usize>(op: &OpDesc, v: &[[f32; 4]; R], group: LaneGroup) -> [(f32, f32); R] {
    let sums = segment_sums(v.map(|r| r[0] + r[1] + r[2] + r[3]), group.lanes);
    let mean = sums.map(|s| s * group.inv);
    let mut q = [0.0f32; R];
    unroll!(i in 0..2 => {
        if i < R {
            unroll!(e in 0..4 => { let d = v[i][e] - mean[i]; q[i] = fma(d, d, q[i]); });
        }
    });
    let q = segment_sums(q, group.lanes);
    let mut stats = [(0.0, 0.0); R];
    unroll!(i in 0..2 => { if i < R { stats[i] = (mean[i], rsqrt(q[i] * group.inv + op.a)); } });
    stats
}

/// `lane_forward_rows_with`, the op's parameter vectors read as stored: one instance
/// per storage type they share ([`Typed`]: plain loads; a branch per load is what the
/// tile-wise kernels' register budgets cannot take), [`AsStored`] where they differ.
#[inline(always)]
pub fn lane_forward_rows<const R: usize>(
    op: &OpDesc,
    group: impl Fn() -> LaneGroup,
    rows: &mut [[f32; 4]; R],
    n: usize,
    c: usize,
) {
    with_reader!(op, Q => lane_forward_rows_with::<R, Q>(op, group, rows, n, c))
}

/// [`lane_backward_rows_with`], the op's parameter vectors read as stored, as
/// [`lane_forward_rows`].
///
/// # Safety
/// As [`lane_backward_rows_with`].
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn lane_backward_rows(
    op: &OpDesc,
    group: LaneGroup,
    x: &[[f32; 4]; 2],
    g: &mut [[f32; 4]; 2],
    n: usize,
    c: usize,
    sums: *mut F4,
    slot: usize,
    lane: usize,
    both: bool,
) {
    let args = (n, c, sums, slot, lane, both);
    unsafe {
        with_reader!(op, Q => lane_backward_rows_with::<Q>(op, group, x, g, args))
    }
}

/// One op forward on the lane's 4 values of `R` (1 or 2) rows at once: the op is
/// decoded once and the rows' independent chains (shuffles, `exp`, parameter loads)
/// share one basic block, so their latencies overlap. (Rows are indexed by unrolled
/// constants only: a loop would put the array on the stack.) `group` gives a
/// GroupNorm's [`LaneGroup`] (called only for one).
#[inline(always)]
fn lane_forward_rows_with<const R: usize, Q: ReadParams>(
    op: &OpDesc,
    group: impl Fn() -> LaneGroup,
    rows: &mut [[f32; 4]; R],
    n: usize,
    c: usize,
) {
    let (p0, p1) = (Vector(op.param0), Vector(op.param1));
    match op.code {
        OP_GROUP_NORM => {
            let stats = lane_group_stats(op, rows, group());
            // SAFETY: a GroupNorm's two parameters hold `n` floats each.
            let (gamma, beta) = unsafe { (Q::column4(p0, n, c), Q::column4(p1, n, c)) };
            unroll!(i in 0..2 => {
                if i < R {
                    let (mean, rstd) = stats[i];
                    unroll!(e in 0..4 => {
                        rows[i][e] = (rows[i][e] - mean) * rstd * gamma[e] + beta[e];
                    });
                }
            });
        }
        // One arm per op, each a straight run over the rows' values: a `match` per
        // element would branch 8 times per op and serialise the rows.
        code => match_pointwise!(code, P => {
            // SAFETY: an op's parameter holds `n` floats.
            let p = if P::HAS_PARAM { unsafe { Q::column4(p0, n, c) } } else { [0.0; 4] };
            each(rows, |x, e| P::forward(x, p[e], op.a, op.b))
        }, _ => each(rows, |x, _| poison(x))), // not fusable: the host never sends it
    }
}

/// A NaN made from `x` (its bits with the exponent and the quiet bit set): an unknown
/// op's poison. A constant NaN would be materialised into every value's register
/// before each op's dispatch (8 moves per op per pass: LLVM hoists a phi's constant
/// inputs out of the switch); this one is computed only in the arm that needs it.
#[inline(always)]
fn poison(x: f32) -> f32 {
    f32::from_bits(x.to_bits() | 0x7fc0_0000)
}

/// `v = f(v, e)` for element `e` of every row (`R` <= 2, unrolled).
#[inline(always)]
fn each<const R: usize>(rows: &mut [[f32; 4]; R], f: impl Fn(f32, usize) -> f32) {
    unroll!(i in 0..2 => {
        if i < R {
            unroll!(e in 0..4 => { rows[i][e] = f(rows[i][e], e); });
        }
    });
}

/// Sums of `K` values over aligned segments of `width` lanes (a power of two up to
/// 32, the same on every lane): the `K` exchanges of a step are independent, so their
/// latencies overlap. One straight run of butterflies per width: a loop's counter,
/// compare and convergence check per step cost as much as its shuffles.
#[inline(always)]
fn segment_sums<const K: usize>(v: [f32; K], width: u32) -> [f32; K] {
    match width {
        0 | 1 => v,
        2 => butterfly::<K, 1>(v),
        4 => butterfly::<K, 2>(v),
        8 => butterfly::<K, 3>(v),
        16 => butterfly::<K, 4>(v),
        _ => butterfly::<K, 5>(v),
    }
}

/// `STEPS` butterfly steps (xor 1, 2, ..) of segment sums over `K` values.
#[inline(always)]
fn butterfly<const K: usize, const STEPS: u32>(mut v: [f32; K]) -> [f32; K] {
    unroll!(s in 0..8 => {
        if (s as u32) < STEPS {
            unroll!(k in 0..4 => { if k < K { v[k] += shfl_xor(v[k], 1 << s); } });
        }
    });
    v
}

/// The lane's 16-byte slice of parameter-gradient slot `slot` in its warp's sums
/// (shared memory, `[slot][lane]` per warp; only this lane touches it).
/// Adds row 0's `v` and, when `both`, row 1's (a select, so an absent row's values,
/// whatever they are, never reach the sums).
///
/// # Safety
/// `sums` is the warp's region of at least `slot + 1` slots.
#[inline(always)]
pub(crate) unsafe fn add_to_slot(sums: *mut F4, slot: usize, lane: usize, v: &[[f32; 4]; 2], both: bool) {
    unsafe {
        let at = sums.add(slot * 32 + lane);
        let mut s = (*at).0;
        unroll!(e in 0..4 => { s[e] += v[0][e] + if both { v[1][e] } else { 0.0 }; });
        *at = F4(s);
    }
}

/// One op backward on the lane's 4 columns of two rows at once (the op decoded once,
/// the rows' chains interleaved): `g` (the gradient of the op's output) becomes that of
/// its input `x`; parameter gradients go to the sums from slot `slot` on (row 1's only
/// when `both`).
///
/// # Safety
/// As [`add_to_slot`], for the op's slots.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn lane_backward_rows_with<Q: ReadParams>(
    op: &OpDesc,
    group: LaneGroup,
    x: &[[f32; 4]; 2],
    g: &mut [[f32; 4]; 2],
    (n, c, sums, slot, lane, both): (usize, usize, *mut F4, usize, usize, bool),
) {
    let p0 = Vector(op.param0);
    match op.code {
        OP_GROUP_NORM => {
            // dx = rstd (dy gamma - mean(dy gamma) - xhat mean(dy gamma xhat))
            let (lanes, inv) = (group.lanes, group.inv);
            let [(m0, r0), (m1, r1)] = lane_group_stats(op, x, group);
            let (mean, rstd) = ([m0, m1], [r0, r1]);
            // SAFETY: a GroupNorm's weight holds `n` floats.
            let gamma = unsafe { Q::column4(p0, n, c) };
            let mut xhat = [[0.0f32; 4]; 2];
            let mut dyg = [[0.0f32; 4]; 2];
            let mut s = [0.0f32; 4];
            unroll!(i in 0..2 => {
                unroll!(e in 0..4 => {
                    xhat[i][e] = (x[i][e] - mean[i]) * rstd[i];
                    dyg[i][e] = g[i][e] * gamma[e];
                    s[2 * i] += dyg[i][e];
                    s[2 * i + 1] = fma(dyg[i][e], xhat[i][e], s[2 * i + 1]);
                });
            });
            let s = segment_sums(s, lanes);
            let gx = [0, 1].map(|i| [0, 1, 2, 3].map(|e| g[i][e] * xhat[i][e]));
            unsafe {
                add_to_slot(sums, slot, lane, &gx, both);
                add_to_slot(sums, slot + 1, lane, g, both);
            }
            unroll!(i in 0..2 => {
                let (a, b) = (s[2 * i] * inv, s[2 * i + 1] * inv);
                unroll!(e in 0..4 => { g[i][e] = rstd[i] * fma(-xhat[i][e], b, dyg[i][e] - a); });
            });
        }
        // One arm per op, each a straight run over the 8 values (as the forward's):
        // a `match` per element dispatched 8 times per op and serialised the values'
        // `exp` chains.
        code => match_pointwise!(code, P => {
            if P::HAS_PARAM {
                let gp = [0, 1].map(|i| [0, 1, 2, 3].map(|e| g[i][e] * P::param_grad(x[i][e])));
                unsafe { add_to_slot(sums, slot, lane, &gp, both) };
                // SAFETY: the op's parameter holds `n` floats.
                let p = unsafe { Q::column4(p0, n, c) };
                unroll!(i in 0..2 => { unroll!(e in 0..4 => { g[i][e] *= P::grad(x[i][e], p[e], op.a, op.b); }); });
            } else {
                scale_by(g, x, |v| P::grad(v, 0.0, op.a, op.b))
            }
        }, _ => scale_by(g, x, poison)), // not fusable: the host never sends it
    }
}

/// `g *= df(x)` for the lane's values of two rows.
#[inline(always)]
fn scale_by(g: &mut [[f32; 4]; 2], x: &[[f32; 4]; 2], df: impl Fn(f32) -> f32) {
    unroll!(i in 0..2 => { unroll!(e in 0..4 => { g[i][e] *= df(x[i][e]); }); });
}

/// Backward of a fusable chain (what the GEMM's epilogue can run forward), tile by
/// tile: `dz` and per-block sums of the parameter gradients. A warp takes two rows per
/// pass: it runs the chain forward once from the saved `z`, keeping each op's input in
/// its lanes' own shared memory, then walks the ops backward; its `z` and `dy` arrive
/// in shared memory by `cp.async` a pass ahead. No barrier until the block's sums meet.
///
/// # Safety
/// Device pointers; `ops[..n_ops]` fusable (the host checks), at most `MAX_TILE_OPS`
/// of them, with at most `MAX_GRAD_SLOTS - 1` parameters. Launch: grid `(ceil(n / 128), row_blocks)`,
/// `TILE_THREADS` threads, `tiles_backward_smem_bytes(slots, n_ops)` shared memory;
/// block `(bx, by)` takes rows `by * rows_per_block ..` of its 128 columns.
///
/// # Parameters
/// * `z`: `(rows, n)`, the chain's input saved by the forward; `dy`: `(rows, n)`.
/// * `dz`: `(rows, n)`, written.
/// * `partials`: `(row_blocks, slots, n)`: slot 0 sums `dz` (the Linear bias's
///   gradient), then one slot per op parameter in chain order; `sum_partials` adds
///   over the row blocks.
/// * `outs`: where `outs[0]` is a vector (not 0) and the grid has one row block, the
///   gradients themselves: slot `k`'s `n` sums go to the vector `outs[k]`
///   (`kernel_abi::vector` words, each rounded into its own type) and `partials` is
///   not touched. The ops' parameter vectors are FP32 (16-bit kernels: stored as `dy`).
///
/// # Thread mapping
/// Warp `w` takes the row pairs `2 w, 2 w + 1`, then `+ 16`, .. of the block's rows;
/// lane `l` columns `128 bx + 4 l ..+4`. Each lane keeps its columns' gradient sums in
/// its own slice of shared memory; at the end the 8 warps' sums are added.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
// `outs` is a by-value kernel parameter (PTX's parameter space), not a C value.
#[allow(improper_ctypes_definitions)]
pub unsafe extern "ptx-kernel" fn epilogue_tiles_backward(
    z: *const f32,
    dy: *const f32,
    dz: *mut f32,
    partials: *mut f32,
    rows: u32,
    n: u32,
    ops: *const OpDesc,
    n_ops: u32,
    rows_per_block: u32,
    outs: [u64; MAX_GRAD_SLOTS],
) {
    unsafe { tiles_backward(z, dy, dz, partials, rows, n, ops, n_ops, rows_per_block, outs) }
}

/// [`epilogue_tiles_backward`] for a 16-bit model: `dy` and `dz` in bf16 or fp16 (the
/// chain in FP32, `dz` rounded to nearest once), `z` and the partial sums in FP32.
macro_rules! tiles_backward_of {
    ($($name:ident: $t:ty),*) => {$(
        /// [`epilogue_tiles_backward`] on a 16-bit `dy` and `dz`.
        ///
        /// # Safety
        /// As [`epilogue_tiles_backward`], with `n % 4 == 0` (8-byte copies of `dy`;
        /// otherwise the kernel writes nothing).
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments)]
        #[allow(improper_ctypes_definitions)]
        pub unsafe extern "ptx-kernel" fn $name(
            z: *const f32,
            dy: *const $t,
            dz: *mut $t,
            partials: *mut f32,
            rows: u32,
            n: u32,
            ops: *const OpDesc,
            n_ops: u32,
            rows_per_block: u32,
            outs: [u64; MAX_GRAD_SLOTS],
        ) {
            if n % 4 != 0 {
                return;
            }
            unsafe { tiles_backward(z, dy, dz, partials, rows, n, ops, n_ops, rows_per_block, outs) }
        }
    )*};
}
tiles_backward_of!(epilogue_tiles_backward_bf16: Bf16, epilogue_tiles_backward_f16: F16);

/// The body of the tile-wise backwards, `G` the type of `dy` and `dz`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tiles_backward<G: Element>(
    z: *const f32,
    dy: *const G,
    dz: *mut G,
    partials: *mut f32,
    rows: u32,
    n: u32,
    ops: *const OpDesc,
    n_ops: u32,
    rows_per_block: u32,
    outs: [u64; MAX_GRAD_SLOTS],
) {
    let half = core::mem::size_of::<G>() == 2;
    let (rows, n, n_ops) = (rows as usize, n as usize, (n_ops as usize).min(MAX_TILE_OPS));
    let (warp, lane) = (warp_id() as usize, lane_id() as usize);
    let warps = TILE_THREADS / 32;
    let c = block_idx_x() as usize * 128 + lane * 4;
    let row0 = block_idx_y() as usize * rows_per_block as usize;
    let row_end = if row0 + (rows_per_block as usize) < rows { row0 + rows_per_block as usize } else { rows };
    // Shared memory: the op descriptors (read at every op of every pass: a short,
    // uniform load) and their GroupNorm constants, then [warp][slot][lane] gradient
    // sums, then per warp [op][row][lane] saved op inputs (all ops but the last) and
    // [slot][row][z, dy][lane] its ring, 16 bytes per lane (tiles_backward_smem_bytes).
    // Vectors of `G` only, plain loads (`Typed<G>`: read per load as any type they cost
    // a bf16 model's backward a quarter of its time; the host widens a mixed model's and
    // runs the FP32 kernel).
    // SAFETY: `ops` holds `n_ops` descriptors.
    unsafe { check_stored::<G>(ops, n_ops) };
    let base = dynamic_shared::<F4>(); // 16-byte aligned
    let descs = base as *mut OpDesc;
    // SAFETY (offset): the groups follow MAX_TILE_OPS descriptors (TILE_OP_BYTES each, both).
    let groups = unsafe { descs.add(MAX_TILE_OPS) } as *mut LaneGroup;
    let t = thread_idx_x() as usize;
    if t < n_ops {
        // SAFETY: t < n_ops <= MAX_TILE_OPS; the launch provides MAX_TILE_OPS descriptors
        // and groups of space.
        unsafe {
            let op = *ops.add(t);
            *descs.add(t) = op;
            *groups.add(t) = if op.code == OP_GROUP_NORM { LaneGroup::of(&op, n) } else { LaneGroup::default() };
        }
    }
    // SAFETY: uniform barrier before the descriptors are read.
    unsafe { sync_threads() };
    // SAFETY: i < n_ops <= MAX_TILE_OPS.
    let op_at = |i: usize| unsafe { &*descs.add(i) };
    let mut slots = 1;
    for i in 0..n_ops {
        slots += param_count(op_at(i));
    }
    // SAFETY (offsets): inside the launch's tiles_backward_smem_bytes(slots, n_ops); the
    // descriptors take a multiple of 16 bytes.
    let all_sums = unsafe { base.byte_add(MAX_TILE_OPS * TILE_OP_BYTES) };
    let sums = unsafe { all_sums.add(warp * slots * 32) };
    let per_warp = (2 * n_ops.saturating_sub(1) + TILES_BACKWARD_RING_ROWS) * 32;
    let saved = unsafe { all_sums.add(warps * slots * 32 + warp * per_warp) };
    for k in 0..slots {
        // SAFETY: k < slots; the lane's own slice.
        unsafe { *sums.add(k * 32 + lane) = F4([0.0; 4]) };
    }

    // z and dy stream through each warp's two ring slots by `cp.async` (no registers
    // held for them): the next pair's copies are in flight during this pair's
    // arithmetic. A lane reads back only its own copies, so waiting on its own groups
    // is enough; the slot a copy overwrites was read a whole pass earlier.
    let ring = unsafe { saved.add(n_ops.saturating_sub(1) * 64) };
    let step = 2 * warps;
    // SAFETY (copies): slot < 2; rows below row_end and columns below n only.
    // `at` is row r's offset of the lane's first column, `r * n + c`, kept by one add per
    // pass; each copy's source is selected only between a pointer and `z` (no bytes
    // are read for rows past row_end or columns past n).
    let fetch = |r: usize, at: usize, slot: usize| unsafe {
        unroll!(i in 0..2 => {
            let live = r + i < row_end;
            let at = at + i * n;
            unroll!(t in 0..2 => {
                let dst = shared_address(ring.add(((slot * 2 + i) * 2 + t) * 32 + lane));
                if t == 1 && half {
                    // Four 16-bit values of `dy`, 8 bytes (the host sends `n % 4 == 0`).
                    let ok = live && c < n;
                    let dy16 = dy as *const u16;
                    cp_async_8(dst, if ok { dy16.add(at) } else { dy16 }, if ok { 8 } else { 0 });
                } else {
                    let src = if t == 0 { z } else { dy as *const f32 };
                    if n % 4 == 0 {
                        let ok = live && c < n;
                        cp_async_16(dst, if ok { src.add(at) } else { z }, if ok { 16 } else { 0 });
                    } else {
                        unroll!(e in 0..4 => {
                            let ok = live && c + e < n;
                            cp_async_4(dst + 4 * e as u32, if ok { src.add(at + e) } else { z }, if ok { 4 } else { 0 });
                        });
                    }
                }
            });
        });
        cp_async_commit();
    };
    let mut row = row0 + 2 * warp;
    let mut at = row * n + c;
    let pass_stride = step * n;
    let mut slot = 0;
    fetch(row, at, slot);
    while row < row_end {
        at += pass_stride;
        fetch(row + step, at, slot ^ 1);
        cp_async_wait::<1>();
        // SAFETY: the lane's own slots, landed.
        let mut cur = [0, 1].map(|i| [0, 1].map(|t| unsafe { (*ring.add(((slot * 2 + i) * 2 + t) * 32 + lane)).0 }));
        if half {
            // `dy`'s four 16-bit values sit in the slot's first 8 bytes.
            unroll!(i in 0..2 => {
                let w = cur[i][1].map(f32::to_bits);
                cur[i][1] = G::unpack4([w[0], w[1]]);
            });
        }
        slot ^= 1;
        let both = row + 1 < row_end;
        let mut x = [cur[0][0], cur[1][0]];
        let mut g = [cur[0][1], cur[1][1]];
        // Forward once: op p's input is kept (p < n_ops - 1) or stays in x (the last).
        for p in 0..n_ops.saturating_sub(1) {
            // SAFETY: p < n_ops; the lane's own slice.
            unsafe {
                *saved.add(p * 64 + lane) = F4(x[0]);
                *saved.add(p * 64 + 32 + lane) = F4(x[1]);
            }
            // SAFETY: p < n_ops.
            lane_forward_rows_with::<2, Typed<G>>(op_at(p), || unsafe { *groups.add(p) }, &mut x, n, c);
        }
        let mut slot_end = slots;
        for i in (0..n_ops).rev() {
            if i + 1 < n_ops {
                // SAFETY: as the stores above.
                unsafe { x = [(*saved.add(i * 64 + lane)).0, (*saved.add(i * 64 + 32 + lane)).0] };
            }
            let op = op_at(i);
            slot_end -= param_count(op);
            // SAFETY: slot_end + param_count(op) <= slots.
            unsafe { lane_backward_rows_with::<Typed<G>>(op, *groups.add(i), &x, &mut g, (n, c, sums, slot_end, lane, both)) };
        }
        // SAFETY: slot 0 < slots; rows below row_end (row 1 only when `both`).
        unsafe {
            add_to_slot(sums, 0, lane, &g, both);
            store_row4(dz, g[0], row, n, c);
            if both {
                store_row4(dz, g[1], row + 1, n, c);
            }
        }
        row += step;
    }
    cp_async_wait_all();

    // The 8 warps' sums meet; warp 0 writes the block's, into the gradients themselves
    // where the host gave them (one row block: its sums are the gradients).
    // SAFETY: indices < warps * slots * 32; uniform barrier.
    unsafe {
        sync_threads();
        if warp == 0 {
            let direct = outs[0] != 0;
            let out = partials.add(block_idx_y() as usize * slots * n);
            // The slots by constant index (a run-time index into the parameter array
            // would copy it to local memory).
            unroll!(k in 0..8 => {
                if k < slots {
                    let mut v = [0.0f32; 4];
                    for w in 0..warps {
                        let s = (*all_sums.add((w * slots + k) * 32 + lane)).0;
                        unroll!(e in 0..4 => { v[e] += s[e]; });
                    }
                    if direct {
                        store4_to(Vector(outs[k]), n, c, v);
                    } else {
                        store_row4(out, v, k, n, c);
                    }
                }
            });
        }
    }
}

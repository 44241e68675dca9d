//! The chain on a warp that holds whole rows of a 128-column tile, a lane holding 4
//! consecutive columns: forward (run by the GEMM on its staged output tile) and
//! backward (`epilogue_tiles_backward`), side by side.
//!
//! A GroupNorm group of `g` channels (a power of two, 4..=128, inside the tile since
//! the tile starts at a multiple of 128 and groups divide `n`) is `g / 4` neighbouring
//! lanes, so its statistics are shuffle sums and no barrier is needed. Columns past
//! `n` carry values that are never stored and never reach a group's sums.

use super::pointwise::*;
use crate::prelude::math::rsqrt;
use crate::prelude::warp::segment_sum;
use crate::prelude::*;
use crate::unroll;
use kernel_abi::epilogue::*;
use kernel_abi::gemm_simt::{MAX_GRAD_SLOTS, MAX_TILE_OPS};

/// 16 bytes, for vector loads and stores.
#[derive(Clone, Copy)]
#[repr(C, align(16))]
pub struct F4(pub [f32; 4]);

/// Per-column parameter `p[c + e]`, 0 past `n`.
#[inline(always)]
pub fn column_param(p: *const f32, n: usize, c: usize, e: usize) -> f32 {
    // SAFETY: c + e < n, the parameter's length.
    if c + e < n { unsafe { *p.add(c + e) } } else { 0.0 }
}

/// Columns `c..c+4` of `row` of an `(.., n)` row-major matrix, 0 past `n`.
///
/// # Safety
/// `row` and the columns below `n` are inside `src`.
#[inline(always)]
pub unsafe fn load_row4(src: *const f32, row: usize, n: usize, c: usize) -> [f32; 4] {
    unsafe {
        if n % 4 == 0 && c + 4 <= n {
            (*(src.add(row * n + c) as *const F4)).0
        } else {
            let mut v = [0.0; 4];
            unroll!(e in 0..4 => { if c + e < n { v[e] = *src.add(row * n + c + e); } });
            v
        }
    }
}

/// Writes columns `c..c+4` of `row` of an `(.., n)` row-major matrix, 16 bytes at a time
/// when aligned, skipping columns past `n`.
///
/// # Safety
/// `row` and the columns below `n` are inside `dst`.
#[inline(always)]
pub unsafe fn store_row4(dst: *mut f32, v: [f32; 4], row: usize, n: usize, c: usize) {
    unsafe {
        if n % 4 == 0 && c + 4 <= n {
            *(dst.add(row * n + c) as *mut F4) = F4(v);
        } else {
            unroll!(e in 0..4 => {
                if c + e < n {
                    *dst.add(row * n + c + e) = v[e];
                }
            });
        }
    }
}

/// GroupNorm statistics of the lane's group: `(mean, 1 / sqrt(var + eps), 1 / g, lanes)`.
#[inline(always)]
fn lane_group_stats(op: &OpDesc, v: &[f32; 4], n: usize) -> (f32, f32, f32, u32) {
    let g = n / (op.count as usize).max(1);
    let lanes = (g / 4) as u32;
    let inv = 1.0 / g as f32;
    let mean = segment_sum(v[0] + v[1] + v[2] + v[3], lanes) * inv;
    let mut q = 0.0;
    unroll!(e in 0..4 => { let d = v[e] - mean; q += d * d; });
    (mean, rsqrt(segment_sum(q, lanes) * inv + op.a), inv, lanes)
}

/// One op forward on the lane's 4 values.
#[inline(always)]
pub fn lane_forward(op: &OpDesc, v: &mut [f32; 4], n: usize, c: usize) {
    let mut rows = [*v];
    lane_forward_rows(op, &mut rows, n, c);
    *v = rows[0];
}

/// One op forward on the lane's 4 values of `R` (1 or 2) rows at once: the op is
/// decoded once and the rows' independent chains (shuffles, `exp`, parameter loads)
/// share one basic block, so their latencies overlap. (Rows are indexed by unrolled
/// constants only: a loop would put the array on the stack.)
#[inline(always)]
pub fn lane_forward_rows<const R: usize>(op: &OpDesc, rows: &mut [[f32; 4]; R], n: usize, c: usize) {
    let (p0, p1) = (op.param0 as *const f32, op.param1 as *const f32);
    match op.code {
        OP_GROUP_NORM => {
            let mut stats = [(0.0, 0.0); 2];
            unroll!(i in 0..2 => {
                if i < R {
                    let (mean, rstd, _, _) = lane_group_stats(op, &rows[i], n);
                    stats[i] = (mean, rstd);
                }
            });
            unroll!(i in 0..2 => {
                if i < R {
                    let (mean, rstd) = stats[i];
                    unroll!(e in 0..4 => {
                        rows[i][e] = (rows[i][e] - mean) * rstd * column_param(p0, n, c, e) + column_param(p1, n, c, e);
                    });
                }
            });
        }
        // One arm per op, each a straight run over the rows' values: a `match` per
        // element would branch 8 times per op and serialise the rows.
        OP_BIAS => each(rows, |x, e| x + column_param(p0, n, c, e)),
        OP_MUL => each(rows, |x, e| x * column_param(p0, n, c, e)),
        OP_SCALE => each(rows, |x, _| x * op.a),
        OP_SWISH => each(rows, |x, _| swish(x)),
        OP_MISH => each(rows, |x, _| mish(x)),
        OP_GELU => each(rows, |x, _| gelu(x)),
        OP_LEAKY_RELU => each(rows, |x, _| leaky_relu(x, op.a)),
        OP_HARDTANH => each(rows, |x, _| hardtanh(x, op.a, op.b)),
        // Not fusable: the host never sends it; poison, never pass through.
        _ => each(rows, |_, _| f32::NAN),
    }
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

/// Adds `v` into slot `slot` of the lane's parameter-gradient sums. The run-time slot
/// (the same in the whole warp) picks one of eight arms, each indexing with a
/// constant, so the sums stay in registers.
#[inline(always)]
fn add_to_slot(sums: &mut [[f32; 4]; MAX_GRAD_SLOTS], slot: usize, v: [f32; 4]) {
    macro_rules! add {
        ($s:literal) => {
            unroll!(e in 0..4 => { sums[$s][e] += v[e]; })
        };
    }
    match slot {
        0 => add!(0),
        1 => add!(1),
        2 => add!(2),
        3 => add!(3),
        4 => add!(4),
        5 => add!(5),
        6 => add!(6),
        _ => add!(7),
    }
}

/// One op backward on the lane: `g` (the gradient of the op's output) becomes that of
/// its input `x`; parameter gradients go to `sums` from slot `slot` on.
#[inline(always)]
fn lane_backward(op: &OpDesc, x: &[f32; 4], g: &mut [f32; 4], n: usize, c: usize, sums: &mut [[f32; 4]; MAX_GRAD_SLOTS], slot: usize) {
    let p0 = op.param0 as *const f32;
    match op.code {
        OP_GROUP_NORM => {
            // dx = rstd (dy gamma - mean(dy gamma) - xhat mean(dy gamma xhat))
            let (mean, rstd, inv, lanes) = lane_group_stats(op, x, n);
            let mut xhat = [0.0f32; 4];
            let mut dyg = [0.0f32; 4];
            let (mut s1, mut s2) = (0.0, 0.0);
            unroll!(e in 0..4 => {
                xhat[e] = (x[e] - mean) * rstd;
                dyg[e] = g[e] * column_param(p0, n, c, e);
                s1 += dyg[e];
                s2 += dyg[e] * xhat[e];
            });
            let (m1, m2) = (segment_sum(s1, lanes) * inv, segment_sum(s2, lanes) * inv);
            add_to_slot(sums, slot, [g[0] * xhat[0], g[1] * xhat[1], g[2] * xhat[2], g[3] * xhat[3]]);
            add_to_slot(sums, slot + 1, *g);
            unroll!(e in 0..4 => { g[e] = rstd * (dyg[e] - m1 - xhat[e] * m2); });
        }
        OP_BIAS => add_to_slot(sums, slot, *g),
        OP_MUL => {
            add_to_slot(sums, slot, [g[0] * x[0], g[1] * x[1], g[2] * x[2], g[3] * x[3]]);
            unroll!(e in 0..4 => { g[e] *= column_param(p0, n, c, e); });
        }
        code => {
            unroll!(e in 0..4 => {
                let v = x[e];
                g[e] *= match code {
                    OP_SCALE => op.a,
                    OP_SWISH => swish_grad(v),
                    OP_MISH => mish_grad(v),
                    OP_GELU => gelu_grad(v),
                    OP_LEAKY_RELU => leaky_relu_grad(v, op.a),
                    OP_HARDTANH => hardtanh_grad(v, op.a, op.b),
                    _ => f32::NAN,
                };
            });
        }
    }
}

/// Gradient slots an op's parameters take.
#[inline(always)]
fn op_slots(op: &OpDesc) -> usize {
    match op.code {
        OP_BIAS | OP_MUL => 1,
        OP_GROUP_NORM => 2,
        _ => 0,
    }
}

/// Backward of a fusable chain (what the GEMM's epilogue can run forward), tile by
/// tile: `dz` and per-block sums of the parameter gradients. Each lane rebuilds every
/// op's input from the saved `z` in registers; no barrier until the block's sums meet.
///
/// # Safety
/// Device pointers; `ops[..n_ops]` fusable (the host checks), at most `MAX_TILE_OPS`
/// of them, with at most `MAX_GRAD_SLOTS - 1` parameters. Launch: grid `(ceil(n / 128), row_blocks)`,
/// `TILE_THREADS` threads, `tiles_backward_smem_bytes()` shared memory; block `(bx, by)`
/// takes rows `by * rows_per_block ..` of its 128 columns.
///
/// # Parameters
/// * `z`: `(rows, n)`, the chain's input saved by the forward; `dy`: `(rows, n)`.
/// * `dz`: `(rows, n)`, written.
/// * `partials`: `(row_blocks, slots, n)`: slot 0 sums `dz` (the Linear bias's
///   gradient), then one slot per op parameter in chain order; `sum_partials` adds
///   over the row blocks.
///
/// # Thread mapping
/// Warp `w` takes rows `w, w + 8, ..` of the block's rows; lane `l` columns
/// `128 bx + 4 l ..+4`. Each lane keeps its columns' gradient sums in registers; at
/// the end the 8 warps add theirs in shared memory.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
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
) {
    let (rows, n, n_ops) = (rows as usize, n as usize, n_ops as usize);
    let (warp, lane) = (warp_id() as usize, lane_id() as usize);
    let warps = TILE_THREADS / 32;
    let c = block_idx_x() as usize * 128 + lane * 4;
    let row0 = block_idx_y() as usize * rows_per_block as usize;
    let row_end = if row0 + (rows_per_block as usize) < rows { row0 + rows_per_block as usize } else { rows };
    // The op descriptors, read at every op of every row, are copied to shared memory
    // (after the warps' sums): a short, uniform load instead of a global one.
    let s = dynamic_shared::<f32>(); // [warp][slot][128] sums, then the descriptors
    let descs = unsafe { s.add(warps * MAX_GRAD_SLOTS * 128) } as *mut OpDesc;
    let t = thread_idx_x() as usize;
    if t < n_ops.min(MAX_TILE_OPS) {
        // SAFETY: t < n_ops; the launch provides MAX_TILE_OPS descriptors of space.
        unsafe { *descs.add(t) = *ops.add(t) };
    }
    // SAFETY: uniform barrier before the descriptors are read.
    unsafe { sync_threads() };
    // SAFETY: i < n_ops <= MAX_TILE_OPS (the host checks).
    let op_at = |i: usize| unsafe { &*descs.add(i) };
    let mut slots = 1;
    for i in 0..n_ops {
        slots += op_slots(op_at(i));
    }

    let mut sums = [[0.0f32; 4]; MAX_GRAD_SLOTS];
    let mut row = row0 + warp;
    // The next row's z and dy are loaded before this row's arithmetic, so their
    // latency overlaps it.
    // SAFETY (loads): row < rows; columns checked against n inside.
    let load = |r: usize| if r < row_end { unsafe { (load_row4(z, r, n, c), load_row4(dy, r, n, c)) } } else { ([0.0; 4], [0.0; 4]) };
    let mut next = load(row);
    while row < row_end {
        let (zr, mut g) = next;
        next = load(row + warps);
        let mut slot_end = slots;
        for i in (0..n_ops).rev() {
            // Op i's input: ops 0..i forward from z, in registers.
            let mut x = zr;
            for p in 0..i {
                lane_forward(op_at(p), &mut x, n, c);
            }
            let op = op_at(i);
            slot_end -= op_slots(op);
            lane_backward(op, &x, &mut g, n, c, &mut sums, slot_end);
        }
        add_to_slot(&mut sums, 0, g);
        // SAFETY: as the loads.
        unsafe { store_row4(dz, g, row, n, c) };
        row += warps;
    }

    // The 8 warps' sums meet in shared memory; warp 0 writes the block's.
    // SAFETY: indices < warps * MAX_GRAD_SLOTS * 128; uniform barrier.
    unsafe {
        unroll!(k in 0..8 => {
            if k < slots {
                unroll!(e in 0..4 => { *s.add((warp * MAX_GRAD_SLOTS + k) * 128 + lane * 4 + e) = sums[k][e]; });
            }
        });
        sync_threads();
        if warp == 0 {
            let out = partials.add(block_idx_y() as usize * slots * n);
            for k in 0..slots {
                let mut v = [0.0f32; 4];
                for w in 0..warps {
                    unroll!(e in 0..4 => { v[e] += *s.add((w * MAX_GRAD_SLOTS + k) * 128 + lane * 4 + e); });
                }
                store_row4(out, v, k, n, c);
            }
        }
    }
}

//! The small-batch forward: `y = chain(x W^T + bias)` for at most [`ROWS`] rows.
//!
//! With a few rows the GEMM is a stream of `W` and nothing else: the tile GEMMs give it
//! one block per `128`-row tile column, a few dozen SMs, each pulling megabytes. Here
//! each block owns a slab of [`SLAB`] output columns over the whole depth, so `n /
//! SLAB` blocks share `W` out across the GPU. Each warp owns four columns; its lanes
//! split the depth, 8 values each per `K_BLOCK` (so a warp reads 512 contiguous bytes
//! of a bf16 row per load, and the sum of a column is a warp reduction at the end);
//! `x` is staged in `K_BLOCK`-deep slices in shared memory, each lane reading its own
//! 8 values per row. One accumulator per row and column: at most `ROWS * 4`.
//!
//! The chain runs on the slab when it is per-element ops and GroupNorms whose groups
//! lie inside a slab (the host checks): the row-wise epilogue's ops, on each row's
//! slab as if it were a row of `SLAB` features with the parameters offset to its
//! first column. Other chains run with `n_ops = 0` (the slab stores `z`) followed by
//! the row-wise epilogue.

use crate::epilogue::rows::op_forward_stored;
use crate::prelude::element::{Bf16, Element, F16};
use crate::prelude::math::fma;
use crate::prelude::warp::warp_sum;
use crate::prelude::*;
use crate::unroll;
use kernel_abi::epilogue::{OP_GROUP_NORM, OpDesc};
use kernel_abi::gemv::{COLS_PER_WARP, K_BLOCK, ROWS, SLAB, THREADS};

const WARP: usize = WARP_SIZE as usize;
const _: () = assert!(ROWS == 8 && COLS_PER_WARP == 4, "the accumulator loops are unrolled 8 x 4 times");
const _: () = assert!(K_BLOCK == 8 * WARP && SLAB == COLS_PER_WARP * THREADS / WARP);

/// Four floats, 16-byte aligned: one shared-memory vector read.
#[derive(Clone, Copy)]
#[repr(C, align(16))]
struct F4([f32; 4]);

/// # Safety
/// Device pointers: `x (m, k)` and `w (n, k)` row-major with `k % 8 == 0` and 16-byte
/// aligned rows, `bias (n,)` or null, `y (m, n)`, `save_z (m, n)` FP32 or null;
/// `1 <= m <= ROWS`. With `n_ops > 0`: `ops[..n_ops]` per-element ops or GroupNorms
/// whose group size divides `SLAB`, which divides `n`. Launch: grid
/// `(n.div_ceil(SLAB), 1, 1)`, `THREADS` threads, `SMEM_BYTES` of dynamic shared memory.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn gemv<E: Element, O: Element>(
    x: *const E,
    w: *const E,
    bias: Vector,
    y: *mut O,
    save_z: *mut f32,
    (m, n, k): (u32, u32, u32),
    ops: *const OpDesc,
    n_ops: u32,
) {
    let (m, n, k) = (m as usize, n as usize, k as usize);
    let t = thread_idx_x() as usize;
    let (warp, lane) = (warp_id() as usize, lane_id() as usize);
    let col0 = block_idx_x() as usize * SLAB;
    let base = dynamic_shared::<f32>();
    // SAFETY: SMEM_BYTES covers [x: ROWS * K_BLOCK][z: ROWS * SLAB][red: 2 * warps].
    let (xs, zs) = unsafe { (base, base.add(ROWS * K_BLOCK)) };
    let red = unsafe { zs.add(ROWS * SLAB) };
    // The warp's columns; one past `n` reads the last row of `W` and is never stored.
    let mut w_rows = [w; COLS_PER_WARP];
    unroll!(c in 0..4 => {
        let col = col0 + warp * COLS_PER_WARP + c;
        // SAFETY: n >= 1, so the row is inside `w`.
        w_rows[c] = unsafe { w.add(if col < n { col } else { n - 1 } * k) };
    });
    let mut acc = [[0.0f32; COLS_PER_WARP]; ROWS];
    let mut kb = 0;
    while kb < k {
        let mut i = t;
        while i < m * K_BLOCK {
            let (r, c) = (i / K_BLOCK, i % K_BLOCK);
            // SAFETY: r < m and kb + c < k inside `x`; i inside the staging buffer.
            unsafe { *xs.add(i) = if kb + c < k { E::load1(x.add(r * k + kb + c)) } else { 0.0 } };
            i += THREADS;
        }
        // SAFETY: uniform control flow.
        unsafe { sync_threads() };
        let kk = kb + 8 * lane;
        if kk < k {
            let mut wv = [[0.0f32; 8]; COLS_PER_WARP];
            unroll!(c in 0..4 => {
                // SAFETY: kk + 8 <= k (k % 8 == 0), 16-byte aligned rows.
                let (lo, hi) = unsafe { (E::load4_nc(w_rows[c].add(kk)), E::load4_nc(w_rows[c].add(kk + 4))) };
                unroll!(e in 0..4 => { wv[c][e] = lo[e]; wv[c][e + 4] = hi[e]; });
            });
            unroll!(r in 0..8 => {
                if r < m {
                    // SAFETY: this lane's 8 values of row r of the staged slice, 16-byte aligned.
                    let (F4(xa), F4(xb)) = unsafe {
                        let p = xs.add(r * K_BLOCK + 8 * lane) as *const F4;
                        (*p, *p.add(1))
                    };
                    unroll!(c in 0..4 => {
                        let mut s = acc[r][c];
                        unroll!(e in 0..4 => { s = fma(xa[e], wv[c][e], s); });
                        unroll!(e in 0..4 => { s = fma(xb[e], wv[c][e + 4], s); });
                        acc[r][c] = s;
                    });
                }
            });
        }
        // SAFETY: uniform control flow.
        unsafe { sync_threads() };
        kb += K_BLOCK;
    }
    // Each column's sum over the lanes, plus the bias, into the slab (and `save_z`).
    unroll!(r in 0..8 => {
        if r < m {
            unroll!(c in 0..4 => {
                let j = warp * COLS_PER_WARP + c;
                let col = col0 + j;
                let mut v = warp_sum(acc[r][c]);
                if lane == 0 {
                    if col < n {
                        // SAFETY: col < n, r < m.
                        unsafe {
                            if !bias.is_null() {
                                v += bias.get(col);
                            }
                            if !save_z.is_null() {
                                *save_z.add(r * n + col) = v;
                            }
                        }
                    }
                    // SAFETY: r < ROWS, j < SLAB.
                    unsafe { *zs.add(r * SLAB + j) = v };
                }
            });
        }
    });
    // SAFETY: uniform control flow.
    unsafe { sync_threads() };
    for r in 0..m {
        // SAFETY: row r of the slab; `alt` is not used by the ops allowed here.
        let mut cur = unsafe { zs.add(r * SLAB) };
        let mut alt = cur;
        for i in 0..n_ops as usize {
            // SAFETY: i < n_ops.
            let mut d = unsafe { *ops.add(i) };
            // The op on this slab: its parameters from the slab's first column, and a
            // GroupNorm's groups those inside the slab.
            if d.param0 != 0 {
                d.param0 = Vector(d.param0).skip(col0).0;
            }
            if d.param1 != 0 {
                d.param1 = Vector(d.param1).skip(col0).0;
            }
            if d.code == OP_GROUP_NORM {
                d.count = (d.count as usize * SLAB / n) as u32;
            }
            // SAFETY: the host's contract; every thread runs every op.
            unsafe { op_forward_stored::<THREADS>(&d, &mut cur, &mut alt, red, SLAB) };
        }
    }
    let mut i = t;
    while i < m * SLAB {
        let (r, j) = (i / SLAB, i % SLAB);
        let c = col0 + j;
        if c < n {
            // SAFETY: c < n, r < m.
            unsafe { O::store1(y.add(r * n + c), *zs.add(r * SLAB + j)) };
        }
        i += THREADS;
    }
}

/// Declares the entry points, one per (operand, output) element type.
macro_rules! gemv_entries {
    ($($(#[$doc:meta])* $name:ident = <$e:ty, $o:ty>;)*) => {$(
        $(#[$doc])*
        ///
        /// # Safety
        /// See `gemv` in this module.
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "ptx-kernel" fn $name(
            x: *const $e, w: *const $e, bias: Vector, y: *mut $o, save_z: *mut f32,
            m: u32, n: u32, k: u32, ops: *const OpDesc, n_ops: u32,
        ) {
            unsafe { gemv::<$e, $o>(x, w, bias, y, save_z, (m, n, k), ops, n_ops) }
        }
    )*};
}

gemv_entries! {
    /// FP32 `x`, `W` and `y`.
    gemv_f32 = <f32, f32>;
    /// A bf16 model's `x` and `W` as stored, FP32 `y` (or `z` before the row-wise epilogue).
    gemv_bf16 = <Bf16, f32>;
    /// A bf16 model's `x`, `W` and `y` as stored.
    gemv_bf16_to_bf16 = <Bf16, Bf16>;
    /// An fp16 model's `x` and `W` as stored, FP32 `y`.
    gemv_f16 = <F16, f32>;
    /// An fp16 model's `x`, `W` and `y` as stored.
    gemv_f16_to_f16 = <F16, F16>;
}

//! The small-batch forward: `y = chain(x W^T + bias)` for at most [`ROWS`] rows.
//!
//! With a few rows the GEMM is a stream of `W` and nothing else: the tile GEMMs give it
//! one block per `128`-row tile column, a few dozen SMs, each pulling megabytes. Here
//! each block owns a slab of `32 * col_warps` output columns over the whole depth, so
//! `n / slab` blocks share `W` out across the GPU. A lane owns one column; the block's
//! eight warps split the depth `8 / col_warps` ways (summed in shared memory at the
//! end); `x` is staged in `K_BLOCK`-deep slices that every warp reads as broadcasts;
//! each lane reads its row of `W` in 8-value chunks, and keeps one accumulator per row.
//!
//! The chain runs on the slab when it is per-element ops and GroupNorms whose groups
//! lie inside a slab (the host checks): the row-wise epilogue's ops, on each row's
//! slab as if it were a row of `slab` features with the parameters offset to its
//! first column. Other chains run with `n_ops = 0` (the slab stores `z`) followed by
//! the row-wise epilogue.

use crate::epilogue::rows::op_forward;
use crate::prelude::element::Element;
use crate::prelude::math::fma;
use crate::prelude::*;
use crate::unroll;
use kernel_abi::epilogue::{OP_GROUP_NORM, OpDesc};
use kernel_abi::gemv::{K_BLOCK, MAX_SLAB, ROWS, THREADS};

const WARP: usize = WARP_SIZE as usize;
const WARPS: usize = THREADS / WARP;
const _: () = assert!(ROWS == 16, "the accumulator loops are unrolled 16 times");

/// Four floats, 16-byte aligned: one shared-memory vector read.
#[derive(Clone, Copy)]
#[repr(C, align(16))]
struct F4([f32; 4]);

/// # Safety
/// Device pointers: `x (m, k)` and `w (n, k)` row-major with `k % 8 == 0` and 16-byte
/// aligned rows, `bias (n,)` or null, `y (m, n)`, `save_z (m, n)` FP32 or null;
/// `1 <= m <= ROWS`; `col_warps` one of 1, 2, 4, 8. With `n_ops > 0`: `ops[..n_ops]`
/// per-element ops or GroupNorms whose group size divides `32 * col_warps`, which
/// divides `n`. Launch: grid `(n.div_ceil(32 * col_warps), 1, 1)`, `THREADS` threads,
/// `SMEM_BYTES` of dynamic shared memory.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn gemv<E: Element, O: Element>(
    x: *const E,
    w: *const E,
    bias: *const f32,
    y: *mut O,
    save_z: *mut f32,
    (m, n, k): (u32, u32, u32),
    col_warps: u32,
    ops: *const OpDesc,
    n_ops: u32,
) {
    let (m, n, k) = (m as usize, n as usize, k as usize);
    let t = thread_idx_x() as usize;
    let (warp, lane) = (warp_id() as usize, lane_id() as usize);
    let cw = col_warps as usize;
    let slab = WARP * cw;
    let parts = WARPS / cw;
    let seg = K_BLOCK / parts;
    let (group, part) = (warp % cw, warp / cw);
    let col0 = block_idx_x() as usize * slab;
    let col = col0 + group * WARP + lane;
    let base = dynamic_shared::<f32>();
    // SAFETY: SMEM_BYTES covers [x: ROWS * K_BLOCK][z: ROWS * MAX_SLAB][red: 2 * WARPS].
    let (xs, zs) = unsafe { (base, base.add(ROWS * K_BLOCK)) };
    let red = unsafe { zs.add(ROWS * MAX_SLAB) };
    // A column past `n` reads the last row of `W` and is never stored.
    // SAFETY: n >= 1, so the row is inside `w`.
    let w_row = unsafe { w.add(if col < n { col } else { n - 1 } * k) };
    let mut acc = [0.0f32; ROWS];
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
        let k0 = part * seg;
        let mut c = 0;
        while c < seg {
            let kk = kb + k0 + c;
            if kk < k {
                // SAFETY: kk + 8 <= k (k % 8 == 0), 16-byte aligned rows.
                let (lo, hi) = unsafe { (E::load4_nc(w_row.add(kk)), E::load4_nc(w_row.add(kk + 4))) };
                unroll!(r in 0..16 => {
                    if r < m {
                        // SAFETY: inside row r of the staged slice, 16-byte aligned.
                        let (F4(xa), F4(xb)) = unsafe {
                            let p = xs.add(r * K_BLOCK + k0 + c) as *const F4;
                            (*p, *p.add(1))
                        };
                        let mut s = acc[r];
                        unroll!(e in 0..4 => { s = fma(xa[e], lo[e], s); });
                        unroll!(e in 0..4 => { s = fma(xb[e], hi[e], s); });
                        acc[r] = s;
                    }
                });
            }
            c += 8;
        }
        // SAFETY: uniform control flow.
        unsafe { sync_threads() };
        kb += K_BLOCK;
    }
    // The depth parts' sums, through the staging buffer (free after the last barrier):
    // [part][row][slab column].
    unroll!(r in 0..16 => {
        if r < m {
            // SAFETY: parts * ROWS * slab = ROWS * 256 <= ROWS * K_BLOCK.
            unsafe { *xs.add((part * ROWS + r) * slab + group * WARP + lane) = acc[r] };
        }
    });
    // SAFETY: uniform control flow.
    unsafe { sync_threads() };
    let mut i = t;
    while i < m * slab {
        let (r, j) = (i / slab, i % slab);
        let c = col0 + j;
        let mut v = 0.0;
        for p in 0..parts {
            // SAFETY: as above.
            v += unsafe { *xs.add((p * ROWS + r) * slab + j) };
        }
        if c < n {
            // SAFETY: c < n, r < m.
            unsafe {
                if !bias.is_null() {
                    v += *bias.add(c);
                }
                if !save_z.is_null() {
                    *save_z.add(r * n + c) = v;
                }
            }
        }
        // SAFETY: r < ROWS, j < slab <= MAX_SLAB.
        unsafe { *zs.add(r * MAX_SLAB + j) = v };
        i += THREADS;
    }
    // SAFETY: uniform control flow.
    unsafe { sync_threads() };
    for r in 0..m {
        // SAFETY: row r of the slab; `alt` is not used by the ops allowed here.
        let mut cur = unsafe { zs.add(r * MAX_SLAB) };
        let mut alt = cur;
        for i in 0..n_ops as usize {
            // SAFETY: i < n_ops.
            let mut d = unsafe { *ops.add(i) };
            // The op on this slab: its parameters from the slab's first column, and a
            // GroupNorm's groups those inside the slab.
            if d.param0 != 0 {
                d.param0 += (col0 * 4) as u64;
            }
            if d.param1 != 0 {
                d.param1 += (col0 * 4) as u64;
            }
            if d.code == OP_GROUP_NORM {
                d.count = (d.count as usize * slab / n) as u32;
            }
            // SAFETY: the host's contract; every thread runs every op.
            unsafe { op_forward(&d, &mut cur, &mut alt, red, slab) };
        }
    }
    let mut i = t;
    while i < m * slab {
        let (r, j) = (i / slab, i % slab);
        let c = col0 + j;
        if c < n {
            // SAFETY: c < n, r < m.
            unsafe { O::store1(y.add(r * n + c), *zs.add(r * MAX_SLAB + j)) };
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
            x: *const $e, w: *const $e, bias: *const f32, y: *mut $o, save_z: *mut f32,
            m: u32, n: u32, k: u32, col_warps: u32, ops: *const OpDesc, n_ops: u32,
        ) {
            unsafe { gemv::<$e, $o>(x, w, bias, y, save_z, (m, n, k), col_warps, ops, n_ops) }
        }
    )*};
}

gemv_entries! {
    /// FP32 `x`, `W` and `y`.
    gemv_f32 = <f32, f32>;
    /// A bf16 model's `x` and `W` as stored, FP32 `y` (or `z` before the row-wise epilogue).
    gemv_bf16 = <u16, f32>;
    /// A bf16 model's `x`, `W` and `y` as stored.
    gemv_bf16_to_bf16 = <u16, u16>;
}

//! `dX = dZ W` of at most [`DX_ROWS`] rows on tensor cores, a 16-bit model's `dZ (m, n)`
//! and `W (n, k)` as stored: the small-batch forward's stream of `W` (`gemv_tc`) with
//! the sum taken over `W`'s rows instead of along them.
//!
//! As `mma.sync` products of the transpose, `dX^T = W^T dZ^T`: `W^T` is the `A` operand
//! (16 columns of `dX` per `m16` fragment), `dZ^T` the `B` operand (the rows in one `n8`
//! fragment). Each block owns a slab of [`SLAB`] columns of `dX` over a range of `W`'s
//! rows (all of them, or one split of them: FP32 partial sums, added by `split_sums`);
//! its warps take units of [`DX_UNIT_ROWS`] rows in turn (unit `u` to warp `u % 8`).
//! In a unit lane `(g, q) = (l / 4, l % 4)` copies the 16-byte chunk `q` of the slab's
//! rows `g + 8t` (four `cp.async`) into its warp's ring, [`STAGES`] units deep, and
//! `W^T`'s fragments come back out by `ldmatrix.trans` (a warp barrier between: lanes
//! read each other's copies). The rows
//! in a fragment's `k` are free as long as `A` and `B` agree: `k` slots `2q, 2q + 1`
//! (and `+ 8`) of step `s` are rows `8q + 4s + (0, 1)` (and `+ 2`), so lane `(g, q)`'s
//! `B` words are its own 16-byte chunk of `dZ` row `g`, copied as it is.

use crate::prelude::async_copy::{cp_async_16, cp_async_commit, cp_async_wait, cp_async_wait_all, shared_address};
use crate::prelude::element::{Bf16, Element, F16, Half};
use crate::prelude::mma::{ld_shared_v4, ldmatrix_x4_trans};
use crate::prelude::*;
use crate::unroll;
use kernel_abi::gemv_tc::{CHUNK, DX_ROWS, DX_STAGE_BYTES, DX_UNIT_ROWS, RED_PITCH, SLAB, STAGES, THREADS, WARPS};

/// Bytes of a unit's `W` tile in the ring (`dZ`'s chunks follow it).
const W_TILE_BYTES: u32 = (DX_UNIT_ROWS * SLAB * 2) as u32;
const _: () = assert!(DX_UNIT_ROWS == 32 && SLAB == 32 && DX_ROWS == 8 && CHUNK == 16 && STAGES == 4);

/// The place of row `r`'s 16-byte chunk `c` in a unit's `W` tile (16-byte units): row
/// after row, the chunks permuted by row `r / 8`, so that the eight rows one
/// `ldmatrix` phase reads (`{0, 1, 8, 9, 16, 17, 24, 25}` plus a constant) fall in
/// eight different 16-byte bank groups.
#[inline(always)]
fn w_place(r: u32, c: u32) -> u32 {
    4 * r + (c ^ ((r >> 3) & 3))
}

/// # Safety
/// Device pointers: `dz (m, n)` and `w (n, k)` row-major in `H`, 16-byte aligned, with
/// `n % 8 == 0` and `k % 8 == 0`; `1 <= m <= DX_ROWS`; `out` is `dX (m, k)` in `O` (the
/// grid's `y` dimension 1), or FP32 partial sums `(splits, m, k)`, split `s` summing
/// `W`'s rows `s per_split .. (s + 1) per_split` (`per_split` a multiple of
/// `DX_UNIT_ROWS`). Launch: grid `(k.div_ceil(SLAB), splits, 1)`, `THREADS` threads,
/// `DX_SMEM_BYTES` of dynamic shared memory.
#[inline(always)]
unsafe fn dx_tc<H: Half, O: Element>(dz: *const H, w: *const H, out: *mut O, (m, n, k): (u32, u32, u32), per_split: u32) {
    // Index arithmetic in 32 bits (the host checks `m n` and `n k` fit).
    let (warp, lane) = (warp_id(), lane_id());
    let (g, q) = (lane / 4, lane % 4);
    let col0 = block_idx_x() * SLAB as u32;
    let split = block_idx_y();
    let first = split * per_split;
    let end = if first + per_split < n { first + per_split } else { n };
    let units = if end > first { (end - first).div_ceil(DX_UNIT_ROWS as u32) } else { 0 };
    let warps = WARPS as u32;
    let mine = if units > warp { (units - warp).div_ceil(warps) } else { 0 };

    let base = dynamic_shared::<f32>();
    let ring = shared_address(base) + warp * (STAGES * DX_STAGE_BYTES) as u32;
    let stage_at = |s: u32| ring + s * DX_STAGE_BYTES as u32;
    // Copies unit `i` (of this warp) into stage `s`: chunk `q` of `W` rows `g + 8 t` of
    // the unit (each copy instruction reads 8 rows' 64 bytes of the slab, whole 32-byte
    // sectors: a lane per row had each sector read twice, 16 bytes at a time) and chunk
    // `q` of `dZ` row `g` (rows `j0 + 8q ..`). A chunk past the range's rows, `k`'s
    // columns or `m`'s rows is zero-filled (nothing read), so the products past the
    // range are zeros.
    let issue = |i: u32, s: u32| {
        let j0 = first + (warp + warps * i) * DX_UNIT_ROWS as u32;
        let dst = stage_at(s);
        let col = col0 + 8 * q;
        unroll!(t in 0..4 => {
            let r = g + 8 * t as u32;
            let row = j0 + r;
            let ok = row < end && col < k;
            // SAFETY: row < n and col + 8 <= k (k % 8 == 0) inside 16-byte aligned `w`,
            // or nothing read; the place is inside this warp's stage.
            unsafe {
                let src = w.add(if ok { (row * k + col) as usize } else { 0 }) as *const f32;
                cp_async_16(dst + 16 * w_place(r, q), src, if ok { 16 } else { 0 })
            };
        });
        let jz = j0 + 8 * q;
        let ok = g < m && jz < end;
        // SAFETY: row g < m of `dz`, columns jz..jz + 8 <= end <= n (both multiples of 8).
        unsafe {
            let src = dz.add(if ok { (g * n + jz) as usize } else { 0 }) as *const f32;
            cp_async_16(dst + W_TILE_BYTES + 16 * lane, src, if ok { 16 } else { 0 })
        };
    };

    // This lane's `ldmatrix` row: matrix `lane / 8` (`k` slots 0-7 or 8-15 by its high
    // bit, columns 0-7 or 8-15 of the fragment by its low bit), row `lane % 8`.
    let (mat, slot) = (lane / 8, lane % 8);
    let (upper, half) = (mat >> 1, mat & 1);
    let mut acc = [[0.0f32; 4]; 2];
    unroll!(s in 0..3 => {
        if (s as u32) < mine {
            issue(s as u32, s as u32);
        }
        cp_async_commit();
    });
    let mut i = 0;
    while i < mine {
        // Unit i has landed for this lane (`STAGES - 2` younger groups may fly); after
        // the warp barrier, for every lane, and every lane is done reading unit i - 1.
        cp_async_wait::<{ STAGES as u32 - 2 }>();
        // SAFETY: every lane runs the loop the same number of times.
        unsafe { sync_warp() };
        let st = stage_at(i % STAGES as u32);
        let mut a = [[[0u32; 4]; 2]; 2];
        unroll!(s in 0..2 => {
            let r = 8 * (slot >> 1) + 4 * s as u32 + 2 * upper + (slot & 1);
            unroll!(mf in 0..2 => {
                // SAFETY: a landed 16-byte chunk of this warp's stage; the whole warp.
                a[mf][s] = unsafe { ldmatrix_x4_trans(st + 16 * w_place(r, 2 * mf as u32 + half)) };
            });
        });
        // SAFETY: this lane's own landed chunk.
        let b = unsafe { ld_shared_v4(st + W_TILE_BYTES + 16 * lane) };
        // Refill the stage unit i - 1 used (every lane read it before the barrier).
        let ahead = i + STAGES as u32 - 1;
        if ahead < mine {
            issue(ahead, ahead % STAGES as u32);
        }
        cp_async_commit();
        unroll!(s in 0..2 => {
            unroll!(mf in 0..2 => { H::mma(&mut acc[mf], a[mf][s], [b[2 * s], b[2 * s + 1]]); });
        });
        i += 1;
    }
    cp_async_wait_all();
    // SAFETY: uniform control flow; every warp is done with its ring.
    unsafe { sync_threads() };

    // The warps' partial sums over the ring, `[warp][row][RED_PITCH]`: accumulator `e` of
    // fragment `mf` is column `16 mf + g + 8 (e / 2)`, row `2q + e % 2`.
    let (warp, g, q) = (warp as usize, g as usize, q as usize);
    unroll!(mf in 0..2 => {
        unroll!(e in 0..4 => {
            let (col, row) = (16 * mf + g + 8 * (e / 2), 2 * q + e % 2);
            // SAFETY: row < DX_ROWS, col < SLAB: inside DX_SMEM_BYTES.
            unsafe { *base.add((warp * DX_ROWS + row) * RED_PITCH + col) = acc[mf][e] };
        });
    });
    // SAFETY: uniform control flow.
    unsafe { sync_threads() };
    let (m, k, col0) = (m as usize, k as usize, col0 as usize);
    let out = out.wrapping_add(split as usize * m * k);
    let mut t = thread_idx_x() as usize;
    while t < m * SLAB {
        let (r, j) = (t / SLAB, t % SLAB);
        // Added in warp order: the same bits every call.
        let mut v = 0.0;
        for wi in 0..WARPS {
            // SAFETY: inside the partial sums.
            v += unsafe { *base.add((wi * DX_ROWS + r) * RED_PITCH + j) };
        }
        if col0 + j < k {
            // SAFETY: r < m, col0 + j < k: inside this split's `(m, k)`.
            unsafe { O::store1(out.add(r * k + col0 + j), v) };
        }
        t += THREADS;
    }
}

/// Declares the entry points, one per (operand type, output).
macro_rules! dx_tc_entries {
    ($($(#[$doc:meta])* $name:ident = <$h:ty, $o:ty>;)*) => {$(
        $(#[$doc])*
        ///
        /// # Safety
        /// See `dx_tc` in this module.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(
            dz: *const $h, w: *const $h, out: *mut $o, m: u32, n: u32, k: u32, per_split: u32,
        ) {
            unsafe { dx_tc::<$h, $o>(dz, w, out, (m, n, k), per_split) }
        }
    )*};
}

dx_tc_entries! {
    /// A bf16 model's `dZ` and `W` as stored, `dX` in bf16 (one range of all `W`'s rows).
    dx_tc_bf16 = <Bf16, Bf16>;
    /// The same, FP32 partial sums of `W`'s row ranges.
    dx_tc_bf16_parts = <Bf16, f32>;
    /// An fp16 model's `dZ` and `W` as stored, `dX` in fp16.
    dx_tc_f16 = <F16, F16>;
    /// The same, FP32 partial sums.
    dx_tc_f16_parts = <F16, f32>;
}

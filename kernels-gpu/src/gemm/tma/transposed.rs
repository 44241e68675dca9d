//! The backward's GEMMs with `A` stored transposed on the persistent kernels, TF32 and
//! 3xTF32: `dW = dZ^T X` (`gemm_tma_*_tk`) and `dX^T = W^T dZ^T` stored as `dX`
//! (`gemm_tma_*_tk_t`), `A` passed through registers.

use super::flush::{Layout, add_flushed, flush_accumulators, k_runs, run_k_tiles};
use super::opaque;
use super::pipeline::{CONSUMER_REGISTERS, PRODUCER_REGISTERS, Pipeline};
use crate::prelude::bulk_copy::*;
use crate::prelude::global::store_v2;
use crate::prelude::mma::{fence_proxy_async_shared, ld_shared_v2, ld_shared_v4, st_shared_v4, tf32_residual};
use crate::prelude::wgmma::*;
use crate::prelude::*;
use crate::unroll;
use kernel_abi::gemm_tma::*;

/// `y (m, n) = A B^T` in TF32 with `A` stored transposed: `(k, m)`, `m`-contiguous, pitch
/// in the tensor map. It is the weight gradient `dW = dZ^T X` reading `dZ (batch, out)`
/// as stored (`B` = `X^T`), so the backward does not transpose `dZ` first (M2: 512 MB,
/// 0.38 ms at 83% of the DRAM peak). `wgmma` reads TF32 `A` from shared memory only
/// `k`-major, so `A` goes through registers: TMA lands it as four `32 k x 32 m` boxes
/// (128-byte swizzle) and each thread loads its fragments with 8-byte shared loads.
///
/// The fragment rows are permuted so that a thread's two rows (`gid`, `gid + 8` of its
/// warp's 16) are neighbours in `m` (one 8-byte load per `k`) and every half-warp's load
/// covers the 32 banks once: with `gid = 4a + 2b + p`, the pair sits at
/// `m = 32 sub + 16 b + 8 (warp % 2) + 4 a + 2 p` of the tile, `sub = 2 wg + warp / 2`
/// (its 16-byte chunk `4 b + 2 (warp % 2) + a`, XOR `k % 8` by the swizzle: over the
/// half-warp's 4 `k`s the chunks of `b = 0` and `b = 1` fill 0-3 and 4-7). The output
/// rows follow the same permutation. No bias, chain or saved `z` (a gradient).
///
/// Unlike the forward, a warpgroup finishes its previous k-tile's MMAs before loading
/// the next fragments (the in-flight MMAs read their `A` registers; ptxas would reuse
/// them): the other warpgroup's MMAs keep the tensor cores busy meanwhile.
///
/// # Safety
/// The maps describe readable `f32` tensors of `(k, m)` (`A`, box `32 x 32`) and
/// `(n, k)` (`B`, box `32 x 256`); `y` holds `m * n` floats; `THREADS`
/// threads, `SMEM_BYTES` of dynamic shared memory, any grid; an sm_90a device.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn gemm_tma_tf32_tk(maps: *const u8, y: *mut f32, m: u32, n: u32, k: u32) {
    unsafe { gemm_tma_tk::<false, false>(maps, y, m, n, k) }
}

/// [`gemm_tma_tf32_tk`] storing `y^T (n, m)`: the input gradient `dX = dZ W` as
/// `dX^T = W^T dZ^T`, reading `W (out, in)` as stored (`A`) and `dZ` (`B`, `k`-major
/// already), so the backward does not transpose `W` first (M1: 256 MB, about half the
/// GEMM's time). A thread's two rows are neighbours, so each of its transposed values
/// pairs is one 8-byte store.
///
/// # Safety
/// As [`gemm_tma_tf32_tk`], `y` holding `n * m` floats.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn gemm_tma_tf32_tk_t(maps: *const u8, y: *mut f32, m: u32, n: u32, k: u32) {
    unsafe { gemm_tma_tk::<false, true>(maps, y, m, n, k) }
}

/// [`gemm_tma_tf32_tk`] in 3xTF32: `A`'s residual is computed in registers from the
/// loaded fragments, `B`'s written by the consumers into the stage (as in
/// [`gemm_tma_tf32x3_nt`](super::forward::gemm_tma_tf32x3_nt), 16-deep stages: `A` in `16 k x 32 m` boxes, `B` with the
/// 64-byte swizzle), three MMAs per `k`-step.
///
/// # Safety
/// As [`gemm_tma_tf32_tk`] with boxes `16 x 32` (`A`) and `16 x 256` (`B`, 64-byte
/// swizzle) and `SPLIT_SMEM_BYTES` of shared memory.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn gemm_tma_tf32x3_tk(maps: *const u8, y: *mut f32, m: u32, n: u32, k: u32) {
    unsafe { gemm_tma_tk::<true, false>(maps, y, m, n, k) }
}

/// [`gemm_tma_tf32x3_tk`] storing `y^T`, as [`gemm_tma_tf32_tk_t`].
///
/// # Safety
/// As [`gemm_tma_tf32x3_tk`], `y` holding `n * m` floats.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn gemm_tma_tf32x3_tk_t(maps: *const u8, y: *mut f32, m: u32, n: u32, k: u32) {
    unsafe { gemm_tma_tk::<true, true>(maps, y, m, n, k) }
}

/// The body of the four (`SPLIT`: 3xTF32; `TRANS`: store `y^T`).
///
/// # Safety
/// See [`gemm_tma_tf32_tk`] and [`gemm_tma_tf32x3_tk`].
#[inline(always)]
unsafe fn gemm_tma_tk<const SPLIT: bool, const TRANS: bool>(maps: *const u8, y: *mut f32, m: u32, n: u32, k: u32) {
    let t = thread_idx_x();
    // SAFETY: the second of the two maps.
    let (map_a, map_b) = (maps, unsafe { maps.add(128) });
    // SAFETY: every thread, first; the launch's shared memory. A stage: `A`'s four
    // `block_k x 32` boxes, `B`; 3xTF32: then `B`'s residual at the same offset one
    // `tile_bytes` on (the `A` residual's place stays unused).
    let pipe = unsafe { Pipeline::<false>::new::<SPLIT>(maps, (m, n, k), 4, 1) };
    let Pipeline { tile_bytes, block_k, a_bytes, k_tiles, .. } = pipe;
    let sub_bytes = 32 * block_k * 4;

    if t < 128 {
        // SAFETY: the whole warpgroup.
        unsafe { set_max_registers::<false, PRODUCER_REGISTERS>() };
        if t == 0 {
            // SAFETY: four `32`-row boxes of `A` and `B`'s `BLOCK_N` rows fill the stage's tiles.
            unsafe {
                pipe.produce(|stage, row0, col0, k0, full| {
                    for q in 0..4 {
                        tma_load_2d(stage + q * sub_bytes, map_a, row0 + 32 * q, k0, full);
                    }
                    tma_load_2d(stage + a_bytes, map_b, k0, col0, full);
                })
            };
        }
        return;
    }

    // SAFETY: whole warpgroups.
    unsafe { set_max_registers::<true, CONSUMER_REGISTERS>() };
    let c = t - 128;
    let (wg, warp, lane) = (c / 128, (c / 32) % 4, c % 32);
    let (gid, tig) = (lane / 4, lane % 4);
    let (a, b, p) = (gid / 4, (gid / 2) % 2, gid % 2);
    let (sub, chunk) = (2 * wg + warp / 2, 4 * b + 2 * (warp % 2) + a);
    // The thread's first output row in the tile, and its fragment loads' offsets in a
    // stage for `k` = `tig` and `tig + 4` of the first `k`-step (step `i` adds 8 rows).
    let pair = 32 * sub + 4 * chunk + 2 * p;
    let at = |kk: u32| sub * sub_bytes + kk * 128 + ((chunk ^ kk) * 16) + 8 * p;
    let (lo, hi) = (at(tig), at(tig + 4));
    let (mut s, mut phase) = (0u32, 0u32);
    // Work items as in the forward: 3xTF32 flushes its accumulators every `FLUSH_K`
    // (M2's `dW` sums 32768 rows: 2.3e-4 of the f64 reference without, on the H100).
    let runs = k_runs::<SPLIT>(k_tiles);
    let mut item = block_idx_x() * runs;
    while item < pipe.units() * runs {
        let (unit, run) = (item / runs, item % runs);
        let (row0, col0, _, _) = pipe.unit(unit);
        let mut acc = [0u32; 128];
        let mut held = None;
        for _ in run_k_tiles::<SPLIT>(run, 0..k_tiles) {
            let sa = pipe.stage(s);
            // SAFETY: the stage is complete once its phase is; all 128 threads of the
            // warpgroup wait and issue the MMAs.
            unsafe { mbarrier_wait(pipe.full(s), phase) };
            if SPLIT {
                // `B`'s residual (its 1024 16-byte chunks, 4 per consumer thread) while
                // the previous k-tile's MMAs run; visible to the tensor cores, then to
                // both warpgroups.
                // SAFETY: inside the stage's `B` and residual tiles; both warpgroups.
                unsafe {
                    let mut v = [[0u32; 4]; 4];
                    unroll!(i in 0..4 => { v[i] = ld_shared_v4(sa + a_bytes + (c + 256 * i as u32) * 16); });
                    unroll!(i in 0..4 => {
                        st_shared_v4(sa + tile_bytes + a_bytes + (c + 256 * i as u32) * 16, v[i].map(tf32_residual));
                    });
                    fence_proxy_async_shared();
                    named_barrier(1, CONSUMER_THREADS as u32);
                }
            }
            // SAFETY: the whole warpgroup. The previous k-tile's MMAs (reading its
            // fragment registers and stage) are finished before the next loads.
            unsafe { wgmma_wait_all(&mut acc) };
            if let Some(prev) = held
                && lane == 0
            {
                // SAFETY: one arrival per consumer warp per phase.
                unsafe { mbarrier_arrive(pipe.empty(prev)) };
            }
            let mut af = [[0u32; 4]; 4];
            unroll!(i in 0..4 => {
                if (i as u32) < block_k / 8 {
                    let step = sa + 1024 * i as u32;
                    // SAFETY: inside the stage's `A` boxes, landed (the phase completed).
                    let (l, h) = unsafe { (ld_shared_v2(step + lo), ld_shared_v2(step + hi)) };
                    af[i] = [l[0], l[1], h[0], h[1]];
                }
            });
            // SAFETY: complete `B` (and residual) tiles; the whole warpgroup.
            unsafe {
                if SPLIT {
                    let (db, dbl) = (descriptor_64b(sa + a_bytes), descriptor_64b(sa + tile_bytes + a_bytes));
                    let a = [af[0], af[1]];
                    wgmma_n256_rs_split_k_tile(&mut acc, a, a.map(|f| f.map(tf32_residual)), [db, db + 2], [dbl, dbl + 2]);
                } else {
                    let db = descriptor_128b(sa + a_bytes);
                    wgmma_n256_rs_k_tile(&mut acc, af, [db, db + 2, db + 4, db + 6]);
                }
            }
            held = Some(s);
            (s, phase) = pipe.next(s, phase);
        }
        // SAFETY: all threads of each warpgroup.
        unsafe { wgmma_wait_all(&mut acc) };
        if let Some(prev) = held
            && lane == 0
        {
            // SAFETY: as above.
            unsafe { mbarrier_arrive(pipe.empty(prev)) };
        }
        // Accumulator `4 j + e`: row `pair + e / 2` of the tile, column `8 j + 2 tig + e % 2`.
        let (r0, col) = ((row0 + pair) as usize, (col0 + 2 * tig) as usize);
        if SPLIT && runs > 1 {
            let layout = if TRANS { Layout::Transposed { row: r0, col } } else { Layout::Rows { row: r0, col, step: 1 } };
            if run + 1 < runs {
                // SAFETY: the MMAs are finished; only this thread reads or writes its
                // accumulators' places until its stores overwrite them.
                unsafe { flush_accumulators(&mut acc, y, run == 0, layout, (m, n)) };
                item += 1;
                continue;
            }
            // SAFETY: as for the flushes.
            unsafe { add_flushed(&mut acc, y, layout, (m, n)) };
        }
        let (m, n) = (m as usize, n as usize);
        if TRANS {
            // `y^T (n, m)`: row `8 j + 2 tig + e`, columns `r0` and `r0 + 1`.
            if r0 < m {
                unroll!(jh in 0..2 => { unroll!(jl in 0..16 => { unroll!(e in 0..2 => {
                    let j = 16 * jh + jl;
                    let cj = col + 8 * j + e;
                    if cj < n {
                        let v = [acc[4 * j + e], acc[4 * j + 2 + e]];
                        // SAFETY: cj < n and r0 < m; with `m` even, r0 + 1 < m too
                        // (r0 even) and the pair is 8-byte aligned.
                        unsafe {
                            let at = y.add(cj * m + r0);
                            if m % 2 == 0 {
                                store_v2(at, v.map(f32::from_bits));
                            } else {
                                *at = f32::from_bits(v[0]);
                                if r0 + 1 < m {
                                    *at.add(1) = f32::from_bits(v[1]);
                                }
                            }
                        }
                    }
                }); }); });
            }
            item += opaque(grid_dim_x()) * runs - run;
            continue;
        }
        unroll!(h in 0..2 => {
            let r = r0 + h;
            if r < m {
                unroll!(jh in 0..2 => { unroll!(jl in 0..16 => {
                    let j = 16 * jh + jl;
                    let cj = col + 8 * j;
                    let v = [acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]];
                    // SAFETY: r < m and every written column < n; with `n` even the
                    // pair is 8-byte aligned (cj even).
                    unsafe {
                        if n % 2 == 0 {
                            if cj < n {
                                store_v2(y.add(r * n + cj), v.map(f32::from_bits));
                            }
                        } else if cj < n {
                            *y.add(r * n + cj) = f32::from_bits(v[0]);
                            if cj + 1 < n {
                                *y.add(r * n + cj + 1) = f32::from_bits(v[1]);
                            }
                        }
                    }
                }); });
            }
        });
        item += opaque(grid_dim_x()) * runs - run;
    }
}


//! `wgmma` (Hopper's warpgroup MMA, sm_90a) TF32 and 3xTF32 GEMMs: the forward
//! `x W^T` (both operands `k`-contiguous) with the epilogue chain fused into its store,
//! and the backward's `dX` and `dW`.
//!
//! For TF32, `wgmma` reads only `k`-contiguous tiles from shared memory, so the
//! backward puts its row-contiguous operand in registers (the `A` side) and a
//! `k`-contiguous one in shared memory (`B`): `dX^T = W^T dZ^T` (`A` = `W` as stored,
//! `B` = `dZ`, the tile stored transposed) and `dW = dZ^T X` with `B` = `X^T`
//! (transposed by the host beforehand, 1/256 of the GEMM's traffic at the seed sizes).
//!
//! Two warpgroups each own 64 rows x 128 columns of the block's `128 x 128` tile of
//! `y`: one `wgmma.mma_async.m64n128k8` per `k`-step of 8 multiplies a warpgroup's `A`
//! rows by the whole `B` tile, reading both operands straight from shared memory
//! through descriptors — no fragment loads at all. The tiles are the same `cp.async`
//! 3-stage pipeline as [`super::mma`], whose `[row][32 k]` layout with chunk
//! `c` of row `r` at `c ^ (r % 8)` is exactly the hardware's 128-byte swizzle (given
//! 1024-byte aligned tiles), so the descriptors describe it directly.
//!
//! 3xTF32: the `A` fragments come from registers instead (`ldmatrix`, as in
//! [`super::mma`]), split into the raw value (the tensor core reads its TF32
//! part) and the FP32 residual; `B`'s residual is written by each thread for the
//! chunks it copied into a third tile of the stage. Three `wgmma` per `k`-step:
//! `A_lo B + A B_lo + A B`.
//!
//! The MMAs and their descriptors are [`crate::prelude::wgmma`]'s (`m64n128` k-tiles),
//! the layer the TMA kernels ([`super::tma`]) use too.

use super::BlockTile;
use super::staged::write_staged_tile;
use super::mma::TileCopy;
use crate::prelude::async_copy::*;
use crate::prelude::mma::*;
use crate::prelude::wgmma::*;
use crate::prelude::*;
use crate::unroll;
use kernel_abi::epilogue::OpDesc;
use kernel_abi::gemm_wgmma::{BLOCK_K, BLOCK_M, SPLIT_STAGES, TF32_STAGES};

/// Bytes of one operand tile (`128 x 32` floats) and of one 128-byte row.
const TILE_BYTES: u32 = (BLOCK_M * BLOCK_K * 4) as u32;
const ROW_BYTES: u32 = (BLOCK_K * 4) as u32;

/// `y = chain(A B^T + bias)` on `wgmma`, or with `TRANS` its transpose `y^T (n, m)`
/// (no chain or bias then). The contract is [`super::fma`]'s `gemm_fma` with
/// `kernel_abi::gemm_wgmma`'s sizes; `B` is `k`-contiguous, `A` `k`-contiguous with `A_K`
/// (element `(i, kk)` at `a[i * lda + kk]`) or row-contiguous (at `a[kk * lda + i]`).
///
/// # Safety
/// As `gemm_fma`; `THREADS` threads; dynamic shared memory `smem_bytes(SPLIT)`; `lda`
/// and `ldb` multiples of 4 and 16-byte aligned operands; an sm_90a device.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_wgmma<const SPLIT: bool, const A_K: bool, const TRANS: bool, const STAGES: u32, const INFLIGHT: u32>(
    a: *const f32,
    b: *const f32,
    bias: Vector,
    y: *mut f32,
    save_z: *mut f32,
    m: u32,
    n: u32,
    k: u32,
    lda: u32,
    ldb: u32,
    k_split: u32,
    ops: *const OpDesc,
    n_ops: u32,
) {
    let t = thread_idx_x();
    let BlockTile { row0, col0, k_begin, k_end, tiles } = BlockTile::new(k, k_split, BLOCK_K as u32);

    let smem = dynamic_shared::<f32>();
    // The swizzle is a function of address bits 7-9: tiles start 1024-byte aligned.
    let base = (shared_address(smem) + 1023) & !1023;
    let tiles_per_stage = if SPLIT { 3 } else { 2 };
    let stage_a = |s: u32| base + s * tiles_per_stage * TILE_BYTES;

    // SAFETY (copies): every chunk lands inside its stage's tile; reads follow the
    // kernel's contract (out-of-range elements are zero-filled, not read).
    let issue = |tile: u32, stage: u32| unsafe {
        let k0 = k_begin + tile * BLOCK_K as u32;
        if A_K {
            TileCopy::new::<true, true>(lda, m, row0, k0, t).issue::<true, true>(a, lda, stage_a(stage), k_end);
        } else {
            // Row-contiguous: the `{0, 2, 4, 6}` chunk swizzle suits the 8-byte
            // fragment loads below.
            TileCopy::new::<false, false>(lda, m, row0, k0, t).issue::<true, false>(a, lda, stage_a(stage), k_end);
        }
        TileCopy::new::<true, false>(ldb, n, col0, k0, t).issue::<true, true>(b, ldb, stage_a(stage) + TILE_BYTES, k_end);
    };
    // Tiles copied ahead of the one multiplied: one stage is read by the MMAs of this
    // k-tile and, with `INFLIGHT`, one by the previous k-tile's, still running.
    let ahead = STAGES - 1 - INFLIGHT;
    for s in 0..ahead {
        if s < tiles {
            issue(s, s);
        }
        cp_async_commit();
    }

    let (warpgroup, warp, lane) = (t / 128, (t / 32) % 4, t % 32);
    // This thread's `B` chunks (for the residual tile) and, for the register `A` of
    // the split, its `ldmatrix` row address (rows of the warp's 16, chunk q / 2).
    let b_chunk = TileCopy::new::<true, false>(ldb, n, col0, 0, t).dst;
    let q = lane / 8;
    let a_row = (warpgroup * 64 + warp * 16 + (q % 2) * 8 + lane % 8) * ROW_BYTES + (((q / 2) ^ (lane % 8)) * 16);
    // Row-contiguous `A` (`[32 k][128 rows]`, 512-byte rows): the fragment rows `gid`
    // and `gid + 8` of the warp's 16 are stored as the neighbours `2 gid`, `2 gid + 1`,
    // one 8-byte load per `k`; the accumulator rows follow the same permutation.
    let (gid, tig) = (lane / 4, lane % 4);
    let pair = warpgroup * 64 + warp * 16 + 2 * gid;
    let a_pair = tig * 512 + ((pair / 4) ^ ((tig % 4) * 2)) * 16 + (pair % 4) * 4;
    let mut acc = [0u32; 64];
    let (mut read, mut write) = (0u32, ahead);
    for kt in 0..tiles {
        // Tile kt has landed when at most `ahead - 1` younger groups are pending.
        match ahead {
            1 => cp_async_wait::<0>(),
            2 => cp_async_wait::<1>(),
            _ => cp_async_wait::<2>(),
        }
        let (sa, sb) = (stage_a(read), stage_a(read) + TILE_BYTES);
        if SPLIT {
            // The residual of the B chunks this thread copied (visible to it now).
            unroll!(i in 0..4 => {
                let off = b_chunk + i as u32 * 4096;
                // SAFETY: inside the stage's B and B-residual tiles.
                unsafe {
                    let v = ld_shared_v4(sb + off);
                    st_shared_v4(sb + TILE_BYTES + off, v.map(tf32_residual));
                }
            });
        }
        // Generic-proxy writes (cp.async, the residual) become visible to wgmma's
        // async proxy; the barrier makes the stage complete for every warp and frees
        // stage `write` (the k-tile that read it has been waited for: at the end of the
        // last iteration, or of the one before with `INFLIGHT`).
        fence_proxy_async_shared();
        // SAFETY: uniform barrier.
        unsafe { sync_threads() };
        if kt + ahead < tiles {
            issue(kt + ahead, write);
        }
        cp_async_commit();
        let da = descriptor_128b(sa + warpgroup * 64 * ROW_BYTES);
        let db = descriptor_128b(sb);
        // k-step s: 32 bytes along the swizzled row = start address + 2 (units of 16 B).
        let (da, db) = ([da, da + 2, da + 4, da + 6], [db, db + 2, db + 4, db + 6]);
        if INFLIGHT > 0 && (SPLIT || !A_K) {
            // The previous k-tile's MMAs read their `A` fragments from registers
            // until they finish, and ptxas reuses those registers for the loads below
            // without waiting: finish them first (they overlapped the barrier and the
            // copies above).
            // SAFETY: all threads of each warpgroup.
            unsafe { wgmma_wait_all(&mut acc) };
        }
        let mut af = [[0u32; 4]; 4];
        if A_K && SPLIT {
            unroll!(s in 0..4 => {
                // SAFETY: inside the stage's A tile; warp-uniform.
                af[s] = unsafe { ldmatrix_x4(sa + (a_row ^ (32 * s as u32))) };
            });
        } else if !A_K {
            unroll!(s in 0..4 => {
                let k0 = sa + a_pair + 8 * s as u32 * 512;
                // SAFETY: inside the stage's A tile.
                let (lo, hi) = unsafe { (ld_shared_v2(k0), ld_shared_v2(k0 + 4 * 512)) };
                af[s] = [lo[0], lo[1], hi[0], hi[1]];
            });
        }
        // SAFETY (MMAs): descriptors of complete, fenced tiles; all 128 threads of
        // each warpgroup execute them.
        if SPLIT {
            let db_lo = descriptor_128b(sb + TILE_BYTES);
            let db_lo = [db_lo, db_lo + 2, db_lo + 4, db_lo + 6];
            let a_lo = af.map(|f| f.map(tf32_residual));
            unsafe { wgmma_n128_split_k_tile::<INFLIGHT>(&mut acc, af, a_lo, db, db_lo) };
        } else if A_K {
            unsafe { wgmma_n128_k_tile::<INFLIGHT>(&mut acc, da, db) };
        } else {
            unsafe { wgmma_n128_rs_k_tile::<INFLIGHT>(&mut acc, af, db) };
        }
        read = if read + 1 == STAGES { 0 } else { read + 1 };
        write = if write + 1 == STAGES { 0 } else { write + 1 };
    }
    // SAFETY: all threads of each warpgroup.
    unsafe { wgmma_wait_all(&mut acc) };
    cp_async_wait::<0>();
    // SAFETY: uniform; every warp is done with the pipeline before it is reused.
    unsafe { sync_threads() };
    // Accumulator `4 j + e` of a thread: row 16 warp + lane / 4 (+ 8 for e >= 2) of its
    // warpgroup's 64 (rows paired as loaded for a row-contiguous `A`), column
    // 8 j + 2 (lane % 4) + e % 2.
    let (gid, tig) = (gid as usize, tig as usize);
    let rows = (warpgroup * 64 + warp * 16) as usize;
    // SAFETY: rows < 128 and columns < 128, inside the staging tile.
    unsafe {
        unroll!(j in 0..16 => {
            unroll!(e in 0..4 => {
                let r = if A_K { rows + gid + 8 * (e / 2) } else { rows + 2 * gid + e / 2 };
                let c = 8 * j + 2 * tig + e % 2;
                let (r, c) = if TRANS { (c, r) } else { (r, c) };
                *smem.add(r * super::staged::STAGE_STRIDE + c) = f32::from_bits(acc[4 * j + e]);
            });
        });
        sync_threads();
        if TRANS {
            write_staged_tile(t as usize, smem, y, bias, save_z, (n as usize, m as usize), (col0 as usize, row0 as usize), ops, n_ops);
        } else {
            write_staged_tile(t as usize, smem, y, bias, save_z, (m as usize, n as usize), (row0 as usize, col0 as usize), ops, n_ops);
        }
    }
}

gemm_entries! {
    gemm_wgmma;
    /// Forward `x W^T`, TF32 on `wgmma`, 16-byte copies: 3 stages, 2 blocks per SM,
    /// each k-tile's MMAs waited for (measured faster than 4 stages at 1 block).
    gemm_wgmma_tf32_nt_vec4 = <false, true, false, { TF32_STAGES as u32 }, 0>;
    /// Forward `x W^T`, 3xTF32 (FP32-accurate) on `wgmma`, 16-byte copies: 4 stages,
    /// a k-tile's MMAs left running across the next barrier and copies.
    gemm_wgmma_tf32x3_nt_vec4 = <true, true, false, { SPLIT_STAGES as u32 }, 1>;
    /// `dX^T = W^T dZ^T` stored as `dX`, TF32: `a` = `W` (row-contiguous in `k` = out
    /// features), `b` = `dZ`.
    gemm_wgmma_tf32_dx_vec4 = <false, false, true, { TF32_STAGES as u32 }, 0>;
    /// `dX`, 3xTF32.
    gemm_wgmma_tf32x3_dx_vec4 = <true, false, true, { SPLIT_STAGES as u32 }, 1>;
    /// `dW = dZ^T X`, TF32: `a` = `dZ` (row-contiguous in `k` = batch), `b` = `X^T`.
    gemm_wgmma_tf32_dw_vec4 = <false, false, false, { TF32_STAGES as u32 }, 0>;
    /// `dW`, 3xTF32.
    gemm_wgmma_tf32x3_dw_vec4 = <true, false, false, { SPLIT_STAGES as u32 }, 1>;
}

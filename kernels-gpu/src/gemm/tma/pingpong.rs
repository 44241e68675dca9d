//! The ping-pong forward `y = chain(x W^T + b)` (`gemm_tma_*_nt_pingpong*`): each consumer
//! warpgroup owns whole `128 x 128` tiles (two `m64n128` MMAs per `k`-step, 128
//! accumulators per thread as in [`super::forward`]) and the two take the block's tiles
//! in turn, so one warpgroup's epilogue runs while the other's MMAs keep the tensor
//! cores busy. In [`super::forward`] both warpgroups share one `128 x 256` tile and run
//! its epilogue together with the tensor cores idle (M1's chain: 0.023 ms of an FP8
//! forward's 0.144, [`super::forward`]'s main loop at 74.5% tensor-pipe use).
//!
//! The stages are filled in the order the tiles are taken, so a warpgroup's next tile's
//! stages follow the other's tile. Its "full" barriers are waited on by parity, which
//! names a phase only within one of the current: a warpgroup back from its epilogue must
//! not wait on its next tile's stages before the other warpgroup has seen all of its own
//! tile's (those stages' earlier phases). So a warpgroup starts a tile only after the
//! other has issued its last k-tile (named barrier `ORDER + wg`), which also keeps the
//! two main loops from sharing the tensor cores for long.

use super::opaque;
use super::pipeline::{CONSUMER_REGISTERS, PRODUCER_REGISTERS, Pipeline};
use crate::epilogue::fragments::{
    HalfFragment, STAGED_HALF_BYTES, add_column_bias, each_half_value, fragment_forward, prefetch_tile_params, stage_half,
    store_half, unscale_fragment,
};
use crate::prelude::bulk_copy::*;
use crate::prelude::element::{Bf16, Element, F16, Half};
use crate::prelude::mma::fence_proxy_async_shared;
use crate::prelude::wgmma::*;
use crate::prelude::*;
use kernel_abi::epilogue::OpDesc;

/// Named barriers `ORDER` and `ORDER + 1`: warpgroup `wg` waits at `ORDER + wg` until the
/// other has issued its tile's last k-tile. (1 is the 3xTF32 kernels', 2 and 3 the
/// staging barriers.)
const ORDER: u32 = 4;

/// Declares the ping-pong entry points: the forward's signature (as
/// `forward::gemm_tma_bf16_nt_to_bf16`), then the e4m3 kernels' inverse scales of `A`'s
/// rows and `B`'s (null for 16-bit operands); the 16-bit operand (or staging) type,
/// the output's element type, and whether the operands are e4m3.
macro_rules! gemm_tma_pingpong_entries {
    ($($(#[$doc:meta])* $name:ident = <$h:ty, $out:ty, $e4m3:literal>;)*) => {$(
        $(#[$doc])*
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "ptx-kernel" fn $name(
            maps: *const u8,
            bias: *const f32,
            y: *mut $out,
            save_z: *mut f32,
            m: u32,
            n: u32,
            k: u32,
            ops: *const OpDesc,
            n_ops: u32,
            inv_row_scales: *const f32,
            inv_col_scales: *const f32,
        ) {
            let scales = (inv_row_scales, inv_col_scales);
            unsafe { gemm_tma_pingpong::<$h, $out, $e4m3>(maps, bias, y, save_z, (m, n, k), ops, n_ops, scales) }
        }
    )*};
}

gemm_tma_pingpong_entries! {
    /// `forward::gemm_tma_bf16_nt_to_bf16` on `128 x 128` tiles taken in turn by the
    /// two consumer warpgroups (see the module): `B`'s map with `64 x 128` boxes.
    ///
    /// # Safety
    /// As `gemm_tma_bf16_nt_to_bf16`, with `PINGPONG_SMEM_BYTES` of shared memory; the
    /// scales are not read.
    gemm_tma_bf16_nt_pingpong_to_bf16 = <Bf16, Bf16, false>;
    /// [`gemm_tma_bf16_nt_pingpong_to_bf16`] in fp16.
    ///
    /// # Safety
    /// As [`gemm_tma_bf16_nt_pingpong_to_bf16`], the maps describing fp16 tensors.
    gemm_tma_f16_nt_pingpong_to_f16 = <F16, F16, false>;
    /// `forward::gemm_tma_e4m3_nt` on `128 x 128` tiles taken in turn: `B`'s map with
    /// `128 x 128` boxes, each 32-deep `k`-step two `m64n128k32` MMAs.
    ///
    /// # Safety
    /// As `gemm_tma_e4m3_nt`, with `PINGPONG_SMEM_BYTES` of shared memory.
    gemm_tma_e4m3_nt_pingpong = <Bf16, f32, true>;
    /// [`gemm_tma_e4m3_nt_pingpong`] with `y` stored in bf16 through the TMA unit.
    ///
    /// # Safety
    /// As [`gemm_tma_e4m3_nt_pingpong`]; `y` holds `m * n` 16-bit words, the third map.
    gemm_tma_e4m3_nt_pingpong_to_bf16 = <Bf16, Bf16, true>;
    /// [`gemm_tma_e4m3_nt_pingpong_to_bf16`] in fp16.
    ///
    /// # Safety
    /// As [`gemm_tma_e4m3_nt_pingpong_to_bf16`].
    gemm_tma_e4m3_nt_pingpong_to_f16 = <F16, F16, true>;
}

/// The body of the entry points (`H`: the 16-bit operand type, or with `E4M3` the type
/// a 16-bit `y` is staged in; `O`: `y`'s type).
///
/// # Safety
/// See the entry points.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_tma_pingpong<H: Half, O: Element, const E4M3: bool>(
    maps: *const u8,
    bias: *const f32,
    y: *mut O,
    save_z: *mut f32,
    (m, n, k): (u32, u32, u32),
    ops: *const OpDesc,
    n_ops: u32,
    scales: (*const f32, *const f32),
) {
    let operand_bytes = const { if E4M3 { 1 } else { 2 } };
    let t = thread_idx_x();
    // SAFETY: the second of the two maps.
    let (map_a, map_b) = (maps, unsafe { maps.add(128) });
    // SAFETY: every thread, first; the launch's shared memory.
    let pipe = unsafe { Pipeline::<false>::pingpong(maps, (m, n, k), operand_bytes) };

    if t < 128 {
        // SAFETY: the whole warpgroup.
        unsafe { set_max_registers::<false, PRODUCER_REGISTERS>() };
        if t == 0 {
            // SAFETY: `A`'s 128 rows and `B`'s 128 fill the stage.
            unsafe {
                pipe.produce(|stage, row0, col0, k0, full| {
                    tma_load_2d(stage, map_a, k0, row0, full);
                    tma_load_2d(stage + pipe.a_bytes, map_b, k0, col0, full);
                    if k0 == 0 {
                        prefetch_tile_params(bias, ops, n_ops, col0, n);
                    }
                })
            };
        }
        return;
    }

    // SAFETY: whole warpgroups.
    unsafe { set_max_registers::<true, CONSUMER_REGISTERS>() };
    let c = t - 128;
    let (wg, warp, lane) = (c / 128, (c / 32) % 4, c % 32);
    let (gid, tig) = ((lane / 4) as usize, (lane % 4) as usize);
    let tma_y = core::mem::size_of::<O>() == 2;
    let leader = || thread_idx_x() % 128 == 0;
    // SAFETY: a 16-bit output's table holds three maps.
    let store_map = || unsafe { maps.add(256) };
    if tma_y && leader() {
        // SAFETY: a valid map, read by this thread's TMA stores.
        unsafe {
            acquire_tensor_map(store_map());
            prefetch_tensor_map(store_map());
        }
    }
    let k_tiles = pipe.k_tiles;
    // The block's tiles `block, block + grid, ..`: this warpgroup takes its `local`-th,
    // `local` = wg, wg + 2, ..; its first k-tile is the block's `local k_tiles`-th stage fill.
    let mut local = wg;
    while block_idx_x() + local * opaque(grid_dim_x()) < pipe.tiles() {
        let tile = block_idx_x() + local * grid_dim_x();
        let first = local * k_tiles;
        let (mut s, mut phase) = (first % pipe.stages, (first / pipe.stages) % 2);
        if local > 0 {
            // The other warpgroup's `j`-th arrival (`local` = 2 j + 2 - wg) releases this
            // warpgroup's tile `local`: it has issued tile `local - 1`.
            // SAFETY: an initialised barrier.
            unsafe { mbarrier_wait(pipe.extra(wg), ((local + wg - 2) / 2) % 2) };
        }
        let (row0, col0) = pipe.tile(tile);
        let mut acc = [0u32; 128];
        let mut held = None;
        for _ in 0..k_tiles {
            let sa = pipe.stage(s);
            let (da, dl, db) =
                (descriptor_128b(sa), descriptor_128b(sa + 64 * 128), descriptor_128b(sa + pipe.a_bytes));
            let step = |d: u64| [d, d + 2, d + 4, d + 6];
            // SAFETY: the stage is complete once its phase is; all 128 threads of the
            // warpgroup issue the MMAs.
            unsafe {
                mbarrier_wait(pipe.full(s), phase);
                if E4M3 {
                    wgmma_pair_k_tile_e4m3(&mut acc, step(da), step(dl), step(db));
                } else {
                    H::wgmma_pair_k_tile(&mut acc, step(da), step(dl), step(db));
                }
            }
            // The previous k-tile's MMAs are done (one group is left in flight).
            if let Some(prev) = held
                && lane == 0
            {
                // SAFETY: one arrival per warp of this warpgroup per phase.
                unsafe { mbarrier_arrive(pipe.empty(prev)) };
            }
            held = Some(s);
            (s, phase) = pipe.next(s, phase);
        }
        // The other warpgroup may start its next tile (if it has one: every arrival is
        // waited for).
        if lane == 0 && block_idx_x() + (local + 1) * grid_dim_x() < pipe.tiles() {
            // SAFETY: one arrival per warp and tile.
            unsafe { mbarrier_arrive(pipe.extra(1 - wg)) };
        }
        // SAFETY: all threads of the warpgroup.
        unsafe { wgmma_wait_all(&mut acc) };
        if let Some(prev) = held
            && lane == 0
        {
            // SAFETY: as above.
            unsafe { mbarrier_arrive(pipe.empty(prev)) };
        }
        // The thread's first row, 16 warp + lane / 4 (and 8 below) of the tile's upper
        // 64; the lower half's are 64 further.
        let row = (row0 + warp * 16) as usize + gid;
        let col = || (opaque(col0 + 2 * tig as u32) as usize, opaque(m) as usize, opaque(n) as usize);
        // SAFETY: `y` and `save_z` (if not null) hold `m * n` values; `ops` holds `n_ops`;
        // the scales `m` and `n`.
        unsafe {
            // The halves (rows `0..64`, `64..128`) in a loop, one copy of the chain's
            // code, as in `forward`.
            let (mut v, mut rest): (HalfFragment, HalfFragment) = ([0.0; 64], [0.0; 64]);
            each_half_value(&mut v, |_, j, e| f32::from_bits(acc[4 * j + e]));
            each_half_value(&mut rest, |_, j, e| f32::from_bits(acc[64 + 4 * j + e]));
            let mut h = 0u32;
            while h < opaque(2) {
                let row = row + 64 * h as usize;
                if E4M3 {
                    let (col, m, n) = col();
                    let inv = scales.0;
                    let row_inv = [row, row + 8].map(|r| if r < m { *inv.add(r) } else { 1.0 });
                    unscale_fragment(&mut v, row_inv, scales.1, n, col);
                }
                if !bias.is_null() {
                    let (col, _, n) = col();
                    add_column_bias(&mut v, bias, n, col);
                }
                if !save_z.is_null() {
                    let (col, m, n) = col();
                    store_half(save_z, &v, (m, n), row, col);
                }
                for o in 0..n_ops as usize {
                    let (col, _, n) = col();
                    fragment_forward(&*ops.add(o), &mut v, n, col);
                }
                if tma_y {
                    let buf = opaque(pipe.staging() + wg * STAGED_HALF_BYTES);
                    // The buffer is free once the last store from it has read it.
                    bulk_wait_group_read_if(leader());
                    named_barrier(2 + wg, 128);
                    stage_half::<H>(buf, &v, opaque(warp), opaque(gid as u32), opaque(tig as u32));
                    // Visible to the TMA unit (async proxy), then to the leader.
                    fence_proxy_async_shared();
                    named_barrier(2 + wg, 128);
                    let half = STAGED_HALF_BYTES / 2;
                    tma_store_2d_pair_if(leader(), buf, half, store_map(), col0, 64, row0 + 64 * h);
                } else {
                    let (col, m, n) = col();
                    store_half(y, &v, (m, n), row, col);
                }
                v = rest;
                h += 1;
            }
        }
        local += 2;
        if tma_y {
            // The stores' reads of shared memory and their writes are done before the
            // warpgroup exits. (Here rather than after the loop: there, as in
            // `forward`, it cost the chain 4 KB of spills.)
            let last = block_idx_x() + local * opaque(grid_dim_x()) >= pipe.tiles();
            bulk_wait_group_if(last && leader());
        }
    }
}

//! The forward `y = chain(x W^T + b)` on the persistent kernels, TF32, 3xTF32 and bf16
//! (`gemm_tma_*_nt`), its epilogue on the accumulators in registers.

use super::flush::{Layout, add_flushed, flush_accumulators, k_runs, run_k_tiles};
use super::opaque;
use super::pipeline::{CONSUMER_REGISTERS, PRODUCER_REGISTERS, Pipeline};
use crate::epilogue::fragments::{
    HalfFragment, STAGED_HALF_BYTES, add_column_bias, each_half_value, fragment_forward, prefetch_tile_params,
    row_reduction, stage_half, store_half, store_row_partials, unscale_fragment,
};
use crate::prelude::bulk_copy::*;
use crate::prelude::element::{Bf16, Element, F16, Half};
use crate::prelude::mma::{fence_proxy_async_shared, ld_shared_v4, st_shared_v4, tf32_residual};
use crate::prelude::wgmma::*;
use crate::prelude::*;
use crate::unroll;
use kernel_abi::epilogue::{OpDesc, ROW_PARTIAL_COLUMNS};
use kernel_abi::gemm_tma::*;

/// Bytes of one MN-major box: 64 values of 2 bytes x 64 of `k`.
const MN_BOX_BYTES: u32 = 64 * 64 * 2;

/// Declares entry points, each an instance of [`gemm_tma`]: `SPLIT`, `HALF` and its
/// 16-bit operand type (ignored without `HALF`), whether `A` and `B` are stored MN-major
/// (`TRANS_A`, `TRANS_B`: 16-bit only), whether the epilogue runs a chain (`CHAIN`; else
/// it only stores), and the output's element type (one signature: the two tensor maps,
/// then as `fma::gemm_fma` with `y` of that type, then the split count).
///
/// Split-K (the kernels `kernel_abi::gemm_tma::SPLIT_K_KERNELS` names, which the host
/// checks by the same list; the others take `splits` as 1. `splits > 1`, an FP32 `y`, no
/// bias, saved `z` or chain: null and 0): each
/// tile's `k` in `splits` ranges of whole k-tiles, one work unit each, each range's
/// sums stored raw into its own `(m, n)` slice of `y (splits, m, n)` for a second
/// kernel to add. With few rows the tiles alone leave most SMs idle (128 x 4096 x 4096
/// is 16 tiles), and a tile's `k` loop is a latency however few run.
macro_rules! gemm_tma_entries {
    ($($(#[$doc:meta])* $name:ident = <$split:literal, $half:literal, $h:ty, $ta:literal, $tb:literal, $chain:literal, $out:ty>;)*) => {$(
        $(#[$doc])*
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "ptx-kernel" fn $name(
            maps: *const u8,
            bias: Vector,
            y: *mut $out,
            save_z: *mut f32,
            m: u32,
            n: u32,
            k: u32,
            ops: *const OpDesc,
            n_ops: u32,
            splits: u32,
        ) {
            let no_scales = (core::ptr::null(), core::ptr::null());
            const SPLIT_K: bool = kernel_abi::gemm_tma::splits_k(stringify!($name));
            unsafe { gemm_tma::<$split, $half, $h, $ta, $tb, $chain, $out, false, SPLIT_K>(maps, bias, y, save_z, (m, n, k), ops, n_ops, splits, no_scales) }
        }
    )*};
}

/// Declares the e4m3 entry points: the forward's signature, then the inverse scales of
/// `A`'s rows and `B`'s (`y`'s rows and columns); the 16-bit type a 16-bit `y` is staged
/// in, and the output's element type.
macro_rules! gemm_tma_e4m3_entries {
    ($($(#[$doc:meta])* $name:ident = <$h:ty, $out:ty>;)*) => {$(
        $(#[$doc])*
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "ptx-kernel" fn $name(
            maps: *const u8,
            bias: Vector,
            y: *mut $out,
            save_z: *mut f32,
            m: u32,
            n: u32,
            k: u32,
            ops: *const OpDesc,
            n_ops: u32,
            splits: u32,
            inv_row_scales: *const f32,
            inv_col_scales: *const f32,
        ) {
            let scales = (inv_row_scales, inv_col_scales);
            unsafe { gemm_tma::<false, false, $h, false, false, true, $out, true, false>(maps, bias, y, save_z, (m, n, k), ops, n_ops, splits, scales) }
        }
    )*};
}

gemm_tma_e4m3_entries! {
    /// The forward `y (m, n) = chain(unscale(x_q W_q^T) + bias)` in FP8: `A` = `x_q (m,
    /// k)` and `B` = `W_q (n, k)` e4m3 (`crate::fp8`'s, scaled per row), their tensor maps
    /// with `128 x 128` and `128 x 256` boxes (128-byte rows of 128 values, the same
    /// swizzle and stage bytes as bf16's 64), each 32-deep `k`-step one
    /// `wgmma.m64n256k32.f32.e4m3.e4m3`. The epilogue first multiplies each sum by its
    /// row's and column's inverse scale (powers of two: exact), then runs as the bf16
    /// kernel's. Also `dX` and `dW` (no bias or chain) over operands quantised transposed.
    ///
    /// # Safety
    /// As [`gemm_tma_bf16_nt`], the maps describing byte tensors; `inv_row_scales` holds
    /// `m` floats, `inv_col_scales` `n`.
    gemm_tma_e4m3_nt = <Bf16, f32>;
    /// [`gemm_tma_e4m3_nt`] with `y` stored in bf16 through the TMA unit (a third map),
    /// as [`gemm_tma_bf16_nt_to_bf16`].
    ///
    /// # Safety
    /// As [`gemm_tma_e4m3_nt`]; `y` holds `m * n` 16-bit words.
    gemm_tma_e4m3_nt_to_bf16 = <Bf16, Bf16>;
    /// [`gemm_tma_e4m3_nt`] with `y` stored in fp16 (an fp16 model's FP8 blocks).
    ///
    /// # Safety
    /// As [`gemm_tma_e4m3_nt_to_bf16`].
    gemm_tma_e4m3_nt_to_f16 = <F16, F16>;
}

gemm_tma_entries! {
    /// The forward `y (m, n) = chain(x W^T + bias)` in TF32, `A` = `x (m, k)` and
    /// `B` = `W (n, k)` described by the two TMA tensor maps at `maps` (128 bytes each:
    /// `A`'s with a `32 x 128` box, `B`'s with `32 x 256`, both with the 128-byte swizzle);
    /// `save_z` as in the other GEMMs.
    ///
    /// # Safety
    /// The maps describe readable `f32` tensors of `(m, k)` and `(n, k)` in global memory;
    /// `y` holds `m * n` floats; bias, `save_z` and `ops` as in `fma::gemm_fma`; `THREADS`
    /// threads, dynamic shared memory `SMEM_BYTES`, any grid; an sm_90a device.
    gemm_tma_tf32_nt = <false, false, Bf16, false, false, true, f32>;

    /// [`gemm_tma_tf32_nt`] in 3xTF32 (FP32-level accuracy): each stage also holds the
    /// FP32 residuals `x - tf32(x)` of its `A` and `B` tiles, which the consumers write
    /// (the stage's share of each thread) while the previous stage's MMAs run, and every
    /// `k`-step is three MMAs, `A B + A B_lo + A_lo B` (the tensor core reads the TF32
    /// part of the raw operands). Stages are 16 deep (64-byte swizzle) so that four fit
    /// (`SPLIT_STAGES`, `SPLIT_SMEM_BYTES`): with two 32-deep ones the copies and the
    /// residuals did not keep up (M2 3.01 ms against 2.36).
    ///
    /// # Safety
    /// As [`gemm_tma_tf32_nt`], with `SPLIT_SMEM_BYTES` of shared memory.
    gemm_tma_tf32x3_nt = <true, false, Bf16, false, false, true, f32>;

    /// [`gemm_tma_tf32_nt`] in bf16: `A` and `B` are bf16 copies of `x` and `W` (rounded to
    /// nearest), their tensor maps with `64 x 128` and `64 x 256` boxes (128-byte rows of
    /// 64 values, the same swizzle and stage bytes as TF32's 32 floats), and each 16-deep
    /// `k`-step one `wgmma.m64n256k16.f32.bf16.bf16` (FP32 accumulators in the TF32
    /// kernel's layout, so the same epilogue).
    ///
    /// # Safety
    /// As [`gemm_tma_tf32_nt`], the maps describing `u16` (bf16) tensors.
    gemm_tma_bf16_nt = <false, true, Bf16, false, false, true, f32>;

    /// [`gemm_tma_bf16_nt`] split-K: each work unit a tile and one of `splits` ranges of
    /// `k`, its raw FP32 sums stored into its own slice of `y (splits, m, n)` for a second
    /// kernel to add. No bias, saved `z` or chain (null and 0). A kernel of its own so
    /// that the unsplit one's producer holds no split state beside the tile parameters it
    /// prefetches (with both, its 24 registers spilled 12 bytes).
    ///
    /// # Safety
    /// As [`gemm_tma_bf16_nt`], `y` holding `splits m n` floats.
    gemm_tma_bf16_nt_split = <false, true, Bf16, false, false, false, f32>;

    /// [`gemm_tma_bf16_nt`] on bf16 tensors as a bf16 model keeps them: `x` and `W`
    /// read as stored (nothing rounded per call), `y` stored in bf16 (each value rounded
    /// to nearest once, after the FP32 epilogue), `save_z` in FP32.
    ///
    /// # Safety
    /// As [`gemm_tma_bf16_nt`]; `y` holds `m * n` 16-bit words.
    gemm_tma_bf16_nt_to_bf16 = <false, true, Bf16, false, false, true, Bf16>;

    /// `dX (m, n) = dZ (m, k) W (k, n)` on bf16 tensors as stored: `A` = `dZ`
    /// `k`-contiguous (its map as the forward's `A`), `B` = `W` `n`-contiguous
    /// (MN-major: boxes of 64 columns x 64 rows of `k`, four per `256`-wide tile, the
    /// `wgmma` reading them transposed), `y` in bf16. No bias or chain (pass null and 0).
    ///
    /// # Safety
    /// As [`gemm_tma_bf16_nt_to_bf16`], `B`'s map describing a `(k, n)` tensor.
    gemm_tma_bf16_nn_to_bf16 = <false, true, Bf16, false, true, false, Bf16>;

    /// [`gemm_tma_bf16_nn_to_bf16`] with an FP32 `y`: a bf16 model's `dX` at few rows,
    /// its depth (the layer's outputs) in `splits` ranges whose raw sums
    /// `epilogue_split_tiles_bf16` adds (a few `128 x 256` tiles each streaming all of
    /// `W` took 0.039 ms at 8 x 1024 x 4096 where cuBLAS's split GEMM took 0.004).
    ///
    /// # Safety
    /// As [`gemm_tma_bf16_nn_to_bf16`], `y` holding `splits m n` floats.
    gemm_tma_bf16_nn = <false, true, Bf16, false, true, false, f32>;

    /// `dW (m, n) = dZ^T X` on bf16 tensors as stored: `A` = `dZ (k, m)`, `B` =
    /// `X (k, n)`, both MN-major (boxes of 64 x 64, two per `A` tile and four per `B`
    /// tile), `y` in bf16. No bias or chain.
    ///
    /// # Safety
    /// As [`gemm_tma_bf16_nn_to_bf16`], `A`'s map describing a `(k, m)` tensor.
    gemm_tma_bf16_tn_to_bf16 = <false, true, Bf16, true, true, false, Bf16>;

    /// [`gemm_tma_bf16_tn_to_bf16`] with an FP32 `y`: the folded weight's gradient of a
    /// leading AvgPool, spread over the whole weight (and rounded) afterwards.
    ///
    /// # Safety
    /// As [`gemm_tma_bf16_tn_to_bf16`], `y` holding `m * n` floats.
    gemm_tma_bf16_tn = <false, true, Bf16, true, true, false, f32>;

    /// [`gemm_tma_bf16_nt`] in fp16: fp16 copies of FP32 `x` and `W` (or an fp16
    /// model's as stored), each `k`-step one `wgmma.m64n256k16.f32.f16.f16`.
    ///
    /// # Safety
    /// As [`gemm_tma_bf16_nt`], the maps describing fp16 tensors.
    gemm_tma_f16_nt = <false, true, F16, false, false, true, f32>;
    /// [`gemm_tma_bf16_nt_split`] in fp16.
    ///
    /// # Safety
    /// As [`gemm_tma_bf16_nt_split`], the maps describing fp16 tensors.
    gemm_tma_f16_nt_split = <false, true, F16, false, false, false, f32>;
    /// [`gemm_tma_bf16_nt_to_bf16`] in fp16: an fp16 model's forward, `y` in fp16.
    ///
    /// # Safety
    /// As [`gemm_tma_f16_nt`]; `y` holds `m * n` 16-bit words.
    gemm_tma_f16_nt_to_f16 = <false, true, F16, false, false, true, F16>;
    /// [`gemm_tma_bf16_nn_to_bf16`] in fp16: an fp16 model's `dX`.
    ///
    /// # Safety
    /// As [`gemm_tma_f16_nt_to_f16`], `B`'s map describing a `(k, n)` tensor.
    gemm_tma_f16_nn_to_f16 = <false, true, F16, false, true, false, F16>;
    /// [`gemm_tma_bf16_nn`] in fp16: an fp16 model's `dX` at few rows, split.
    ///
    /// # Safety
    /// As [`gemm_tma_bf16_nn`], the maps describing fp16 tensors.
    gemm_tma_f16_nn = <false, true, F16, false, true, false, f32>;
    /// [`gemm_tma_bf16_tn_to_bf16`] in fp16: an fp16 model's `dW`.
    ///
    /// # Safety
    /// As [`gemm_tma_f16_nn_to_f16`], `A`'s map describing a `(k, m)` tensor.
    gemm_tma_f16_tn_to_f16 = <false, true, F16, true, true, false, F16>;
    /// [`gemm_tma_bf16_tn`] in fp16 (a folded AvgPool weight's gradient).
    ///
    /// # Safety
    /// As [`gemm_tma_f16_tn_to_f16`], `y` holding `m * n` floats.
    gemm_tma_f16_tn = <false, true, F16, true, true, false, f32>;
}

/// A barrier over warpgroup `wg`'s 128 threads: named barrier `2 + wg`. (A register id,
/// so ptxas reserves all sixteen barriers; it runs one block per SM. Choosing between two
/// constant ids by a branch cost the chain's epilogue spills.)
///
/// # Safety
/// Every thread of the warpgroup reaches it.
#[inline(always)]
unsafe fn staging_barrier(wg: u32) {
    // SAFETY: as the caller's.
    unsafe { named_barrier(2 + wg, 128) }
}

/// The body of the entry points (`SPLIT`: 3xTF32; `HALF`: 16-bit operands of type `H`,
/// `TRANS_A`, `TRANS_B` MN-major; `CHAIN`: bias, saved `z` and chain; `O`: the output's
/// type, `H` where it is 16-bit; `E4M3`: e4m3 operands, `scales` their inverse row and
/// column scales; `SPLIT_K`: `splits` is read, else taken as 1).
///
/// # Safety
/// See [`gemm_tma_tf32_nt`] and [`gemm_tma_e4m3_nt`].
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_tma<
    const SPLIT: bool,
    const HALF: bool,
    H: Half,
    const TRANS_A: bool,
    const TRANS_B: bool,
    const CHAIN: bool,
    O: Element,
    const E4M3: bool,
    const SPLIT_K: bool,
>(
    maps: *const u8,
    bias: Vector,
    y: *mut O,
    save_z: *mut f32,
    (m, n, k): (u32, u32, u32),
    ops: *const OpDesc,
    n_ops: u32,
    splits: u32,
    scales: (*const f32, *const f32),
) {
    const { assert!(!E4M3 || !(HALF || SPLIT || TRANS_A || TRANS_B), "e4m3 operands are k-major bytes") };
    let operand_bytes = const { if E4M3 { 1 } else if HALF { 2 } else { 4 } };
    let t = thread_idx_x();
    // SAFETY: the second of the two maps.
    let (map_a, map_b) = (maps, unsafe { maps.add(128) });
    // SAFETY: every thread, first; the launch's shared memory.
    let pipe = unsafe { Pipeline::<SPLIT_K>::new::<SPLIT>(maps, (m, n, k), operand_bytes, splits) };
    let Pipeline { tile_bytes, block_k, a_bytes, split_tiles, .. } = pipe;

    if t < 128 {
        // The producer: one thread; its warpgroup hands most of its registers to the
        // consumers (`PRODUCER_REGISTERS`, `CONSUMER_REGISTERS`).
        // SAFETY: the whole warpgroup.
        unsafe { set_max_registers::<false, PRODUCER_REGISTERS>() };
        if t == 0 {
            // SAFETY: `A`'s `BLOCK_M` rows and `B`'s `BLOCK_N` fill the stage's tiles.
            unsafe {
                pipe.produce(|stage, row0, col0, k0, full| {
                    // MN-major operands arrive as boxes of 64 rows (or columns) x 64 of
                    // `k`, 8 KB each, side by side.
                    if TRANS_A {
                        tma_load_2d(stage, map_a, row0, k0, full);
                        tma_load_2d(stage + MN_BOX_BYTES, map_a, row0 + 64, k0, full);
                    } else {
                        tma_load_2d(stage, map_a, k0, row0, full);
                    }
                    if TRANS_B {
                        unroll!(j in 0..4 => {
                            tma_load_2d(stage + a_bytes + j as u32 * MN_BOX_BYTES, map_b, col0 + 64 * j as u32, k0, full);
                        });
                    } else {
                        tma_load_2d(stage + a_bytes, map_b, k0, col0, full);
                    }
                    if CHAIN && k0 == 0 && !SPLIT {
                        // A tile's first copies: its epilogue is a main loop away. (Not
                        // for 3xTF32: its epilogue is a smaller share of a tile's time,
                        // and the parameters' pointers held through the producer's
                        // loop cost it a spill at 24 registers once the flushes came.)
                        prefetch_tile_params(bias.0 as *const f32, ops, n_ops, col0, n);
                    }
                })
            };
        }
        return;
    }

    // The consumers: warpgroup `wg` owns rows `64 wg..64 wg + 64` of each tile, its
    // 128 accumulators and the epilogue's values all in registers.
    // SAFETY: whole warpgroups.
    unsafe { set_max_registers::<true, CONSUMER_REGISTERS>() };
    let c = t - 128;
    let (wg, warp, lane) = (c / 128, (c / 32) % 4, c % 32);
    let (gid, tig) = ((lane / 4) as usize, (lane % 4) as usize);
    // A 16-bit `y` goes out through a TMA store where the host could describe it (a third
    // map, flagged by the word after it): each warpgroup stages its half tiles in shared
    // memory and its first thread stores them, so the writes drain while the next tile's
    // MMAs run instead of holding up the epilogue.
    // (The map's address and the leader are recomputed where used: held through the
    // main loop, they cost the chain's epilogue spills.)
    let tma_y = core::mem::size_of::<O>() == 2;
    // Whether a chain may end in a row reduction (`row_reduction`): FP32 `y`, not FP8,
    // and not 3xTF32, whose runs of `k` are added up in `y` itself (`flush`).
    let reduces = CHAIN && !E4M3 && !tma_y && !SPLIT;
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
    if CHAIN {
        // The epilogue reads FP32 vectors (`fragments`; the host widens 16-bit ones),
        // whose words are their addresses: any other stops the kernel rather than be
        // read as floats.
        // SAFETY: `ops` holds `n_ops` descriptors.
        unsafe { Fp32Params::check(ops, n_ops as usize) };
        if bias.stored() != kernel_abi::vector::Stored::F32 {
            // SAFETY: aborts the kernel.
            unsafe { core::arch::nvptx::trap() }
        }
    }
    let (mut s, mut phase) = (0u32, 0u32);
    // Work items: each unit's (a tile's split's) `k` in `runs` runs (`k_runs`), taken in
    // order by the block that owns the unit; every run but the last ends with its sums
    // added into `y` (`FLUSH_K`), the last with the epilogue.
    let runs = k_runs::<SPLIT>(split_tiles);
    let mut item = block_idx_x() * runs;
    while item < pipe.units() * runs {
        let (unit, run) = (item / runs, item % runs);
        let (row0, col0, split, k_tiles) = pipe.unit(unit);
        let mut acc = [0u32; 128];
        let mut held = None;
        for _ in run_k_tiles::<SPLIT>(run, k_tiles) {
            let sa = pipe.stage(s);
            let describe = if SPLIT { descriptor_64b } else { descriptor_128b };
            // The warpgroup's 64 rows of `A` (rows of `block_k` 4- or 2-byte values).
            let da = describe(sa + wg * 64 * block_k * operand_bytes);
            let db = describe(sa + a_bytes);
            // k-step i: 32 bytes along the swizzled rows = start address + 2 (16-byte units).
            // SAFETY: the stage is complete once its phase is; all 128 threads of the
            // warpgroup issue the MMAs.
            unsafe {
                mbarrier_wait(pipe.full(s), phase);
                if SPLIT {
                    // The residuals of the stage's 1536 16-byte chunks, 6 per consumer
                    // thread, written at the same offsets one stage-half on (the swizzle
                    // moves whole chunks, so the residual tiles share the layout).
                    let mut v = [[0u32; 4]; 6];
                    unroll!(i in 0..8 => {
                        if i < 6 {
                            v[i] = ld_shared_v4(sa + (c + 256 * i as u32) * 16);
                        }
                    });
                    unroll!(i in 0..8 => {
                        if i < 6 {
                            st_shared_v4(sa + tile_bytes + (c + 256 * i as u32) * 16, v[i].map(tf32_residual));
                        }
                    });
                    // Visible to the tensor cores (async proxy), then to both warpgroups.
                    fence_proxy_async_shared();
                    named_barrier(1, CONSUMER_THREADS as u32);
                    let (dal, dbl) = (da + (tile_bytes as u64 >> 4), db + (tile_bytes as u64 >> 4));
                    wgmma_n256_k_tile_split(&mut acc, [da, db, dal, dbl]);
                } else if E4M3 {
                    // k-step i: 32 bytes (values) further along the 128-byte rows.
                    wgmma_n256_k_tile_e4m3(&mut acc, [da, da + 2, da + 4, da + 6], [db, db + 2, db + 4, db + 6]);
                } else if HALF {
                    // k-step i: 32 bytes further along a `k`-major operand's 128-byte rows
                    // (2 16-byte units), 16 rows of 128 bytes further in an MN-major one
                    // (2048 bytes = 128 units).
                    const { assert!(TRANS_B || !TRANS_A, "an MN-major A comes with an MN-major B") };
                    let da = if TRANS_A { descriptor_128b_mn(sa + wg * MN_BOX_BYTES) } else { da };
                    let db = if TRANS_B { descriptor_128b_mn(sa + a_bytes) } else { db };
                    let a = [0, 1, 2, 3].map(|i| da + if TRANS_A { 128 * i } else { 2 * i });
                    let b = [0, 1, 2, 3].map(|i| db + if TRANS_B { 128 * i } else { 2 * i });
                    H::wgmma_k_tile::<TRANS_A, TRANS_B>(&mut acc, a, b);
                } else {
                    wgmma_n256_k_tile(&mut acc, [da, da + 2, da + 4, da + 6], [db, db + 2, db + 4, db + 6]);
                }
            }
            // The previous k-tile's MMAs are done (one group is left in flight): free its stage.
            if let Some(prev) = held
                && lane == 0
            {
                // SAFETY: one arrival per consumer warp per phase.
                unsafe { mbarrier_arrive(pipe.empty(prev)) };
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
        // The thread's first row: 16 warp + lane / 4 of the warpgroup's 64 (and 8 below),
        // in the split's slice of `y`, seen as `(splits m, n)`: its rows end at `m_end`.
        let row = (row0 + wg * 64 + warp * 16) as usize + gid + (split * m) as usize;
        let m_end = (split + 1) * m;
        let layout = Layout::Rows { row, col: (col0 + 2 * tig as u32) as usize, step: 8 };
        // (3xTF32 alone flushes, and its `y` is FP32.)
        if SPLIT && run + 1 < runs {
            // SAFETY: the MMAs are finished; `y` holds `splits m n` floats, and only this
            // thread reads or writes its accumulators' places until its epilogue
            // overwrites them.
            unsafe { flush_accumulators(&mut acc, y as *mut f32, run == 0, layout, (m_end, n)) };
            item += 1;
            continue;
        }
        if SPLIT && runs > 1 {
            // SAFETY: as for the flushes.
            unsafe { add_flushed(&mut acc, y as *mut f32, layout, (m_end, n)) };
        }
        // The epilogue on the accumulators where they are (`epilogue::fragments`):
        // rows `row` (+ 8), columns 2 (lane % 4) + 8 j.
        // The thread's first column and the sizes, opaque to the compiler at each use:
        // otherwise it derives the 64 column bounds once and holds them beside the 128
        // values through the whole epilogue (and spills).
        let fresh =
            |offset: u32| (opaque(col0 + 2 * tig as u32 + offset) as usize, opaque(m_end) as usize, opaque(n) as usize);
        // SAFETY: `y` and `save_z` (if not null) hold `m * n` floats; `ops` holds `n_ops`.
        unsafe {
            // The halves in a loop, not unrolled (the opaque bound), so the chain's code
            // exists once (14 k instructions instead of 28 k): unrolled, M2's three ops
            // cost 0.6 ms more than its three one-op chains together; as a loop its
            // forward went from 1.83 to 1.14 ms (the code is fetched anew for every
            // tile; see docs/VERSIONS.md, "Kernel design history"). The second half waits in `rest` and
            // moves into `v`, so only the half in flight and the one waiting are live,
            // as when unrolled.
            // (Element by element: `map` would take the arrays through local memory.)
            let (mut v, mut rest): (HalfFragment, HalfFragment) = ([0.0; 64], [0.0; 64]);
            each_half_value(&mut v, |_, j, e| f32::from_bits(acc[4 * j + e]));
            each_half_value(&mut rest, |_, j, e| f32::from_bits(acc[64 + 4 * j + e]));
            // FP8: the inverse scales of the thread's two rows (1 past `m`: never stored).
            let row_inv = if E4M3 {
                let (m, inv) = (opaque(m) as usize, scales.0);
                let first = row - split as usize * m;
                [first, first + 8].map(|r| if r < m { *inv.add(r) } else { 1.0 })
            } else {
                [1.0; 2]
            };
            let mut h = 0u32;
            while h < opaque(2) {
                let offset = 128 * h;
                if E4M3 {
                    let (col, _, n) = fresh(offset);
                    unscale_fragment(&mut v, row_inv, scales.1, n, col);
                }
                if CHAIN && !bias.is_null() {
                    let (col, _, n) = fresh(offset);
                    add_column_bias(&mut v, bias.0 as *const f32, n, col);
                }
                if CHAIN && !save_z.is_null() {
                    let (col, m, n) = fresh(offset);
                    store_half(save_z, &v, (m, n), row, col);
                }
                // A chain ending in a row reduction (FP32 `y` only: the row-partials
                // plan) runs up to it, then leaves the half's row partials in `y`.
                let reduce = if reduces { row_reduction(ops, opaque(n_ops)) } else { 0 };
                for o in 0..if CHAIN { n_ops as usize - (reduce != 0) as usize } else { 0 } {
                    let (col, _, n) = fresh(offset);
                    fragment_forward(&*ops.add(o), &mut v, n, col);
                }
                if reduces && reduce != 0 {
                    let (col, m, n) = fresh(offset);
                    let first = (col0 + offset) as usize;
                    if first < n {
                        let part = first / ROW_PARTIAL_COLUMNS;
                        store_row_partials(&v, reduce, y as *mut f32, (m, n), row, col, part, tig);
                    }
                } else if tma_y {
                    // Opaque at each use, as `fresh`: else the 32 staging addresses are
                    // hoisted out of the loop and held through the chain (and spill).
                    let buf = opaque(pipe.staging() + wg * STAGED_HALF_BYTES);
                    // The buffer is free once the last store from it has read it.
                    bulk_wait_group_read_if(leader());
                    staging_barrier(wg);
                    stage_half::<H>(buf, &v, opaque(warp), opaque(gid as u32), opaque(tig as u32));
                    // Visible to the TMA unit (async proxy), then to the leader.
                    fence_proxy_async_shared();
                    staging_barrier(wg);
                    let half = STAGED_HALF_BYTES / 2;
                    tma_store_2d_pair_if(leader(), buf, half, store_map(), col0 + offset, 64, row0 + 64 * wg);
                } else {
                    let (col, m, n) = fresh(offset);
                    store_half(y, &v, (m, n), row, col);
                }
                v = rest;
                h += 1;
            }
        }
        // The block's next unit's first run.
        item += opaque(grid_dim_x()) * runs - run;
        if tma_y {
            // The stores' reads of shared memory and their writes are done before the
            // block exits. (Here rather than after the loop: there, it cost the chain
            // 5 KB of spills.)
            bulk_wait_group_if(item >= pipe.units() * runs && leader());
        }
    }
}


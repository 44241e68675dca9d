//! The persistent, warp-specialised TF32 and 3xTF32 GEMMs on Hopper: `wgmma.m64n256k8`
//! fed by TMA, for 16-byte aligned operands without split-K (and the bf16 forward,
//! `m64n256k16` over the same 128-byte rows). The forward
//! `y = chain(x W^T + b)` (`gemm_tma_*_nt`), and the backward's `dW` and `dX` with the
//! row-contiguous operand (`dZ`, `W`) read as stored and passed through registers
//! (`gemm_tma_*_tk`, `gemm_tma_*_tk_t`).
//!
//! Why another kernel beside [`super::wgmma`]: there, `128 x 128` tiles read 6 KB of
//! shared memory per 131 kFLOP `wgmma` and every warp also issues `cp.async` copies and
//! meets the others at a barrier per k-tile; that kernel reaches about half the TF32
//! peak. Here
//! - a `128 x 256` tile (each consumer warpgroup `m64n256`) halves `B`'s shared-memory
//!   reads per FLOP;
//! - one producer thread copies whole tiles with TMA (`cp.async.bulk.tensor`, the
//!   hardware writes the 128-byte swizzle the `wgmma` descriptors read, and zero-fills
//!   out-of-range rows and `k`), and "full"/"empty" `mbarrier`s per stage replace the
//!   block barriers: the consumers only wait for data and issue MMAs;
//! - blocks are persistent (one per SM, looping over tiles), so the producer fills the
//!   next tile's stages while the consumers run the epilogue of the last.
//!
//! The epilogue runs on the accumulators in registers ([`crate::epilogue::fragments`]):
//! no staging tile, so its shared memory goes to a fourth stage, and no barrier, so
//! each warp stores as soon as its own rows are done. The tensor cores still idle while
//! it runs (one block per SM, both warpgroups in the epilogue): with short `k` that
//! costs more than the tile's MMAs gain, so the host sends only `k >= MIN_K` here.
//! (A ping-pong schedule — each warpgroup its own `128 x 128` tile, one in its epilogue
//! while the other multiplies — was measured slower: docs/PERFORMANCE.md, t13.)

use crate::epilogue::fragments::{F2, HalfFragment, add_column_bias, each_half_value, fragment_forward, prefetch_tile_params, store_half};
use crate::prelude::async_copy::shared_address;
use crate::prelude::global::store_v2;
use crate::prelude::bulk_copy::*;
use crate::prelude::tensor_core::{fence_proxy_async_shared, ld_shared_v2, ld_shared_v4, st_shared_v4, tf32_residual};
use crate::prelude::*;
use crate::unroll;
use kernel_abi::epilogue::OpDesc;
use kernel_abi::gemm_tma::*;

/// `x`, hidden from the optimiser: nothing computed from it moves above this point (and
/// a loop bounded by it is not unrolled).
#[inline(always)]
fn opaque(mut x: u32) -> u32 {
    // SAFETY: a register move.
    unsafe { core::arch::asm!("mov.u32 {0}, {0};", inout(reg32) x, options(nostack, nomem)) };
    x
}

/// Registers per thread of the producer and of the consumer warpgroups. The block's
/// registers are those it launched with (168 per thread, the launch bounds' cap):
/// `setmaxnreg.inc` waits until the producer's `dec` has freed enough, so the two must
/// fit in them, or the consumers wait forever (32 / 240 hung). The consumers' epilogue
/// is at the cap: at 232 it spilled 8 bytes (a tile's row and column bases).
const PRODUCER_REGISTERS: u32 = 24;
const CONSUMER_REGISTERS: u32 = 240;
const _: () = assert!(128 * PRODUCER_REGISTERS + CONSUMER_THREADS as u32 * CONSUMER_REGISTERS <= 168 * THREADS as u32);

/// A `k`-contiguous, 128-byte-swizzled operand's `wgmma` descriptor (as in
/// [`super::wgmma`]): start address, 1024 bytes between 8-row groups, swizzle mode 1.
#[inline(always)]
fn descriptor(addr: u32) -> u64 {
    ((addr as u64 >> 4) & 0x3fff) | (1 << 16) | ((1024u64 >> 4) << 32) | (1 << 62)
}

/// The same for 64-byte rows (16 floats) with the 64-byte swizzle: 512 bytes between
/// 8-row groups, swizzle mode 2.
#[inline(always)]
fn descriptor_64b(addr: u32) -> u64 {
    ((addr as u64 >> 4) & 0x3fff) | (1 << 16) | ((512u64 >> 4) << 32) | (2 << 62)
}

/// The origin `(row0, col0)` of tile `tile`: panels of [`PANEL_M`] row tiles, walked
/// row tile fastest, so the blocks in flight share `B` tiles and few `A` rows.
#[inline(always)]
fn tile_origin(tile: u32, tiles_m: u32, tiles_n: u32) -> (u32, u32) {
    let panel_tiles = PANEL_M as u32 * tiles_n;
    let (panel, local) = (tile / panel_tiles, tile % panel_tiles);
    let first = panel * PANEL_M as u32;
    let height = if tiles_m - first < PANEL_M as u32 { tiles_m - first } else { PANEL_M as u32 };
    ((first + local % height) * BLOCK_M as u32, (local / height) * BLOCK_N as u32)
}

/// The stages of a persistent TMA kernel, their "full" and "empty" barriers and the
/// tile walk, shared by the `nt` and `tk` bodies. A stage holds the `A` and `B` tiles
/// (`tile_bytes`, `A` first), then with 3xTF32 their residuals in the same layout.
#[derive(Clone, Copy)]
struct Pipeline {
    base: u32,
    stages: u32,
    stage_bytes: u32,
    tile_bytes: u32,
    block_k: u32,
    a_bytes: u32,
    tiles_m: u32,
    tiles_n: u32,
    k_tiles: u32,
}

impl Pipeline {
    /// The layout for `SPLIT` (3xTF32: four 16-deep stages with the 64-byte swizzle,
    /// so that they fit beside their residuals) and a `(m, n, k)` GEMM. Thread 0 sets
    /// up the barriers ("full": the producer's one arrival plus the stage's bytes;
    /// "empty": one arrival per consumer warp) and prefetches both tensor maps; then
    /// the block's only barrier.
    ///
    /// # Safety
    /// Every thread of the block calls it once, first; `maps` holds two tensor maps;
    /// the dynamic shared memory is `SMEM_BYTES` (`SPLIT_SMEM_BYTES` with `SPLIT`).
    #[inline(always)]
    unsafe fn new<const SPLIT: bool, const BF16: bool>(maps: *const u8, (m, n, k): (u32, u32, u32)) -> Pipeline {
        // The hardware swizzle is a function of address bits 7-9: stages start
        // 1024-byte aligned.
        let base = (shared_address(dynamic_shared::<f32>()) + 1023) & !1023;
        let (stages, tile_bytes, block_k, a_bytes) = if SPLIT {
            (SPLIT_STAGES, SPLIT_STAGE_BYTES, SPLIT_BLOCK_K, SPLIT_A_BYTES)
        } else if BF16 {
            // The same bytes: 128-byte rows of 64 bf16 values.
            (STAGES, STAGE_BYTES, BF16_BLOCK_K, A_BYTES)
        } else {
            (STAGES, STAGE_BYTES, BLOCK_K, A_BYTES)
        };
        let (stages, tile_bytes, block_k, a_bytes) = (stages as u32, tile_bytes as u32, block_k as u32, a_bytes as u32);
        let stage_bytes = if SPLIT { 2 * tile_bytes } else { tile_bytes };
        let (tiles_m, tiles_n) = (m.div_ceil(BLOCK_M as u32), n.div_ceil(BLOCK_N as u32));
        let p = Pipeline { base, stages, stage_bytes, tile_bytes, block_k, a_bytes, tiles_m, tiles_n, k_tiles: k.div_ceil(block_k) };
        if thread_idx_x() == 0 {
            // SAFETY: fresh barriers inside the dynamic shared memory; valid tensor maps.
            unsafe {
                for s in 0..stages {
                    mbarrier_init(p.full(s), 1);
                    mbarrier_init(p.empty(s), (CONSUMER_THREADS / 32) as u32);
                }
                // Thread 0 is also the producer, the only thread that reads the maps.
                acquire_tensor_map(maps);
                acquire_tensor_map(maps.add(128));
                prefetch_tensor_map(maps);
                prefetch_tensor_map(maps.add(128));
            }
            fence_barrier_init();
        }
        // SAFETY: uniform; the only block-wide barrier.
        unsafe { sync_threads() };
        p
    }

    /// Shared-memory address of stage `s`.
    #[inline(always)]
    fn stage(&self, s: u32) -> u32 {
        self.base + s * self.stage_bytes
    }

    #[inline(always)]
    fn full(&self, s: u32) -> u32 {
        self.base + self.stages * self.stage_bytes + 8 * s
    }

    #[inline(always)]
    fn empty(&self, s: u32) -> u32 {
        self.full(self.stages + s)
    }

    /// The stage after `s` and its barriers' phase.
    #[inline(always)]
    fn next(&self, s: u32, phase: u32) -> (u32, u32) {
        if s + 1 == self.stages { (0, phase ^ 1) } else { (s + 1, phase) }
    }

    fn tiles(&self) -> u32 {
        self.tiles_m * self.tiles_n
    }

    /// The origin of tile `tile`.
    #[inline(always)]
    fn origin(&self, tile: u32) -> (u32, u32) {
        tile_origin(tile, self.tiles_m, self.tiles_n)
    }

    /// The producer (one thread): walks the same tiles as the consumers and fills each
    /// stage once the consumers have released it, `copy(stage, row0, col0, k0, full)`
    /// issuing its TMA copies (`tile_bytes` in all).
    ///
    /// # Safety
    /// One thread calls it, after [`Pipeline::new`]; `copy`'s boxes land inside the stage.
    #[inline(always)]
    unsafe fn produce(&self, copy: impl Fn(u32, u32, u32, u32, u32)) {
        let (mut s, mut phase) = (0u32, 0u32);
        let mut tile = block_idx_x();
        while tile < self.tiles() {
            let (row0, col0) = self.origin(tile);
            for kt in 0..self.k_tiles {
                // SAFETY: initialised barriers.
                unsafe {
                    mbarrier_wait(self.empty(s), phase ^ 1);
                    mbarrier_arrive_expect_tx(self.full(s), self.tile_bytes);
                }
                copy(self.stage(s), row0, col0, kt * self.block_k, self.full(s));
                (s, phase) = self.next(s, phase);
            }
            tile += grid_dim_x();
        }
    }
}

/// Declares forward entry points, each an instance of [`gemm_tma`] with the given
/// `SPLIT` and `BF16` (one signature: the two tensor maps, then as `simt::gemm_f32`).
macro_rules! gemm_tma_entries {
    ($($(#[$doc:meta])* $name:ident = <$split:literal, $bf16:literal>;)*) => {$(
        $(#[$doc])*
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "ptx-kernel" fn $name(
            maps: *const u8,
            bias: *const f32,
            y: *mut f32,
            save_z: *mut f32,
            m: u32,
            n: u32,
            k: u32,
            ops: *const OpDesc,
            n_ops: u32,
        ) {
            unsafe { gemm_tma::<$split, $bf16>(maps, bias, y, save_z, m, n, k, ops, n_ops) }
        }
    )*};
}

gemm_tma_entries! {
    /// The forward `y (m, n) = chain(x W^T + bias)` in TF32, `A` = `x (m, k)` and
    /// `B` = `W (n, k)` described by the two TMA tensor maps at `maps` (128 bytes each:
    /// `A`'s with a `32 x 128` box, `B`'s with `32 x 256`, both with the 128-byte swizzle);
    /// `save_z` as in the other GEMMs.
    ///
    /// # Safety
    /// The maps describe readable `f32` tensors of `(m, k)` and `(n, k)` in global memory;
    /// `y` holds `m * n` floats; bias, `save_z` and `ops` as in `simt::gemm_f32`; `THREADS`
    /// threads, dynamic shared memory `SMEM_BYTES`, any grid; an sm_90a device.
    gemm_tma_tf32_nt = <false, false>;

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
    gemm_tma_tf32x3_nt = <true, false>;

    /// [`gemm_tma_tf32_nt`] in bf16: `A` and `B` are bf16 copies of `x` and `W` (rounded to
    /// nearest), their tensor maps with `64 x 128` and `64 x 256` boxes (128-byte rows of
    /// 64 values, the same swizzle and stage bytes as TF32's 32 floats), and each 16-deep
    /// `k`-step one `wgmma.m64n256k16.f32.bf16.bf16` (FP32 accumulators in the TF32
    /// kernel's layout, so the same epilogue).
    ///
    /// # Safety
    /// As [`gemm_tma_tf32_nt`], the maps describing `u16` (bf16) tensors.
    gemm_tma_bf16_nt = <false, true>;
}

/// The body of the forward entry points (`SPLIT`: 3xTF32; `BF16`: bf16 operands).
///
/// # Safety
/// See [`gemm_tma_tf32_nt`].
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_tma<const SPLIT: bool, const BF16: bool>(
    maps: *const u8,
    bias: *const f32,
    y: *mut f32,
    save_z: *mut f32,
    m: u32,
    n: u32,
    k: u32,
    ops: *const OpDesc,
    n_ops: u32,
) {
    let t = thread_idx_x();
    // SAFETY: the second of the two maps.
    let (map_a, map_b) = (maps, unsafe { maps.add(128) });
    // SAFETY: every thread, first; the launch's shared memory.
    let pipe = unsafe { Pipeline::new::<SPLIT, BF16>(maps, (m, n, k)) };
    let Pipeline { tile_bytes, block_k, a_bytes, k_tiles, .. } = pipe;

    if t < 128 {
        // The producer: one thread; its warpgroup hands most of its registers to the
        // consumers (`PRODUCER_REGISTERS`, `CONSUMER_REGISTERS`).
        // SAFETY: the whole warpgroup.
        unsafe { set_max_registers::<false, PRODUCER_REGISTERS>() };
        if t == 0 {
            // SAFETY: `A`'s `BLOCK_M` rows and `B`'s `BLOCK_N` fill the stage's tiles.
            unsafe {
                pipe.produce(|stage, row0, col0, k0, full| {
                    tma_load_2d(stage, map_a, k0, row0, full);
                    tma_load_2d(stage + a_bytes, map_b, k0, col0, full);
                    if k0 == 0 && !SPLIT {
                        // A tile's first copies: its epilogue is a main loop away. (Not
                        // for 3xTF32: its epilogue is a smaller share of a tile's time,
                        // and the parameters' pointers held through the producer's
                        // loop cost it a spill at 24 registers once the flushes came.)
                        prefetch_tile_params(bias, ops, n_ops, col0, n);
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
    let (mut s, mut phase) = (0u32, 0u32);
    // Work items: each tile's `k` in `runs` runs (`k_runs`), taken in order by the block
    // that owns the tile; every run but the last ends with its sums added into `y`
    // (`FLUSH_K`), the last with the epilogue.
    let runs = k_runs::<SPLIT>(k_tiles);
    let mut item = block_idx_x() * runs;
    while item < pipe.tiles() * runs {
        let (tile, run) = (item / runs, item % runs);
        let (row0, col0) = pipe.origin(tile);
        let mut acc = [0u32; 128];
        let mut held = None;
        for _ in run_k_tiles::<SPLIT>(run, k_tiles) {
            let sa = pipe.stage(s);
            let describe = if SPLIT { descriptor_64b } else { descriptor };
            // The warpgroup's 64 rows of `A` (rows of `block_k` 4- or 2-byte values).
            let da = describe(sa + wg * 64 * block_k * if BF16 { 2 } else { 4 });
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
                } else if BF16 {
                    wgmma_n256_k_tile_bf16(&mut acc, [da, da + 2, da + 4, da + 6], [db, db + 2, db + 4, db + 6]);
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
        // The thread's first row: 16 warp + lane / 4 of the warpgroup's 64 (and 8 below).
        let row = (row0 + wg * 64 + warp * 16) as usize + gid;
        let layout = Layout::Rows { row, col: (col0 + 2 * tig as u32) as usize, step: 8 };
        if SPLIT && run + 1 < runs {
            // SAFETY: the MMAs are finished; `y` holds `m * n` floats, and only this
            // thread reads or writes its accumulators' places until its epilogue
            // overwrites them.
            unsafe { flush_accumulators(&mut acc, y, run == 0, layout, (m, n)) };
            item += 1;
            continue;
        }
        if SPLIT && runs > 1 {
            // SAFETY: as for the flushes.
            unsafe { add_flushed(&mut acc, y, layout, (m, n)) };
        }
        // The epilogue on the accumulators where they are (`epilogue::fragments`):
        // rows `row` (+ 8), columns 2 (lane % 4) + 8 j.
        // The thread's first column and the sizes, opaque to the compiler at each use:
        // otherwise it derives the 64 column bounds once and holds them beside the 128
        // values through the whole epilogue (and spills).
        let fresh = |offset: u32| (opaque(col0 + 2 * tig as u32 + offset) as usize, opaque(m) as usize, opaque(n) as usize);
        // SAFETY: `y` and `save_z` (if not null) hold `m * n` floats; `ops` holds `n_ops`.
        unsafe {
            // The halves in a loop, not unrolled (the opaque bound), so the chain's code
            // exists once (14 k instructions instead of 28 k): unrolled, M2's three ops
            // cost 0.6 ms more than its three one-op chains together; as a loop its
            // forward went from 1.83 to 1.14 ms (the code is fetched anew for every
            // tile; see docs/PERFORMANCE.md, t12). The second half waits in `rest` and
            // moves into `v`, so only the half in flight and the one waiting are live,
            // as when unrolled.
            // (Element by element: `map` would take the arrays through local memory.)
            let (mut v, mut rest): (HalfFragment, HalfFragment) = ([0.0; 64], [0.0; 64]);
            each_half_value(&mut v, |_, j, e| f32::from_bits(acc[4 * j + e]));
            each_half_value(&mut rest, |_, j, e| f32::from_bits(acc[64 + 4 * j + e]));
            let mut h = 0u32;
            while h < opaque(2) {
                let offset = 128 * h;
                if !bias.is_null() {
                    let (col, _, n) = fresh(offset);
                    add_column_bias(&mut v, bias, n, col);
                }
                if !save_z.is_null() {
                    let (col, m, n) = fresh(offset);
                    store_half(save_z, &v, (m, n), row, col);
                }
                for o in 0..n_ops as usize {
                    let (col, _, n) = fresh(offset);
                    fragment_forward(&*ops.add(o), &mut v, n, col);
                }
                let (col, m, n) = fresh(offset);
                store_half(y, &v, (m, n), row, col);
                v = rest;
                h += 1;
            }
        }
        // The block's next tile's first run.
        item += opaque(grid_dim_x()) * runs - run;
    }
}

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
/// [`gemm_tma_tf32x3_nt`], 16-deep stages: `A` in `16 k x 32 m` boxes, `B` with the
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
    let pipe = unsafe { Pipeline::new::<SPLIT, false>(maps, (m, n, k)) };
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
    while item < pipe.tiles() * runs {
        let (tile, run) = (item / runs, item % runs);
        let (row0, col0) = pipe.origin(tile);
        let mut acc = [0u32; 128];
        let mut held = None;
        for _ in run_k_tiles::<SPLIT>(run, k_tiles) {
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
                    let db = descriptor(sa + a_bytes);
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

/// 3xTF32 adds three MMAs' products into the accumulators per `k`-step, and the tensor
/// cores add into FP32 with a truncation that shrinks the sums: on the H100, a TF32
/// GEMM of TF32-exact operands at `k` = 8192 came out 1.7e-5 small (relative; SGEMM:
/// 1e-9), a quarter of that when summed as four GEMMs of 2048 (H100, seventh session).
/// At `k` = 8192 that put 3xTF32's forward at 3e-5 of the f64 reference, and single
/// values 2-3x outside `allclose(1e-4, 1e-4)`, and M2's weight gradient (`k` = 32768)
/// at 2.3e-4. So the 3xTF32 forward, `dW` and `dX` add their accumulators into `y` (in
/// IEEE FP32) and restart them from zero every `FLUSH_K` of `k` (about 3% of the
/// forward's time, t71).
const FLUSH_K: u32 = 2048;
/// `FLUSH_K` in 3xTF32's k-tiles.
const FLUSH_TILES: u32 = FLUSH_K / SPLIT_BLOCK_K as u32;

/// The runs a tile's `k_tiles` are taken in: `FLUSH_TILES` each for 3xTF32 (`SPLIT`),
/// one otherwise.
#[inline(always)]
fn k_runs<const SPLIT: bool>(k_tiles: u32) -> u32 {
    if SPLIT { k_tiles.div_ceil(FLUSH_TILES) } else { 1 }
}

/// The k-tiles of run `run` (of [`k_runs`]).
#[inline(always)]
fn run_k_tiles<const SPLIT: bool>(run: u32, k_tiles: u32) -> core::ops::Range<u32> {
    if SPLIT { run * FLUSH_TILES..k_tiles.min((run + 1) * FLUSH_TILES) } else { 0..k_tiles }
}

/// What [`flush_quarter`] does with a quarter of the accumulators and their places in `y`.
#[derive(Clone, Copy, PartialEq)]
enum Flush {
    /// `y = acc`
    Store,
    /// `y += acc`
    Add,
    /// `acc += y`
    Take,
}

/// Where a thread's accumulators sit in `y`, as pairs of neighbouring places: pair
/// `(i, jj)` (`i < 2`, `jj < 32`) holds accumulators `4 jj + a` and `4 jj + b` at
/// `y[at]` and `y[at + 1]`. A flush uses the places the tile's own output takes, so
/// that no other tile reads or writes them meanwhile.
#[derive(Clone, Copy)]
enum Layout {
    /// The forward's and `tk`'s `y (m, n)`: `4 jj + 2 i` and `+ 1` at row `row + i
    /// step`, columns `col + 8 jj`, `+ 1` (`step`: 8 for the forward's fragments, 1 for
    /// `tk`'s neighbouring rows).
    Rows { row: usize, col: usize, step: usize },
    /// `tk_t`'s `y^T (n, m)`: `4 jj + i` and `4 jj + 2 + i` at row `col + 8 jj + i`,
    /// columns `row`, `row + 1`.
    Transposed { row: usize, col: usize },
}

impl Layout {
    /// Pair `(i, jj)`: its accumulators, the offset of its first place, and whether each
    /// place is inside `y (m, n)` (or `(n, m)`).
    #[inline(always)]
    fn pair(self, i: usize, jj: usize, (m, n): (usize, usize)) -> (usize, usize, usize, bool, bool) {
        match self {
            Layout::Rows { row, col, step } => {
                let (r, c) = (row + step * i, col + 8 * jj);
                (4 * jj + 2 * i, 4 * jj + 2 * i + 1, r * n + c, r < m && c < n, r < m && c + 1 < n)
            }
            Layout::Transposed { row, col } => {
                let c = col + 8 * jj + i;
                (4 * jj + i, 4 * jj + 2 + i, c * m + row, c < n && row < m, c < n && row + 1 < m)
            }
        }
    }

    /// Whether every place of quarter `q` is inside and each pair 8-byte aligned.
    #[inline(always)]
    fn quarter_inside(self, q: usize, (m, n): (usize, usize)) -> bool {
        let last = 8 * (8 * q + 7);
        match self {
            Layout::Rows { row, col, step } => n % 2 == 0 && row + step < m && col + last + 2 <= n,
            Layout::Transposed { row, col } => m % 2 == 0 && row + 1 < m && col + last + 1 < n,
        }
    }
}

/// [`Flush`] on accumulators `32 q..32 q + 32` (pairs `(i, 8 q..8 q + 8)` of the
/// layout), skipping places outside `y`. A quarter at a time: the loads of a whole half
/// beside the other accumulators spill.
///
/// Where all 16 places are inside, the loads come first, with no branch between them,
/// so they are in flight together: under a bounds check each, one went out after
/// another, each waiting out L2's latency, and a flush cost ~17 us per tile (M1's
/// forward 1.19 ms against 1.01 without flushes, 1.08 with one per tile).
///
/// # Safety
/// `y` holds `m * n` floats; nothing else reads or writes these places meanwhile.
#[inline(always)]
unsafe fn flush_quarter(acc: &mut [u32; 128], y: *mut f32, q: usize, how: Flush, layout: Layout, sizes: (usize, usize)) {
    if layout.quarter_inside(q, sizes) {
        let mut u = [F2([0.0; 2]); 16];
        // SAFETY (both loops): every place is inside, as just checked, and each pair
        // 8-byte aligned.
        if how != Flush::Store {
            unroll!(i in 0..2 => {
                unroll!(j in 0..8 => {
                    let (_, _, at, _, _) = layout.pair(i, 8 * q + j, sizes);
                    u[8 * i + j] = unsafe { *(y.add(at) as *const F2) };
                });
            });
        }
        unroll!(i in 0..2 => {
            unroll!(j in 0..8 => {
                let (ia, ib, at, _, _) = layout.pair(i, 8 * q + j, sizes);
                let (a, b) = (f32::from_bits(acc[ia]), f32::from_bits(acc[ib]));
                let F2([v, w]) = u[8 * i + j];
                let p = unsafe { y.add(at) } as *mut F2;
                match how {
                    Flush::Store => unsafe { *p = F2([a, b]) },
                    Flush::Add => unsafe { *p = F2([v + a, w + b]) },
                    Flush::Take => {
                        acc[ia] = (a + v).to_bits();
                        acc[ib] = (b + w).to_bits();
                    }
                }
            });
        });
        return;
    }
    unroll!(i in 0..2 => {
        unroll!(j in 0..8 => {
            let (ia, ib, at, a_in, b_in) = layout.pair(i, 8 * q + j, sizes);
            unroll!(e in 0..2 => {
                let (slot, inside) = if e == 0 { (ia, a_in) } else { (ib, b_in) };
                if inside {
                    // SAFETY: the place is inside `y`.
                    unsafe {
                        let p = y.add(at + e);
                        let x = f32::from_bits(acc[slot]);
                        match how {
                            Flush::Store => *p = x,
                            Flush::Add => *p += x,
                            Flush::Take => acc[slot] = (x + *p).to_bits(),
                        }
                    }
                }
            });
        });
    });
}

/// Adds the accumulators into their places in `y` (stores them, the first time) and
/// zeroes them.
///
/// # Safety
/// The warpgroup's MMAs are finished; `y` holds `m * n` floats.
#[inline(always)]
unsafe fn flush_accumulators(acc: &mut [u32; 128], y: *mut f32, first: bool, layout: Layout, (m, n): (u32, u32)) {
    // Each way its own code, so that nothing decides between a load and the next.
    // SAFETY: as the caller promises.
    unsafe {
        if first {
            flush_quarters(acc, y, Flush::Store, layout, (m, n));
        } else {
            flush_quarters(acc, y, Flush::Add, layout, (m, n));
        }
    }
    *acc = [0; 128];
}

/// [`flush_quarter`] on all four quarters (a function, not a closure: LLVM took a
/// closure out of line once three kernels used it, and ptxas then serialised the
/// `wgmma`s around the call, C7514).
///
/// # Safety
/// As [`flush_quarter`].
#[inline(always)]
unsafe fn flush_quarters(acc: &mut [u32; 128], y: *mut f32, how: Flush, layout: Layout, (m, n): (u32, u32)) {
    unroll!(q in 0..4 => {
        let sizes = (opaque(m) as usize, opaque(n) as usize);
        // SAFETY: as the caller promises.
        unsafe { flush_quarter(acc, y, q, how, layout, sizes) };
    });
}

/// Adds the flushed sums in `y` back into the accumulators before the epilogue.
///
/// # Safety
/// As [`flush_accumulators`], after at least one.
#[inline(always)]
unsafe fn add_flushed(acc: &mut [u32; 128], y: *mut f32, layout: Layout, sizes: (u32, u32)) {
    // SAFETY: as the caller promises.
    unsafe { flush_quarters(acc, y, Flush::Take, layout, sizes) };
}

/// Waits for all of the warpgroup's `wgmma`s (the accumulators are operands, so nothing
/// reads them before).
///
/// # Safety
/// Every thread of the warpgroup calls it.
#[inline(always)]
unsafe fn wgmma_wait_all(acc: &mut [u32; 128]) {
    unsafe { wgmma_asm!(128, acc; [concat!("wgmma.wait_group.sync.aligned 0; // ", accumulators!(128))];) }
}

/// One 16-deep stage of the 3xTF32 split: per `k`-step `acc += A_lo B + A B_lo + A B` (the
/// small terms first), from the descriptors `[A, B, A_lo, B_lo]` of the k-tile's first
/// step (step `i` adds `2 i`: 32 bytes along the swizzled rows). Returns with this
/// group still running, the previous one finished.
///
/// # Safety
/// As [`wgmma_n256_k_tile`]; the residual tiles are complete and fenced.
#[inline(always)]
unsafe fn wgmma_n256_k_tile_split(acc: &mut [u32; 128], d: [u64; 4]) {
    macro_rules! step {
        ($i:literal) => {
            concat!(
                "add.s64 xa, {a}, ", $i, "; add.s64 xb, {b}, ", $i, "; add.s64 xl, {al}, ", $i, "; add.s64 xm, {bl}, ", $i, ";",
                "wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32 ", accumulators!(128), ", xl, xb, p, 1, 1;",
                "wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32 ", accumulators!(128), ", xa, xm, p, 1, 1;",
                "wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32 ", accumulators!(128), ", xa, xb, p, 1, 1;"
            )
        };
    }
    unsafe {
        wgmma_asm!(128, acc; [
            "{{ .reg .pred p; .reg .b64 xa, xb, xl, xm; setp.ne.b32 p, {one}, 0;",
            "wgmma.fence.sync.aligned;",
            step!(0),
            step!(2),
            "wgmma.commit_group.sync.aligned;",
            "wgmma.wait_group.sync.aligned 1; }}",
        ];
            one = in(reg32) 1u32,
            a = in(reg64) d[0], b = in(reg64) d[1], al = in(reg64) d[2], bl = in(reg64) d[3],
        )
    }
}

/// One k-tile of a warpgroup with `A` from registers (`a[i]`: step `i`'s fragment),
/// `B` from shared memory: issued and committed, not waited for.
///
/// # Safety
/// A complete `B` tile; every thread of the warpgroup calls it; nothing writes `a`'s
/// registers until the group is waited for (the caller waits before its next loads).
#[inline(always)]
unsafe fn wgmma_n256_rs_k_tile(acc: &mut [u32; 128], a: [[u32; 4]; 4], db: [u64; 4]) {
    unsafe {
        wgmma_asm!(128, acc; [
            "{{ .reg .pred p; setp.ne.b32 p, {one}, 0;",
            "wgmma.fence.sync.aligned;",
            concat!("wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32 ", accumulators!(128), ", {{{a00}, {a01}, {a02}, {a03}}}, {b0}, p, 1, 1;"),
            concat!("wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32 ", accumulators!(128), ", {{{a10}, {a11}, {a12}, {a13}}}, {b1}, p, 1, 1;"),
            concat!("wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32 ", accumulators!(128), ", {{{a20}, {a21}, {a22}, {a23}}}, {b2}, p, 1, 1;"),
            concat!("wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32 ", accumulators!(128), ", {{{a30}, {a31}, {a32}, {a33}}}, {b3}, p, 1, 1;"),
            "wgmma.commit_group.sync.aligned; }}",
        ];
            one = in(reg32) 1u32,
            a00 = in(reg32) a[0][0], a01 = in(reg32) a[0][1], a02 = in(reg32) a[0][2], a03 = in(reg32) a[0][3],
            a10 = in(reg32) a[1][0], a11 = in(reg32) a[1][1], a12 = in(reg32) a[1][2], a13 = in(reg32) a[1][3],
            a20 = in(reg32) a[2][0], a21 = in(reg32) a[2][1], a22 = in(reg32) a[2][2], a23 = in(reg32) a[2][3],
            a30 = in(reg32) a[3][0], a31 = in(reg32) a[3][1], a32 = in(reg32) a[3][2], a33 = in(reg32) a[3][3],
            b0 = in(reg64) db[0], b1 = in(reg64) db[1], b2 = in(reg64) db[2], b3 = in(reg64) db[3],
        )
    }
}

/// One 16-deep stage of the 3xTF32 split with `A` from registers: per `k`-step `i`,
/// `acc += A_lo B + A B_lo + A B` (`a[i]`, `a_lo[i]`; descriptors `db[i]`, `dbl[i]`):
/// issued and committed, not waited for.
///
/// # Safety
/// As [`wgmma_n256_rs_k_tile`]; the residual tile is complete and fenced.
#[inline(always)]
unsafe fn wgmma_n256_rs_split_k_tile(acc: &mut [u32; 128], a: [[u32; 4]; 2], a_lo: [[u32; 4]; 2], db: [u64; 2], dbl: [u64; 2]) {
    macro_rules! mma {
        ($a:literal, $b:literal) => {
            concat!(
                "wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32 ", accumulators!(128),
                ", {{{", $a, "0}, {", $a, "1}, {", $a, "2}, {", $a, "3}}}, {", $b, "}, p, 1, 1;"
            )
        };
    }
    unsafe {
        wgmma_asm!(128, acc; [
            "{{ .reg .pred p; setp.ne.b32 p, {one}, 0;",
            "wgmma.fence.sync.aligned;",
            mma!("l0", "b0"), mma!("h0", "c0"), mma!("h0", "b0"),
            mma!("l1", "b1"), mma!("h1", "c1"), mma!("h1", "b1"),
            "wgmma.commit_group.sync.aligned; }}",
        ];
            one = in(reg32) 1u32,
            h00 = in(reg32) a[0][0], h01 = in(reg32) a[0][1], h02 = in(reg32) a[0][2], h03 = in(reg32) a[0][3],
            h10 = in(reg32) a[1][0], h11 = in(reg32) a[1][1], h12 = in(reg32) a[1][2], h13 = in(reg32) a[1][3],
            l00 = in(reg32) a_lo[0][0], l01 = in(reg32) a_lo[0][1], l02 = in(reg32) a_lo[0][2], l03 = in(reg32) a_lo[0][3],
            l10 = in(reg32) a_lo[1][0], l11 = in(reg32) a_lo[1][1], l12 = in(reg32) a_lo[1][2], l13 = in(reg32) a_lo[1][3],
            b0 = in(reg64) db[0], b1 = in(reg64) db[1], c0 = in(reg64) dbl[0], c1 = in(reg64) dbl[1],
        )
    }
}

/// Declares a function running one k-tile (four `k`-steps, 32 bytes of each 128-byte
/// row apiece) of a warpgroup, `acc += A B^T` with both operands in shared memory, each
/// step `$mma acc, a, b, p, 1, 1$tail;`: issued, committed, and returned from with this
/// group still running (the previous one finished).
macro_rules! wgmma_n256_k_tile_fn {
    ($(#[$doc:meta])* $name:ident, $mma:literal, $tail:literal) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// Descriptors of complete tiles written by the async proxy (TMA); every thread
        /// of the warpgroup calls it.
        #[inline(always)]
        unsafe fn $name(acc: &mut [u32; 128], da: [u64; 4], db: [u64; 4]) {
            unsafe {
                wgmma_asm!(128, acc; [
                    "{{ .reg .pred p; setp.ne.b32 p, {one}, 0;",
                    "wgmma.fence.sync.aligned;",
                    concat!($mma, " ", accumulators!(128), ", {a0}, {b0}, p, 1, 1", $tail, ";"),
                    concat!($mma, " ", accumulators!(128), ", {a1}, {b1}, p, 1, 1", $tail, ";"),
                    concat!($mma, " ", accumulators!(128), ", {a2}, {b2}, p, 1, 1", $tail, ";"),
                    concat!($mma, " ", accumulators!(128), ", {a3}, {b3}, p, 1, 1", $tail, ";"),
                    "wgmma.commit_group.sync.aligned;",
                    "wgmma.wait_group.sync.aligned 1; }}",
                ];
                    one = in(reg32) 1u32,
                    a0 = in(reg64) da[0], a1 = in(reg64) da[1], a2 = in(reg64) da[2], a3 = in(reg64) da[3],
                    b0 = in(reg64) db[0], b1 = in(reg64) db[1], b2 = in(reg64) db[2], b3 = in(reg64) db[3],
                )
            }
        }
    };
}

wgmma_n256_k_tile_fn!(
    /// A 32-deep TF32 k-tile: four `m64n256k8` steps.
    wgmma_n256_k_tile, "wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32", ""
);
wgmma_n256_k_tile_fn!(
    /// A 64-deep bf16 k-tile: four `m64n256k16` steps, both operands `k`-major (no
    /// transpose: the last two immediates).
    wgmma_n256_k_tile_bf16, "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16", ", 0, 0"
);

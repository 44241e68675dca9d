//! The warp-specialised pipeline the persistent kernels share: the producer's and the
//! consumers' registers, the stages with their "full" and "empty" barriers, and the
//! walk over the output's tiles.

use crate::prelude::async_copy::shared_address;
use crate::prelude::bulk_copy::*;
use crate::prelude::*;
use kernel_abi::gemm_tma::*;

/// Registers per thread of the producer and of the consumer warpgroups. The block's
/// registers are those it launched with (168 per thread, the launch bounds' cap):
/// `setmaxnreg.inc` waits until the producer's `dec` has freed enough, so the two must
/// fit in them, or the consumers wait forever (32 / 240 hung). The consumers' epilogue
/// is at the cap: at 232 it spilled 8 bytes (a tile's row and column bases).
pub(super) const PRODUCER_REGISTERS: u32 = 24;
pub(super) const CONSUMER_REGISTERS: u32 = 240;
const _: () = assert!(128 * PRODUCER_REGISTERS + CONSUMER_THREADS as u32 * CONSUMER_REGISTERS <= 168 * THREADS as u32);

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

/// `gridDim.x`, read where it is used (a `mov` LLVM may not hoist): the producer's loop
/// then holds no register for it, which at its 24 registers ptxas had spilled.
#[inline(always)]
fn grid_dim_x_in_place() -> u32 {
    let x: u32;
    // SAFETY: reads a read-only special register.
    unsafe { core::arch::asm!("mov.u32 {0}, %nctaid.x;", out(reg32) x, options(nostack, nomem, preserves_flags)) };
    x
}

/// The stages of a persistent TMA kernel, their "full" and "empty" barriers and the
/// walk over its work units, shared by the `nt` and `tk` bodies. A stage holds the `A`
/// and `B` tiles (`tile_bytes`, `A` first), then with 3xTF32 their residuals in the
/// same layout. A unit is a tile and one of `splits` ranges of `k` (split-K: each range
/// its own partial product), units of one range first. Without `SPLIT_K` a unit is a
/// tile (the producer's 24 registers then hold no split state: with it, the kernels that
/// never split spilled a few bytes).
#[derive(Clone, Copy)]
pub(super) struct Pipeline<const SPLIT_K: bool> {
    pub(super) base: u32,
    pub(super) stages: u32,
    pub(super) stage_bytes: u32,
    pub(super) tile_bytes: u32,
    pub(super) block_k: u32,
    pub(super) a_bytes: u32,
    pub(super) tiles_m: u32,
    pub(super) tiles_n: u32,
    pub(super) k_tiles: u32,
    pub(super) splits: u32,
    /// The k-tiles of a split's range (the last one's may be fewer, or none).
    pub(super) split_tiles: u32,
}

impl<const SPLIT_K: bool> Pipeline<SPLIT_K> {
    /// The layout for `SPLIT` (3xTF32: four 16-deep stages with the 64-byte swizzle,
    /// so that they fit beside their residuals) or operands of `operand_bytes` bytes,
    /// and a `(m, n, k)` GEMM whose `k` is split into `splits` ranges of whole k-tiles
    /// (the last may have fewer). Thread 0 sets
    /// up the barriers ("full": the producer's one arrival plus the stage's bytes;
    /// "empty": one arrival per consumer warp) and prefetches both tensor maps; then
    /// the block's only barrier.
    ///
    /// # Safety
    /// Every thread of the block calls it once, first; `maps` holds two tensor maps;
    /// the dynamic shared memory is `SMEM_BYTES` (`SPLIT_SMEM_BYTES` with `SPLIT`).
    #[inline(always)]
    pub(super) unsafe fn new<const SPLIT: bool>(
        maps: *const u8,
        (m, n, k): (u32, u32, u32),
        operand_bytes: u32,
        splits: u32,
    ) -> Pipeline<SPLIT_K> {
        // The hardware swizzle is a function of address bits 7-9: stages start
        // 1024-byte aligned.
        let base = (shared_address(dynamic_shared::<f32>()) + 1023) & !1023;
        let (stages, tile_bytes, block_k, a_bytes) = if SPLIT {
            (SPLIT_STAGES, SPLIT_STAGE_BYTES, SPLIT_BLOCK_K, SPLIT_A_BYTES)
        } else {
            // The same bytes whatever the operand: 128-byte rows of 32 floats, 64
            // 16-bit values or 128 e4m3 ones.
            (STAGES, STAGE_BYTES, 128 / operand_bytes as usize, A_BYTES)
        };
        let (stages, tile_bytes, block_k, a_bytes) = (stages as u32, tile_bytes as u32, block_k as u32, a_bytes as u32);
        let stage_bytes = if SPLIT { 2 * tile_bytes } else { tile_bytes };
        let (tiles_m, tiles_n) = (m.div_ceil(BLOCK_M as u32), n.div_ceil(BLOCK_N as u32));
        let (k_tiles, splits) = (k.div_ceil(block_k), if splits == 0 || !SPLIT_K { 1 } else { splits });
        let split_tiles = k_tiles.div_ceil(splits);
        let p = Pipeline { base, stages, stage_bytes, tile_bytes, block_k, a_bytes, tiles_m, tiles_n, k_tiles, splits, split_tiles };
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
    pub(super) fn stage(&self, s: u32) -> u32 {
        self.base + s * self.stage_bytes
    }

    #[inline(always)]
    pub(super) fn full(&self, s: u32) -> u32 {
        self.base + self.stages * self.stage_bytes + 8 * s
    }

    #[inline(always)]
    pub(super) fn empty(&self, s: u32) -> u32 {
        self.full(self.stages + s)
    }

    /// Shared-memory address of the bf16-output kernels' staged half tile
    /// (`STORE_STAGING_BYTES`, after the barriers, 1024-byte aligned).
    #[inline(always)]
    pub(super) fn staging(&self) -> u32 {
        self.base + self.stages * self.stage_bytes + 1024
    }

    /// The stage after `s` and its barriers' phase.
    #[inline(always)]
    pub(super) fn next(&self, s: u32, phase: u32) -> (u32, u32) {
        if s + 1 == self.stages { (0, phase ^ 1) } else { (s + 1, phase) }
    }

    pub(super) fn tiles(&self) -> u32 {
        self.tiles_m * self.tiles_n
    }

    /// Tiles times splits.
    pub(super) fn units(&self) -> u32 {
        if SPLIT_K { self.tiles() * self.splits } else { self.tiles() }
    }

    /// Unit `unit`'s tile origin `(row0, col0)`, its split and that split's k-tiles.
    #[inline(always)]
    pub(super) fn unit(&self, unit: u32) -> (u32, u32, u32, core::ops::Range<u32>) {
        if !SPLIT_K {
            let (row0, col0) = tile_origin(unit, self.tiles_m, self.tiles_n);
            return (row0, col0, 0, 0..self.k_tiles);
        }
        let (split, tile) = (unit / self.tiles(), unit % self.tiles());
        let (row0, col0) = tile_origin(tile, self.tiles_m, self.tiles_n);
        let k0 = split * self.split_tiles;
        let k1 = if k0 + self.split_tiles < self.k_tiles { k0 + self.split_tiles } else { self.k_tiles };
        (row0, col0, split, k0..k1)
    }

    /// The producer (one thread): walks the same units as the consumers and fills each
    /// stage once the consumers have released it, `copy(stage, row0, col0, k0, full)`
    /// issuing its TMA copies (`tile_bytes` in all).
    ///
    /// # Safety
    /// One thread calls it, after [`Pipeline::new`]; `copy`'s boxes land inside the stage.
    #[inline(always)]
    pub(super) unsafe fn produce(&self, copy: impl Fn(u32, u32, u32, u32, u32)) {
        let (mut s, mut phase) = (0u32, 0u32);
        let mut unit = block_idx_x();
        while unit < self.units() {
            let (row0, col0, _, k_tiles) = self.unit(unit);
            for kt in k_tiles {
                // SAFETY: initialised barriers.
                unsafe {
                    mbarrier_wait(self.empty(s), phase ^ 1);
                    mbarrier_arrive_expect_tx(self.full(s), self.tile_bytes);
                }
                copy(self.stage(s), row0, col0, kt * self.block_k, self.full(s));
                (s, phase) = self.next(s, phase);
            }
            unit += grid_dim_x_in_place();
        }
    }
}


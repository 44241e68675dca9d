//! Constants shared by the device kernels (`kernels-gpu`) and their host launchers.
//!
//! A tile size lives here once; the kernel indexes with it and the host sizes grids
//! and shared memory with it, so the two cannot drift apart. So does each kernel's
//! identity ([`Kernel`]): its entry point's name and its launch bounds.
#![no_std]

pub mod ops;

/// Words one `store_words` launch writes (a TMA tensor-map pair is 32): its argument
/// array's length, 256 bytes of the 4 KiB a launch's arguments may take.
pub const STORE_WORDS: usize = 32;

/// Vectors one `convert_vectors` launch takes (three argument words each).
pub const VECTORS: usize = 8;
/// `convert_vectors`' modes (the high word of a vector's third word): FP32 copied,
/// bf16 or fp16 widened to FP32 (exact), FP32 rounded to bf16 or fp16 (to nearest even).
pub const CONVERT_F32: u32 = 0;
pub const CONVERT_BF16_TO_F32: u32 = 1;
pub const CONVERT_F32_TO_BF16: u32 = 2;
pub const CONVERT_F16_TO_F32: u32 = 3;
pub const CONVERT_F32_TO_F16: u32 = 4;

pub mod kernels;
pub use kernels::{Kernel, LaunchBounds};

/// Per-feature parameter vectors (a Linear bias, a chain op's `gamma`, `beta` or
/// per-channel operand) as the kernels take them: one 64-bit word, the vector's device
/// address with how its values are stored in the top byte. A 16-bit model's
/// parameters are read as they are stored (widened to FP32 on load, exactly), so no
/// call has to widen them into FP32 copies first (a launch, an allocation and a graph
/// node per call). CUDA's device addresses leave the top byte clear; the host refuses
/// one that does not.
pub mod vector {
    /// How a parameter vector's values are stored.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    #[repr(u8)]
    pub enum Stored {
        F32 = 0,
        Bf16 = 1,
        F16 = 2,
    }

    /// Where the [`Stored`] tag sits in a vector's word.
    pub const STORED_SHIFT: u32 = 56;
    /// The address bits of a vector's word.
    pub const ADDRESS_MASK: u64 = (1 << STORED_SHIFT) - 1;

    /// The word of the vector at `address` stored as `stored` (0 for a null address: no
    /// vector), or `None` where the address uses the tag's bits.
    pub const fn word(address: u64, stored: Stored) -> Option<u64> {
        if address & !ADDRESS_MASK != 0 {
            None
        } else if address == 0 {
            Some(0)
        } else {
            Some(address | (stored as u64) << STORED_SHIFT)
        }
    }

    /// How the vector of `word` is stored (an unknown tag reads as FP32: the host
    /// never writes one).
    pub const fn stored(word: u64) -> Stored {
        match word >> STORED_SHIFT {
            1 => Stored::Bf16,
            2 => Stored::F16,
            _ => Stored::F32,
        }
    }

    /// The device address of the vector of `word`.
    pub const fn address(word: u64) -> u64 {
        word & ADDRESS_MASK
    }

    /// Bytes per value of a vector stored as `stored`.
    pub const fn value_bytes(stored: Stored) -> usize {
        match stored {
            Stored::F32 => 4,
            Stored::Bf16 | Stored::F16 => 2,
        }
    }
}

/// `a == b` for strings, in a `const fn`.
pub const fn same_str(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// The `wgmma` family (sm_90a): two warpgroups per block, operands read by the tensor
/// cores from 128-byte-swizzled shared memory.
pub mod gemm_wgmma {
    pub const BLOCK_M: usize = 128;
    pub const BLOCK_N: usize = 128;
    pub const BLOCK_K: usize = 32;
    pub const THREADS: usize = 256;
    /// Pipeline stages of the TF32 kernel (2 blocks per SM) and of the 3xTF32 one.
    pub const TF32_STAGES: usize = 3;
    pub const SPLIT_STAGES: usize = 4;
    const TILE_BYTES: usize = BLOCK_M * BLOCK_K * 4;
    /// Dynamic shared memory: `stages` stages of the `A` and `B` tiles (and, with the
    /// 3xTF32 split, `B`'s residual), 1024 bytes of slack to align them for the
    /// hardware swizzle; the staged output tile reuses it.
    pub const fn smem_bytes(split: bool) -> usize {
        let pipeline = if split { SPLIT_STAGES * 3 } else { TF32_STAGES * 2 } * TILE_BYTES + 1024;
        let output = BLOCK_M * (BLOCK_N + 4) * 4;
        if pipeline > output { pipeline } else { output }
    }
    const _: () = assert!(BLOCK_M == super::gemm_fma::BLOCK_M && BLOCK_N == super::gemm_fma::BLOCK_N);
}

/// The small-batch forward (`kernels-gpu/src/gemm/gemv.rs`): at most [`ROWS`](gemv::ROWS)
/// rows, each block a slab of [`SLAB`](gemv::SLAB) columns over the whole depth, `W`
/// streamed once across every SM.
pub mod gemv {
    /// Most rows the kernel takes: its FP32 FMAs (`2 m n k`) stay under the time `W`'s
    /// bytes take to arrive.
    pub const ROWS: usize = 8;
    /// Columns a warp sums at once (one accumulator per row and column).
    pub const COLS_PER_WARP: usize = 4;
    /// Threads per block: eight warps, as the row-wise epilogue's ops expect.
    pub const THREADS: usize = 256;
    /// Columns per block.
    pub const SLAB: usize = COLS_PER_WARP * THREADS / 32;
    /// Depth of `x` staged in shared memory at a time: 8 values per lane.
    pub const K_BLOCK: usize = 256;
    /// Dynamic shared memory: staged `x`, the slab's `z`, two floats per warp of scratch.
    pub const SMEM_BYTES: usize = 4 * (ROWS * K_BLOCK + ROWS * SLAB + 2 * (THREADS / 32));
}

/// A Linear layer folded to one output column (`kernels-gpu/src/dot.rs`): row dots,
/// column dots and outer products, one pass each over their matrix.
pub mod dot {
    /// Threads per block: eight warps.
    pub const THREADS: usize = 256;
    /// The row and column dots' launch bounds: 64 registers a thread, so that ptxas
    /// keeps every load of an unrolled step in flight (left to itself it held 47 and
    /// issued two at a time).
    pub const BLOCKS_PER_SM: usize = 4;
    /// Columns one `column_dot` block sums for elements of `element_bytes`: a 16-byte
    /// chunk per lane.
    pub const fn column_dot_cols(element_bytes: usize) -> usize {
        32 * 16 / element_bytes
    }
    /// `column_dot`'s dynamic shared memory: each warp's sums of the block's columns
    /// (16-bit elements' 256).
    pub const COLUMN_DOT_SMEM_BYTES: usize = 4 * (THREADS / 32) * column_dot_cols(2);
    /// `row_dot`'s: one sum per warp.
    pub const ROW_DOT_SMEM_BYTES: usize = 4 * (THREADS / 32);
    /// Rows whose loads a `column_dot` warp has in flight at once.
    pub const COLUMN_DOT_ROWS_IN_FLIGHT: usize = 8;
    /// Rows a `column_dot` block reads in one step of its warps: the host gives each block
    /// a multiple of them (the rows past the last whole step go one at a time, a memory
    /// latency each).
    pub const COLUMN_DOT_STEP_ROWS: usize = (THREADS / 32) * COLUMN_DOT_ROWS_IN_FLIGHT;
    /// The most outer products one `outer*` launch sums (a weight gradient of up to this
    /// many rows: each thread keeps a quad of every one of them in registers).
    pub const OUTER_MAX_RANK: usize = 8;
    /// The most output rows one `outer*` block writes (its share of `u` sits in shared
    /// memory, and each thread's quads of `v` serve all of them).
    pub const OUTER_MAX_BLOCK_ROWS: usize = 32;
    /// `outer*`'s dynamic shared memory: `u`'s values for the block's rows.
    pub const OUTER_SMEM_BYTES: usize = 4 * OUTER_MAX_RANK * OUTER_MAX_BLOCK_ROWS;
    /// Output columns one `outer*` block covers: a quad per thread.
    pub const OUTER_BLOCK_COLS: usize = 4 * THREADS;
    /// Columns one `column_dots*` block sums: a quad per lane (its eight weight vectors'
    /// sums of four columns are 32 registers).
    pub const COLUMN_DOTS_BLOCK_COLS: usize = 4 * 32;
    /// The most rows of one `column_dots*` block's range (their weights staged in shared
    /// memory, `OUTER_MAX_RANK` each).
    pub const COLUMN_DOTS_MAX_RANGE_ROWS: usize = 1024;
    /// `column_dots*`'s dynamic shared memory: the range's weights, then (reused) the
    /// warps' sums, `(THREADS / 32) x OUTER_MAX_RANK x COLUMN_DOTS_BLOCK_COLS` floats.
    pub const COLUMN_DOTS_SMEM_BYTES: usize = {
        let weights = 4 * OUTER_MAX_RANK * COLUMN_DOTS_MAX_RANGE_ROWS;
        let sums = 4 * (THREADS / 32) * OUTER_MAX_RANK * COLUMN_DOTS_BLOCK_COLS;
        if weights > sums { weights } else { sums }
    };
    /// `column_dots*`'s launch bounds: two blocks per SM (128 registers: 32 sums and
    /// eight rows' loads in flight per lane).
    pub const COLUMN_DOTS_BLOCKS_PER_SM: usize = 2;
}

/// The tensor-core small-batch forward (`kernels-gpu/src/gemm/gemv_tc.rs`): at most
/// [`ROWS`](gemv_tc::ROWS) rows on `mma.sync` (bf16, TF32, 3xTF32), each block a slab
/// of [`SLAB`](gemv_tc::SLAB) columns over the whole depth, its warps splitting `k`.
pub mod gemv_tc {
    /// Most rows: eight `n8` fragments of the MMA's `B` operand (`x^T`).
    pub const ROWS: usize = 64;
    /// Threads per block: eight warps, as the epilogue's row ops expect.
    pub const THREADS: usize = 256;
    pub const WARPS: usize = THREADS / 32;
    /// Columns per block: as `gemv`'s, so one rule says which chains run on the slabs.
    pub const SLAB: usize = super::gemv::SLAB;
    /// Bytes each lane copies per row and unit of `k`: one 16-byte `cp.async`.
    pub const CHUNK: usize = 16;
    /// `W` rows a lane copies per unit (rows `g + 8 j` of the slab).
    pub const W_SLOTS: usize = SLAB / 8;
    /// Units of `k` each warp has in flight in its own `cp.async` ring.
    pub const STAGES: usize = 4;
    /// Row pitch (floats) of the warps' partial sums: 36 keeps the fragment stores
    /// conflict-free.
    pub const RED_PITCH: usize = SLAB + 4;
    /// Dynamic shared memory for `rows` rows: each warp's ring of `STAGES` units (`W`'s
    /// slots and one slot per `n8` fragment of `x`, `32 * CHUNK` bytes each), later
    /// reused for the warps' partial sums and the slab's `z`.
    pub const fn smem_bytes(rows: usize) -> usize {
        let frags = rows.div_ceil(8);
        let ring = WARPS * STAGES * (W_SLOTS + frags) * 32 * CHUNK;
        let sums = (WARPS * frags * 8 * RED_PITCH + frags * 8 * SLAB) * 4;
        if ring > sums { ring } else { sums }
    }
    const _: () = assert!(smem_bytes(ROWS) <= 227 * 1024 && W_SLOTS == 4);

    /// `dX = dZ W` of at most `DX_ROWS` rows on the same tensor cores (`dx_tc_*`): rows
    /// of `W` (the sum's index) each warp takes per unit, a slab's 64 bytes of each.
    pub const DX_UNIT_ROWS: usize = 32;
    /// Most rows of `dZ`: one `n8` fragment.
    pub const DX_ROWS: usize = 8;
    /// Bytes of one unit in a warp's ring: `W`'s `DX_UNIT_ROWS x SLAB` 16-bit values,
    /// then a 16-byte chunk of `dZ` per lane.
    pub const DX_STAGE_BYTES: usize = DX_UNIT_ROWS * SLAB * 2 + 32 * CHUNK;
    /// `dx_tc_*`'s dynamic shared memory: each warp's ring, later its partial sums.
    pub const DX_SMEM_BYTES: usize = WARPS * STAGES * DX_STAGE_BYTES;
    const _: () = assert!(DX_SMEM_BYTES >= WARPS * DX_ROWS * RED_PITCH * 4 && 2 * DX_SMEM_BYTES <= 227 * 1024);
}

/// The persistent, warp-specialised `wgmma` forward: `128 x 256` output tiles, operands
/// copied by TMA into 128-byte-swizzled stages whose completion `mbarrier`s announce.
pub mod gemm_tma {
    pub const BLOCK_M: usize = 128;
    pub const BLOCK_N: usize = 256;
    /// One 128-byte swizzle row of floats.
    pub const BLOCK_K: usize = 32;
    /// A producer warpgroup and two consumer warpgroups (64 rows of the tile each).
    pub const THREADS: usize = 384;
    pub const CONSUMER_THREADS: usize = 256;
    pub const STAGES: usize = 4;
    /// The 3xTF32 kernel's stages are half as deep (one 64-byte swizzle row of floats)
    /// and also hold the residuals of their `A` and `B` tiles (written by the
    /// consumers): four of them, as in TF32 (two 32-deep stages, measured first, left
    /// the tensor cores waiting: M1 1.35 ms against 1.01).
    pub const SPLIT_BLOCK_K: usize = 16;
    pub const SPLIT_STAGES: usize = 4;
    pub const SPLIT_A_BYTES: usize = BLOCK_M * SPLIT_BLOCK_K * 4;
    /// One stage's `A` and `B` tiles (the residuals follow in the same layout).
    pub const SPLIT_STAGE_BYTES: usize = (BLOCK_M + BLOCK_N) * SPLIT_BLOCK_K * 4;
    /// Tiles are visited in panels of this many row tiles, column by column, so the
    /// blocks running at once share their `B` (weight) tiles in L2 and re-read few `A` rows.
    pub const PANEL_M: usize = 8;
    /// The shortest `k` the host sends here: the epilogue runs between a tile's k-loops
    /// with the tensor cores idle (one block per SM), so the shorter `k`, the larger its
    /// share; `gemm_wgmma` hides it behind a second block per SM. Measured at 1024 (M2:
    /// 1.14 ms here against 1.63 on `gemm_wgmma`) and 8192; below 1024 is unmeasured and
    /// stays on `gemm_wgmma`.
    pub const MIN_K: usize = 1024;
    /// The bf16 forward's k-tile: 64 values, the same 128-byte rows (and stage bytes).
    pub const BF16_BLOCK_K: usize = 64;
    /// The least `k` of one split-K range: below it a unit's pipeline ramp and its FP32
    /// partial product cost more than its MMAs.
    pub const MIN_SPLIT_K: usize = 256;
    const _: () = assert!(MIN_SPLIT_K.is_multiple_of(BF16_BLOCK_K));
    /// The GEMMs that split `k` (a work unit per tile and range of `k`): the 16-bit
    /// forwards' split twins and the 16-bit `dX` into FP32 (none of which runs a chain),
    /// and the 3xTF32 forward. The others walk whole tiles only, so their producer's 24
    /// registers hold no split state: with it beside the tile parameters it prefetches,
    /// `gemm_tma_bf16_nt` spilled 12 bytes, hence its `_split` twin.
    pub const SPLIT_K_KERNELS: [crate::Kernel; 5] = [
        crate::Kernel::GemmTmaBf16NtSplit,
        crate::Kernel::GemmTmaF16NtSplit,
        crate::Kernel::GemmTmaTf32x3Nt,
        crate::Kernel::GemmTmaBf16Nn,
        crate::Kernel::GemmTmaF16Nn,
    ];

    /// Whether the entry point `name` is one of [`SPLIT_K_KERNELS`] (a `const fn`: the
    /// kernels' entry points are instantiated from it).
    pub const fn splits_k(name: &str) -> bool {
        let mut i = 0;
        while i < SPLIT_K_KERNELS.len() {
            if crate::same_str(SPLIT_K_KERNELS[i].name(), name) {
                return true;
            }
            i += 1;
        }
        false
    }
    pub const A_BYTES: usize = BLOCK_M * BLOCK_K * 4;
    const _: () = assert!(BF16_BLOCK_K * 2 == BLOCK_K * 4);
    pub const B_BYTES: usize = BLOCK_N * BLOCK_K * 4;
    pub const STAGE_BYTES: usize = A_BYTES + B_BYTES;
    /// Dynamic shared memory: 1024 bytes of slack (the swizzle wants 1024-byte aligned
    /// tiles), the stages, a "full" and an "empty" barrier per stage. (The epilogue
    /// works in registers.)
    pub const SMEM_BYTES: usize = 1024 + STAGES * STAGE_BYTES + 2 * STAGES * 8;
    /// The same for the 3xTF32 kernel: stages of `A`, `B` and their residuals.
    pub const SPLIT_SMEM_BYTES: usize = 1024 + SPLIT_STAGES * 2 * SPLIT_STAGE_BYTES + 2 * SPLIT_STAGES * 8;
    /// The bf16-output kernels (`*_to_bf16`) stage half a tile (`128 x 128` bf16 values)
    /// for a TMA store, so the store drains while the next tile's MMAs run.
    pub const STORE_STAGING_BYTES: usize = BLOCK_M * 128 * 2;
    /// Their dynamic shared memory: the stages and barriers as [`SMEM_BYTES`], then,
    /// 1024-byte aligned (the swizzle), the staged half tile.
    pub const BF16_OUT_SMEM_BYTES: usize = 1024 + STAGES * STAGE_BYTES + 1024 + STORE_STAGING_BYTES;
    const _: () = assert!(2 * STAGES * 8 <= 1024);
    const _: () = assert!(
        SMEM_BYTES <= 227 * 1024
            && SPLIT_SMEM_BYTES <= 227 * 1024
            && BF16_OUT_SMEM_BYTES <= 227 * 1024
            && CONSUMER_THREADS == 2 * 128
    );
}

/// The tensor-core GEMM family: `mma.sync` TF32 fed by a `cp.async` pipeline.
pub mod gemm_mma {
    /// Rows and columns of `y` per block (as the FMA family, so the host's tiling,
    /// split-K and row-wise epilogue logic is shared).
    pub const BLOCK_M: usize = 128;
    pub const BLOCK_N: usize = 128;
    /// Depth of one pipeline stage: 32 floats, one 128-byte row of a `k`-contiguous tile.
    pub const BLOCK_K: usize = 32;
    pub const THREADS: usize = 256;
    /// Stages of the `cp.async` pipeline in flight.
    pub const STAGES: usize = 3;
    /// One stage: the `A` and `B` tiles, `BLOCK_M x BLOCK_K` floats each, unpadded (the
    /// layouts are XOR-swizzled instead).
    pub const STAGE_BYTES: usize = 2 * BLOCK_M * BLOCK_K * 4;
    const PIPELINE_BYTES: usize = STAGES * STAGE_BYTES;
    /// The output tile staged for the epilogue, rows padded to `BLOCK_N + 4` floats.
    const OUTPUT_BYTES: usize = BLOCK_M * (BLOCK_N + 4) * 4;
    /// Dynamic shared memory: the pipeline, later reused for the staged output tile.
    pub const SMEM_BYTES: usize = if PIPELINE_BYTES > OUTPUT_BYTES { PIPELINE_BYTES } else { OUTPUT_BYTES };
    const _: () = assert!(BLOCK_M == BLOCK_N && BLOCK_M == super::gemm_fma::BLOCK_M && THREADS == 256);
}

/// The epilogue chain as the kernels see it: one [`OpDesc`](epilogue::OpDesc) per op, in a device array.
/// The column kernels of a BatchNorm (`batch_norm.rs`): a block takes 128 columns of
/// a run of rows, each lane 4 consecutive columns (one 16-byte load of FP32 values), its
/// 8 warps row pairs `2 w, 2 w + 1`, then `+ 16`.
pub mod batch_norm {
    /// Threads of a block.
    pub const THREADS: usize = 256;
    /// Warps of a block.
    pub const WARPS: usize = THREADS / 32;
    /// Columns of a block: 32 lanes of 4.
    pub const COLUMNS: usize = 128;
    /// Blocks per SM the statistics kernel is sized for (its launch bounds cap the
    /// registers at 80: its FP64 sums spilled at 64); the host sizes one wave of each
    /// kernel.
    pub const STATS_BLOCKS_PER_SM: u32 = 3;
    /// The same for `apply` (64 registers).
    pub const APPLY_BLOCKS_PER_SM: u32 = 4;
    /// The same for `backward_sums` (128 registers. At 3, 80 registers, it used all 80
    /// until its parameters were read as stored (`vector`), then spilled 44-128 bytes;
    /// at 64 it spilled 160.)
    pub const SUMS_BLOCKS_PER_SM: u32 = 2;
    /// The same for `backward_dz` (at most 128 registers; it uses 115: at 80 it
    /// spilled 292 bytes).
    pub const DZ_BLOCKS_PER_SM: u32 = 2;
    /// Ops of the chain before the BatchNorm, and after it, that the kernels take each
    /// (their descriptors sit in shared memory).
    pub const MAX_OPS: usize = 8;
    /// Gradient sums a block keeps per lane (16 bytes each, per warp).
    pub const MAX_SLOTS: usize = 10;
    /// Shared memory of the statistics: the op table before the BatchNorm, then a count,
    /// 4 means and 4 sums of squared deviations per thread (FP64).
    pub const STATS_SMEM_BYTES: usize = MAX_OPS * core::mem::size_of::<super::epilogue::OpDesc>() + THREADS * 9 * 8;
    /// Shared memory of a kernel with gradient sums: both op tables, then `slots` sums
    /// of 16 bytes per lane of each warp.
    pub const fn sums_smem_bytes(slots: usize) -> usize {
        2 * MAX_OPS * core::mem::size_of::<super::epilogue::OpDesc>() + WARPS * slots * 32 * 16
    }
}

/// FP8 (e4m3) operands: the quantisation kernels (`kernels-gpu/src/fp8.rs`).
pub mod fp8 {
    /// Threads of a row-wise quantisation block (one block per row).
    pub const ROW_THREADS: usize = 256;
    /// Shared memory of a row-wise block: a word per warp.
    pub const ROW_SMEM_BYTES: usize = ROW_THREADS / 8;
    /// Rows of a column-amax block's panel.
    pub const COLUMN_BLOCK_ROWS: usize = 64;
    /// Columns of a column-amax block: four per thread, four row lanes of 64 threads.
    pub const COLUMN_AMAX_COLS: usize = 256;
    /// Shared memory of a column-amax block: a word per column and row lane.
    pub const COLUMN_AMAX_SMEM_BYTES: usize = 4 * COLUMN_AMAX_COLS * 4;
    /// The transposing kernels' tiles (the quantisation by columns, the weight's
    /// transpose): `TILE x TILE` values.
    pub const TILE: usize = 64;
    /// Bytes between its transposed tile's rows in shared memory (4 more than a row:
    /// fewer bank conflicts on the byte writes).
    pub const TILE_PITCH: usize = TILE + 4;
    pub const TILE_SMEM_BYTES: usize = TILE * TILE_PITCH;
    /// The e4m3 GEMM's k-tile: 128 one-byte values, the same 128-byte rows as the
    /// TF32 and bf16 stages.
    pub const E4M3_BLOCK_K: usize = 128;
    const _: () = assert!(E4M3_BLOCK_K == super::gemm_tma::BF16_BLOCK_K * 2 && TILE.is_multiple_of(16));
}

pub mod epilogue {
    pub use crate::ops::{
        OP_AVG_POOL, OP_GROUP_NORM, OP_LOGSUMEXP, OP_MAX_POOL, OP_RESIDUAL, OP_RMS_NORM, OP_ROW_MAX, OP_ROW_MEAN,
        OP_ROW_MIN, OP_ROW_SUM, OP_SOFTMAX, Pointwise, code, reduces_row,
    };

    /// One op of an epilogue chain. Fields unused by an op are zero.
    ///
    /// | code            | `count`  | `a`   | `b`  | `param0` | `param1` |
    /// |-----------------|----------|-------|------|----------|----------|
    /// | per-element     |          | 1st argument | 2nd | its parameter, if any |  |
    /// | `OP_GROUP_NORM` | groups   | eps   |      | gamma    | beta     |
    /// | `OP_AVG_POOL`   | k        |       |      |          |          |
    /// | `OP_MAX_POOL`   | k        |       |      |          |          |
    /// | `OP_RMS_NORM`   |          | eps   |      | weight   |          |
    /// | reductions, `OP_SOFTMAX`, `OP_RESIDUAL` | | |  |          |          |
    ///
    /// (A per-element op's arguments and parameter: [`Pointwise::info`].)
    /// `param0`/`param1` are parameter vectors' words ([`crate::vector`]: a device
    /// address, and whether its values are FP32, bf16 or fp16) with one entry per
    /// feature at that point of the chain.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq)]
    pub struct OpDesc {
        pub code: u32,
        pub count: u32,
        pub a: f32,
        pub b: f32,
        pub param0: u64,
        pub param1: u64,
    }

    /// Features after `op`, given `f` before it (the host validated the chain): what
    /// the row-wise kernels and the kink scan's host side walk the chain by.
    #[inline(always)]
    pub fn features_after(op: &OpDesc, f: usize) -> usize {
        match op.code {
            OP_AVG_POOL | OP_MAX_POOL => f / (op.count as usize).max(1),
            code if reduces_row(code) => 1,
            _ => f,
        }
    }

    /// Threads per block of the row-wise epilogue kernel (one block per row).
    pub const ROW_THREADS: usize = 256;

    /// Threads per block of the row-wise kernels' `_narrow` entries, for rows of at
    /// most [`NARROW_ROW_FEATURES`]: about 16 columns a thread at 1024 features, where
    /// 256 threads held a row for a few latency-bound passes of 4 columns each (three
    /// blocks per SM by registers); small blocks put more rows in flight.
    pub const NARROW_ROW_THREADS: usize = 64;

    /// The widest rows the `_narrow` entries take.
    pub const NARROW_ROW_FEATURES: usize = 2048;

    /// Dynamic shared memory of the row-wise epilogue for rows of `features` floats:
    /// scratch for two values per warp (row max and arg-max reductions), the row, and
    /// a second buffer that pooling writes into.
    pub const fn row_smem_bytes(features: usize) -> usize {
        row_smem_bytes_unpooled(features) + features * 4
    }

    /// [`row_smem_bytes`] without the pooling buffer, for a forward chain with no
    /// pooling op: half the bytes, twice the blocks per SM on wide rows.
    pub const fn row_smem_bytes_unpooled(features: usize) -> usize {
        (features + 2 * (ROW_THREADS / 32)) * 4
    }

    /// Threads per block of the tile-wise backward (`epilogue_tiles_backward`).
    pub const TILE_THREADS: usize = 256;

    /// Blocks per SM the tile-wise backward is sized for (its launch bounds): 3, so 80
    /// registers per thread; 24 warps per SM hide its latencies (shuffle chains,
    /// `exp`) better than 16 at 110 registers.
    pub const TILES_BACKWARD_BLOCKS_PER_SM: u32 = 3;

    /// Rows of 128 floats each warp of the tile-wise backward streams `z` and `dy`
    /// through: two ring slots of a row pair of each.
    pub const TILES_BACKWARD_RING_ROWS: usize = 8;

    /// Shared memory of one op in the tile-wise backward's table: its descriptor and,
    /// for a GroupNorm, its group's lane count and `1 / g` (worked out once per block).
    pub const TILE_OP_BYTES: usize = core::mem::size_of::<OpDesc>() + 8;

    /// Dynamic shared memory of the tile-wise backward for a chain of `n_ops` ops with
    /// `slots` gradient slots: the op table (descriptors, then GroupNorm constants), each
    /// warp's gradient sums (`slots` rows of 128 floats), then per warp its saved op
    /// inputs (two rows for each op but the last) and its `z`/`dy` ring.
    pub const fn tiles_backward_smem_bytes(slots: usize, n_ops: usize) -> usize {
        super::gemm_fma::MAX_TILE_OPS * TILE_OP_BYTES
            + (TILE_THREADS / 32) * (slots + 2 * n_ops.saturating_sub(1) + TILES_BACKWARD_RING_ROWS) * 128 * 4
    }

    /// Blocks per SM the row-wise backward is sized for (its launch bounds, 128
    /// registers: at 3, 85 registers, it spills).
    pub const ROW_BACKWARD_BLOCKS_PER_SM: u32 = 2;

    /// [`ROW_BACKWARD_BLOCKS_PER_SM`] for the `_narrow` entries: the same registers.
    pub const NARROW_ROW_BACKWARD_BLOCKS_PER_SM: u32 =
        ROW_BACKWARD_BLOCKS_PER_SM * (ROW_THREADS / NARROW_ROW_THREADS) as u32;

    /// Dynamic shared memory of the row-wise backward: the forward's scratch, the
    /// gradient, the recomputed op input, where the chain `pools` a buffer for the ops
    /// that change the row's length (the row reductions work in place), and `sum_slots`
    /// rows of parameter-gradient sums when they are kept on chip (else 0).
    pub const fn row_backward_smem_bytes(features: usize, sum_slots: usize, pools: bool) -> usize {
        ((2 + pools as usize + sum_slots) * features + 2 * (ROW_THREADS / 32)) * 4
    }

    /// Columns of one row partial: a TMA GEMM tile's half (a consumer thread's half
    /// fragment, [`row_partials`]).
    pub const ROW_PARTIAL_COLUMNS: usize = 128;

    /// Row partials of a chain that reduces each row once: the TMA GEMM's epilogue runs
    /// the ops before the reduction and reduces each half tile's 128 columns of a row to
    /// two floats (sum: the sum, 0; max, min: the extreme, 0; logsumexp: the max and the
    /// sum of `exp(v - max)`, or of `exp(v)` where that max is infinite), stored as
    /// `(row_partials(n), m, 2)` floats; `row_partials_finish` adds them up in order and
    /// runs the ops after the reduction. So `z` is never written where nothing needs it.
    pub const fn row_partials(n: usize) -> usize {
        n.div_ceil(ROW_PARTIAL_COLUMNS)
    }

    /// Shared memory a block may opt into on sm_90 (H100, H200): 227 KiB.
    pub const SM90_MAX_SHARED_OPTIN: usize = 227 * 1024;
    /// Shared memory of one sm_90 multiprocessor (228 KiB), of which the driver keeps
    /// 1 KiB per resident block.
    pub const SM90_SHARED_PER_SM: usize = 228 * 1024;
    pub const SM90_SHARED_RESERVED_PER_BLOCK: usize = 1024;

    /// Widest row the row-wise kernels take on sm_90: the forward keeps two copies of it
    /// in shared memory, the backward three.
    pub const fn max_row_features(backward: bool) -> usize {
        let copies = if backward { 3 } else { 2 };
        (SM90_MAX_SHARED_OPTIN / 4 - 2 * (ROW_THREADS / 32)) / copies
    }
}

/// Near-kink refinement of the saved `z` (`kernels-gpu/src/epilogue/kinks.rs`).
pub mod kinks {
    use super::epilogue::ROW_THREADS;
    /// Columns of `z` refined together: the unit `kink_scan` lists and one block of
    /// `refine_z` computes (its weights read once per batch of listed rows).
    pub const CHUNK: usize = 16;
    pub const REFINE_THREADS: usize = 256;
    /// Rows of `x` one block of `refine_z` takes at a time: four 8-row tiles of the
    /// f64 MMA (`m16n8k16`, the chunk's weights the 16-row side) per warp. A chunk of
    /// M3 or M5 lists ~20 rows under TF32, rarely over 32, and a second batch reads the
    /// chunk's weights again (24 rows: refine_z 8% slower on M3).
    pub const REFINE_ROWS: usize = 32;
    /// Slices of `k` each warp of `refine_z` keeps in flight (`cp.async` ring slots):
    /// one slice ahead in registers left each step waiting on memory.
    pub const REFINE_STAGES: usize = 4;
    /// 16-byte copies per lane and ring slot: its row of each of the 4 tiles of `x`
    /// and its 2 weight rows.
    pub const REFINE_LOADS: usize = REFINE_ROWS / 8 + 2;
    /// Each warp's ring. After a batch's loop it holds the warp's partial sums.
    pub const REFINE_SMEM_BYTES: usize = REFINE_THREADS / 32 * REFINE_STAGES * REFINE_LOADS * 32 * 16;
    const _: () = assert!(REFINE_STAGES * REFINE_LOADS * 32 * 16 >= REFINE_ROWS * CHUNK * 8);
    /// `refine_order`'s buckets of listed-row counts (larger counts share the last).
    pub const ORDER_BUCKETS: usize = 256;
    /// `kink_scan`'s shared memory for rows of `n`: values and radii (each with a
    /// second buffer when the scanned ops pool), a scratch value per warp, the
    /// whole-row flag and a byte per chunk.
    pub const fn scan_smem_bytes(n: usize, pooled: bool) -> usize {
        ((if pooled { 4 } else { 2 }) * n + ROW_THREADS / 32 + 1) * 4 + n.div_ceil(CHUNK)
    }
    const _: () = assert!(CHUNK == 16 && REFINE_ROWS == 32);

    /// Values of one row that `kink_scan_tiles` lists for `refine_values`: one weight
    /// row and `x`'s row are read per value, where `refine_z` reads a 16-row chunk of
    /// weights and `x`'s row per listed chunk. M5 under TF32 has ~9 values per row,
    /// plus a group of 32 now and then (18 of its 1024 rows; in `refine_z` those took a
    /// 37 us tail, a block per chunk streaming 512 KB); M3's ~10 groups of 16 per row,
    /// and bf16's ~80 values, read less in `refine_z`.
    pub const ELEMENT_CAP: usize = 64;
    const _: () = assert!(ELEMENT_CAP <= ROW_THREADS, "a thread per value copies the row's list");
    /// `refine_values`' grid, per SM, and its launch bounds: its blocks of `ROW_THREADS`
    /// stride over the list. At this occupancy ptxas may spend 64 registers and keeps a
    /// lane's 8 16-byte loads in flight together (at the 42 it chose unbounded, one).
    pub const REFINE_VALUES_BLOCKS_PER_SM: usize = 4;

    /// `kink_scan_tiles`'s shared memory, as byte offsets `[first, red, count, list,
    /// marks, end]`, for rows of `n`, listing up to `cap` values: where the row's
    /// values start in the global list, the block reduction's scratch, the count and
    /// list of the row's values, and a word per 128-column segment with the chunks its
    /// decisions depend on (bits 0-7 whole groups, 8-15 single values).
    pub const fn tiles_scan_layout(n: usize, cap: usize) -> [usize; 6] {
        let red = 4;
        let count = red + ROW_THREADS / 32 * 4;
        let list = count + 4;
        let marks = list + 4 * cap;
        [0, red, count, list, marks, marks + 4 * n.div_ceil(8 * CHUNK)]
    }
}

/// The register-blocked FP32 GEMM with the fused epilogue (`kernels-gpu/src/gemm/fma.rs`).
pub mod gemm_fma {
    /// Rows of `y` per block.
    pub const BLOCK_M: usize = 128;
    /// Columns of `y` per block.
    pub const BLOCK_N: usize = 128;
    /// Depth of one shared-memory stage.
    pub const BLOCK_K: usize = 16;
    pub const THREADS: usize = 256;
    /// Two resident blocks per SM: caps registers at 128 per thread.
    pub const MIN_BLOCKS_PER_SM: u32 = 2;

    /// Row of a staged operand tile: 4 floats of padding (see `Fma` in fma.rs).
    pub const SMEM_STRIDE: usize = BLOCK_M + 4;
    /// Two stages (double buffering) of the x and w tiles.
    const PIPELINE_BYTES: usize = 2 * 2 * BLOCK_K * SMEM_STRIDE * 4;
    /// The output tile staged for the epilogue, rows padded to `BLOCK_N + 4` floats.
    const STAGE_BYTES: usize = BLOCK_M * (BLOCK_N + 4) * 4;
    /// Dynamic shared memory: the pipeline, later reused for the staged output tile.
    pub const SMEM_BYTES: usize = if PIPELINE_BYTES > STAGE_BYTES { PIPELINE_BYTES } else { STAGE_BYTES };
    /// In the epilogue a lane holds 4 consecutive columns of a 128-column row, so a
    /// GroupNorm group of `g` channels (a power of two, 4..=128) is `g / 4` lanes.
    /// Gradient slots the tile-wise backward keeps in registers: the Linear bias and
    /// up to 7 op parameters (a chain with more takes the row-wise backward).
    pub const MAX_GRAD_SLOTS: usize = 8;
    /// Ops of a chain the tile-wise backward takes (their descriptors sit in shared memory).
    pub const MAX_TILE_OPS: usize = 16;
    /// Group sizes the fused GroupNorm handles (power of two in this range).
    pub const MIN_FUSED_GROUP: usize = 4;
    pub const MAX_FUSED_GROUP: usize = BLOCK_N;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_k_names_exactly_the_listed_kernels() {
        for k in Kernel::ALL {
            assert_eq!(gemm_tma::splits_k(k.name()), gemm_tma::SPLIT_K_KERNELS.contains(k), "{k:?}");
        }
        assert!(gemm_tma::splits_k("gemm_tma_bf16_nt_split"));
        assert!(!gemm_tma::splits_k("gemm_tma_bf16_nt"));
        assert!(!gemm_tma::splits_k("gemm_tma_bf16_nt_to_bf16"));
        assert!(!gemm_tma::splits_k("gemm_tma_bf16_n"));
        assert!(same_str("", "") && !same_str("a", "") && !same_str("ab", "ac"));
    }

    /// The row-wise backward's third buffer is there only where the chain pools; the
    /// narrow entries' launch bounds leave each thread the registers of the wide ones'.
    #[test]
    fn row_backward_sizes() {
        use epilogue::*;
        let n = 1000;
        assert_eq!(row_backward_smem_bytes(n, 0, true) - row_backward_smem_bytes(n, 0, false), 4 * n);
        assert_eq!(row_backward_smem_bytes(n, 2, false) - row_backward_smem_bytes(n, 0, false), 8 * n);
        assert_eq!(
            NARROW_ROW_BACKWARD_BLOCKS_PER_SM as usize * NARROW_ROW_THREADS,
            ROW_BACKWARD_BLOCKS_PER_SM as usize * ROW_THREADS
        );
        assert!(NARROW_ROW_THREADS.is_multiple_of(32) && NARROW_ROW_THREADS < ROW_THREADS);
    }
}

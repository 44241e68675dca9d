//! The GEMM family: `y = x W^T + b` with `W` stored `(out, in)` row-major, as PyTorch does.

/// Declares GEMM entry points that share one signature (`a, b, bias, y, save_z, m, n,
/// k, lda, ldb, k_split, ops, n_ops`; see `simt::gemm_f32` for its contract), each an
/// instance of the generic body `$body` with the given generic arguments.
macro_rules! gemm_entries {
    ($body:ident; $($(#[$doc:meta])* $name:ident = <$($arg:tt),*>;)*) => {$(
        $(#[$doc])*
        ///
        /// # Safety
        #[doc = concat!("See [`", stringify!($body), "`].")]
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "ptx-kernel" fn $name(
            a: *const f32, b: *const f32, bias: *const f32, y: *mut f32, save_z: *mut f32,
            m: u32, n: u32, k: u32, lda: u32, ldb: u32, k_split: u32, ops: *const OpDesc, n_ops: u32,
        ) {
            unsafe { $body::<$($arg),*>(a, b, bias, y, save_z, m, n, k, lda, ldb, k_split, ops, n_ops) }
        }
    )*};
}

/// Runs a warpgroup-wide `wgmma` asm block with the 64 or 128 accumulators of `$acc`
/// (`m64n128` / `m64n256`, f32) as its first operands, positional `{0}`, `{1}`, ..
/// (the templates list them with `accumulators!`; the other operands are named). One
/// statement, so nothing touches the accumulators while the MMAs are in flight.
macro_rules! wgmma_asm {
    (64, $acc:ident; [$($tmpl:expr),* $(,)?]; $($ops:tt)*) => {
        wgmma_asm!(@ $acc; [$($tmpl),*]; [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32 33 34 35 36 37 38 39 40 41 42 43 44 45 46 47 48 49 50 51 52 53 54 55 56 57 58 59 60 61 62 63]; $($ops)*)
    };
    (128, $acc:ident; [$($tmpl:expr),* $(,)?]; $($ops:tt)*) => {
        wgmma_asm!(@ $acc; [$($tmpl),*]; [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32 33 34 35 36 37 38 39 40 41 42 43 44 45 46 47 48 49 50 51 52 53 54 55 56 57 58 59 60 61 62 63 64 65 66 67 68 69 70 71 72 73 74 75 76 77 78 79 80 81 82 83 84 85 86 87 88 89 90 91 92 93 94 95 96 97 98 99 100 101 102 103 104 105 106 107 108 109 110 111 112 113 114 115 116 117 118 119 120 121 122 123 124 125 126 127]; $($ops)*)
    };
    (@ $acc:ident; [$($tmpl:expr),*]; [$($i:literal)*]; $($ops:tt)*) => {
        core::arch::asm!($($tmpl),*, $(inout(reg32) $acc[$i],)* $($ops)* options(nostack))
    };
}

/// The `{{0}, .., {N-1}}` accumulator list of a `wgmma` template (`N` = 64 or 128).
macro_rules! accumulators {
    (64) => {
        "{{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}, {16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}, {24}, {25}, {26}, {27}, {28}, {29}, {30}, {31}, {32}, {33}, {34}, {35}, {36}, {37}, {38}, {39}, {40}, {41}, {42}, {43}, {44}, {45}, {46}, {47}, {48}, {49}, {50}, {51}, {52}, {53}, {54}, {55}, {56}, {57}, {58}, {59}, {60}, {61}, {62}, {63}}}"
    };
    (128) => {
        "{{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}, {16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}, {24}, {25}, {26}, {27}, {28}, {29}, {30}, {31}, {32}, {33}, {34}, {35}, {36}, {37}, {38}, {39}, {40}, {41}, {42}, {43}, {44}, {45}, {46}, {47}, {48}, {49}, {50}, {51}, {52}, {53}, {54}, {55}, {56}, {57}, {58}, {59}, {60}, {61}, {62}, {63}, {64}, {65}, {66}, {67}, {68}, {69}, {70}, {71}, {72}, {73}, {74}, {75}, {76}, {77}, {78}, {79}, {80}, {81}, {82}, {83}, {84}, {85}, {86}, {87}, {88}, {89}, {90}, {91}, {92}, {93}, {94}, {95}, {96}, {97}, {98}, {99}, {100}, {101}, {102}, {103}, {104}, {105}, {106}, {107}, {108}, {109}, {110}, {111}, {112}, {113}, {114}, {115}, {116}, {117}, {118}, {119}, {120}, {121}, {122}, {123}, {124}, {125}, {126}, {127}}}"
    };
}

/// Where a block of the tensor-core GEMMs works: its `128 x 128` tile of `y` at
/// `(row0, col0)` (grid `x` walks columns, `y` rows) and its split-K slice
/// `k_begin..k_end` (`gridDim.z` slices of `k_split`), `tiles` k-tiles of `block_k`.
pub(crate) struct BlockTile {
    pub row0: u32,
    pub col0: u32,
    pub k_begin: u32,
    pub k_end: u32,
    pub tiles: u32,
}

impl BlockTile {
    #[inline(always)]
    pub fn new(k: u32, k_split: u32, block_k: u32) -> BlockTile {
        use crate::prelude::{block_idx_x, block_idx_y, block_idx_z};
        use kernel_abi::gemm_tc::{BLOCK_M, BLOCK_N};
        let k_begin = block_idx_z() * k_split;
        let k_end = if k - k_begin > k_split { k_begin + k_split } else { k };
        BlockTile {
            row0: block_idx_y() * BLOCK_M as u32,
            col0: block_idx_x() * BLOCK_N as u32,
            k_begin,
            k_end,
            tiles: (k_end - k_begin).div_ceil(block_k),
        }
    }
}

pub mod simt;
pub mod staged;
pub mod tensor_core;
pub mod tma;
pub mod wgmma;

//! The GEMM family: `y = x W^T + b` with `W` stored `(out, in)` row-major, as PyTorch does.

/// Declares GEMM entry points that share one signature (`a, b, bias, y, save_z, m, n,
/// k, lda, ldb, k_split, ops, n_ops`; see `fma::gemm_fma` for its contract), each an
/// instance of the generic body `$body` with the given generic arguments.
macro_rules! gemm_entries {
    ($body:ident; $($(#[$doc:meta])* $name:ident = <$($arg:tt),*>;)*) => {$(
        $(#[$doc])*
        ///
        /// # Safety
        #[doc = concat!("See `", stringify!($body), "` in this module.")]
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "ptx-kernel" fn $name(
            a: *const f32, b: *const f32, bias: Vector, y: *mut f32, save_z: *mut f32,
            m: u32, n: u32, k: u32, lda: u32, ldb: u32, k_split: u32, ops: *const OpDesc, n_ops: u32,
        ) {
            unsafe { $body::<$($arg),*>(a, b, bias, y, save_z, m, n, k, lda, ldb, k_split, ops, n_ops) }
        }
    )*};
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
        use kernel_abi::gemm_mma::{BLOCK_M, BLOCK_N};
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

pub mod dx_tc;
pub mod fma;
pub mod gemv;
pub mod gemv_tc;
pub mod staged;
pub mod mma;
pub mod tma;
pub mod wgmma;

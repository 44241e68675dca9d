//! Constants shared by the device kernels (`kernels-gpu`) and their host launchers.
//!
//! A tile size lives here once; the kernel indexes with it and the host sizes grids
//! and shared memory with it, so the two cannot drift apart.
#![no_std]

/// The shared-memory tiled GEMM with bias (`y = x W^T + b`).
pub mod gemm_tiled {
    /// Rows of `y` (batch) per block.
    pub const BLOCK_M: usize = 64;
    /// Columns of `y` (output features) per block.
    pub const BLOCK_N: usize = 64;
    /// Depth of the reduction step held in shared memory.
    pub const BLOCK_K: usize = 16;
    /// Each thread owns `THREAD_M x THREAD_N` outputs.
    pub const THREAD_M: usize = 4;
    pub const THREAD_N: usize = 4;
    pub const THREADS: usize = (BLOCK_M / THREAD_M) * (BLOCK_N / THREAD_N);
    /// Padding of each shared-memory row, in floats, to spread the transposed stores over banks.
    pub const SMEM_PAD: usize = 4;
    /// Dynamic shared memory the kernel needs, in bytes.
    pub const SMEM_BYTES: usize = BLOCK_K * ((BLOCK_M + SMEM_PAD) + (BLOCK_N + SMEM_PAD)) * 4;
}

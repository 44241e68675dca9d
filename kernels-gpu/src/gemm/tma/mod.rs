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
//! while the other multiplies — was measured slower: docs/VERSIONS.md, "Kernel design history".)
//! A bf16 `y` is the exception to "no staging": its 4-byte pairs filled half a sector
//! per row, so each warpgroup stages half tiles for a TMA store that drains during the
//! next tile's MMAs (32 KB beside the stages).
//!
//! The modules: `pipeline` (the producer/consumer register split, the stages and
//! their barriers, the tile walk), [`forward`] (`gemm_tma_*_nt`), [`transposed`]
//! (`gemm_tma_*_tk`, `gemm_tma_*_tk_t`), `flush` (3xTF32's runs of `k` and the
//! accumulators added into `y` between them). The MMAs are `crate::prelude::wgmma`'s.

mod flush;
pub mod forward;
mod pipeline;
pub mod transposed;

/// `x`, hidden from the optimiser: nothing computed from it moves above this point (and
/// a loop bounded by it is not unrolled).
#[inline(always)]
fn opaque(mut x: u32) -> u32 {
    // SAFETY: a register move.
    unsafe { core::arch::asm!("mov.u32 {0}, {0};", inout(reg32) x, options(nostack, nomem)) };
    x
}


//! Epilogues: the chain of ops applied to a GEMM's output.
//!
//! `pointwise` holds each elementwise op's forward (and, beside it, its derivative);
//! `lanes` runs a chain on a warp holding whole rows of a 128-column tile (the GEMM's
//! fused epilogue, and the tile-wise backward); `rows` runs any chain on whole rows
//! of a finished GEMM output, forward and backward; `fragments` runs a fusable chain on
//! `wgmma` accumulators in registers (the TMA GEMM's epilogue), or its part up to a row
//! reduction, whose partial sums `partials` finishes; `kinks` refines the
//! saved `z` where the backward would read a kink.

pub mod fragments;
pub mod kinks;
pub mod lanes;
pub mod partials;
pub mod pointwise;
pub mod rows;

use crate::prelude::math::fabs;

/// logsumexp's shift for values whose maximum is `m`: `m`, or 0 where it is infinite, so
/// that a row of `-inf` gives `-inf` and one holding `inf` gives `inf` (as PyTorch's)
/// rather than `inf - inf`. Every kernel that reduces by logsumexp shifts by it.
#[inline(always)]
pub fn logsumexp_shift(m: f32) -> f32 {
    if fabs(m) == f32::INFINITY { 0.0 } else { m }
}

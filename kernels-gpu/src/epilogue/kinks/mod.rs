//! Refining the saved GEMM output `z` where the chain backward would read a kink.
//!
//! LeakyReLU, Hardtanh and the row max have derivatives that jump. Where the forward's
//! rounded `z` (TF32, bf16, even FP32 at large `k`) puts an op's input within its
//! rounding error of a kink, the backward may take the other side's derivative: with
//! TF32 about 1e-4 of the elements do, 1e-2 of the gradients' norm (docs/PERFORMANCE.md).
//! `kink_scan` finds those places, row by row, by carrying an error radius with each
//! value through the chain up to its last kinked op, and lists the 16-column chunks of
//! `z` that each doubtful decision depends on (its GroupNorm group, pooling window or
//! whole row). `refine_z` recomputes those chunks of `z` as dot products accumulated
//! in f64 (the products of two f32 are exact there), so the backward decides every
//! kink as the exact function does. Where a row's decisions depend on a few values
//! only (M5's Hardtanh before its GroupNorm), `kink_scan_tiles` lists those values and
//! `refine_values` recomputes them one by one instead: a weight row each, not a chunk.
//!
//! `radius` holds the rules both scans carry a value's error radius by; `scan` is the
//! row-wise scan (any chain), `scan_tiles` the tile-wise one (the chains the tile-wise
//! backward takes); `refine` recomputes what they listed.

mod radius;
mod refine;
mod scan;
mod scan_tiles;

use super::pointwise::{PointwiseMath, match_pointwise, param_count};
use crate::prelude::math::{exp, fabs, fma, ln, max_nan, rsqrt, sqrt};
use crate::prelude::async_copy::{
    cp_async_4, cp_async_16_hint, cp_async_commit, cp_async_wait, cp_async_wait_all, l2_policy, shared_address,
};
use crate::prelude::global::load_v4_nc;
use crate::prelude::mma::ld_shared_v4;
use crate::prelude::mma::mma_f64_m16n8k16;
use crate::prelude::warp::{segment_sum, shfl_xor, warp_max, warp_sum, warp_sum_f64};
use crate::prelude::*;
use crate::unroll;
use kernel_abi::epilogue::*;
use kernel_abi::kinks::*;
use kernel_abi::ops::ErrorRule;

pub(super) const WARPS: usize = ROW_THREADS / WARP_SIZE as usize;
pub(super) const WARP: usize = WARP_SIZE as usize;
/// A dependency that spans the whole row (`dep` below).
pub(super) const WHOLE_ROW: usize = 0;
/// `v` reduced over the block, in every thread: `in_warp` over each warp, then the
/// warps' results folded by `fold` from `init` (`red` holds `WARPS` floats; ends with
/// a barrier).
///
/// # Safety
/// Called by the whole block.
#[inline(always)]
pub(super) unsafe fn block_reduce(v: f32, red: *mut f32, in_warp: fn(f32) -> f32, init: f32, fold: fn(f32, f32) -> f32) -> f32 {
    let (warp, lane) = (warp_id() as usize, lane_id() as usize);
    let s = in_warp(v);
    unsafe {
        if lane == 0 {
            *red.add(warp) = s;
        }
        sync_threads();
        let mut total = init;
        for w in 0..WARPS {
            total = fold(total, *red.add(w));
        }
        sync_threads();
        total
    }
}

/// Sum of `v` over the block, in every thread (see [`block_reduce`]).
///
/// # Safety
/// Called by the whole block.
#[inline(always)]
pub(super) unsafe fn block_sum(v: f32, red: *mut f32) -> f32 {
    unsafe { block_reduce(v, red, warp_sum, 0.0, |a, b| a + b) }
}

/// Maximum of `v` over the block, NaN propagating, in every thread (see [`block_reduce`]).
///
/// # Safety
/// Called by the whole block.
#[inline(always)]
pub(super) unsafe fn block_max(v: f32, red: *mut f32) -> f32 {
    unsafe { block_reduce(v, red, warp_max, f32::NEG_INFINITY, max_nan) }
}

/// `*p += v` on shared memory, returning the old value (`atom.shared.add.u32`).
///
/// # Safety
/// `p` is a shared-memory address of a `u32`.
#[inline(always)]
pub(super) unsafe fn atomic_add_shared(p: *mut u32, v: u32) -> u32 {
    let old: u32;
    unsafe {
        core::arch::asm!("{{ .reg .b64 s; cvta.to.shared.u64 s, {p}; atom.shared.add.u32 {o}, [s], {v}; }}",
             p = in(reg64) p as u64, v = in(reg32) v, o = out(reg32) old, options(nostack));
    }
    old
}

/// `*p += v` on global memory, returning the old value (`atom.global.add.u32`).
///
/// # Safety
/// `p` is a global-memory address of a `u32`.
#[inline(always)]
pub(super) unsafe fn atomic_add_global(p: *mut u32, v: u32) -> u32 {
    let old: u32;
    unsafe {
        core::arch::asm!("{{ .reg .b64 g; cvta.to.global.u64 g, {p}; atom.global.add.u32 {o}, [g], {v}; }}",
             p = in(reg64) p as u64, v = in(reg32) v, o = out(reg32) old, options(nostack));
    }
    old
}

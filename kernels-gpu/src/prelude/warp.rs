//! Warp shuffles (`shfl.sync`) and the reductions built on them.
//!
//! All take the full-warp member mask: every lane of the warp must call them together.

use core::arch::asm;

const FULL_MASK: u32 = 0xffff_ffff;

/// Value of `v` held by lane `lane_id ^ lane_mask` (butterfly exchange).
#[inline(always)]
pub fn shfl_xor(v: f32, lane_mask: u32) -> f32 {
    let out: u32;
    // SAFETY: register-only instruction; all 32 lanes participate (full mask).
    unsafe {
        asm!(
            "shfl.sync.bfly.b32 {out}, {v}, {m}, 0x1f, {full};",
            out = out(reg32) out,
            v = in(reg32) v.to_bits(),
            m = in(reg32) lane_mask,
            full = in(reg32) FULL_MASK,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    f32::from_bits(out)
}

/// Value of `v` held by lane `src_lane` (within the segment of `width` lanes, a power of two).
#[inline(always)]
pub fn shfl_idx(v: f32, src_lane: u32, width: u32) -> f32 {
    let out: u32;
    // c operand of shfl: ((32 - width) << 8) | 0x1f keeps the exchange within each segment.
    let clamp = ((32 - width) << 8) | 0x1f;
    // SAFETY: register-only instruction; all 32 lanes participate (full mask).
    unsafe {
        asm!(
            "shfl.sync.idx.b32 {out}, {v}, {src}, {c}, {full};",
            out = out(reg32) out,
            v = in(reg32) v.to_bits(),
            src = in(reg32) src_lane,
            c = in(reg32) clamp,
            full = in(reg32) FULL_MASK,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    f32::from_bits(out)
}

/// Sum of `v` over aligned segments of `width` lanes (1, 2, 4, 8, 16 or 32);
/// every lane of a segment gets its segment's sum.
#[inline(always)]
pub fn segment_sum(mut v: f32, width: u32) -> f32 {
    let mut m = 1;
    while m < width {
        v += shfl_xor(v, m);
        m <<= 1;
    }
    v
}

/// Sum of `v` over the whole warp, returned to every lane.
#[inline(always)]
pub fn warp_sum(v: f32) -> f32 {
    segment_sum(v, 32)
}

/// Maximum of `v` over the whole warp, returned to every lane. NaN propagates.
#[inline(always)]
pub fn warp_max(mut v: f32) -> f32 {
    let mut m = 1;
    while m < 32 {
        v = super::math::max_nan(v, shfl_xor(v, m));
        m <<= 1;
    }
    v
}

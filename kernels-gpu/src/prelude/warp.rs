//! Warp shuffles (`shfl.sync`) and the reductions built on them.
//!
//! All take the full-warp member mask: every lane of the warp must call them together.
//! They call the LLVM NVVM intrinsics rather than inline PTX on purpose: the
//! intrinsics are `convergent`, so LLVM never moves a shuffle into a branch that only
//! some lanes take. (Inline asm marked `pure` was sunk into an `if lane == 0` block
//! once — the other 31 lanes never arrived and the kernel hung.)

const FULL_MASK: i32 = -1; // 0xffff_ffff

unsafe extern "C" {
    #[link_name = "llvm.nvvm.shfl.sync.bfly.i32"]
    fn shfl_sync_bfly_i32(mask: i32, value: i32, lane_mask: i32, clamp: i32) -> i32;
    #[link_name = "llvm.nvvm.shfl.sync.idx.i32"]
    fn shfl_sync_idx_i32(mask: i32, value: i32, src_lane: i32, clamp: i32) -> i32;
}

/// Value of `v` held by lane `lane_id ^ lane_mask` (butterfly exchange).
#[inline(always)]
pub fn shfl_xor(v: f32, lane_mask: u32) -> f32 {
    // SAFETY: register-only exchange; all 32 lanes participate (full mask).
    let out = unsafe { shfl_sync_bfly_i32(FULL_MASK, v.to_bits() as i32, lane_mask as i32, 0x1f) };
    f32::from_bits(out as u32)
}

/// Value of `v` held by lane `src_lane` (within the segment of `width` lanes, a power of two).
#[inline(always)]
pub fn shfl_idx(v: f32, src_lane: u32, width: u32) -> f32 {
    // c operand of shfl: ((32 - width) << 8) | 0x1f keeps the exchange within each segment.
    let clamp = (((32 - width) << 8) | 0x1f) as i32;
    // SAFETY: register-only exchange; all 32 lanes participate (full mask).
    let out = unsafe { shfl_sync_idx_i32(FULL_MASK, v.to_bits() as i32, src_lane as i32, clamp) };
    f32::from_bits(out as u32)
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

/// Sum of an f64 `v` over the whole warp, returned to every lane (each butterfly step
/// exchanges the two 32-bit halves).
#[inline(always)]
pub fn warp_sum_f64(mut v: f64) -> f64 {
    let mut m = 1;
    while m < 32 {
        let bits = v.to_bits();
        let lo = shfl_xor(f32::from_bits(bits as u32), m).to_bits();
        let hi = shfl_xor(f32::from_bits((bits >> 32) as u32), m).to_bits();
        v += f64::from_bits(lo as u64 | (hi as u64) << 32);
        m <<= 1;
    }
    v
}

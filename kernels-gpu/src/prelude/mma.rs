//! Tensor-core building blocks: shared-memory fragment loads (`ldmatrix`,
//! `ld.shared.v4`), the TF32 `mma.sync` (sm_80+) and the split of an operand for
//! 3xTF32, as inline PTX. (The copies that feed them are in `async_copy`.)
//!
//! Shared memory is addressed here by 32-bit `.shared` offsets (`shared_address`),
//! which is what these instructions take and what keeps a tile's address arithmetic to
//! one register. None of the collective ones (`ldmatrix`, `mma`) is marked `pure`: LLVM
//! must not move them into code that only some lanes of a warp run.

use core::arch::asm;

/// `ldmatrix .x4`: lanes `8q..8q+7` give the row addresses of 8 x 16-byte matrix `q`;
/// every lane gets, from each matrix, the 32-bit word at row `lane / 4`, word `lane % 4`
/// — an `m16n8k8` TF32 fragment's layout, read in 4 conflict-free phases.
///
/// # Safety
/// `addr` is a 16-byte aligned shared address; every lane of the warp calls it.
#[inline(always)]
pub unsafe fn ldmatrix_x4(addr: u32) -> [u32; 4] {
    let (mut r0, mut r1, mut r2, mut r3): (u32, u32, u32, u32);
    unsafe {
        asm!("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{{r0}, {r1}, {r2}, {r3}}}, [{a}];",
             r0 = out(reg32) r0, r1 = out(reg32) r1, r2 = out(reg32) r2, r3 = out(reg32) r3,
             a = in(reg32) addr, options(nostack, readonly, preserves_flags));
    }
    [r0, r1, r2, r3]
}

/// `ldmatrix .x4 .trans`: as [`ldmatrix_x4`], each matrix transposed on the way: every
/// lane gets the 16-bit values at rows `2 (lane % 4)` and `2 (lane % 4) + 1` of column
/// `lane / 4` (low half first) — an `m16n8k16` operand's fragment from a tile stored
/// with the fragment's `k` across rows.
///
/// # Safety
/// As [`ldmatrix_x4`].
#[inline(always)]
pub unsafe fn ldmatrix_x4_trans(addr: u32) -> [u32; 4] {
    let (mut r0, mut r1, mut r2, mut r3): (u32, u32, u32, u32);
    unsafe {
        asm!("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{{r0}, {r1}, {r2}, {r3}}}, [{a}];",
             r0 = out(reg32) r0, r1 = out(reg32) r1, r2 = out(reg32) r2, r3 = out(reg32) r3,
             a = in(reg32) addr, options(nostack, readonly, preserves_flags));
    }
    [r0, r1, r2, r3]
}

/// Four consecutive 32-bit words of shared memory.
///
/// # Safety
/// `addr` is a 16-byte aligned shared address inside the block's allocation.
#[inline(always)]
pub unsafe fn ld_shared_v4(addr: u32) -> [u32; 4] {
    let (mut r0, mut r1, mut r2, mut r3): (u32, u32, u32, u32);
    unsafe {
        asm!("ld.shared.v4.b32 {{{r0}, {r1}, {r2}, {r3}}}, [{a}];",
             r0 = out(reg32) r0, r1 = out(reg32) r1, r2 = out(reg32) r2, r3 = out(reg32) r3,
             a = in(reg32) addr, options(pure, readonly, nostack, preserves_flags));
    }
    [r0, r1, r2, r3]
}

const TF32_MASK: u32 = 0xffff_e000;

/// Two consecutive 32-bit words of shared memory.
///
/// # Safety
/// `addr` is an 8-byte aligned shared address inside the block's allocation.
#[inline(always)]
pub unsafe fn ld_shared_v2(addr: u32) -> [u32; 2] {
    let (mut r0, mut r1): (u32, u32);
    unsafe {
        asm!("ld.shared.v2.b32 {{{r0}, {r1}}}, [{a}];",
             r0 = out(reg32) r0, r1 = out(reg32) r1, a = in(reg32) addr, options(pure, readonly, nostack, preserves_flags));
    }
    [r0, r1]
}

/// Stores four 32-bit words to shared memory.
///
/// # Safety
/// `addr` is a 16-byte aligned shared address inside the block's allocation.
#[inline(always)]
pub unsafe fn st_shared_v4(addr: u32, v: [u32; 4]) {
    unsafe {
        asm!("st.shared.v4.b32 [{a}], {{{r0}, {r1}, {r2}, {r3}}};",
             a = in(reg32) addr, r0 = in(reg32) v[0], r1 = in(reg32) v[1], r2 = in(reg32) v[2], r3 = in(reg32) v[3],
             options(nostack, preserves_flags));
    }
}

/// Stores one 32-bit word to shared memory.
///
/// # Safety
/// `addr` is a 4-byte aligned shared address inside the block's allocation.
#[inline(always)]
pub unsafe fn st_shared_b32(addr: u32, v: u32) {
    unsafe { asm!("st.shared.b32 [{a}], {v};", a = in(reg32) addr, v = in(reg32) v, options(nostack, preserves_flags)) }
}

/// Makes this thread's earlier shared-memory writes (plain stores and completed
/// `cp.async`) visible to the async proxy, which `wgmma` reads operands through. A
/// barrier must still follow before other threads' `wgmma`s use them.
#[inline(always)]
pub fn fence_proxy_async_shared() {
    // SAFETY: a memory fence.
    unsafe { asm!("fence.proxy.async.shared::cta;", options(nostack, preserves_flags)) };
}

/// The residual of the "3xTF32" split of `x`: `x = hi + lo` with `hi` the TF32 part
/// the tensor core reads from `x`'s own bits (it ignores the low 13 — so `x` itself is
/// passed as the high part, and costs no register), and `lo = x - hi` exact in FP32, of
/// which the tensor core uses the leading 11 bits: about 2^-21 of `x` is lost.
/// An infinity gets residual 0 (not `inf - inf`), so it propagates as in an FP32 GEMM.
#[inline(always)]
pub fn tf32_residual(x: u32) -> u32 {
    let lo = f32::from_bits(x) - f32::from_bits(x & TF32_MASK);
    if lo.is_nan() { 0 } else { lo.to_bits() }
}

/// `d += a b` for one `m16n8k8` TF32 fragment product (a warp-wide instruction).
#[inline(always)]
pub fn mma_tf32(d: &mut [f32; 4], a: [u32; 4], b: [u32; 2]) {
    let mut c = d.map(f32::to_bits);
    // SAFETY: register-only; every lane of the warp executes it.
    unsafe {
        asm!(
            "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {{{d0},{d1},{d2},{d3}}}, {{{a0},{a1},{a2},{a3}}}, {{{b0},{b1}}}, {{{d0},{d1},{d2},{d3}}};",
            d0 = inout(reg32) c[0], d1 = inout(reg32) c[1], d2 = inout(reg32) c[2], d3 = inout(reg32) c[3],
            a0 = in(reg32) a[0], a1 = in(reg32) a[1], a2 = in(reg32) a[2], a3 = in(reg32) a[3],
            b0 = in(reg32) b[0], b1 = in(reg32) b[1],
            options(nostack, preserves_flags),
        );
    }
    *d = c.map(f32::from_bits);
}

/// `d += a b` for one `m8n8k4` f64 fragment product (`DMMA`, a warp-wide instruction):
/// lane `l` holds `a = A[l / 4][l % 4]`, `b = B[l % 4][l / 4]` and
/// `d = C[l / 4][2 (l % 4) ..][..2]`.
#[inline(always)]
pub fn mma_f64(d: &mut [f64; 2], a: f64, b: f64) {
    let mut c = d.map(f64::to_bits);
    // SAFETY: register-only; every lane of the warp executes it.
    unsafe {
        asm!(
            "mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {{{d0},{d1}}}, {{{a}}}, {{{b}}}, {{{d0},{d1}}};",
            d0 = inout(reg64) c[0], d1 = inout(reg64) c[1],
            a = in(reg64) a.to_bits(), b = in(reg64) b.to_bits(),
            options(nostack, preserves_flags),
        );
    }
    *d = c.map(f64::from_bits);
}

/// `d += a b` for one `m16n8k16` f64 fragment product (`DMMA.16x8x16`, Hopper's full
/// FP64 tensor-core rate; a warp-wide instruction). With `g = l / 4`, `q = l % 4` for
/// lane `l`: `a[2e]` is `A[g][4e + q]`, `a[2e + 1]` is `A[g + 8][4e + q]`, `b[e]` is
/// `B[4e + q][g]`; `d[0..2]` is `C[g][2q..][..2]`, `d[2..4]` is `C[g + 8][2q..][..2]`.
#[inline(always)]
pub fn mma_f64_m16n8k16(d: &mut [f64; 4], a: [f64; 8], b: [f64; 4]) {
    let mut c = d.map(f64::to_bits);
    let (a, b) = (a.map(f64::to_bits), b.map(f64::to_bits));
    // SAFETY: register-only; every lane of the warp executes it.
    unsafe {
        asm!(
            "mma.sync.aligned.m16n8k16.row.col.f64.f64.f64.f64 {{{d0},{d1},{d2},{d3}}}, \
             {{{a0},{a1},{a2},{a3},{a4},{a5},{a6},{a7}}}, {{{b0},{b1},{b2},{b3}}}, {{{d0},{d1},{d2},{d3}}};",
            d0 = inout(reg64) c[0], d1 = inout(reg64) c[1], d2 = inout(reg64) c[2], d3 = inout(reg64) c[3],
            a0 = in(reg64) a[0], a1 = in(reg64) a[1], a2 = in(reg64) a[2], a3 = in(reg64) a[3],
            a4 = in(reg64) a[4], a5 = in(reg64) a[5], a6 = in(reg64) a[6], a7 = in(reg64) a[7],
            b0 = in(reg64) b[0], b1 = in(reg64) b[1], b2 = in(reg64) b[2], b3 = in(reg64) b[3],
            options(nostack, preserves_flags),
        );
    }
    *d = c.map(f64::from_bits);
}

/// Two floats rounded to bf16 (to nearest even) and packed: `lo` in the low half, the
/// element with the lower `k` of an `m16n8k16` fragment register.
#[inline(always)]
pub fn pack_bf16x2(lo: u32, hi: u32) -> u32 {
    let out: u32;
    // SAFETY: register-only conversion.
    unsafe {
        asm!("cvt.rn.bf16x2.f32 {o}, {h}, {l};", o = out(reg32) out, h = in(reg32) hi, l = in(reg32) lo,
             options(pure, nomem, nostack, preserves_flags));
    }
    out
}

/// `d += a b` for one `m16n8k16` bf16 fragment product with FP32 accumulation.
#[inline(always)]
pub fn mma_bf16(d: &mut [f32; 4], a: [u32; 4], b: [u32; 2]) {
    let mut c = d.map(f32::to_bits);
    // SAFETY: register-only; every lane of the warp executes it.
    unsafe {
        asm!(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{{d0},{d1},{d2},{d3}}}, {{{a0},{a1},{a2},{a3}}}, {{{b0},{b1}}}, {{{d0},{d1},{d2},{d3}}};",
            d0 = inout(reg32) c[0], d1 = inout(reg32) c[1], d2 = inout(reg32) c[2], d3 = inout(reg32) c[3],
            a0 = in(reg32) a[0], a1 = in(reg32) a[1], a2 = in(reg32) a[2], a3 = in(reg32) a[3],
            b0 = in(reg32) b[0], b1 = in(reg32) b[1],
            options(nostack, preserves_flags),
        );
    }
    *d = c.map(f32::from_bits);
}

/// Two floats rounded to fp16 (to nearest even; beyond 65504 to infinity, as IEEE
/// rounding does) and packed: `lo` in the low half, as [`pack_bf16x2`].
#[inline(always)]
pub fn pack_f16x2(lo: u32, hi: u32) -> u32 {
    let out: u32;
    // SAFETY: register-only conversion.
    unsafe {
        asm!("cvt.rn.f16x2.f32 {o}, {h}, {l};", o = out(reg32) out, h = in(reg32) hi, l = in(reg32) lo,
             options(pure, nomem, nostack, preserves_flags));
    }
    out
}

/// The two fp16 values of a 32-bit word (low half first) as floats: exact.
#[inline(always)]
pub fn unpack_f16x2(w: u32) -> [f32; 2] {
    let (lo, hi): (u32, u32);
    // SAFETY: register-only conversion.
    unsafe {
        asm!("{{ .reg .b16 l, h; mov.b32 {{l, h}}, {w}; cvt.f32.f16 {lo}, l; cvt.f32.f16 {hi}, h; }}",
             lo = out(reg32) lo, hi = out(reg32) hi, w = in(reg32) w,
             options(pure, nomem, nostack, preserves_flags));
    }
    [f32::from_bits(lo), f32::from_bits(hi)]
}

/// `d += a b` for one `m16n8k16` fp16 fragment product with FP32 accumulation.
#[inline(always)]
pub fn mma_f16(d: &mut [f32; 4], a: [u32; 4], b: [u32; 2]) {
    let mut c = d.map(f32::to_bits);
    // SAFETY: register-only; every lane of the warp executes it.
    unsafe {
        asm!(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{{d0},{d1},{d2},{d3}}}, {{{a0},{a1},{a2},{a3}}}, {{{b0},{b1}}}, {{{d0},{d1},{d2},{d3}}};",
            d0 = inout(reg32) c[0], d1 = inout(reg32) c[1], d2 = inout(reg32) c[2], d3 = inout(reg32) c[3],
            a0 = in(reg32) a[0], a1 = in(reg32) a[1], a2 = in(reg32) a[2], a3 = in(reg32) a[3],
            b0 = in(reg32) b[0], b1 = in(reg32) b[1],
            options(nostack, preserves_flags),
        );
    }
    *d = c.map(f32::from_bits);
}

//! 16-byte loads and 16- and 8-byte stores of global memory as single instructions.
//!
//! Written as `asm!` because LLVM took the plain vector accesses of the epilogue's
//! two-path helpers (a row load: one 16-byte load when aligned, else four checked
//! scalar ones) apart: it sank the scalar path's last load into the join, so the
//! aligned path ran a 16-byte load *and* a 4-byte reload of its last element, which
//! waited for the first (Nsight Compute: 38% of the chain backward's stalls, M2), and
//! the stores became 8 + 4 + 4 bytes.

use core::arch::asm;

/// `p[0..4]` through the read-only (non-coherent) data path.
///
/// # Safety
/// `p` is 16-byte aligned, points at 4 readable floats of global memory, and nothing
/// writes them while the kernel runs.
#[inline(always)]
pub unsafe fn load_v4_nc(p: *const f32) -> [f32; 4] {
    let v: [u32; 4];
    unsafe {
        let (a, b, c, d);
        asm!("{{ .reg .b64 g; cvta.to.global.u64 g, {p}; ld.global.nc.v4.b32 {{{a}, {b}, {c}, {d}}}, [g]; }}",
             p = in(reg64) p as u64, a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
             options(pure, readonly, nostack));
        v = [a, b, c, d];
    }
    v.map(f32::from_bits)
}

/// `p[0..2]` (two 32-bit words) through the read-only (non-coherent) data path.
///
/// # Safety
/// `p` is 8-byte aligned, points at 2 readable words of global memory, and nothing
/// writes them while the kernel runs.
#[inline(always)]
pub unsafe fn load_v2_b32_nc(p: *const u32) -> [u32; 2] {
    let (a, b): (u32, u32);
    unsafe {
        asm!("{{ .reg .b64 g; cvta.to.global.u64 g, {p}; ld.global.nc.v2.b32 {{{a}, {b}}}, [g]; }}",
             p = in(reg64) p as u64, a = out(reg32) a, b = out(reg32) b,
             options(pure, readonly, nostack));
    }
    [a, b]
}

/// `p[0..4] = v`.
///
/// # Safety
/// `p` is 16-byte aligned and points at 4 writable floats of global memory.
#[inline(always)]
pub unsafe fn store_v4(p: *mut f32, v: [f32; 4]) {
    let v = v.map(f32::to_bits);
    unsafe {
        asm!("{{ .reg .b64 g; cvta.to.global.u64 g, {p}; st.global.v4.b32 [g], {{{a}, {b}, {c}, {d}}}; }}",
             p = in(reg64) p as u64, a = in(reg32) v[0], b = in(reg32) v[1], c = in(reg32) v[2], d = in(reg32) v[3],
             options(nostack));
    }
}

/// `p[0..2] = v`.
///
/// # Safety
/// `p` is 8-byte aligned and points at 2 writable floats of global memory.
#[inline(always)]
pub unsafe fn store_v2(p: *mut f32, v: [f32; 2]) {
    let v = v.map(f32::to_bits);
    unsafe {
        asm!("{{ .reg .b64 g; cvta.to.global.u64 g, {p}; st.global.v2.b32 [g], {{{a}, {b}}}; }}",
             p = in(reg64) p as u64, a = in(reg32) v[0], b = in(reg32) v[1], options(nostack));
    }
}

/// `prefetch.global.L1`: starts bringing the 128-byte line holding `p` into L1 (no
/// register written, nothing waits for it).
///
/// # Safety
/// `p` is a global-memory address (a prefetch of an invalid one is dropped, but the
/// pointer must come from a device allocation to be generic-to-global convertible).
#[inline(always)]
pub unsafe fn prefetch_l1<T>(p: *const T) {
    unsafe {
        core::arch::asm!("{{ .reg .b64 g; cvta.to.global.u64 g, {p}; prefetch.global.L1 [g]; }}",
             p = in(reg64) p as u64, options(nostack, readonly, preserves_flags))
    }
}


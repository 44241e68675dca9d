//! `cp.async` (sm_80+): global-to-shared copies that do not pass through registers.
//!
//! A thread issues copies, then waits for its own ([`cp_async_wait_all`], or per
//! committed group with [`cp_async_wait`]); a barrier after the wait makes every
//! thread's copies visible to the block. Shared memory is addressed by 32-bit `.shared`
//! offsets ([`shared_address`]), which is what these instructions take.

use core::arch::asm;

/// The `.shared` state-space address of a generic pointer into shared memory.
#[inline(always)]
pub fn shared_address<T>(p: *const T) -> u32 {
    let out: u32;
    // SAFETY: register-only address conversion.
    unsafe {
        asm!("{{ .reg .u64 t; cvta.to.shared.u64 t, {p}; cvt.u32.u64 {o}, t; }}",
             p = in(reg64) p as u64, o = out(reg32) out, options(pure, nomem, nostack, preserves_flags));
    }
    out
}

/// Starts copying 16 bytes from global `src` to shared `dst`, of which the first
/// `src_bytes` (0, 4, 8, 12 or 16) are read and the rest are zero-filled: out-of-range
/// rows or `k` of an edge tile cost no branch.
///
/// # Safety
/// `dst` is a 16-byte aligned shared address inside the block's allocation; `src` is
/// 16-byte aligned and its first `src_bytes` are readable (nothing is read when 0).
#[inline(always)]
pub unsafe fn cp_async_16(dst: u32, src: *const f32, src_bytes: u32) {
    unsafe {
        asm!("cp.async.cg.shared.global [{d}], [{s}], 16, {n};",
             d = in(reg32) dst, s = in(reg64) src as u64, n = in(reg32) src_bytes, options(nostack, preserves_flags));
    }
}

/// [`cp_async_16`] under an L2 cache policy from [`l2_policy`].
///
/// # Safety
/// As [`cp_async_16`].
#[inline(always)]
pub unsafe fn cp_async_16_hint(dst: u32, src: *const f32, src_bytes: u32, policy: u64) {
    unsafe {
        asm!("cp.async.cg.shared.global.L2::cache_hint [{d}], [{s}], 16, {n}, {p};",
             d = in(reg32) dst, s = in(reg64) src as u64, n = in(reg32) src_bytes, p = in(reg64) policy,
             options(nostack, preserves_flags));
    }
}

/// An L2 cache policy for [`cp_async_16_hint`]: lines loaded with it are evicted first
/// (`createpolicy.fractional.L2::evict_first`) or last (`evict_last`), so a stream
/// read once does not push out data read again.
#[inline(always)]
pub fn l2_policy(evict_first: bool) -> u64 {
    let p: u64;
    // SAFETY: creates a policy value in a register; no memory access.
    unsafe {
        if evict_first {
            asm!("createpolicy.fractional.L2::evict_first.b64 {p}, 1.0;", p = out(reg64) p,
                 options(pure, nomem, nostack, preserves_flags));
        } else {
            asm!("createpolicy.fractional.L2::evict_last.b64 {p}, 1.0;", p = out(reg64) p,
                 options(pure, nomem, nostack, preserves_flags));
        }
    }
    p
}

/// Copies 8 bytes (bf16 values) from global to shared memory asynchronously; bytes
/// past `src_bytes` (0 or 8) are zero-filled.
///
/// # Safety
/// `dst` is an 8-byte aligned shared address; `src` is 8-byte aligned and valid for
/// `src_bytes` bytes.
#[inline(always)]
pub unsafe fn cp_async_8(dst: u32, src: *const u16, src_bytes: u32) {
    unsafe {
        asm!("cp.async.ca.shared.global [{d}], [{s}], 8, {n};",
             d = in(reg32) dst, s = in(reg64) src as u64, n = in(reg32) src_bytes, options(nostack, preserves_flags));
    }
}

/// [`cp_async_16`] for one float (4-byte aligned operands): `src_bytes` 0 or 4.
///
/// # Safety
/// As [`cp_async_16`], with 4-byte alignment.
#[inline(always)]
pub unsafe fn cp_async_4(dst: u32, src: *const f32, src_bytes: u32) {
    unsafe {
        asm!("cp.async.ca.shared.global [{d}], [{s}], 4, {n};",
             d = in(reg32) dst, s = in(reg64) src as u64, n = in(reg32) src_bytes, options(nostack, preserves_flags));
    }
}

/// Closes the group of copies this thread started since the last commit.
#[inline(always)]
pub fn cp_async_commit() {
    // SAFETY: bookkeeping of this thread's own copies.
    unsafe { asm!("cp.async.commit_group;", options(nostack, preserves_flags)) };
}

/// Waits until at most `N` of this thread's committed groups are still in flight. Other
/// threads' copies become visible only after a barrier that follows.
#[inline(always)]
pub fn cp_async_wait<const N: u32>() {
    // SAFETY: waits on this thread's own copies; a memory clobber for the compiler.
    unsafe { asm!("cp.async.wait_group {n};", n = const N, options(nostack, preserves_flags)) };
}

/// Waits until every `cp.async` this thread issued has landed in shared memory (other
/// threads see them after a barrier).
#[inline(always)]
pub fn cp_async_wait_all() {
    // SAFETY: waits only; a memory clobber, so no shared access moves across it.
    unsafe { asm!("cp.async.wait_all;", options(nostack, preserves_flags)) }
}

//! `cp.async` (sm_80+): global-to-shared copies that do not pass through registers.
//!
//! A thread issues copies, then waits for all of its own with [`cp_async_wait_all`];
//! a barrier after the wait makes every thread's copies visible to the block.

use core::arch::asm;

/// The shared-window address of `p`, a generic pointer into this block's shared memory
/// (what `cp.async` takes as its destination).
#[inline(always)]
pub fn shared_addr<T>(p: *const T) -> u32 {
    let out: u64;
    // SAFETY: register-only address conversion.
    unsafe {
        asm!("cvta.to.shared.u64 {o}, {i};", o = out(reg64) out, i = in(reg64) p as u64,
             options(pure, nomem, nostack, preserves_flags));
    }
    out as u32
}

/// Starts a copy of 16 bytes to shared address `dst` (16-byte aligned, from
/// [`shared_addr`]): the first `src_bytes` (0..=16) from global `src` (16-byte aligned,
/// valid for `src_bytes`), the rest zero. Done when [`cp_async_wait_all`] returns.
///
/// # Safety
/// As above; nothing may read or write `dst` until the wait.
#[inline(always)]
pub unsafe fn cp_async_16(dst: u32, src: *const f32, src_bytes: u32) {
    // SAFETY: the caller's contract.
    unsafe {
        asm!("cp.async.cg.shared.global [{d}], [{s}], 16, {n};", d = in(reg32) dst, s = in(reg64) src,
             n = in(reg32) src_bytes, options(nostack, preserves_flags));
    }
}

/// Waits until every `cp.async` this thread issued has landed in shared memory (other
/// threads see them after a barrier).
#[inline(always)]
pub fn cp_async_wait_all() {
    // SAFETY: waits only; a memory clobber, so no shared access moves across it.
    unsafe { asm!("cp.async.wait_all;", options(nostack, preserves_flags)) }
}

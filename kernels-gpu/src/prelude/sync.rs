//! Barriers.

/// `__syncthreads()`: waits until every thread of the block arrives, and orders their
/// shared- and global-memory accesses made before it against those made after it.
///
/// # Safety
/// Every thread of the block must reach the same call (not under divergent control
/// flow), or the block deadlocks or behaves undefined.
#[inline(always)]
pub unsafe fn sync_threads() {
    unsafe { core::arch::nvptx::_syncthreads() }
}

/// `__syncwarp()`: waits until every lane of the warp arrives, and orders their
/// shared-memory accesses made before it against those made after it (a warp reusing
/// memory its lanes were reading).
///
/// # Safety
/// Every lane of the warp must reach the same call.
#[inline(always)]
pub unsafe fn sync_warp() {
    unsafe { core::arch::asm!("bar.warp.sync 0xffffffff;", options(nostack, preserves_flags)) }
}

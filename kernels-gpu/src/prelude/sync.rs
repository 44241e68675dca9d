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

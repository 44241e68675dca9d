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

/// `fence.acq_rel.gpu`: orders this thread's memory accesses before it against those
/// after it for every thread of the GPU that synchronises with it (through an atomic,
/// itself fenced). Before a signal: makes the stores before it visible; after a wait:
/// makes the loads after it see what the signaller stored.
#[inline(always)]
pub fn fence_acq_rel_gpu() {
    // SAFETY: a memory fence.
    unsafe { core::arch::asm!("fence.acq_rel.gpu;", options(nostack, preserves_flags)) }
}

/// `*p += v` on global memory at GPU scope, returning the old value
/// (`atom.relaxed.gpu.global.add.u32`; order it with [`fence_acq_rel_gpu`]).
///
/// # Safety
/// `p` points to a `u32` in global memory.
#[inline(always)]
pub unsafe fn atomic_add_gpu(p: *mut u32, v: u32) -> u32 {
    let old: u32;
    // SAFETY: as the caller promises.
    unsafe {
        core::arch::asm!(
            "{{ .reg .b64 g; cvta.to.global.u64 g, {p}; atom.relaxed.gpu.global.add.u32 {o}, [g], {v}; }}",
            p = in(reg64) p,
            v = in(reg32) v,
            o = out(reg32) old,
            options(nostack)
        )
    };
    old
}

/// `*p = v` on global memory at GPU scope (`st.relaxed.gpu.global.u32`).
///
/// # Safety
/// `p` points to a `u32` in global memory.
#[inline(always)]
pub unsafe fn store_gpu(p: *mut u32, v: u32) {
    // SAFETY: as the caller promises.
    unsafe {
        core::arch::asm!(
            "{{ .reg .b64 g; cvta.to.global.u64 g, {p}; st.relaxed.gpu.global.u32 [g], {v}; }}",
            p = in(reg64) p,
            v = in(reg32) v,
            options(nostack)
        )
    };
}

//! Dynamic shared memory.
//!
//! Rust cannot declare `.shared` statics for this target, so every kernel uses the
//! launch-sized region (`extern .shared` in PTX); its host launcher passes the byte
//! count, computed from the same `kernel-abi` constants the kernel indexes with.

/// Start of this block's dynamic shared memory, aligned for `T`.
///
/// Every call returns the same address; the kernel carves its arrays out of it.
/// Dereferencing is valid up to the byte count given at launch.
#[inline(always)]
pub fn dynamic_shared<T>() -> *mut T {
    core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<T>()
}

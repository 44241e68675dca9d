//! GPU kernels of the Linear + epilogue blocks, in `no_std` Rust for `nvptx64-nvidia-cuda`.
//!
//! Built to PTX by `host/build.rs` (through `ptx-builder`) and embedded in the host
//! binary. Every kernel is an `extern "ptx-kernel"` entry point taking raw device
//! pointers; its host launcher (in `host/src/gpu/`) checks shapes, sizes the grid and
//! shared memory from `kernel-abi`, and documents the same contract.
//!
//! Layout: `prelude` is the small replacement for rust-cuda's `cuda_std` (indices,
//! barriers, warp shuffles, shared memory, fast math); `gemm` holds the GEMM family.
#![no_std]
#![feature(abi_ptx, stdarch_nvptx, asm_experimental_arch, core_intrinsics, gpu_intrinsics, gpu_launch_sized_workgroup_mem, link_llvm_intrinsics)]
#![allow(internal_features)]
// `x % k == 0` is kept: `is_multiple_of` compiles to other PTX in several kernels here
// (checked by diff), and the kernels as they stand are the ones verified on the GPU.
#![allow(clippy::manual_is_multiple_of)]

pub mod batch_norm;
pub mod dot;
pub mod elementwise;
pub mod epilogue;
pub mod fp8;
pub mod gemm;
pub mod optim;
pub mod parallel;
pub mod prelude;

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    // No unwinding or printing on the device: stop the kernel; the host sees a launch error.
    unsafe { core::arch::nvptx::trap() }
}

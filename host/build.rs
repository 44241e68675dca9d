//! Compiles `kernels-gpu` to PTX (embedded by `src/gpu/mod.rs`). The same executable is
//! also the PTX linker that rustc calls during that build: see `ptx-builder`.

use std::path::PathBuf;

fn main() {
    ptx_builder::link_if_invoked_as_linker();

    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap());
    let root = manifest.parent().unwrap();
    let out = PathBuf::from(std::env::var_os("OUT_DIR").unwrap()).join("kernels_sm90.ptx");
    let mut builder =
        // PTX ISA 8.3: `fence.proxy.tensormap` (tensor maps written by a kernel, `prelude::bulk_copy`).
        ptx_builder::PtxBuilder::new(root.join("kernels-gpu")).arch("sm_90a").ptx_isa("ptx83").watch(root.join("kernel-abi"));
    for &(kernel, threads, blocks) in kernel_abi::LAUNCH_BOUNDS
        .iter()
        .chain(kernel_abi::LAUNCH_BOUNDS_TC)
        .chain(kernel_abi::LAUNCH_BOUNDS_WG)
        .chain(kernel_abi::LAUNCH_BOUNDS_TMA)
        .chain(kernel_abi::LAUNCH_BOUNDS_EPILOGUE)
    {
        builder = builder.launch_bounds(kernel, threads, blocks);
    }
    if let Err(e) = builder.build(&out) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

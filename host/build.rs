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
    // Launch bounds from the kernels' identifiers (`kernel_abi::Kernel`), which the host's
    // launches use too; `tests/ptx.rs` checks that they and the PTX's entries agree.
    for &kernel in kernel_abi::Kernel::ALL {
        if let Some(b) = kernel.launch_bounds() {
            builder = builder.launch_bounds(kernel.name(), b.max_threads, b.min_blocks_per_sm);
        }
    }
    if let Err(e) = builder.build(&out) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

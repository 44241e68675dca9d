//! Compiles `kernels-gpu` to PTX (embedded by `src/gpu/ptx.rs`). The same executable is
//! also the PTX linker that rustc calls during that build: see `ptx-builder`.

use std::path::PathBuf;

fn main() {
    ptx_builder::link_if_invoked_as_linker();

    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap());
    let root = manifest.parent().unwrap();
    let out = PathBuf::from(std::env::var_os("OUT_DIR").unwrap()).join("kernels_sm90.ptx");
    let result =
        ptx_builder::PtxBuilder::new(root.join("kernels-gpu")).arch("sm_90").watch(root.join("kernel-abi")).build(&out);
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

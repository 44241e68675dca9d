//! Compiles `kernels-gpu` to PTX, then, where a `ptxas` is at hand, assembles that PTX
//! into an sm_90a cubin (both embedded by `src/gpu/mod.rs`). The same executable is also
//! the PTX linker that rustc calls during that build: see `ptx-builder`.
//!
//! Why the cubin: the PTX is some 16 MB, and a driver loading it compiles every kernel
//! before the first launch, 60 s on the H100 machine (cached afterwards in the
//! user's CUDA cache, per driver and PTX). The cubin loads at once.

use std::path::{Path, PathBuf};
use std::process::Command;

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
    let cubin = out.with_extension("cubin");
    match ptxas() {
        Some(ptxas) => assemble(&ptxas, &out, &cubin),
        None => {
            // An empty image: the library loads the PTX instead.
            std::fs::write(&cubin, []).unwrap();
            println!(
                "cargo:warning=no ptxas (set PTXAS or put CUDA's bin on PATH): the kernels ship as PTX only, \
                 which the driver compiles at first use (about a minute on an H100 machine; then cached)"
            );
        }
    }
}

/// The `ptxas` to assemble with: `$PTXAS` if set, else the first on `PATH`.
fn ptxas() -> Option<PathBuf> {
    println!("cargo:rerun-if-env-changed=PTXAS");
    println!("cargo:rerun-if-env-changed=PATH");
    if let Some(p) = std::env::var_os("PTXAS").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    std::env::split_paths(&std::env::var_os("PATH")?).map(|dir| dir.join("ptxas")).find(|p| p.is_file())
}

/// `ptxas -arch=sm_90a` over the whole module into `cubin`, on every core. A PTX it
/// cannot assemble is a broken build, as rustc's own errors are.
fn assemble(ptxas: &Path, ptx: &Path, cubin: &Path) {
    let status = Command::new(ptxas)
        .args(["-arch=sm_90a", "--split-compile", "0", "-o"])
        .arg(cubin)
        .arg(ptx)
        .status()
        .unwrap_or_else(|e| panic!("running {}: {e}", ptxas.display()));
    if !status.success() {
        eprintln!("error: {} could not assemble the kernels ({status})", ptxas.display());
        std::process::exit(1);
    }
}

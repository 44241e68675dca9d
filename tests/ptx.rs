//! The embedded PTX's entry points are exactly the kernel identifiers
//! (`kernel_abi::Kernel`), and every kernel assembles for sm_90a with no spills and no
//! stack frame (local memory), read off `ptxas -v`. The second needs `ptxas`: CI
//! installs it from PyPI (`nvidia-cuda-nvcc`); set `PTXAS` to its path, or have it on
//! `PATH`. The build embeds a cubin assembled by the same `ptxas` (`host/build.rs`).

use host::gpu::{KERNELS_CUBIN, KERNELS_PTX};
use kernel_abi::Kernel;
use std::process::Command;

fn ptxas() -> String {
    std::env::var("PTXAS").unwrap_or_else(|_| "ptxas".into())
}

/// The names of the PTX's entry points.
fn entries() -> Vec<String> {
    KERNELS_PTX
        .lines()
        .filter_map(|l| l.trim().strip_prefix(".visible .entry ").map(|r| r.split('(').next().unwrap().to_string()))
        .collect()
}

/// Every kernel identifier names an entry point of the PTX, and every entry point has an
/// identifier (each once): what the host launches and what `host/build.rs` gives launch
/// bounds to are exactly the kernels there are.
#[test]
fn kernel_identifiers_are_the_ptx_entry_points() {
    let entries = entries();
    for k in Kernel::ALL {
        assert!(entries.iter().any(|e| e == k.name()), "{k:?}: no entry `{}` in the PTX", k.name());
        assert_eq!(Kernel::ALL.iter().filter(|o| o.name() == k.name()).count(), 1, "{k:?} named twice");
        assert_eq!(Kernel::by_name(k.name()), Some(*k));
    }
    for e in &entries {
        assert!(Kernel::by_name(e).is_some(), "PTX entry `{e}` has no `kernel_abi::Kernel` identifier");
    }
    assert_eq!(entries.len(), Kernel::ALL.len());
}

/// The cubin `host/build.rs` assembled from the PTX (it needs `ptxas`, as the resource
/// checks below do) is a CUDA ELF image holding every entry point: a GPU loads it as is
/// instead of compiling 16 MB of PTX first.
#[test]
#[ignore = "needs ptxas at build time: set PTXAS (CI runs it with the resource checks)"]
fn the_embedded_cubin_holds_every_kernel() {
    assert!(
        !KERNELS_CUBIN.is_empty(),
        "the build found no ptxas, so no cubin is embedded: set PTXAS to the ptxas binary and rebuild"
    );
    assert_eq!(&KERNELS_CUBIN[..4], b"\x7fELF", "not an ELF image");
    const EM_CUDA: u16 = 190;
    assert_eq!(u16::from_le_bytes([KERNELS_CUBIN[18], KERNELS_CUBIN[19]]), EM_CUDA, "not a CUDA ELF image");
    for k in Kernel::ALL {
        let symbol = [k.name().as_bytes(), b"\0"].concat();
        assert!(
            KERNELS_CUBIN.windows(symbol.len()).any(|w| w == symbol.as_slice()),
            "{k:?}: no symbol `{}` in the cubin",
            k.name()
        );
    }
}

/// `(kernel, registers, stack bytes, spill store bytes, spill load bytes)` per entry point.
fn resources(arch: &str) -> Vec<(String, u32, u32, u32, u32)> {
    let dir = std::env::temp_dir().join(format!("ptx-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ptx = dir.join("kernels.ptx");
    std::fs::write(&ptx, KERNELS_PTX).unwrap();
    let out = Command::new(ptxas())
        .args([&format!("-arch={arch}"), "-v", "-o", "/dev/null"])
        .arg(&ptx)
        .output()
        .unwrap_or_else(|e| panic!("cannot run `{}` ({e}); set PTXAS to the ptxas binary", ptxas()));
    let log = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "ptxas failed:\n{log}");
    std::fs::remove_dir_all(&dir).unwrap();

    let entries = entries();
    let num = |s: &str, before: &str| -> u32 {
        let i = s.find(before).unwrap_or_else(|| panic!("`{before}` not in `{s}`"));
        s[..i].split_whitespace().last().unwrap().parse().unwrap()
    };
    let lines: Vec<&str> = log.lines().collect();
    entries
        .into_iter()
        .map(|k| {
            let at = lines
                .iter()
                // (The whole name: `column_dot`'s report is not `column_dots`'.)
                .position(|l| l.trim_end().ends_with(&format!("Function properties for {k}")))
                .unwrap_or_else(|| panic!("no ptxas report for kernel `{k}`:\n{log}"));
            let frame = lines[at + 1];
            let used = lines[at + 2..].iter().find(|l| l.contains("Used")).unwrap();
            (
                k,
                num(used, "registers"),
                num(frame, "bytes stack frame"),
                num(frame, "bytes spill stores"),
                num(frame, "bytes spill loads"),
            )
        })
        .collect()
}

#[test]
#[ignore = "needs ptxas (pip install nvidia-cuda-nvcc==13.0.88, or a CUDA toolkit)"]
fn every_kernel_assembles_for_sm90_without_spills() {
    let kernels = resources("sm_90a");
    assert!(kernels.len() >= 2, "expected the GEMM and epilogue kernels, found {kernels:?}");
    println!("{:<28} {:>5} {:>6} {:>7} {:>7}", "kernel", "regs", "stack", "spill-st", "spill-ld");
    for (k, regs, stack, st, ld) in &kernels {
        println!("{k:<28} {regs:>5} {stack:>6} {st:>7} {ld:>7}");
    }
    for (k, regs, stack, st, ld) in &kernels {
        assert_eq!((*st, *ld), (0, 0), "kernel `{k}` spills");
        assert_eq!(*stack, 0, "kernel `{k}` uses a stack frame (local memory)");
        assert!(*regs <= 255, "kernel `{k}` uses {regs} registers");
    }
    // Launch bounds: every kernel given them fits its blocks per SM in the 64 K register
    // file, and every kernel that moves registers between warpgroups (`setmaxnreg`,
    // which needs a register count fixed at entry) has them.
    let bounds: Vec<(&str, u32, u32)> = Kernel::ALL
        .iter()
        .filter_map(|k| k.launch_bounds().map(|b| (k.name(), b.max_threads, b.min_blocks_per_sm)))
        .collect();
    for &(name, threads, blocks) in &bounds {
        let (_, regs, ..) = kernels.iter().find(|k| k.0 == name).unwrap_or_else(|| panic!("no kernel `{name}`"));
        assert!(regs * threads * blocks <= 65536, "`{name}`: {regs} registers x {threads} threads x {blocks} blocks");
    }
    for body in KERNELS_PTX.split(".visible .entry ").skip(1) {
        let name = body.split('(').next().unwrap();
        if body.contains("setmaxnreg") {
            assert!(bounds.iter().any(|b| b.0 == name), "`{name}` uses setmaxnreg without launch bounds");
        }
    }
}

//! Compiles the `#![no_std]` kernel crate to PTX from a build script.
//!
//! This plays the role of rust-cuda's `cuda_builder`, with rustc's own
//! `nvptx64-nvidia-cuda` backend instead of `rustc_codegen_nvvm` (which needs
//! LLVM 7; see docs/ARCHITECTURE.md, "Why not rust-cuda's compiler").
//!
//! Two halves, both called from the host crate's `build.rs`:
//!
//! * [`PtxBuilder::build`] runs a nested `cargo build` of the kernel crate for
//!   `nvptx64-nvidia-cuda` with `-Zbuild-std=core` (there is no prebuilt
//!   `rust-std` for that target), in its own target directory so the two cargo
//!   processes never wait on one lock. It names the build script's own
//!   executable as the linker.
//! * [`link_if_invoked_as_linker`] is that linker. rustc calls it with the
//!   "llbc" linker flavour (`--export-symbol K ... a.o b.rlib -o out.ptx`); it
//!   runs the `llvm-tools` binaries of the pinned toolchain: `llvm-link`, then
//!   `opt` (internalize all but the kernels, global DCE, O3), then `llc` to PTX.
//!   rustup ships no `llvm-bitcode-linker` for this nightly, hence our own.

use std::env;
use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, exit};

/// Set in the nested cargo's environment; rustc passes it on to the linker it
/// spawns, which is how the build script knows it was started as the linker.
const LINK_MODE_VAR: &str = "PTX_BUILDER_LINK_MODE";
/// Folder holding `llvm-link`, `opt` and `llc` (from rustup's `llvm-tools`).
const LLVM_BIN_VAR: &str = "PTX_BUILDER_LLVM_BIN";
/// Value for `llc -mattr`, e.g. `+ptx80`.
const MATTR_VAR: &str = "PTX_BUILDER_MATTR";

const TARGET: &str = "nvptx64-nvidia-cuda";

/// One PTX module built from a kernel crate for one GPU architecture.
pub struct PtxBuilder {
    crate_dir: PathBuf,
    arch: String,
    ptx_isa: String,
    extra_watch: Vec<PathBuf>,
    launch_bounds: Vec<LaunchBounds>,
}

/// `.maxntid` / `.minnctapersm` for one kernel: what `__launch_bounds__(threads, blocks)`
/// does in CUDA C++. rustc has no attribute for it, so the builder writes the
/// directives into the PTX; ptxas then caps registers at `65536 / (threads * blocks)`.
#[derive(Clone, Debug, PartialEq)]
pub struct LaunchBounds {
    pub kernel: String,
    pub max_threads: u32,
    pub min_blocks_per_sm: u32,
}

impl PtxBuilder {
    /// `crate_dir`: the kernel crate (a `cdylib` for `nvptx64-nvidia-cuda`).
    pub fn new(crate_dir: impl Into<PathBuf>) -> Self {
        PtxBuilder {
            crate_dir: crate_dir.into(),
            arch: "sm_90".into(),
            ptx_isa: "ptx80".into(),
            extra_watch: Vec::new(),
            launch_bounds: Vec::new(),
        }
    }

    /// Target architecture, e.g. `sm_90` or `sm_90a` (needed for `wgmma`).
    pub fn arch(mut self, arch: &str) -> Self {
        self.arch = arch.into();
        self
    }

    /// PTX ISA version for `llc -mattr=+ptxNN`; ISA 8.0 is the first with sm_90.
    pub fn ptx_isa(mut self, isa: &str) -> Self {
        self.ptx_isa = isa.into();
        self
    }

    /// Another folder whose changes must rebuild the PTX (a path dependency).
    pub fn watch(mut self, path: impl Into<PathBuf>) -> Self {
        self.extra_watch.push(path.into());
        self
    }

    /// Declares a kernel's launch bounds (see [`LaunchBounds`]).
    pub fn launch_bounds(mut self, kernel: &str, max_threads: u32, min_blocks_per_sm: u32) -> Self {
        self.launch_bounds.push(LaunchBounds { kernel: kernel.into(), max_threads, min_blocks_per_sm });
        self
    }

    /// Builds the PTX and copies it to `out`. Prints the `cargo:rerun-if-*`
    /// lines so that the PTX is rebuilt exactly when kernel sources change.
    pub fn build(&self, out: &Path) -> Result<(), String> {
        let crate_dir =
            fs::canonicalize(&self.crate_dir).map_err(|e| format!("kernel crate {}: {e}", self.crate_dir.display()))?;
        for watched in std::iter::once(&crate_dir).chain(&self.extra_watch) {
            println!("cargo:rerun-if-changed={}", watched.display());
        }
        for var in ["RUSTUP_TOOLCHAIN", "PTX_BUILDER_VERBOSE"] {
            println!("cargo:rerun-if-env-changed={var}");
        }

        let out_dir = PathBuf::from(env::var_os("OUT_DIR").ok_or("OUT_DIR is not set: call from build.rs")?);
        let target_dir = out_dir.join(format!("kernels-{}", self.arch));
        let linker = env::current_exe().map_err(|e| format!("cannot find the build script's path: {e}"))?;
        let rustc = env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
        let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let llvm_bin = llvm_tools_dir(&rustc)?;

        let rustflags = [format!("-Clinker={}", linker.display()), format!("-Ctarget-cpu={}", self.arch)].join("\x1f");
        let mut cmd = Command::new(&cargo);
        cmd.current_dir(&crate_dir)
            .args(["build", "--release", "--target", TARGET, "-Zbuild-std=core", "--target-dir"])
            .arg(&target_dir)
            .env("CARGO_ENCODED_RUSTFLAGS", rustflags)
            .env(LINK_MODE_VAR, "1")
            .env(LLVM_BIN_VAR, &llvm_bin)
            .env(MATTR_VAR, format!("+{}", self.ptx_isa));
        // The outer build's settings are for the host; keep them out of the device build.
        for var in ["RUSTFLAGS", "CARGO_TARGET_DIR", "CARGO_BUILD_TARGET", "RUSTC_WRAPPER", "RUSTC_WORKSPACE_WRAPPER"] {
            cmd.env_remove(var);
        }
        let status = cmd.status().map_err(|e| format!("cannot run {}: {e}", Path::new(&cargo).display()))?;
        if !status.success() {
            return Err(format!("building the kernel crate for {} failed ({status})", self.arch));
        }

        let name = crate_name(&crate_dir)?.replace('-', "_");
        let ptx = target_dir.join(TARGET).join("release").join(format!("{name}.ptx"));
        let text = fs::read_to_string(&ptx).map_err(|e| format!("reading {}: {e}", ptx.display()))?;
        let text = add_launch_bounds(&text, &self.launch_bounds)?;
        fs::write(out, text).map_err(|e| format!("writing {}: {e}", out.display()))?;
        Ok(())
    }
}

/// Inserts each kernel's performance directives between its parameter list and body.
fn add_launch_bounds(ptx: &str, bounds: &[LaunchBounds]) -> Result<String, String> {
    let mut lines: Vec<String> = ptx.lines().map(String::from).collect();
    for b in bounds {
        let header = format!(".entry {}(", b.kernel);
        let start = lines
            .iter()
            .position(|l| l.contains(&header))
            .ok_or_else(|| format!("launch bounds given for `{}`, which the PTX does not export", b.kernel))?;
        let close = (start..lines.len())
            .find(|&i| lines[i].trim_start().starts_with(')'))
            .ok_or_else(|| format!("no end of `{}`'s parameter list in the PTX", b.kernel))?;
        lines.insert(close + 1, format!(".maxntid {}, 1, 1\n.minnctapersm {}", b.max_threads, b.min_blocks_per_sm));
    }
    Ok(lines.join("\n") + "\n")
}

fn llvm_tools_dir(rustc: &OsString) -> Result<PathBuf, String> {
    let output =
        Command::new(rustc).args(["--print", "sysroot"]).output().map_err(|e| format!("cannot run rustc: {e}"))?;
    let sysroot = String::from_utf8_lossy(&output.stdout).trim().to_string();
    let host = env::var("HOST").unwrap_or_else(|_| "x86_64-unknown-linux-gnu".into());
    let dir = Path::new(&sysroot).join("lib/rustlib").join(host).join("bin");
    if dir.join(exe("llc")).exists() {
        Ok(dir)
    } else {
        Err(format!(
            "llc not found in {}: install the toolchain component with `rustup component add llvm-tools`",
            dir.display()
        ))
    }
}

fn crate_name(crate_dir: &Path) -> Result<String, String> {
    let manifest =
        fs::read_to_string(crate_dir.join("Cargo.toml")).map_err(|e| format!("kernel crate manifest: {e}"))?;
    manifest
        .lines()
        .find_map(|l| {
            let (key, value) = l.split_once('=')?;
            (key.trim() == "name").then(|| value.trim().trim_matches('"').to_string())
        })
        .ok_or_else(|| "no `name` in the kernel crate's Cargo.toml".into())
}

fn exe(name: &str) -> String {
    format!("{name}{}", env::consts::EXE_SUFFIX)
}

/// If rustc started this process as the PTX linker, link and exit; otherwise return.
/// Call it first thing in `build.rs`'s `main`.
pub fn link_if_invoked_as_linker() {
    if env::var_os(LINK_MODE_VAR).is_none() {
        return;
    }
    let args: Vec<String> = env::args().skip(1).collect();
    match link(&args) {
        Ok(()) => exit(0),
        Err(e) => {
            eprintln!("ptx-builder link step: {e}");
            exit(1);
        }
    }
}

/// What rustc's "llbc" linker flavour asks for.
#[derive(Debug, Default, PartialEq)]
struct LinkRequest {
    exports: Vec<String>,
    bitcode: Vec<PathBuf>,
    archives: Vec<PathBuf>,
    cpu: Option<String>,
    output: Option<PathBuf>,
}

fn parse_link_args(args: &[String]) -> Result<LinkRequest, String> {
    let mut req = LinkRequest::default();
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("`{arg}` needs a value"));
        match arg.as_str() {
            "--export-symbol" => req.exports.push(value()?.clone()),
            "--target-cpu" => req.cpu = Some(value()?.clone()),
            "-o" => req.output = Some(PathBuf::from(value()?)),
            "-L" | "--target" => {
                value()?;
            }
            a if a.starts_with('-') => {} // -O3, --debug and other flags we do not need
            a if a.ends_with(".rlib") || a.ends_with(".a") => req.archives.push(a.into()),
            a => req.bitcode.push(a.into()),
        }
    }
    if req.output.is_none() {
        return Err("no `-o` output given".into());
    }
    if req.exports.is_empty() {
        return Err("no kernels exported: mark kernels `#[unsafe(no_mangle)] pub unsafe extern \"ptx-kernel\"`".into());
    }
    Ok(req)
}

fn link(args: &[String]) -> Result<(), String> {
    let req = parse_link_args(args)?;
    let bin = PathBuf::from(env::var_os(LLVM_BIN_VAR).ok_or(format!("{LLVM_BIN_VAR} not set"))?);
    let output = req.output.clone().unwrap();
    let work = output.with_extension("link");
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(&work).map_err(|e| format!("{}: {e}", work.display()))?;

    // Archives (compiler_builtins is kept out of LTO) hold bitcode objects:
    // unpack them and let llvm-link pull in only the symbols the kernels use.
    let mut lazy = Vec::new();
    for (i, archive) in req.archives.iter().enumerate() {
        let dir = work.join(format!("ar{i}"));
        fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        run(Command::new(bin.join(exe("llvm-ar")))
            .arg("x")
            .arg(fs::canonicalize(archive).map_err(|e| e.to_string())?)
            .current_dir(&dir))?;
        for entry in fs::read_dir(&dir).map_err(|e| e.to_string())? {
            let path = entry.map_err(|e| e.to_string())?.path();
            if path.extension().is_some_and(|e| e == "o") && is_bitcode(&path) {
                lazy.push(path);
            }
        }
    }

    let linked = work.join("linked.bc");
    let mut cmd = Command::new(bin.join(exe("llvm-link")));
    cmd.args(&req.bitcode);
    for obj in &lazy {
        cmd.arg("--only-needed").arg(obj);
    }
    run(cmd.arg("-o").arg(&linked))?;

    let optimized = work.join("opt.bc");
    run(Command::new(bin.join(exe("opt")))
        .arg(format!("--internalize-public-api-list={}", req.exports.join(",")))
        .arg("-passes=internalize,globaldce,default<O3>")
        .arg(&linked)
        .arg("-o")
        .arg(&optimized))?;

    let cpu = req.cpu.clone().unwrap_or_else(|| "sm_90".into());
    let mattr = env::var(MATTR_VAR).unwrap_or_else(|_| "+ptx80".into());
    run(Command::new(bin.join(exe("llc")))
        .args(["-mtriple=nvptx64-nvidia-cuda", "-O3"])
        .arg(format!("-mcpu={cpu}"))
        .arg(format!("-mattr={mattr}"))
        .arg(&optimized)
        .arg("-o")
        .arg(&output))?;
    let _ = fs::remove_dir_all(&work);
    Ok(())
}

fn is_bitcode(path: &Path) -> bool {
    fs::read(path).map(|b| b.starts_with(b"BC\xC0\xDE")).unwrap_or(false)
}

fn run(cmd: &mut Command) -> Result<(), String> {
    let shown = format!("{cmd:?}");
    let out = cmd.output().map_err(|e| format!("cannot run {shown}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("{shown} failed ({}):\n{}", out.status, String::from_utf8_lossy(&out.stderr)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn parses_rustc_llbc_arguments() {
        let args = strings(
            "--export-symbol gemm --export-symbol add k.o libcompiler_builtins.rlib -L /x \
             --target nvptx64-nvidia-cuda --target-cpu sm_90a -o out.ptx -O3 --debug",
        );
        let req = parse_link_args(&args).unwrap();
        assert_eq!(req.exports, ["gemm", "add"]);
        assert_eq!(req.bitcode, [PathBuf::from("k.o")]);
        assert_eq!(req.archives, [PathBuf::from("libcompiler_builtins.rlib")]);
        assert_eq!(req.cpu.as_deref(), Some("sm_90a"));
        assert_eq!(req.output, Some(PathBuf::from("out.ptx")));
    }

    #[test]
    fn writes_launch_bounds_after_the_parameter_list() {
        let ptx = ".visible .entry k(\n\t.param .u64 k_param_0\n)\n{\n\tret;\n}\n";
        let b = [LaunchBounds { kernel: "k".into(), max_threads: 256, min_blocks_per_sm: 2 }];
        let out = add_launch_bounds(ptx, &b).unwrap();
        assert!(out.contains(")\n.maxntid 256, 1, 1\n.minnctapersm 2\n{"), "{out}");
        let missing = [LaunchBounds { kernel: "other".into(), ..b[0].clone() }];
        assert!(add_launch_bounds(ptx, &missing).unwrap_err().contains("`other`"));
    }

    #[test]
    fn refuses_a_module_without_kernels() {
        let err = parse_link_args(&strings("k.o -o out.ptx")).unwrap_err();
        assert!(err.contains("no kernels exported"), "{err}");
    }
}

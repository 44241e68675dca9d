//! Bad input is refused with an error that names the problem (the tensor and both
//! shapes, the flag, the op, the file), through the `host` binary: non-zero exit,
//! `error: ...` on stderr, never a panic. Then what must work: the summary, files
//! round-tripped through `--weights/--input/--output`, converted dtypes, NaN/Inf
//! propagated as PyTorch does, and `--device gpu` with and without a driver.

use host::chain::Reduce;
use host::check::{FP32_REL, compare, compare_f32};
use host::io::{BlockMeta, TensorFile, write, write_typed};
use host::reference::{self, op_forward};
use host::{BlockSpec, Op, Params, Pointwise, Preset, Tensor};
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand_distr::{Distribution, StandardNormal};
use safetensors::{Dtype, tensor::TensorView};
use std::path::{Path, PathBuf};
use std::process::Command;

// ---------------------------------------------------------------- helpers

/// A fresh folder under the system's temp dir, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
        let dir = std::env::temp_dir().join(format!("host-{tag}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
    fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs the `host` binary: exit code, stdout, stderr.
fn host(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_host")).args(args).output().expect("the host binary runs");
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code().expect("exited, not killed by a signal"), text(&out.stdout), text(&out.stderr))
}

fn normal_tensor(rng: &mut StdRng, shape: &[usize]) -> Tensor<f32> {
    Tensor::from_fn(shape, |_| StandardNormal.sample(rng)).unwrap()
}

/// Parameters for `spec`, all random (GroupNorm's too, so they matter).
fn random_params(spec: &BlockSpec, rng: &mut StdRng) -> Params<f32> {
    let tensors = spec.param_specs().iter().map(|s| normal_tensor(rng, &s.shape)).collect();
    Params::from_flat(spec, tensors).unwrap()
}

/// Writes `params` under their PyTorch names, with `replace` swapped in by name
/// (`None` drops the tensor).
fn write_weights(path: &Path, spec: &BlockSpec, params: &Params<f32>, replace: &[(&str, Option<Tensor<f32>>)]) {
    let names: Vec<String> = spec.param_specs().into_iter().map(|s| s.name).collect();
    let mut owned: Vec<(String, Tensor<f32>)> = Vec::new();
    for (name, t) in names.iter().zip(params.flat()) {
        match replace.iter().find(|(n, _)| n == name) {
            Some((_, Some(r))) => owned.push((name.clone(), r.clone())),
            Some((_, None)) => {}
            None => owned.push((name.clone(), t.clone())),
        }
    }
    let refs: Vec<(&str, &Tensor<f32>)> = owned.iter().map(|(n, t)| (n.as_str(), t)).collect();
    write(path, &refs).unwrap();
}

/// A safetensors file of one tensor stored as `dtype` (from f32 values).
fn write_as(path: &Path, name: &str, t: &Tensor<f32>, dtype: Dtype) {
    let bytes: Vec<u8> = match dtype {
        Dtype::F64 => t.data().iter().flat_map(|&v| (v as f64).to_le_bytes()).collect(),
        // Truncating to bf16 is exact for the values used here (few mantissa bits).
        Dtype::BF16 => t.data().iter().flat_map(|&v| ((v.to_bits() >> 16) as u16).to_le_bytes()).collect(),
        Dtype::I32 => t.data().iter().flat_map(|&v| (v as i32).to_le_bytes()).collect(),
        Dtype::F16 => t.data().iter().flat_map(|&v| f32_to_f16_exact(v).to_le_bytes()).collect(),
        _ => panic!("write_as: {dtype:?} not supported by this test helper"),
    };
    let view = TensorView::new(dtype, t.shape().to_vec(), &bytes).unwrap();
    safetensors::serialize_to_file([(name, view)], None, path).unwrap();
}

/// f32 to IEEE half for values that are exactly representable as normal halves.
fn f32_to_f16_exact(v: f32) -> u16 {
    if v == 0.0 {
        return 0;
    }
    let bits = v.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let exponent = ((bits >> 23) & 0xff) as i32 - 127 + 15;
    assert!((1..31).contains(&exponent) && bits & 0x1fff == 0, "{v} is not exact in f16");
    sign | ((exponent as u16) << 10) | ((bits >> 13) & 0x3ff) as u16
}

// ---------------------------------------------------------------- bad input

/// One bad command line: the exit code wanted and what the message must name.
struct Case {
    what: &'static str,
    args: Vec<String>,
    code: i32,
    needles: Vec<String>,
}

fn case(what: &'static str, args: &[&str], code: i32, needles: &[&str]) -> Case {
    Case {
        what,
        args: args.iter().map(|s| s.to_string()).collect(),
        code,
        needles: needles.iter().map(|s| s.to_string()).collect(),
    }
}

#[test]
fn bad_input_is_refused_with_an_error_naming_it() {
    let dir = TempDir::new("validation");
    let mut rng = StdRng::seed_from_u64(5);
    // M1 with 4 groups at (4, 16, 32): lin.weight, lin.bias, gn.weight, gn.bias, w.
    let spec = BlockSpec::new(16, 32, Preset::M1.chain().with_groups(4)).unwrap();
    let params = random_params(&spec, &mut rng);
    let p = |name: &str| dir.join(name).to_string_lossy().into_owned();

    write_weights(&dir.join("good.safetensors"), &spec, &params, &[]);
    write(&dir.join("x.safetensors"), &[("x", &normal_tensor(&mut rng, &[4, 16]))]).unwrap();
    write(&dir.join("x17.safetensors"), &[("x", &normal_tensor(&mut rng, &[4, 17]))]).unwrap();
    write(&dir.join("x0.safetensors"), &[("x", &Tensor::new(&[0, 16], vec![]).unwrap())]).unwrap();
    write_as(&dir.join("x-i32.safetensors"), "x", &Tensor::full(&[4, 16], 1.0).unwrap(), Dtype::I32);
    fn bad<'a>(name: &'a str, shape: &[usize]) -> (&'a str, Option<Tensor<f32>>) {
        (name, Some(Tensor::full(shape, 0.5).unwrap()))
    }
    write_weights(&dir.join("w15.safetensors"), &spec, &params, &[bad("lin.weight", &[32, 15])]);
    write_weights(&dir.join("bias31.safetensors"), &spec, &params, &[bad("lin.bias", &[31])]);
    write_weights(&dir.join("w31.safetensors"), &spec, &params, &[bad("w", &[31])]);
    write_weights(&dir.join("no-w.safetensors"), &spec, &params, &[("w", None)]);
    let good = std::fs::read(dir.join("good.safetensors")).unwrap();
    std::fs::write(dir.join("truncated.safetensors"), &good[..good.len() / 2]).unwrap();
    std::fs::write(dir.join("text.safetensors"), "lin.weight = [[1, 2], [3, 4]]\n").unwrap();

    let m1 = ["forward", "--device", "cpu", "--groups", "4"];
    let with = |extra: &[&str]| -> Vec<String> { m1.iter().chain(extra).map(|s| s.to_string()).collect() };
    #[rustfmt::skip]
    let mut cases = vec![
        // Shapes of x, the weights and the chain that disagree.
        case("x with the wrong in", &to_strs(&with(&["--shape", "4,16,32", "--input", &p("x17.safetensors")])), 1, &["`x`", "[4, 17]", "[4, 16]", "--shape 4,16,32"]),
        case("x and lin.weight disagree", &to_strs(&with(&["--input", &p("x17.safetensors"), "--weights", &p("good.safetensors")])), 1, &["`lin.weight`", "[32, 16]", "[32, 17]"]),
        case("lin.weight vs --shape", &to_strs(&with(&["--shape", "4,16,32", "--weights", &p("w15.safetensors")])), 1, &["`lin.weight`", "[32, 15]", "[32, 16]"]),
        case("lin.bias of the wrong length", &to_strs(&with(&["--shape", "4,16,32", "--weights", &p("bias31.safetensors")])), 1, &["`lin.bias`", "[31]", "[32]"]),
        case("chain parameter of the wrong length", &to_strs(&with(&["--shape", "4,16,32", "--weights", &p("w31.safetensors")])), 1, &["`w`", "[31]", "[32]"]),
        case("chain parameter missing", &to_strs(&with(&["--shape", "4,16,32", "--weights", &p("no-w.safetensors")])), 1, &["`w`", "missing", &p("no-w.safetensors")]),
        // Groups.
        case("--groups 7 with out 96", &["forward", "--device", "cpu", "--shape", "4,16,96", "--groups", "7"], 1, &["--groups 7", "96 channels", "1, 2, 3, 4, 6, 8"]),
        case("groupnorm(7) with out 96", &["forward", "--device", "cpu", "--shape", "4,16,96", "--ops", "groupnorm(7)"], 1, &["groupnorm(7)", "96 channels"]),
        case("groupnorm(0)", &["forward", "--device", "cpu", "--shape", "4,16,96", "--ops", "swish,groupnorm(0)"], 1, &["groupnorm(0)", "at least 1 group"]),
        case("--groups 0", &["forward", "--device", "cpu", "--shape", "4,16,96", "--groups", "0"], 1, &["--groups 0"]),
        case("--groups without a groupnorm", &["forward", "--device", "cpu", "--model", "M4", "--shape", "4,16,96", "--groups", "4"], 1, &["--groups 4", "no groupnorm"]),
        case("groups after a pool", &["forward", "--device", "cpu", "--shape", "4,16,96", "--ops", "avgpool(4),groupnorm(5)"], 1, &["groupnorm(5)", "24 channels"]),
        // Zero-sized dimensions.
        case("--shape with batch 0", &["forward", "--device", "cpu", "--shape", "0,16,32"], 1, &["--shape 0,16,32", "BATCH must be at least 1"]),
        case("--shape with in 0", &["forward", "--device", "cpu", "--shape", "4,0,32"], 1, &["--shape 4,0,32", "IN must be at least 1"]),
        case("--shape with out 0", &["forward", "--device", "cpu", "--shape", "4,16,0"], 1, &["--shape 4,16,0", "OUT must be at least 1"]),
        case("x with 0 rows", &to_strs(&with(&["--input", &p("x0.safetensors")])), 1, &["`x`", "0 rows", &p("x0.safetensors")]),
        case("x with 0 rows vs --shape", &to_strs(&with(&["--shape", "4,16,32", "--input", &p("x0.safetensors")])), 1, &["`x`", "[0, 16]", "[4, 16]"]),
        // Pooling.
        case("avgpool(200) with out 96", &["forward", "--device", "cpu", "--shape", "4,16,96", "--ops", "avgpool(200)"], 1, &["avgpool(200)", "96 features"]),
        case("avgpool(0)", &["forward", "--device", "cpu", "--shape", "4,16,96", "--ops", "avgpool(0)"], 1, &["avgpool(0)"]),
        case("maxpool(200) with out 96", &["forward", "--device", "cpu", "--shape", "4,16,96", "--ops", "maxpool(200)"], 1, &["maxpool(200)", "96 features"]),
        case("maxpool without k", &["forward", "--device", "cpu", "--shape", "4,16,96", "--ops", "maxpool"], 1, &["maxpool", "takes 1 argument"]),
        // Whole-row ops.
        case("a parameter after a reduction", &["forward", "--device", "cpu", "--shape", "4,16,96", "--ops", "sum,gelu,bias"], 1, &["`bias` after `sum`", "per-channel parameter", "one value per row"]),
        case("a norm after a reduction", &["forward", "--device", "cpu", "--shape", "4,16,96", "--ops", "logsumexp,layernorm"], 1, &["after `logsumexp`", "`ln.weight`"]),
        case("softmax with an argument", &["forward", "--device", "cpu", "--shape", "4,16,96", "--ops", "softmax(1)"], 1, &["softmax", "takes 0 argument"]),
        case("layernorm eps 0", &["forward", "--device", "cpu", "--shape", "4,16,96", "--ops", "layernorm(0)"], 1, &["layernorm", "eps must be positive"]),
        case("rmsnorm eps nan", &["forward", "--device", "cpu", "--shape", "4,16,96", "--ops", "rmsnorm(nan)"], 1, &["rmsnorm", "eps must be positive"]),
        // Chains and flags.
        case("empty op", &["forward", "--device", "cpu", "--shape", "4,16,96", "--ops", "swish,,mish"], 1, &["empty op"]),
        case("unknown op", &["forward", "--device", "cpu", "--shape", "4,16,96", "--ops", "relu6"], 1, &["relu6"]),
        case("hardtanh min above max", &["forward", "--device", "cpu", "--shape", "4,16,96", "--ops", "hardtanh(1,0)"], 1, &["hardtanh(1,0)"]),
        case("infinite scale", &["forward", "--device", "cpu", "--shape", "4,16,96", "--ops", "scale(inf)"], 1, &["scale(inf)", "finite"]),
        case("negative eps", &["forward", "--device", "cpu", "--shape", "4,16,96", "--ops", "groupnorm(4,-1)"], 1, &["groupnorm", "eps"]),
        case("unknown model", &["forward", "--device", "cpu", "--model", "M9"], 1, &["--model M9"]),
        case("--groups not a number", &["forward", "--device", "cpu", "--groups", "abc"], 2, &["--groups"]),
        case("--device unknown", &["forward", "--device", "tpu"], 2, &["--device", "tpu"]),
        case("--shape not numbers", &["forward", "--device", "cpu", "--shape", "4,x,8"], 1, &["--shape 4,x,8", "IN `x`"]),
        case("--shape with two sizes", &["forward", "--device", "cpu", "--shape", "4,8"], 1, &["--shape 4,8", "BATCH,IN,OUT"]),
        // Files.
        case("missing file", &to_strs(&with(&["--weights", &p("missing.safetensors")])), 1, &["--weights", &p("missing.safetensors"), "cannot read"]),
        case("truncated file", &to_strs(&with(&["--weights", &p("truncated.safetensors")])), 1, &[&p("truncated.safetensors"), "not a valid safetensors file"]),
        case("not safetensors", &to_strs(&with(&["--input", &p("text.safetensors")])), 1, &["--input", &p("text.safetensors"), "not a valid safetensors file"]),
        case("a directory", &to_strs(&with(&["--weights", &dir.0.to_string_lossy()])), 1, &[&dir.0.to_string_lossy(), "is a directory"]),
        case("x of dtype I32", &to_strs(&with(&["--shape", "4,16,32", "--input", &p("x-i32.safetensors")])), 1, &["`x`", "I32", "F32"]),
        case("--output in a missing directory", &to_strs(&with(&["--shape", "4,16,32", "--output", &p("nope/y.safetensors")])), 1, &["--output", &p("nope/y.safetensors"), "does not exist"]),
        case("--output is a directory", &to_strs(&with(&["--shape", "4,16,32", "--output", &dir.0.to_string_lossy()])), 1, &["--output", "is a directory"]),
        case("backward --grads in a missing directory", &["backward", "--device", "cpu", "--shape", "4,16,32", "--grads", &p("nope/g.safetensors")], 1, &["--grads", &p("nope/g.safetensors"), "does not exist"]),
        // Sizes whose arithmetic would overflow, refused before allocating.
        case("batch beyond 32-bit kernel arguments", &["forward", "--device", "gpu", "--ops", "swish", "--shape", "4294967296,2,2"], 1, &["--shape 4294967296,2,2", "32-bit"]),
        case("batch beyond the GEMM grid", &["forward", "--device", "gpu", "--ops", "swish", "--shape", "9000000,2,2"], 1, &["--shape 9000000,2,2", "grid"]),
        case("x beyond usize", &["forward", "--device", "cpu", "--ops", "swish", "--shape", "4294967296,4294967296,2"], 1, &["--shape 4294967296,4294967296,2", "more elements than memory can address"]),
        case("weight beyond usize", &["forward", "--device", "cpu", "--ops", "swish", "--shape", "2,4294967296,4294967296"], 1, &["Linear(4294967296, 4294967296)", "more elements than memory can address"]),
        case("batch beyond 64 bits", &["forward", "--device", "cpu", "--shape", "99999999999999999999,2,2"], 1, &["--shape", "BATCH `99999999999999999999` is not a whole number"]),
    ];
    // The memory check reads /proc/meminfo; elsewhere there is no total to compare with.
    // /proc takes no new files, even from root: an existing directory one cannot write to.
    if cfg!(target_os = "linux") {
        #[rustfmt::skip]
        cases.push(case("backward --grads where nothing can be written", &["backward", "--device", "cpu", "--shape", "4,16,32", "--grads", "/proc/grads.safetensors"], 1, &["--grads", "/proc/grads.safetensors", "cannot write here"]));
        #[rustfmt::skip]
        cases.push(case("beyond this machine's memory", &["forward", "--device", "cpu", "--ops", "swish", "--shape", "1000000000,1000,1000"], 1, &["--shape 1000000000,1000,1000", "GiB of memory"]));
    }

    let mut failures = Vec::new();
    for c in &cases {
        let args: Vec<&str> = c.args.iter().map(String::as_str).collect();
        let (code, stdout, stderr) = host(&args);
        let missing: Vec<&String> = c.needles.iter().filter(|n| !stderr.contains(n.as_str())).collect();
        if code != c.code || !stderr.starts_with("error: ") || !missing.is_empty() || stderr.contains("panicked") {
            failures.push(format!(
                "{}: exit {code} (want {}), missing {missing:?}\n  args: {}\n  stderr: {stderr}  stdout: {stdout}",
                c.what,
                c.code,
                args.join(" ")
            ));
        }
    }
    assert!(failures.is_empty(), "{} of {} cases failed:\n{}", failures.len(), cases.len(), failures.join("\n"));
    // Nothing was written for the refused --output.
    assert!(!dir.join("nope").exists());
    let partial =
        std::fs::read_dir(&dir.0).unwrap().any(|f| f.unwrap().file_name().to_string_lossy().ends_with(".partial"));
    assert!(!partial, "a .partial file was left behind");
}

fn to_strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

// ---------------------------------------------------------------- what must work

#[test]
fn forward_on_the_cpu_prints_the_summary() {
    let (code, stdout, stderr) = host(&["forward", "--device", "cpu", "--shape", "8,16,32", "--groups", "4"]);
    assert_eq!(code, 0, "stderr: {stderr}");
    for line in [
        "host forward",
        "  backend   cpu",
        "  model     M1: Linear(16, 32) -> groupnorm(4,1e-5),swish,mul,swish",
        "  shape     x [8, 16] -> y [8, 32]",
        "  time      ",
        "  checksum  sum ",
    ] {
        assert!(stdout.lines().any(|l| l.starts_with(line)), "no line starting `{line}` in:\n{stdout}");
    }
    let check = stdout.lines().find(|l| l.starts_with("  check     8 rows vs f64 CPU reference")).unwrap();
    assert!(check.ends_with(": ok"), "{check}");
}

/// Weights and x written with `host::io`, run through `--weights/--input/--output`,
/// and `y` read back: the same as the reference on the same data.
#[test]
fn files_round_trip_through_forward() {
    let dir = TempDir::new("round-trip");
    let mut rng = StdRng::seed_from_u64(9);
    for (text, (batch, in_f, out_f)) in [
        ("groupnorm(4),swish,mul,swish", (5, 16, 32)),
        ("avgpool(16),gelu,scale(2),max", (3, 16, 64)),
        ("bias,mish", (4, 7, 9)),
    ] {
        let spec = BlockSpec::new(in_f, out_f, text.parse().unwrap()).unwrap();
        let params = random_params(&spec, &mut rng);
        let x = normal_tensor(&mut rng, &[batch, in_f]);
        let (w_path, x_path, y_path) =
            (dir.join("w.safetensors"), dir.join("x.safetensors"), dir.join("y.safetensors"));
        write_weights(&w_path, &spec, &params, &[]);
        write(&x_path, &[("x", &x)]).unwrap();
        let (code, stdout, stderr) = host(&[
            "forward",
            "--device",
            "cpu",
            "--ops",
            text,
            "--weights",
            w_path.to_str().unwrap(),
            "--input",
            x_path.to_str().unwrap(),
            "--output",
            y_path.to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "{text}: {stderr}");
        assert!(stdout.contains(&format!("y written to {}", y_path.display())), "{stdout}");
        let out_shape = spec.output_shape(batch);
        let y = TensorFile::open(&y_path).unwrap().get("y", &out_shape).unwrap();
        // The CLI's CPU run is the CPU backend's: the same bits after the round trip.
        assert_eq!(y, host::cpu::forward(&spec, &x, &params, &Default::default()).unwrap(), "{text}");
        let want = reference::block_forward(&spec, &x.to_f64(), &params.map(f64::from)).unwrap();
        let c = compare_f32(y.data(), want.data());
        assert!(c.passes(FP32_REL), "{text}: {c:?}");
    }
}

/// F64, F16 and BF16 tensors are converted to f32 on reading: with values exact in
/// all of them, the output is the same as from f32 files.
#[test]
fn f64_f16_and_bf16_files_are_converted() {
    let dir = TempDir::new("dtypes");
    let spec = BlockSpec::new(8, 12, "bias,swish".parse().unwrap()).unwrap();
    // Multiples of 1/16 in [-2, 2): exact in f16 and bf16.
    let mut k = 0i32;
    let mut exact = |shape: &[usize]| {
        Tensor::from_fn(shape, |_| {
            k = (k * 37 + 11) % 64;
            (k - 32) as f32 / 16.0
        })
        .unwrap()
    };
    let params = Params::from_flat(&spec, spec.param_specs().iter().map(|s| exact(&s.shape)).collect()).unwrap();
    let x = exact(&[3, 8]);
    let run = |weights: &Path, input: &Path| -> Tensor<f32> {
        let y_path = dir.join("y.safetensors");
        let args = ["forward", "--device", "cpu", "--ops", "bias,swish", "--output", y_path.to_str().unwrap()];
        let files = ["--weights", weights.to_str().unwrap(), "--input", input.to_str().unwrap()];
        let (code, _, stderr) = host(&[&args[..], &files[..]].concat());
        assert_eq!(code, 0, "{}: {stderr}", weights.display());
        TensorFile::open(&y_path).unwrap().get("y", &[3, 12]).unwrap()
    };
    write_weights(&dir.join("w32.safetensors"), &spec, &params, &[]);
    write(&dir.join("x32.safetensors"), &[("x", &x)]).unwrap();
    let want = run(&dir.join("w32.safetensors"), &dir.join("x32.safetensors"));
    for dtype in [Dtype::F64, Dtype::F16, Dtype::BF16] {
        // One tensor per file is enough to exercise the reader: x in the dtype.
        let x_path = dir.join(&format!("x-{dtype:?}.safetensors"));
        write_as(&x_path, "x", &x, dtype);
        assert_eq!(run(&dir.join("w32.safetensors"), &x_path), want, "x as {dtype:?}");
        let f = TensorFile::open(&x_path).unwrap();
        assert_eq!(f.get("x", &[3, 8]).unwrap(), x, "{dtype:?}");
    }
    // Weights as F64: the whole file in another dtype.
    let w64 = dir.join("w64.safetensors");
    let names: Vec<String> = spec.param_specs().into_iter().map(|s| s.name).collect();
    let bytes: Vec<Vec<u8>> =
        params.flat().iter().map(|t| t.data().iter().flat_map(|&v| (v as f64).to_le_bytes()).collect()).collect();
    let views: Vec<(&str, TensorView)> = names
        .iter()
        .zip(params.flat())
        .zip(&bytes)
        .map(|((n, t), b)| (n.as_str(), TensorView::new(Dtype::F64, t.shape().to_vec(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &w64).unwrap();
    assert_eq!(run(&w64, &dir.join("x32.safetensors")), want, "weights as F64");
}

/// A bf16 model's files (`--precision bf16` with BF16 `x` and `lin.weight`): the outputs
/// come back as BF16 (`y`, `grad.x`, `grad.lin.weight`; each other gradient in its
/// parameter's stored dtype), equal to the FP32 path's rounded (the CPU backend computes
/// in FP32); a BF16 `x` beside an F32 weight is refused, naming both.
#[test]
fn a_bf16_models_files_stay_bf16() {
    let dir = TempDir::new("bf16");
    let spec = BlockSpec::new(8, 12, "bias,swish".parse().unwrap()).unwrap();
    let mut rng = StdRng::seed_from_u64(5);
    // bf16 values (rounded once), so F32 and BF16 files hold the same numbers.
    let bf16 = |t: Tensor<f32>| t.to_bf16().to_f32();
    let params = random_params(&spec, &mut rng);
    let params = Params::from_flat(&spec, params.flat().into_iter().map(|t| bf16(t.clone())).collect()).unwrap();
    let x = bf16(normal_tensor(&mut rng, &[3, 8]));
    let (w16, x16, x32) = (dir.join("w16.safetensors"), dir.join("x16.safetensors"), dir.join("x32.safetensors"));
    // lin.weight BF16; the chain's `bias` F32 (its gradient stays F32).
    write_weights(&w16, &spec, &params, &[("lin.weight", None), ("lin.bias", None)]);
    let names: Vec<String> = spec.param_specs().into_iter().map(|s| s.name).collect();
    let mut bytes = Vec::new();
    for (n, t) in names.iter().zip(params.flat()) {
        let b: Vec<u8> = match n.as_str() {
            "bias" => t.data().iter().flat_map(|v| v.to_le_bytes()).collect(),
            _ => t.data().iter().flat_map(|&v| ((v.to_bits() >> 16) as u16).to_le_bytes()).collect(),
        };
        bytes.push(b);
    }
    let views: Vec<(&str, TensorView)> = names
        .iter()
        .zip(params.flat())
        .zip(&bytes)
        .map(|((n, t), b)| {
            let dtype = if n == "bias" { Dtype::F32 } else { Dtype::BF16 };
            (n.as_str(), TensorView::new(dtype, t.shape().to_vec(), b).unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, None, &w16).unwrap();
    write_as(&x16, "x", &x, Dtype::BF16);
    write(&x32, &[("x", &x)]).unwrap();
    let (y_path, g_path) = (dir.join("y.safetensors"), dir.join("g.safetensors"));
    let (y, g) = (y_path.to_str().unwrap(), g_path.to_str().unwrap());
    let base = ["backward", "--device", "cpu", "--ops", "bias,swish", "--precision", "bf16"];
    let (code, _, stderr) = host(
        &[
            &base[..],
            &["--weights", w16.to_str().unwrap(), "--input", x16.to_str().unwrap()],
            &["--output", y, "--grads", g],
        ]
        .concat(),
    );
    assert_eq!(code, 0, "{stderr}");
    let stored = |path: &Path, name: &str| {
        let bytes = std::fs::read(path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        st.tensor(name).unwrap().dtype()
    };
    assert_eq!(stored(&y_path, "y"), Dtype::BF16);
    assert_eq!(stored(&g_path, "grad.x"), Dtype::BF16);
    assert_eq!(stored(&g_path, "grad.lin.weight"), Dtype::BF16);
    assert_eq!(stored(&g_path, "grad.lin.bias"), Dtype::BF16);
    assert_eq!(stored(&g_path, "grad.bias"), Dtype::F32);
    // The FP32 path on the same values, rounded: the same numbers.
    let want = reference::block_forward(&spec, &x.to_f64(), &params.map(f64::from)).unwrap();
    let got = TensorFile::open(&y_path).unwrap().get("y", &[3, 12]).unwrap();
    let rounded: Vec<f32> =
        want.data().iter().map(|&v| bf16(Tensor::new(&[1], vec![v as f32]).unwrap()).data()[0]).collect();
    let c = compare_f32(got.data(), &rounded.iter().map(|&v| v as f64).collect::<Vec<_>>());
    assert!(c.rel < 1e-2, "{c:?}");
    // Mixed: BF16 x, F32 weight.
    write_weights(&dir.join("w32.safetensors"), &spec, &params, &[]);
    let w32 = dir.join("w32.safetensors");
    let (code, _, stderr) =
        host(&[&base[..], &["--weights", w32.to_str().unwrap(), "--input", x16.to_str().unwrap()]].concat());
    assert_ne!(code, 0);
    assert!(stderr.contains("x is stored as BF16 but lin.weight as F32"), "{stderr}");
    // Without --precision bf16 the same files are widened to F32, as before.
    let fwd = ["forward", "--device", "cpu", "--ops", "bias,swish", "--output", y];
    let (code, _, stderr) =
        host(&[&fwd[..], &["--weights", w16.to_str().unwrap(), "--input", x32.to_str().unwrap()]].concat());
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(stored(&y_path, "y"), Dtype::F32);
}

/// NaN and Inf in `x` go through like PyTorch's (a group holding NaN is NaN, the
/// rest finite); the check finds them where the f64 reference has them, and still says
/// not ok (exit 2): an output holding NaN or Inf is not a usable result. `y` is written.
#[test]
fn nan_and_inf_inputs_propagate_through_the_cli() {
    let dir = TempDir::new("nan");
    let mut rng = StdRng::seed_from_u64(3);
    let (batch, in_f, out_f) = (5, 16, 32);
    // Whether rows whose x holds an Inf end finite: hardtanh clamps the Linear layer's
    // ±Inf; GroupNorm over mixed infinities gives NaN.
    for (text, inf_rows_finite) in [
        ("groupnorm(4),swish,mul,swish", false),
        ("leakyrelu,hardtanh(-2,2),max", true),
        ("bias,hardtanh,mish,groupnorm(8)", true),
    ] {
        let spec = BlockSpec::new(in_f, out_f, text.parse().unwrap()).unwrap();
        let params = random_params(&spec, &mut rng);
        let mut x = normal_tensor(&mut rng, &[batch, in_f]);
        x.data_mut()[in_f + 3] = f32::NAN; // row 1
        x.data_mut()[2 * in_f] = f32::INFINITY; // row 2
        x.data_mut()[3 * in_f + 5] = f32::NEG_INFINITY; // row 3
        let (w_path, x_path, y_path) =
            (dir.join("w.safetensors"), dir.join("x.safetensors"), dir.join("y.safetensors"));
        write_weights(&w_path, &spec, &params, &[]);
        write(&x_path, &[("x", &x)]).unwrap();
        let (code, stdout, stderr) = host(&[
            "forward",
            "--device",
            "cpu",
            "--ops",
            text,
            "--check-rows",
            "5",
            "--weights",
            w_path.to_str().unwrap(),
            "--input",
            x_path.to_str().unwrap(),
            "--output",
            y_path.to_str().unwrap(),
        ]);
        assert_eq!(code, 2, "{text}: {stderr}\n{stdout}");
        assert!(stderr.contains("NaN/Inf values"), "{text}: {stderr}");
        let check = stdout.lines().find(|l| l.starts_with("  check ")).unwrap();
        assert!(check.contains("non-finite 0") && check.contains(": not ok: "), "{text}: {check}");
        let y = TensorFile::open(&y_path).unwrap().get("y", &spec.output_shape(batch)).unwrap();
        let width = y.len() / batch;
        for r in 0..batch {
            let row = &y.data()[r * width..(r + 1) * width];
            // The Linear layer spreads x's NaN (row 1) over the whole row.
            let finite = match r {
                1 => false,
                2 | 3 => inf_rows_finite,
                _ => true,
            };
            assert!(row.iter().all(|v| v.is_finite() == finite), "{text}: row {r} {row:?}");
        }
        let want = reference::block_forward(&spec, &x.to_f64(), &params.map(f64::from)).unwrap();
        assert!(compare_f32(y.data(), want.data()).passes(FP32_REL), "{text}");
    }
}

/// The CPU reference's NaN/Inf semantics, op by op, as PyTorch's (values checked
/// against torch 2.x on the CPU).
#[test]
fn nan_and_inf_follow_pytorch_op_by_op() {
    let (nan, inf) = (f64::NAN, f64::INFINITY);
    let row = |v: &[f64]| Tensor::new(&[1, v.len()], v.to_vec()).unwrap();
    let apply = |op: Op, v: &[f64]| -> Vec<f64> { op_forward(&op, &row(v), &[]).unwrap().0.into_data() };
    let same = |got: &[f64], want: &[f64]| {
        got.len() == want.len() && got.iter().zip(want).all(|(g, w)| g == w || (g.is_nan() && w.is_nan()))
    };
    let input = [nan, inf, -inf, 0.0];
    for (op, want) in [
        (Op::Pointwise(Pointwise::Hardtanh, [-1.0, 1.0]), [nan, 1.0, -1.0, 0.0]),
        (Op::Pointwise(Pointwise::LeakyRelu, [0.01, 0.0]), [nan, inf, -inf, 0.0]),
        (Op::of(Pointwise::Swish), [nan, inf, nan, 0.0]),
        (Op::of(Pointwise::Mish), [nan, inf, nan, 0.0]),
        // torch.gelu(inf) is inf on its scalar path (and mathematically), NaN on its
        // vectorised CPU path; the reference keeps the mathematical value.
        (Op::of(Pointwise::Gelu), [nan, inf, nan, 0.0]),
        (Op::Pointwise(Pointwise::Scale, [2.0, 0.0]), [nan, inf, -inf, 0.0]),
    ] {
        let got = apply(op, &input);
        assert!(same(&got, &want), "{op}: got {got:?}, want {want:?}");
    }
    // Max over a row holding NaN is NaN; Inf without NaN is the max.
    assert!(apply(Op::RowMax, &[1.0, nan, 3.0])[0].is_nan());
    assert_eq!(apply(Op::RowMax, &[1.0, inf, 3.0]), [inf]);
    // The min, as the max; sum, mean and logsumexp: NaN from NaN, Inf from Inf.
    assert!(apply(Op::Reduce(Reduce::Min), &[1.0, nan, -3.0])[0].is_nan());
    assert_eq!(apply(Op::Reduce(Reduce::Min), &[1.0, -inf, 3.0]), [-inf]);
    assert!(apply(Op::Reduce(Reduce::Sum), &[1.0, nan])[0].is_nan());
    assert!(apply(Op::Reduce(Reduce::Sum), &[inf, -inf])[0].is_nan());
    assert_eq!(apply(Op::Reduce(Reduce::Mean), &[1.0, inf]), [inf]);
    // logsumexp shifts by 0 where the max is infinite (torch.logsumexp: inf, -inf).
    assert_eq!(apply(Op::Reduce(Reduce::LogSumExp), &[1.0, inf]), [inf]);
    assert_eq!(apply(Op::Reduce(Reduce::LogSumExp), &[-inf, -inf]), [-inf]);
    assert!(apply(Op::Reduce(Reduce::LogSumExp), &[1.0, nan])[0].is_nan());
    // Softmax: a row with NaN is NaN; MaxPool: only the window holding NaN.
    assert!(apply(Op::Softmax, &[1.0, nan, 2.0]).iter().all(|v| v.is_nan()));
    assert!(same(&apply(Op::MaxPool(2), &[1.0, nan, 3.0, 4.0]), &[nan, 4.0]));
    // AvgPool: only the window holding NaN.
    assert!(same(&apply(Op::AvgPool(2), &[1.0, nan, 3.0, 4.0]), &[nan, 3.5]));
    // GroupNorm: the group holding NaN or Inf is NaN, the other group untouched.
    let gn = Op::GroupNorm { groups: 2, eps: 1e-5 };
    let ones = Tensor::full(&[6], 1.0).unwrap();
    let zeros = Tensor::full(&[6], 0.0).unwrap();
    for bad in [nan, inf] {
        let y = op_forward(&gn, &row(&[1.0, bad, 3.0, 4.0, 5.0, 6.0]), &[ones.clone(), zeros.clone()]).unwrap().0;
        assert!(y.data()[..3].iter().all(|v| v.is_nan()), "{bad}: {y:?}");
        let clean = op_forward(&gn, &row(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]), &[ones.clone(), zeros.clone()]).unwrap().0;
        assert!(compare(&y.data()[3..], &clean.data()[3..]).passes(0.0), "{bad}: {y:?}");
    }
}

/// `--device gpu` without a driver is an error saying so; with one, the run works.
/// `auto` always runs, falling back to the CPU with a note.
#[test]
fn device_choice_with_and_without_a_gpu() {
    let args = ["forward", "--shape", "8,16,32", "--groups", "4"];
    let (code, stdout, stderr) = host(&[&args[..], &["--device", "gpu"]].concat());
    match host::gpu::driver_present() {
        Err(_) => {
            assert_eq!(code, 1, "{stdout}");
            assert!(stderr.starts_with("error: no GPU:"), "{stderr}");
        }
        Ok(()) => {
            assert_eq!(code, 0, "{stderr}");
            assert!(stdout.contains("  backend   gpu"), "{stdout}");
        }
    }
    let (code, stdout, stderr) = host(&[&args[..], &["--device", "auto"]].concat());
    assert_eq!(code, 0, "{stderr}");
    if host::gpu::driver_present().is_err() {
        assert!(stderr.contains("running on the CPU backend"), "{stderr}");
        assert!(stdout.contains("  backend   cpu"), "{stdout}");
    } else {
        assert!(stdout.contains("  backend   "), "{stdout}");
    }
}

/// A weights file that names its block in its metadata (as `fused_linear.save` and the
/// CLI's outputs do) runs that block when --ops and --model are left out, in its
/// precision; a run that asks for another chain is refused, naming both; the CLI's
/// output files name theirs.
#[test]
fn weights_files_carry_and_check_their_chain() {
    let dir = TempDir::new("meta");
    let mut rng = StdRng::seed_from_u64(9);
    // 16 groups: M1's chain with groupnorm(16), whose file M1's default groupnorm(256)
    // would read without complaint (its tensors have the same shapes).
    let chain = Preset::M1.chain().with_groups(16);
    let spec = BlockSpec::new(32, 256, chain.clone()).unwrap();
    let params = random_params(&spec, &mut rng);
    let names: Vec<String> = spec.param_specs().into_iter().map(|s| s.name).collect();
    let flat = params.flat();
    let tensors: Vec<(&str, &Tensor<f32>, bool)> =
        names.iter().zip(&flat).map(|(n, t)| (n.as_str(), *t, false)).collect();
    let meta = BlockMeta { chain: chain.to_string(), precision: "tf32x3".into() };
    let w = dir.join("w.safetensors");
    write_typed(&w, &tensors, Some(&meta)).unwrap();
    assert_eq!(TensorFile::open(&w).unwrap().block_meta(), Some(meta.clone()));
    let (w, y) = (w.to_string_lossy().into_owned(), dir.join("y.safetensors").to_string_lossy().into_owned());

    let (code, stdout, stderr) =
        host(&["forward", "--device", "cpu", "--shape", "4,32,256", "--weights", &w, "--output", &y]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains(&format!("-> {chain}")) && stdout.contains("from "), "{stdout}");
    let written = TensorFile::open(Path::new(&y)).unwrap().block_meta().unwrap();
    assert_eq!(written, BlockMeta { chain: chain.to_string(), precision: "tf32x3".into() });

    for asks in [&["--model", "M1"][..], &["--ops", "groupnorm(256),swish,mul,swish"][..], &["--groups", "8"][..]] {
        let (code, _, stderr) =
            host(&[&["forward", "--device", "cpu", "--shape", "4,32,256", "--weights", &w][..], asks].concat());
        assert_eq!(code, 1, "{asks:?}: {stderr}");
        assert!(
            stderr.contains(&format!("holds a block of chain `{chain}`")) && stderr.contains("--ops"),
            "{asks:?}: {stderr}"
        );
    }
    // The same chain asked for explicitly, and another precision, run.
    let (code, _, stderr) = host(&[
        "forward",
        "--device",
        "cpu",
        "--shape",
        "4,32,256",
        "--weights",
        &w,
        "--groups",
        "16",
        "--precision",
        "fp32",
    ]);
    assert_eq!(code, 0, "{stderr}");
}

/// Without a GPU, `check` checks the CPU backend against the f64 reference (saying so),
/// and `check --device gpu` and `bench` say what they need; with one, `check` runs there.
#[test]
fn check_and_bench_with_and_without_a_gpu() {
    for extra in [&[][..], &["--backward"][..]] {
        let (code, stdout, stderr) = host(&[&["check", "--random", "3", "--device", "auto"][..], extra].concat());
        assert_eq!(code, 0, "{stderr}\n{stdout}");
        assert!(stdout.contains("all cases within"), "{stdout}");
        if host::gpu::driver_present().is_err() {
            assert!(stderr.contains("running on the CPU backend"), "{stderr}");
            assert!(stdout.contains("backend cpu") && stdout.contains("/ cpu backend"), "{stdout}");
        }
    }
    if host::gpu::driver_present().is_err() {
        let (code, _, stderr) = host(&["check", "--device", "gpu"]);
        assert_eq!(code, 1, "{stderr}");
        assert!(
            stderr.contains("needs a CUDA GPU of compute capability 9.0") && stderr.contains("--device cpu"),
            "{stderr}"
        );
        let (code, _, stderr) = host(&["bench"]);
        assert_eq!(code, 1, "{stderr}");
        assert!(stderr.contains("`host bench` times the GPU kernels") && stderr.contains("--device cpu"), "{stderr}");
    }
}

/// `host::cli::run` returns the same errors as values (no exit, no panic).
#[test]
fn the_library_entry_point_returns_errors() {
    let r = host::cli::run(["host", "forward", "--device", "cpu", "--shape", "4,16,96", "--groups", "7"]);
    match r {
        Err(host::cli::Failure::Run(e)) => assert!(e.to_string().contains("--groups 7"), "{e}"),
        other => panic!("expected a run error, got {other:?}"),
    }
    assert!(matches!(host::cli::run(["host", "forward", "--groups", "x"]), Err(host::cli::Failure::Usage(_))));
}

/// The per-step losses `host train` prints.
fn losses(stdout: &str) -> Vec<f64> {
    stdout
        .lines()
        .filter(|l| l.starts_with("step"))
        .map(|l| l.split("loss ").nth(1).and_then(|t| t.split_whitespace().next()).unwrap().parse().unwrap())
        .collect()
}

/// Data parallel (ranks run in turn on the CPU backend) takes the same steps as one
/// rank on the whole batch: the ranks' mean-loss gradients averaged are the batch's.
/// Only f32 rounding of the sums differs; 1e-5 relative after Adam's 8 steps.
#[test]
fn data_parallel_training_follows_one_ranks_losses() {
    let run = |n: &str| {
        let (code, out, err) =
            host(&["train", "--device", "cpu", "--steps", "8", "--batch", "64", "--data-parallel", n]);
        assert_eq!(code, 0, "{err}");
        losses(&out)
    };
    let one = run("1");
    assert_eq!(one.len(), 8);
    for n in ["2", "4"] {
        for (step, (a, b)) in one.iter().zip(run(n)).enumerate() {
            assert!((a - b).abs() <= 1e-5 * a.abs(), "--data-parallel {n}, step {}: {b} vs {a}", step + 1);
        }
    }
    let (code, _, err) = host(&["train", "--device", "cpu", "--steps", "1", "--batch", "64", "--data-parallel", "3"]);
    assert_ne!(code, 0);
    assert!(err.contains("does not split evenly over 3") && err.contains("multiple of 3"), "{err}");
}

/// `--tensor-parallel` runs (ranks in turn on the CPU backend) and passes the f64
/// check; a count that would cut a GroupNorm group is refused with the counts that work.
#[test]
fn tensor_parallel_cli_checks_and_refuses() {
    for cmd in ["forward", "backward"] {
        let args = ["--device", "cpu", "--model", "M1", "--groups", "16", "--shape", "16,32,512"];
        let (code, out, err) = host(&[&[cmd, "--tensor-parallel", "4"][..], &args].concat());
        assert_eq!(code, 0, "{cmd}: {err}");
        assert!(out.contains("4 ranks of Linear(32, 128)") && out.contains(": ok"), "{cmd}: {out}");
        assert!(!out.contains("FAILED"), "{out}");
        let (code, _, err) = host(&[&[cmd, "--tensor-parallel", "3"][..], &args].concat());
        assert_ne!(code, 0);
        assert!(err.contains("would cut a group of groupnorm(16)") && err.contains("1, 2, 4, 8, 16"), "{err}");
    }
}

//! Fuzz-style test of the safetensors reader: a valid weights file corrupted many
//! ways (truncated at every offset, header bytes flipped, random text in the JSON,
//! huge declared lengths, wrong offsets, shapes and dtypes). `TensorFile::open/get`
//! and `host forward --weights` must never panic: they return an error, or succeed
//! with tensors of the asked-for shape. Seeded, so a failure reproduces.

use host::cli::Failure;
use host::io::{TensorFile, write};
use host::{BlockSpec, Params, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};

const OPS: &str = "bias,groupnorm(2)";
const SHAPE: &str = "3,4,6";

/// The block whose weights are fuzzed: Linear(4, 6), then bias and GroupNorm(2).
fn spec() -> BlockSpec {
    BlockSpec::new(4, 6, OPS.parse().unwrap()).unwrap()
}

/// The valid file: every parameter of [`spec`], values `0.1 * i`.
fn valid_file(path: &Path) -> Vec<u8> {
    let spec = spec();
    let mut i = 0;
    let tensors = spec
        .param_specs()
        .iter()
        .map(|s| {
            Tensor::from_fn(&s.shape, |_| {
                i += 1;
                0.1 * i as f32
            })
            .unwrap()
        })
        .collect();
    let params = Params::from_flat(&spec, tensors).unwrap();
    let names: Vec<String> = spec.param_specs().into_iter().map(|s| s.name).collect();
    let named: Vec<(&str, &Tensor<f32>)> = names.iter().map(String::as_str).zip(params.flat()).collect();
    write(path, &named).unwrap();
    std::fs::read(path).unwrap()
}

/// The header's JSON text and where the data starts.
fn split(file: &[u8]) -> (String, usize) {
    let n = u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
    (String::from_utf8(file[8..8 + n].to_vec()).unwrap(), 8 + n)
}

/// A file with header `json` (length prefix recomputed) and `data`.
fn with_header(json: &str, data: &[u8]) -> Vec<u8> {
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(json.as_bytes());
    out.extend_from_slice(data);
    out
}

/// Every way of corrupting `file`, each with a name saying how.
fn corruptions(file: &[u8], rng: &mut StdRng) -> Vec<(String, Vec<u8>)> {
    let (json, data_start) = split(file);
    let data = &file[data_start..];
    let mut cases = Vec::new();

    for cut in 0..file.len() {
        cases.push((format!("truncated at {cut}"), file[..cut].to_vec()));
    }
    for i in 0..150 {
        let mut f = file.to_vec();
        let at = rng.random_range(0..data_start);
        f[at] ^= rng.random_range(1..=255u8);
        cases.push((format!("header flip {i} at {at}"), f));
    }
    for i in 0..100 {
        let mut text = json.clone().into_bytes();
        let at = rng.random_range(0..text.len());
        let len = rng.random_range(1..=8).min(text.len() - at);
        for b in &mut text[at..at + len] {
            *b = rng.random_range(b' '..=b'~');
        }
        let text = String::from_utf8(text).unwrap();
        cases.push((format!("random JSON text {i} at {at}"), with_header(&text, data)));
    }
    for declared in [0u64, 1, 7, 8, u32::MAX as u64, 100_000_001, 1 << 40, 1 << 63, u64::MAX].into_iter().chain([
        json.len() as u64 - 1,
        json.len() as u64 + 1,
        file.len() as u64,
    ]) {
        let mut f = file.to_vec();
        f[..8].copy_from_slice(&declared.to_le_bytes());
        cases.push((format!("declared header length {declared}"), f));
    }
    // Field by field: every tensor's offsets, shape and dtype replaced.
    let total = data.len();
    let fields: [(&str, Vec<String>); 3] = [
        (
            "\"data_offsets\":[",
            vec![
                "0,0".into(),
                format!("0,{}", total + 4),
                format!("{total},{}", total + 96),
                "96,0".into(),
                "0,96".into(),
                format!("{},{}", u64::MAX - 3, u64::MAX),
                "4,100".into(),
                "-4,92".into(),
                "0.5,96".into(),
            ],
        ),
        (
            "\"shape\":[",
            vec![
                "".into(),
                "0".into(),
                "4,6".into(),
                "6,4,1".into(),
                "24".into(),
                "18446744073709551615,2".into(),
                "4294967296,4294967296".into(),
                "-1,4".into(),
                "6.5,4".into(),
                "1e3".into(),
            ],
        ),
        (
            "\"dtype\":\"",
            ["F64", "F16", "BF16", "I32", "I64", "U8", "BOOL", "F8_E4M3", "XYZ", ""].map(String::from).to_vec(),
        ),
    ];
    for (key, values) in &fields {
        let close = if key.ends_with('[') { ']' } else { '"' };
        let mut from = 0;
        while let Some(pos) = json[from..].find(key) {
            let start = from + pos + key.len();
            let end = start + json[start..].find(close).unwrap();
            for v in values {
                let text = format!("{}{v}{}", &json[..start], &json[end..]);
                cases.push((format!("{key}{v}{close} at byte {start}"), with_header(&text, data)));
            }
            from = end;
        }
    }
    // Data bytes: NaN, Inf and garbage in the values themselves.
    for i in 0..20 {
        let mut f = file.to_vec();
        let at = rng.random_range(data_start..f.len());
        f[at] = rng.random();
        cases.push((format!("data byte {i} at {at}"), f));
    }
    cases
}

/// Opens and reads every tensor; `Err` says what went wrong if a result breaks the contract.
fn probe(path: &Path, spec: &BlockSpec) -> Result<(), String> {
    let file = match TensorFile::open(path) {
        Ok(f) => f,
        Err(e) => {
            let e = e.to_string();
            return if e.contains(&path.display().to_string()) {
                Ok(())
            } else {
                Err(format!("error without the path: {e}"))
            };
        }
    };
    for s in spec.param_specs() {
        let _ = file.shape_of(&s.name);
        match file.get(&s.name, &s.shape) {
            Ok(t) if t.shape() == s.shape.as_slice() && t.len() == s.shape.iter().product::<usize>() => {}
            Ok(t) => return Err(format!("`{}` read with shape {:?}, asked {:?}", s.name, t.shape(), s.shape)),
            Err(e) if e.to_string().contains(&format!("`{}`", s.name)) => {}
            Err(e) => return Err(format!("error not naming `{}`: {e}", s.name)),
        }
    }
    Ok(())
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn corrupted_files_never_panic() {
    let dir = TempDir(std::env::temp_dir().join(format!("host-fuzz-{}", std::process::id())));
    std::fs::create_dir_all(&dir.0).unwrap();
    let valid = valid_file(&dir.0.join("valid.safetensors"));
    let spec = spec();
    assert_eq!(probe(&dir.0.join("valid.safetensors"), &spec), Ok(()));

    let mut rng = StdRng::seed_from_u64(0x5afe);
    let cases = corruptions(&valid, &mut rng);
    assert!(cases.len() > 600, "{} cases", cases.len());
    let path = dir.0.join("fuzzed.safetensors");
    let path_arg = path.to_str().unwrap().to_string();
    let (mut failures, mut opened, mut cli_runs) = (Vec::new(), 0, 0);
    for (i, (name, bytes)) in cases.iter().enumerate() {
        std::fs::write(&path, bytes).unwrap();
        opened += usize::from(TensorFile::open(&path).is_ok());
        match catch_unwind(AssertUnwindSafe(|| probe(&path, &spec))) {
            Ok(Ok(())) => {}
            Ok(Err(why)) => failures.push(format!("{name}: {why}")),
            Err(_) => failures.push(format!("{name}: TensorFile panicked")),
        }
        // The whole command on every fourth case (in process: fast).
        if i % 4 == 0 {
            cli_runs += 1;
            let args = ["host", "forward", "--device", "cpu", "--ops", OPS, "--shape", SHAPE, "--weights", &path_arg];
            match catch_unwind(AssertUnwindSafe(|| host::cli::run(args))) {
                Ok(Ok(()) | Err(Failure::Run(_) | Failure::CheckFailed(_))) => {}
                Ok(Err(Failure::Usage(e))) => failures.push(format!("{name}: forward: usage error {e}")),
                Err(_) => failures.push(format!("{name}: forward panicked")),
            }
        }
    }
    println!("{} corrupted files: {opened} still opened, {cli_runs} run through forward", cases.len());
    assert!(failures.is_empty(), "{} of {} cases:\n{}", failures.len(), cases.len(), failures.join("\n"));
    // Some corruptions keep a valid file (data bytes, shapes swapped back): the test
    // must have seen both outcomes.
    assert!(opened > 0 && opened < cases.len(), "{opened} of {} opened", cases.len());
}

/// The binary on a sample of the same files: an exit code and `error:`, never a panic (101).
#[test]
fn the_binary_exits_cleanly_on_corrupted_weights() {
    let dir = TempDir(std::env::temp_dir().join(format!("host-fuzz-bin-{}", std::process::id())));
    std::fs::create_dir_all(&dir.0).unwrap();
    let valid = valid_file(&dir.0.join("valid.safetensors"));
    let mut rng = StdRng::seed_from_u64(0xb1a);
    let cases = corruptions(&valid, &mut rng);
    let path = dir.0.join("fuzzed.safetensors");
    let mut failures = Vec::new();
    for (name, bytes) in cases.iter().step_by(cases.len() / 24) {
        std::fs::write(&path, bytes).unwrap();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_host"))
            .args(["forward", "--device", "cpu", "--ops", OPS, "--shape", SHAPE, "--weights"])
            .arg(&path)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let clean = match out.status.code() {
            Some(0) => true,
            Some(1 | 2) => stderr.starts_with("error: "),
            _ => false,
        };
        if !clean || stderr.contains("panicked") {
            failures.push(format!("{name}: exit {:?}, stderr {stderr}", out.status.code()));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

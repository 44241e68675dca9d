//! What the commands share: the block and data they run on (`BlockArgs` -> `Setup`
//! -> `Problem`), the backend choice, the GPU tuning switches, and small formatting
//! helpers.

use crate::block::{BlockSpec, Params};
use crate::chain::{Chain, Op, Preset};
use crate::error::{Error, Result};
use crate::gpu::block::{DeviceParams, GpuBlock};
use crate::gpu::{Gpu, Tuning};
use crate::io::TensorFile;
use crate::precision::Precision;
use crate::tensor::{Bf16, Tensor};
use clap::ValueEnum;
use rand::SeedableRng;
use rand::rngs::StdRng;
use std::path::PathBuf;

/// Which backend runs the block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DeviceChoice {
    /// The GPU if one is usable, else the CPU (saying so).
    Auto,
    Cpu,
    Gpu,
}

/// `--ops`'s long help: the syntax of every op, from the registry.
fn ops_help() -> String {
    format!(
        "Epilogue chain instead of the model's, comma-separated, e.g. \"groupnorm(256),swish,mul,swish\":\n{}",
        crate::chain::syntax_help()
    )
}

/// Flags that say which block to build and with what data; shared by commands.
#[derive(clap::Args, Debug, Clone)]
pub struct BlockArgs {
    /// Reference model (chain preset): M1..M5 (default: the chain a --weights file names
    /// in its metadata, else M1).
    #[arg(long)]
    pub(super) model: Option<String>,
    /// Epilogue chain instead of the model's, e.g. "groupnorm(256),swish,mul,swish".
    #[arg(long, long_help = ops_help())]
    pub(super) ops: Option<String>,
    /// BATCH,IN,OUT (default: from --input/--weights, else the model's seed size).
    #[arg(long)]
    pub(super) shape: Option<String>,
    /// Number of groups of every GroupNorm in the chain.
    #[arg(long)]
    pub(super) groups: Option<usize>,
    /// Seed of the random inputs and parameters.
    #[arg(long, default_value_t = 0)]
    pub(super) seed: u64,
    /// safetensors file with the parameters, named as the PyTorch modules' (lin.weight, lin.bias, gn.weight, ...).
    #[arg(long)]
    pub(super) weights: Option<PathBuf>,
    /// safetensors file with the input tensor `x` (batch, in).
    #[arg(long)]
    pub(super) input: Option<PathBuf>,
    /// Arithmetic of the GPU GEMMs: fp32 (FMA units), tf32x3 (tensor cores,
    /// FP32-accurate), tf32 (tensor cores, TF32 operands), bf16 (tensor cores, bf16
    /// operands, FP32 sums). The epilogue is always FP32; the CPU backend always
    /// computes in FP32. Default: the precision a --weights file names, else fp32.
    #[arg(long, value_enum)]
    pub(super) precision: Option<Precision>,
}

/// The GPU backend's A/B switches ([`Tuning`]): without any of them, production. Shared
/// by every command that runs on the GPU.
#[derive(clap::Args, Debug, Clone, Copy, Default)]
#[command(next_help_heading = "Tuning (A/B switches of the GPU backend; default: production)")]
pub struct TuningArgs {
    /// Keep the TF32, 3xTF32 and bf16 GEMMs off the persistent TMA kernels: the
    /// `gemm_wgmma` kernels (bf16: `mma.sync`) run them instead.
    #[arg(long)]
    pub(super) no_tma: bool,
    /// Backward: skip the exact recomputation of `z` near kinks (faster; the gradients
    /// are taken at the forward's rounded `z`).
    #[arg(long)]
    pub(super) no_kink_refinement: bool,
    /// Backward: refine near kinks by 16-column chunks only, never value by value.
    #[arg(long)]
    pub(super) kink_chunks_only: bool,
    /// Backward: print how much of `z` the kink refinement recomputed (waits for the
    /// GPU after each refinement).
    #[arg(long)]
    pub(super) kink_stats: bool,
    /// Forward: run every batch on the tile GEMMs, never a small-batch kernel (`gemv_*`,
    /// `gemv_tc_*`).
    #[arg(long)]
    pub(super) no_gemv: bool,
    /// Forward: small batches on the FP32-FMA `gemv_*` (up to 8 rows), not the
    /// tensor-core `gemv_tc_*`.
    #[arg(long)]
    pub(super) no_gemv_tensor_cores: bool,
    /// Forward: split `k` into N ranges wherever the dispatch would split it at all
    /// (1: never), instead of the dispatch's count.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=64))]
    pub(super) split_k: Option<u16>,
}

impl TuningArgs {
    /// The switches as the GPU backend takes them.
    pub fn tuning(&self) -> Tuning {
        Tuning {
            tma: !self.no_tma,
            kink_refinement: !self.no_kink_refinement,
            kink_values: !self.kink_chunks_only,
            kink_stats: self.kink_stats,
            gemv: !self.no_gemv,
            gemv_tensor_cores: !self.no_gemv_tensor_cores,
            split_k: self.split_k.map(usize::from),
        }
    }
}

/// A block ready to run: its spec, parameters and input.
pub struct Problem {
    pub name: String,
    pub precision: Precision,
    pub spec: BlockSpec,
    pub params: Params<f32>,
    pub x: Tensor<f32>,
    /// A bf16 model's block: `--precision bf16` with `x` or the Linear weight stored as
    /// BF16 in the files. `x` and the parameters hold bf16 values (widened exactly), the
    /// GPU keeps them bf16 (`GpuBlock<Bf16>`), and outputs are written as BF16.
    pub bf16: Option<Bf16Model>,
}

impl Problem {
    /// What the files this run writes say of their block (safetensors metadata).
    pub fn meta(&self) -> crate::io::BlockMeta {
        crate::io::BlockMeta { chain: self.spec.chain.to_string(), precision: self.precision.to_string() }
    }
}

/// A bf16 model's block on `gpu`: the Linear weight uploaded as bf16, the bias and the
/// chain's parameters as FP32 (their values as read: bf16 where the file held BF16).
pub fn bf16_block(gpu: &Gpu, p: &Problem) -> Result<GpuBlock<Bf16>> {
    let ops = p.params.ops.iter().map(|v| v.iter().map(|t| gpu.upload(t)).collect()).collect::<Result<_>>()?;
    let params = DeviceParams {
        linear_weight: gpu.upload(&p.params.linear_weight.to_bf16())?,
        linear_bias: gpu.upload(&p.params.linear_bias)?,
        ops,
    };
    GpuBlock::from_device_in(gpu, &p.spec, params, Precision::Bf16)
}

/// Which of a bf16 model's tensors the files stored as BF16 (their outputs and
/// gradients are written the same way), in [`BlockSpec::param_specs`] order.
#[derive(Clone, Debug)]
pub struct Bf16Model {
    pub params: Vec<bool>,
}

/// A block's chain, sizes and files, all checked, before any tensor is allocated:
/// commands check what their backend can hold here, then [`Setup::load`] the data.
pub struct Setup {
    pub name: String,
    pub spec: BlockSpec,
    pub batch: usize,
    /// Where the sizes came from (`--shape ...`, a file's tensor, a seed size), to name
    /// in errors about them.
    pub shape_origin: String,
    pub(super) weights: Option<TensorFile>,
    pub(super) input: Option<TensorFile>,
    pub(super) seed: u64,
    pub(super) precision: Precision,
}

impl BlockArgs {
    /// Builds the block and its data, checking every file against the shape and the
    /// sizes against this machine's memory.
    pub fn problem(&self) -> Result<Problem> {
        let setup = self.setup()?;
        setup.check_host_memory(0, 0)?;
        setup.load()
    }

    /// Parses the chain and the sizes and opens the files; allocates no tensor.
    pub fn setup(&self) -> Result<Setup> {
        let preset: Preset = match &self.model {
            Some(m) => m
                .parse()
                .map_err(|_| Error::Argument(format!("--model {m}: unknown model; expected M1, M2, M3, M4 or M5")))?,
            None => Preset::M1,
        };
        let open = |flag: &str, path: &Option<PathBuf>| {
            path.as_deref().map(TensorFile::open).transpose().map_err(|e| Error::Argument(format!("{flag} {e}")))
        };
        let weights = open("--weights", &self.weights)?;
        let input = open("--input", &self.input)?;
        // A weights file may say which block it belongs to (fused_linear.save, the CLI's
        // outputs): its chain is the default, and one asked for must be the same.
        let file_meta = weights.as_ref().and_then(|f| f.block_meta().map(|m| (f.path().to_path_buf(), m)));
        let file_chain = match &file_meta {
            Some((path, m)) => Some(m.chain.parse::<Chain>().map_err(|e| {
                Error::file(path, format!("its metadata names the chain `{}`, which does not parse: {e}", m.chain))
            })?),
            None => None,
        };
        let (chain, name) = match (&self.ops, &self.model, &file_chain, &file_meta) {
            (Some(ops), _, _, _) => (ops.parse::<Chain>()?, "custom".to_string()),
            (None, Some(_), _, _) => (preset.chain(), preset.to_string()),
            (None, None, Some(c), Some((path, _))) => (c.clone(), format!("from {}", path.display())),
            _ => (preset.chain(), preset.to_string()),
        };
        let chain = match self.groups {
            Some(0) => return Err(Error::Argument("--groups 0: a GroupNorm needs at least 1 group".into())),
            Some(g) if !chain.has_group_norm() => {
                return Err(Error::Argument(format!("--groups {g} given, but the chain `{chain}` has no groupnorm")));
            }
            Some(g) => chain.with_groups(g),
            None => chain,
        };
        if let (Some(theirs), Some((path, _))) = (&file_chain, &file_meta)
            && theirs.to_string() != chain.to_string()
        {
            return Err(Error::Argument(format!(
                "--weights {} holds a block of chain `{theirs}` (its metadata), but this run asks for `{chain}`: \
                 leave out --model, --ops and --groups to run the file's, or pass --ops \"{theirs}\"",
                path.display()
            )));
        }
        let precision = match (self.precision, &file_meta) {
            (Some(p), _) => p,
            (None, Some((path, m))) if !m.precision.is_empty() => {
                <Precision as clap::ValueEnum>::from_str(&m.precision, true).map_err(|_| {
                    Error::file(
                        path,
                        format!(
                            "its metadata names the precision `{}`, which is not one of fp32, tf32x3, tf32, bf16, fp16",
                            m.precision
                        ),
                    )
                })?
            }
            _ => Precision::Fp32,
        };

        let (batch, in_f, out_f, shape_origin) = match &self.shape {
            Some(s) => {
                let (b, i, o) = parse_shape(s)?;
                (b, i, o, format!("--shape {s}"))
            }
            None => {
                let (sb, si, so) = preset.seed_shape();
                let x_shape = input.as_ref().and_then(|f| f.shape_of("x"));
                let w_shape = weights.as_ref().and_then(|f| f.shape_of("lin.weight"));
                let x_dim = |i: usize| x_shape.as_ref().and_then(|s| s.get(i).copied());
                let w_dim = |i: usize| w_shape.as_ref().and_then(|s| s.get(i).copied());
                let batch = x_dim(0).unwrap_or(sb);
                let in_f = x_dim(1).or(w_dim(1)).unwrap_or(si);
                let out_f = w_dim(0).unwrap_or(so);
                let mut origins = Vec::new();
                if let (Some(s), Some(f)) = (&x_shape, &input) {
                    if batch == 0 {
                        return Err(Error::tensor(
                            "x",
                            format!("in {} has shape {s:?}: 0 rows; the batch must be at least 1", f.path().display()),
                        ));
                    }
                    origins.push(format!("x {s:?} in {}", f.path().display()));
                }
                if let (Some(s), Some(f)) = (&w_shape, &weights) {
                    origins.push(format!("lin.weight {s:?} in {}", f.path().display()));
                }
                if x_dim(0).is_none() || x_dim(1).or(w_dim(1)).is_none() || w_dim(0).is_none() {
                    origins.push(format!("the seed size of {preset} ({sb},{si},{so})"));
                }
                (batch, in_f, out_f, origins.join(", "))
            }
        };
        if let Some(g) = self.groups {
            check_groups_flag(g, &chain, out_f)?;
        }
        let spec = BlockSpec::new(in_f, out_f, chain).map_err(|e| with_origin(&shape_origin, e))?;
        spec.check_batch(batch).map_err(|e| with_origin(&shape_origin, e))?;
        Ok(Setup { name, spec, batch, shape_origin, weights, input, seed: self.seed, precision })
    }
}

impl Setup {
    /// Refuses sizes the GPU kernels cannot launch (see [`crate::gpu::check_launch_sizes`]).
    pub fn check_gpu_limits(&self) -> Result<()> {
        let s = &self.spec;
        crate::gpu::check_launch_sizes(self.batch, s.in_features, s.out_features)
            .map_err(|e| with_origin(&self.shape_origin, e))
    }

    /// Refuses a block whose input, weight and two activations cannot fit `gpu`'s memory.
    pub fn check_device_memory(&self, gpu: &Gpu) -> Result<()> {
        let (b, i, o) = (self.batch as u128, self.spec.in_features as u128, self.spec.out_features as u128);
        crate::gpu::check_device_memory(4 * (b * i + o * i + 2 * b * o), gpu.props.total_memory)
    }

    /// Refuses a run that cannot fit in this machine's memory: the f32 input and
    /// weight, `activations` f32 copies of the widest activation (what the backend
    /// holds at once) and `check_rows` rows checked in f64. A rough lower bound: it is
    /// there to turn a certain allocation failure (an abort) into an error.
    pub fn check_host_memory(&self, activations: usize, check_rows: usize) -> Result<()> {
        let Some(total) = host_memory_bytes() else { return Ok(()) };
        let s = &self.spec;
        let widest = (0..=s.chain.0.len()).map(|i| s.features_at(i)).max().unwrap_or(s.out_features) as u128;
        let (b, i, o) = (self.batch as u128, s.in_features as u128, s.out_features as u128);
        let checked = check_rows.min(self.batch) as u128;
        let needed = 4 * (b * i + o * i + activations as u128 * b * widest) + 8 * checked * (i + 3 * widest);
        if needed > total {
            let gib = |bytes: u128| bytes as f64 / (1u64 << 30) as f64;
            return Err(Error::Shape(format!(
                "{}: the run needs at least {:.1} GiB of memory; this machine has {:.1} GiB",
                self.shape_origin,
                gib(needed),
                gib(total)
            )));
        }
        Ok(())
    }

    /// Reads the parameters and `x` from the files (or draws them), checking shapes.
    pub fn load(self) -> Result<Problem> {
        let Setup { name, spec, batch, shape_origin, weights, input, seed, precision } = self;
        // A shape error says where the expected shape came from.
        let read = |f: &TensorFile, name: &str, shape: &[usize]| match f.shape_of(name) {
            Some(s) if s != shape => Err(Error::tensor(
                name,
                format!("in {} has shape {s:?}; expected {shape:?} (sizes from {shape_origin})", f.path().display()),
            )),
            _ => f.get(name, shape),
        };
        let mut rng = StdRng::seed_from_u64(seed);
        let params = match &weights {
            Some(f) => {
                let tensors = spec.param_specs().iter().map(|p| read(f, &p.name, &p.shape)).collect::<Result<_>>()?;
                Params::from_flat(&spec, tensors)?
            }
            None => Params::init(&spec, &mut rng),
        };
        let x = match &input {
            Some(f) => read(f, "x", &[batch, spec.in_features])?,
            None => crate::block::random_input(batch, spec.in_features, &mut rng)?,
        };
        // A bf16 model: --precision bf16 and x or the Linear weight stored as BF16. Both
        // must then be (or be drawn, and rounded): a bf16 model's GEMM takes the two alike.
        let stored = |f: &Option<TensorFile>, name: &str| f.as_ref().and_then(|f| f.is_bf16(name));
        let (x_bf16, w_bf16) = (stored(&input, "x"), stored(&weights, "lin.weight"));
        let bf16 = match (precision, x_bf16, w_bf16) {
            (Precision::Bf16, Some(true), Some(false)) | (Precision::Bf16, Some(false), Some(true)) => {
                return Err(Error::Argument(format!(
                    "x is stored as {} but lin.weight as {}: a bf16 model takes both in BF16 (or both in F32 \
                     for --precision bf16 on float32 tensors)",
                    if x_bf16 == Some(true) { "BF16" } else { "F32" },
                    if w_bf16 == Some(true) { "BF16" } else { "F32" }
                )));
            }
            (Precision::Bf16, Some(true), _) | (Precision::Bf16, _, Some(true)) => Some(Bf16Model {
                params: spec.param_specs().iter().map(|p| stored(&weights, &p.name).unwrap_or(true)).collect(),
            }),
            _ => None,
        };
        // Drawn values of a bf16 model are rounded to bf16, as its tensors hold (those
        // read as BF16 are bf16 values already).
        let (x, params) = match &bf16 {
            Some(m) => {
                let flat = params.flat().into_iter().zip(&m.params);
                let rounded = flat.map(|(t, &b)| if b { t.to_bf16().to_f32() } else { t.clone() }).collect();
                (x.to_bf16().to_f32(), Params::from_flat(&spec, rounded)?)
            }
            None => (x, params),
        };
        spec.check_input(&x)?;
        Ok(Problem { name, precision, spec, params, x, bf16 })
    }
}

/// Prefixes a size error with where the sizes came from.
fn with_origin(origin: &str, e: Error) -> Error {
    match e {
        Error::Shape(m) => Error::Shape(format!("{origin}: {m}")),
        e => e,
    }
}

/// `--groups g` must divide the channels at every GroupNorm of the chain (which
/// `BlockSpec::new` checks too, but without naming the flag).
fn check_groups_flag(g: usize, chain: &Chain, out_features: usize) -> Result<()> {
    let mut f = out_features;
    for (i, op) in chain.0.iter().enumerate() {
        if matches!(op, Op::GroupNorm { .. }) && !f.is_multiple_of(g) {
            return Err(Error::Argument(format!(
                "--groups {g}: the number of groups must divide the {f} channels at op {} (`{op}`); {}",
                i + 1,
                crate::chain::divisors_hint(f)
            )));
        }
        match op.out_features(f) {
            Ok(next) => f = next,
            Err(_) => return Ok(()), // BlockSpec::new reports it
        }
    }
    Ok(())
}

/// Total memory of this machine (Linux: `MemTotal` of /proc/meminfo), if known.
fn host_memory_bytes() -> Option<u128> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u128 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

fn parse_shape(s: &str) -> Result<(usize, usize, usize)> {
    let parts: Vec<&str> = s.split(',').map(str::trim).collect();
    if parts.len() != 3 {
        return Err(Error::Argument(format!("--shape {s}: expected BATCH,IN,OUT (three whole numbers)")));
    }
    let mut dims = [0usize; 3];
    for ((d, part), what) in dims.iter_mut().zip(&parts).zip(["BATCH", "IN", "OUT"]) {
        *d = part.parse().map_err(|_| {
            Error::Argument(format!("--shape {s}: {what} `{part}` is not a whole number from 1 to {}", usize::MAX))
        })?;
        if *d == 0 {
            return Err(Error::Argument(format!("--shape {s}: {what} must be at least 1, got 0")));
        }
    }
    Ok((dims[0], dims[1], dims[2]))
}

/// The backend chosen for a run.
pub enum Backend {
    Cpu,
    Gpu(Box<Gpu>),
}

impl Backend {
    /// Opens the backend asked for, a GPU with `tuning`'s production paths. `auto` falls
    /// back to the CPU with a one-line note.
    pub fn open(choice: DeviceChoice, tuning: Tuning) -> Result<Backend> {
        match choice {
            DeviceChoice::Cpu => Ok(Backend::Cpu),
            DeviceChoice::Gpu => {
                let gpu = Gpu::open(0).map_err(|e| {
                    Error::NoGpu(format!(
                        "{}; --device gpu needs a CUDA GPU of compute capability 9.0 (H100, H200); \
                         --device cpu runs the CPU backend",
                        no_gpu_reason(e)
                    ))
                })?;
                Ok(Backend::Gpu(Box::new(gpu.with_tuning(tuning))))
            }
            DeviceChoice::Auto => match Gpu::open(0) {
                Ok(gpu) => Ok(Backend::Gpu(Box::new(gpu.with_tuning(tuning)))),
                Err(e) => {
                    eprintln!("note: {e}; running on the CPU backend");
                    Ok(Backend::Cpu)
                }
            },
        }
    }
}

/// Why a GPU could not be opened, without the error's own "no GPU: " prefix (for
/// messages that go on to say what the command needs).
pub fn no_gpu_reason(e: Error) -> String {
    match e {
        Error::NoGpu(reason) => reason,
        other => other.to_string(),
    }
}

/// `flops` done in `ms` milliseconds as a rate: TFLOP/s from 1 TFLOP/s up, else GFLOP/s.
pub fn flop_rate(flops: f64, ms: f64) -> String {
    let per_s = flops / (ms * 1e-3);
    if per_s >= 1e12 { format!("{:.2} TFLOP/s", per_s / 1e12) } else { format!("{:.1} GFLOP/s", per_s / 1e9) }
}

/// What the CPU backend's summary line adds when `--precision` asked for something
/// it does not do (it computes in FP32, which 3xTF32 matches).
pub fn cpu_precision_note(p: Precision) -> String {
    match p {
        Precision::Fp32 | Precision::Tf32x3 | Precision::Fp8 | Precision::Fp8GwBf16 => String::new(),
        p => format!(" (--precision {p} is the GPU's: FP32 here)"),
    }
}

/// `n` row indices spread evenly over `batch` rows, first and last included (at most
/// `batch` of them), for checks against the reference on a sample.
pub fn sample_rows(batch: usize, n: usize) -> Vec<usize> {
    let n = n.min(batch);
    // In u128: i * (batch - 1) can exceed u64 for a huge batch checked in full.
    let spread = |i: usize| (i as u128 * (batch as u128 - 1) / (n as u128 - 1)) as usize;
    (0..n).map(|i| if n == 1 { 0 } else { spread(i) }).collect()
}

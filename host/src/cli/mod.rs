//! The command line: argument parsing and the commands. `main.rs` only maps the
//! outcome to an exit code, so tests can call [`run`] directly.

mod backward;
mod bench;
mod check;
mod forward;
mod train;

use crate::block::{BlockSpec, Params};
use crate::chain::{Chain, Preset};
use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::gpu::gemm::simt::Precision;
use crate::io::TensorFile;
use crate::tensor::Tensor;
use clap::{Parser, Subcommand, ValueEnum};
use rand::SeedableRng;
use rand::rngs::StdRng;
use std::ffi::OsString;
use std::path::PathBuf;

/// How a command ended, when not successfully.
#[derive(Debug)]
pub enum Failure {
    /// Bad command line (clap's own message, or help/version output).
    Usage(clap::Error),
    /// The command could not run.
    Run(Error),
    /// It ran, but a result did not match the reference.
    CheckFailed(String),
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure::Run(e)
    }
}

#[derive(Parser, Debug)]
#[command(name = "host", version, about = "Fused Linear + epilogue blocks on the GPU, with a CPU reference")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run one block's forward pass and print a summary (backend, time, checksum,
    /// error against the f64 CPU reference on sample rows).
    Forward(forward::ForwardArgs),
    /// Run one block's forward and backward; print a summary and write the gradients.
    Backward(backward::BackwardArgs),
    /// Time blocks on the GPU against cuBLAS's SGEMM alone (same process, strict FP32).
    Bench(bench::BenchArgs),
    /// Fit a two-block MLP to a teacher network with MSE and Adam/SGD; print the loss.
    Train(train::TrainArgs),
    /// Check the GPU against the f64 CPU reference: every preset and random chains.
    Check(check::CheckArgs),
}

/// Which backend runs the block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DeviceChoice {
    /// The GPU if one is usable, else the CPU (saying so).
    Auto,
    Cpu,
    Gpu,
}

/// Flags that say which block to build and with what data; shared by commands.
#[derive(clap::Args, Debug, Clone)]
pub struct BlockArgs {
    /// Reference model (chain preset): M1..M5.
    #[arg(long, default_value = "M1")]
    model: String,
    /// Epilogue chain instead of the model's, e.g. "groupnorm(256),swish,mul,swish".
    #[arg(long)]
    ops: Option<String>,
    /// BATCH,IN,OUT (default: from --input/--weights, else the model's seed size).
    #[arg(long)]
    shape: Option<String>,
    /// Number of groups of every GroupNorm in the chain.
    #[arg(long)]
    groups: Option<usize>,
    /// Seed of the random inputs and parameters.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// safetensors file with the parameters, named as the PyTorch modules' (lin.weight, lin.bias, gn.weight, ...).
    #[arg(long)]
    weights: Option<PathBuf>,
    /// safetensors file with the input tensor `x` (batch, in).
    #[arg(long)]
    input: Option<PathBuf>,
    /// Arithmetic of the GPU GEMMs: fp32 (FMA units), tf32x3 (tensor cores,
    /// FP32-accurate), tf32 (tensor cores, TF32 operands). The epilogue is always FP32;
    /// the CPU backend always computes in FP32.
    #[arg(long, value_enum, default_value = "fp32")]
    precision: Precision,
}

/// A block ready to run: its spec, parameters and input.
pub struct Problem {
    pub name: String,
    pub precision: Precision,
    pub spec: BlockSpec,
    pub params: Params<f32>,
    pub x: Tensor<f32>,
}

impl BlockArgs {
    /// Builds the block and its data, checking every file against the shape.
    pub fn problem(&self) -> Result<Problem> {
        let preset: Preset = self.model.parse()?;
        let (chain, name) = match &self.ops {
            Some(ops) => (ops.parse::<Chain>()?, "custom".to_string()),
            None => (preset.chain(), preset.to_string()),
        };
        let chain = match self.groups {
            Some(0) => return Err(Error::Argument("--groups must be at least 1".into())),
            Some(g) if !chain.has_group_norm() => {
                return Err(Error::Argument(format!("--groups {g} given, but the chain `{chain}` has no groupnorm")));
            }
            Some(g) => chain.with_groups(g),
            None => chain,
        };
        let weights = self.weights.as_deref().map(TensorFile::open).transpose()?;
        let input = self.input.as_deref().map(TensorFile::open).transpose()?;

        let (batch, in_f, out_f) = match &self.shape {
            Some(s) => parse_shape(s)?,
            None => {
                let (sb, si, so) = preset.seed_shape();
                let x_shape = input.as_ref().and_then(|f| f.shape_of("x"));
                let w_shape = weights.as_ref().and_then(|f| f.shape_of("lin.weight"));
                let batch = x_shape.as_ref().and_then(|s| s.first().copied()).unwrap_or(sb);
                let in_f = x_shape.as_ref().and_then(|s| s.get(1).copied()).unwrap_or(si);
                let out_f = w_shape.as_ref().and_then(|s| s.first().copied()).unwrap_or(so);
                (batch, in_f, out_f)
            }
        };
        let spec = BlockSpec::new(in_f, out_f, chain)?;
        let mut rng = StdRng::seed_from_u64(self.seed);
        let params = match &weights {
            Some(f) => {
                let tensors = spec.param_specs().iter().map(|p| f.get(&p.name, &p.shape)).collect::<Result<_>>()?;
                Params::from_flat(&spec, tensors)?
            }
            None => Params::init(&spec, &mut rng),
        };
        let x = match &input {
            Some(f) => f.get("x", &[batch, in_f])?,
            None => crate::block::random_input(batch, in_f, &mut rng),
        };
        spec.check_input(&x)?;
        Ok(Problem { name, precision: self.precision, spec, params, x })
    }
}

fn parse_shape(s: &str) -> Result<(usize, usize, usize)> {
    let parts: Vec<_> = s.split(',').map(|p| p.trim().parse::<usize>()).collect();
    match parts[..] {
        [Ok(b), Ok(i), Ok(o)] if b > 0 && i > 0 && o > 0 => Ok((b, i, o)),
        [Ok(_), Ok(_), Ok(_)] => Err(Error::Argument(format!("--shape {s}: sizes must be at least 1"))),
        _ => Err(Error::Argument(format!("--shape {s}: expected BATCH,IN,OUT (three whole numbers)"))),
    }
}

/// The backend chosen for a run.
pub enum Backend {
    Cpu,
    Gpu(Box<Gpu>),
}

impl Backend {
    /// Opens the backend asked for. `auto` falls back to the CPU with a one-line note.
    pub fn open(choice: DeviceChoice) -> Result<Backend> {
        match choice {
            DeviceChoice::Cpu => Ok(Backend::Cpu),
            DeviceChoice::Gpu => Ok(Backend::Gpu(Box::new(Gpu::open(0)?))),
            DeviceChoice::Auto => match Gpu::open(0) {
                Ok(gpu) => Ok(Backend::Gpu(Box::new(gpu))),
                Err(e) => {
                    eprintln!("note: {e}; running on the CPU backend");
                    Ok(Backend::Cpu)
                }
            },
        }
    }
}

/// Parses `args` (program name first) and runs the command.
pub fn run<I, T>(args: I) -> Result<(), Failure>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = Cli::try_parse_from(args).map_err(Failure::Usage)?;
    match cli.command {
        Command::Forward(a) => forward::run(&a),
        Command::Backward(a) => backward::run(&a),
        Command::Bench(a) => bench::run(&a),
        Command::Check(a) => check::run(&a),
        Command::Train(a) => train::run(&a),
    }
}

//! The command line: argument parsing and the commands. `main.rs` only maps the
//! outcome to an exit code, so tests can call [`run`] directly.

mod args;
mod backward;
mod bench;
mod check;
mod forward;
mod parallel;
mod train;

use crate::error::Error;
pub use args::*;
use clap::{Parser, Subcommand};
use std::ffi::OsString;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::Tuning;

    /// No flag is production; each flag turns off (or on) exactly its switch.
    #[test]
    fn tuning_flags_are_the_gpu_tuning() {
        #[derive(Parser)]
        struct Flags {
            #[command(flatten)]
            tuning: TuningArgs,
        }
        let tuning = |args: &[&str]| Flags::try_parse_from([&["t"], args].concat()).unwrap().tuning.tuning();
        let production = Tuning::default();
        assert_eq!(tuning(&[]), production);
        assert_eq!(tuning(&["--no-tma"]), Tuning { tma: false, ..production });
        assert_eq!(tuning(&["--no-kink-refinement"]), Tuning { kink_refinement: false, ..production });
        assert_eq!(tuning(&["--kink-chunks-only"]), Tuning { kink_values: false, ..production });
        assert_eq!(tuning(&["--kink-stats"]), Tuning { kink_stats: true, ..production });
        assert_eq!(tuning(&["--no-gemv"]), Tuning { gemv: false, ..production });
        assert_eq!(tuning(&["--no-gemv-tensor-cores"]), Tuning { gemv_tensor_cores: false, ..production });
        assert_eq!(tuning(&["--split-k", "3"]), Tuning { split_k: Some(3), ..production });
        assert!(Flags::try_parse_from(["t", "--split-k", "0"]).is_err());
    }

    /// Every command that runs on the GPU takes the tuning flags.
    #[test]
    fn every_gpu_command_takes_the_tuning_flags() {
        for command in ["forward", "backward", "bench", "check", "train"] {
            let args = [
                "host",
                command,
                "--no-tma",
                "--no-kink-refinement",
                "--kink-chunks-only",
                "--kink-stats",
                "--no-gemv",
                "--no-gemv-tensor-cores",
                "--split-k",
                "2",
            ];
            assert!(Cli::try_parse_from(args).is_ok(), "{command}");
        }
    }
}

//! `host forward`: one block's forward pass, with a one-screen summary.

use super::{Backend, BlockArgs, DeviceChoice, Failure, Problem, TuningArgs};
use crate::check::compare_f32;
use crate::cpu;
use crate::error::{Error, Result};
use crate::gpu::block::GpuBlock;
use crate::reference;
use crate::tensor::Tensor;
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args, Debug)]
pub struct ForwardArgs {
    #[command(flatten)]
    block: BlockArgs,
    /// Backend: auto (GPU if usable, else CPU), cpu or gpu.
    #[arg(long, value_enum, default_value = "auto")]
    device: DeviceChoice,
    /// Write the output to this safetensors file as tensor `y`.
    #[arg(long)]
    output: Option<PathBuf>,
    /// Rows compared against the f64 CPU reference (spread over the batch; 0 skips the check).
    #[arg(long, default_value_t = 8)]
    check_rows: usize,
    /// Timed repetitions on the GPU (the median is reported).
    #[arg(long, default_value_t = 5)]
    repeat: usize,
    /// Split the Linear's output channels over GPUs 0..N of this process (NCCL between
    /// them), in whole GroupNorm groups; with --device cpu, over N ranks run in turn.
    #[arg(long, value_name = "N")]
    tensor_parallel: Option<usize>,
    #[command(flatten)]
    tuning: TuningArgs,
}

/// What a run produced.
struct Run {
    backend: String,
    /// Floating-point operations actually performed (a folded avgpool shrinks the GEMM).
    flops: f64,
    path: String,
    y: Tensor<f32>,
    ms: f64,
    timing: String,
}

pub fn run(a: &ForwardArgs) -> Result<(), Failure> {
    // Everything that can be refused is refused before the work (and its allocations).
    if let Some(path) = &a.output {
        crate::io::check_output_path(path).map_err(|e| Error::Argument(format!("--output {e}")))?;
    }
    let setup = a.block.setup()?;
    if a.device == DeviceChoice::Gpu {
        setup.check_gpu_limits()?; // also where no GPU opens: the sizes are the problem
    }
    let backend = Backend::open(a.device, a.tuning.tuning())?;
    let activations = match &backend {
        Backend::Cpu => 2, // the output and one row panel of the Linear output
        Backend::Gpu(gpu) => {
            setup.check_gpu_limits()?;
            setup.check_device_memory(gpu)?;
            1 // the downloaded output
        }
    };
    setup.check_host_memory(activations, a.check_rows)?;
    let p = setup.load()?;
    let r = match (&backend, a.tensor_parallel) {
        (_, Some(ranks)) => {
            let s = super::parallel::run(&p, ranks, &backend, None, a.repeat)?;
            Run {
                backend: s.backend,
                flops: s.flops,
                path: "each rank's fused block on its channels".into(),
                y: s.y,
                ms: s.ms,
                timing: s.timing,
            }
        }
        (Backend::Cpu, None) => run_cpu(&p)?,
        (Backend::Gpu(gpu), None) => {
            // The same calls on an FP32 block and on a bf16 model's (bf16 x and y).
            macro_rules! timed_forward {
                ($block:expr, $x:expr, $widen:expr) => {{
                    let (block, x) = ($block, $x);
                    let batch = p.x.rows();
                    // The checked run writes into NaN-poisoned buffers, so a missed element shows.
                    let mut ws = block.workspace(gpu, batch)?;
                    block.forward_into(gpu, &x, &mut ws, None)?;
                    let out = $widen(gpu.download(&ws.y)?).reshape(&p.spec.output_shape(batch))?;
                    let mut times = Vec::new();
                    for _ in 0..a.repeat.max(1) {
                        times.push(gpu.time_ms(|| block.forward_into(gpu, &x, &mut ws, None))?);
                    }
                    times.sort_by(f64::total_cmp);
                    (out, times, block.describe(gpu, &ws.plan), block.executed_flops(batch))
                }};
            }
            let (out, times, path, flops) = match &p.bf16 {
                None => timed_forward!(
                    GpuBlock::new(gpu, &p.spec, &p.params)?.with_precision(p.precision),
                    gpu.upload(&p.x)?,
                    |t: Tensor<f32>| t
                ),
                Some(_) => {
                    timed_forward!(super::bf16_block(gpu, &p)?, gpu.upload(&p.x.to_bf16())?, |t: Tensor<
                        crate::tensor::Bf16,
                    >| t
                        .to_f32())
                }
            };
            let pr = &gpu.props;
            let tensors = if p.bf16.is_some() { ", bf16 model (bf16 x, W, y)" } else { "" };
            Run {
                backend: format!(
                    "gpu: {} ({} SMs, sm_{}{}, kernels from {:?}), {} GEMM{tensors}",
                    pr.name,
                    pr.multiprocessors,
                    pr.compute_capability.0,
                    pr.compute_capability.1,
                    gpu.kernel_image(),
                    p.precision
                ),
                path,
                flops,
                y: out,
                ms: times[times.len() / 2],
                timing: format!("median of {} after a warm-up run, CUDA events", times.len()),
            }
        }
    };

    let (batch, spec) = (p.x.rows(), &p.spec);
    let sum: f64 = r.y.data().iter().map(|&v| v as f64).sum();
    let abs: f64 = r.y.data().iter().map(|&v| (v as f64).abs()).sum();
    println!("host forward");
    println!("  backend   {}", r.backend);
    println!("  model     {}: Linear({}, {}) -> {}", p.name, spec.in_features, spec.out_features, spec.chain);
    println!("  shape     x [{batch}, {}] -> y {:?}", spec.in_features, r.y.shape());
    println!("  path      {}", r.path);
    println!("  time      {:.3} ms, {} ({})", r.ms, super::flop_rate(r.flops, r.ms), r.timing);
    println!("  checksum  sum {sum:.6e}, sum|y| {abs:.6e}");

    // The CPU backend computes in FP32 whatever --precision says; a bf16 model's y is
    // rounded once from FP32 (on the CPU, when written).
    let tol = match (r.backend.starts_with("gpu"), &p.bf16) {
        (true, Some(_)) => crate::precision::BF16_STORED_REL,
        (true, None) => p.precision.tolerance(),
        (false, _) => crate::check::FP32_REL,
    };
    let verdict = check_rows(&p, &r.y, a.check_rows, tol)?;
    if let Some(path) = &a.output {
        crate::io::write_typed(path, &[("y", &r.y, p.bf16.is_some())], Some(&p.meta()))?;
        let dtype = if p.bf16.is_some() { " (BF16)" } else { "" };
        println!("  output    y written to {}{dtype}", path.display());
    }
    verdict
}

fn run_cpu(p: &Problem) -> Result<Run> {
    let t0 = Instant::now();
    let precision = cpu::Precision::emulating(p.precision).unwrap_or_default();
    let y = cpu::forward(&p.spec, &p.x, &p.params, &cpu::Options::new(precision).with_progress("cpu forward"))?;
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    Ok(Run {
        backend: format!("cpu: {}{}", cpu::describe(precision), super::cpu_precision_note(p.precision)),
        flops: p.spec.forward_flops(p.x.rows()),
        path: "GEMM (in row panels above 160 GFLOP), then the chain on each row, rows in parallel".into(),
        y,
        ms,
        timing: "one run, wall clock".into(),
    })
}

/// Compares `n` rows of `y`, spread over the batch, with the f64 reference.
fn check_rows(p: &Problem, y: &Tensor<f32>, n: usize, tol: f64) -> Result<Result<(), Failure>> {
    if n == 0 {
        println!("  check     skipped (--check-rows 0)");
        return Ok(Ok(()));
    }
    let batch = p.x.rows();
    let rows = super::sample_rows(batch, n);
    let n = rows.len();
    let in_f = p.spec.in_features;
    let width = y.len() / batch;
    let got: Vec<f32> = rows.iter().flat_map(|&r| y.data()[r * width..(r + 1) * width].iter().copied()).collect();
    let reference = if p.spec.chain.batch_norm().is_some() {
        // A BatchNorm's statistics span every row: the reference runs on all of them.
        let macs = batch as f64 * in_f as f64 * p.spec.out_features as f64;
        if macs > super::backward::FULL_CHECK_MACS {
            println!(
                "  check     skipped: a BatchNorm's statistics span every row, and all rows are too many for \
                 the f64 CPU check here (host check covers it)"
            );
            return Ok(Ok(()));
        }
        let all = reference::block_forward::<f64>(&p.spec, &p.x.to_f64(), &p.params.map(f64::from))?;
        Tensor::from_fn(&[n, width], |e| all.data()[rows[e / width] * width + e % width])?
    } else {
        let x_rows = Tensor::from_fn(&[n, in_f], |e| p.x.data()[rows[e / in_f] * in_f + e % in_f] as f64)?;
        reference::block_forward::<f64>(&p.spec, &x_rows, &p.params.map(f64::from))?
    };
    let c = compare_f32(&got, reference.data());
    let ok = c.ok(tol);
    println!(
        "  check     {n} rows vs f64 CPU reference: rel err {:.2e}, max abs {:.2e}, allclose(1e-4, 1e-4) ratio {:.2}, non-finite {}, NaN/Inf {} (tolerance {tol:e}): {}",
        c.rel,
        c.max_abs,
        c.close,
        c.non_finite,
        c.nan_or_inf,
        c.verdict(tol)
    );
    Ok(if ok {
        Ok(())
    } else {
        Err(Failure::CheckFailed(match c.passes(tol) {
            true => format!("the output holds {} NaN/Inf values", c.nan_or_inf),
            false => format!("output differs from the reference: relative error {:.3e}", c.rel),
        }))
    })
}

//! `host backward`: one block's forward and backward, gradients of `x` and of every
//! parameter, with a one-screen summary and an f64 check.

use super::{Backend, BlockArgs, DeviceChoice, Failure, Problem, TuningArgs};
use crate::block::Params;
use crate::check::{Comparison, compare_f32};
use crate::cpu;
use crate::error::{Error, Result};
use crate::gpu::block::GpuBlock;
use crate::io::TensorFile;
use crate::reference;
use crate::tensor::Tensor;
use rand::SeedableRng;
use rand_distr::{Distribution, StandardNormal};
use std::path::PathBuf;
use std::time::Instant;

/// Full f64 checks of every gradient only below this many multiply-adds (B x I x O):
/// the reference's three GEMMs run on one CPU core.
pub(super) const FULL_CHECK_MACS: f64 = 3e8;

#[derive(clap::Args, Debug)]
pub struct BackwardArgs {
    #[command(flatten)]
    block: BlockArgs,
    /// Backend: auto (GPU if usable, else CPU), cpu or gpu.
    #[arg(long, value_enum, default_value = "auto")]
    device: DeviceChoice,
    /// safetensors file with `dy`, the gradient of the output (default: random normal).
    #[arg(long)]
    grad_output: Option<PathBuf>,
    /// Write the gradients here: `grad.x` and `grad.<parameter name>`.
    #[arg(long)]
    grads: Option<PathBuf>,
    /// Write the forward output here as tensor `y`.
    #[arg(long)]
    output: Option<PathBuf>,
    /// Rows of `grad.x` compared against the f64 CPU reference (0 skips the check).
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

pub fn run(a: &BackwardArgs) -> Result<(), Failure> {
    // Before any work: a refused write at the end would throw the whole run away.
    for (flag, path) in [("--grads", &a.grads), ("--output", &a.output)] {
        if let Some(path) = path {
            crate::io::check_output_path(path).map_err(|e| Error::Argument(format!("{flag} {e}")))?;
        }
    }
    let p = a.block.problem()?;
    let batch = p.x.rows();
    let out_shape = p.spec.output_shape(batch);
    let dy = match &a.grad_output {
        Some(path) => TensorFile::open(path)?.get("dy", &out_shape)?,
        None => {
            let mut rng = rand::rngs::StdRng::seed_from_u64(a.block.seed ^ 0x5eed);
            Tensor::from_fn(&out_shape, |_| StandardNormal.sample(&mut rng))?
        }
    };
    // A bf16 model's dy is bf16 (rounded, where the file or the draw held FP32 values).
    let dy = if p.bf16.is_some() { dy.to_bf16().to_f32() } else { dy };
    let backend = Backend::open(a.device, a.tuning.tuning())?;
    let (backend, y, dx, grads, ms, timing) = match (backend, a.tensor_parallel) {
        (backend, Some(ranks)) => {
            let s = super::parallel::run(&p, ranks, &backend, Some(&dy), a.repeat)?;
            let (dx, grads) = s.grads.ok_or_else(|| crate::error::Error::Argument("no gradients".into()))?;
            (s.backend, s.y, dx, grads, s.ms, s.timing)
        }
        (Backend::Cpu, None) => {
            let precision = cpu::Precision::emulating(p.precision).unwrap_or_default();
            let opts = cpu::Options::new(precision).with_progress("cpu forward+backward");
            let t0 = Instant::now();
            let (y, g) = cpu::backward(&p.spec, &p.x, &p.params, &dy, &opts)?;
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            (
                format!("cpu: {}{}", cpu::describe(precision), super::cpu_precision_note(p.precision)),
                y,
                g.x,
                g.params,
                ms,
                "one run, wall clock".into(),
            )
        }
        (Backend::Gpu(gpu), None) => {
            // The same calls on an FP32 block and on a bf16 model's (bf16 x, dy, dX, dW).
            macro_rules! timed_backward {
                ($block:expr, $x:expr, $dy:expr) => {{
                    let (block, x, dy) = ($block, $x, $dy);
                    let out = block.forward_backward(&gpu, &x, &dy)?;
                    let (x, ddy) = (gpu.upload(&x)?, gpu.upload(&dy)?);
                    let mut times = Vec::new();
                    for _ in 0..a.repeat.max(1) {
                        times.push(gpu.time_ms(|| {
                            let (_, saved) = block.forward_train(&gpu, &x, false)?;
                            block.backward(&gpu, &x, saved, &ddy).map(drop)
                        })?);
                    }
                    times.sort_by(f64::total_cmp);
                    (out, times, block.describe(&gpu, &block.plan(&gpu, batch)))
                }};
            }
            let (out, times, path) = match &p.bf16 {
                None => timed_backward!(
                    GpuBlock::new(&gpu, &p.spec, &p.params)?.with_precision(p.precision),
                    p.x.clone(),
                    dy.clone()
                ),
                Some(_) => timed_backward!(super::bf16_block(&gpu, &p)?, p.x.to_bf16(), dy.to_bf16()),
            };
            let pr = &gpu.props;
            let tensors = if p.bf16.is_some() { ", bf16 model (bf16 x, W, y, dy, dX, dW)" } else { "" };
            let backend = format!("gpu: {} ({} SMs), {} GEMMs{tensors}", pr.name, pr.multiprocessors, p.precision);
            let timing = format!("median of {} after a checked run, CUDA events; forward {path}", times.len());
            (backend, out.y, out.x, out.params, times[times.len() / 2], timing)
        }
    };

    let spec = &p.spec;
    println!("host backward");
    println!("  backend   {backend}");
    println!("  model     {}: Linear({}, {}) -> {}", p.name, spec.in_features, spec.out_features, spec.chain);
    println!("  shape     x [{batch}, {}] -> y {:?}", spec.in_features, y.shape());
    let rate = super::flop_rate(3.0 * spec.forward_flops(batch), ms);
    println!("  time      {ms:.3} ms forward+backward, {rate} of 3 GEMMs ({timing})");
    let sum = |t: &Tensor<f32>| t.data().iter().map(|&v| v as f64).sum::<f64>();
    let names: Vec<String> = spec.param_specs().into_iter().map(|s| s.name).collect();
    let sums: Vec<String> = names.iter().zip(grads.flat()).map(|(n, g)| format!("{n} {:.4e}", sum(g))).collect();
    println!("  checksums grad.x {:.4e}; {}", sum(&dx), sums.join(", "));

    // The CPU backend computes in FP32 whatever --precision says; a bf16 model's
    // outputs are rounded once from FP32 (on the CPU, when written).
    let tol = match (backend.starts_with("gpu"), &p.bf16) {
        (true, Some(_)) => crate::precision::BF16_STORED_REL,
        (true, None) => p.precision.tolerance(),
        (false, _) => crate::check::FP32_REL,
    };
    let verdict = check(&p, &dy, &dx, &grads, a.check_rows, tol)?;
    // A bf16 model's files: grad.x and y in BF16, each parameter's gradient in the
    // dtype its file held.
    let bf16_x = p.bf16.is_some();
    let bf16_param = |i: usize| p.bf16.as_ref().is_some_and(|m| m.params[i]);
    if let Some(path) = &a.grads {
        let mut named = vec![("grad.x".to_string(), &dx, bf16_x)];
        let params = names.iter().zip(grads.flat()).enumerate();
        named.extend(params.map(|(i, (n, g))| (format!("grad.{n}"), g, bf16_param(i))));
        let refs: Vec<(&str, &Tensor<f32>, bool)> = named.iter().map(|(n, t, b)| (n.as_str(), *t, *b)).collect();
        crate::io::write_typed(path, &refs, Some(&p.meta()))?;
        let dtype = if bf16_x { ", in the inputs' dtypes" } else { "" };
        println!("  grads     written to {} (grad.x, grad.<parameter>{dtype})", path.display());
    }
    if let Some(path) = &a.output {
        crate::io::write_typed(path, &[("y", &y, bf16_x)], Some(&p.meta()))?;
        println!("  output    y written to {}", path.display());
    }
    verdict
}

/// `grad.x` on sample rows (rows are independent), and every gradient when the
/// problem is small enough for the f64 reference.
fn check(
    p: &Problem,
    dy: &Tensor<f32>,
    dx: &Tensor<f32>,
    grads: &Params<f32>,
    n: usize,
    tol: f64,
) -> Result<Result<(), Failure>> {
    if n == 0 {
        println!("  check     skipped (--check-rows 0)");
        return Ok(Ok(()));
    }
    let (batch, in_f) = (p.x.rows(), p.spec.in_features);
    let macs = batch as f64 * in_f as f64 * p.spec.out_features as f64;
    let mut failed = Vec::new();
    let mut report = |what: &str, c: Comparison| {
        let ok = c.ok(tol);
        println!(
            "  check     {what}: rel err {:.2e}, max abs {:.2e}, allclose(1e-4, 1e-4) ratio {:.2}, non-finite {}, NaN/Inf {} (tolerance {tol:e}): {}",
            c.rel,
            c.max_abs,
            c.close,
            c.non_finite,
            c.nan_or_inf,
            c.verdict(tol)
        );
        if !ok {
            failed.push(what.to_string());
        }
    };
    if macs <= FULL_CHECK_MACS {
        let (_, want) = reference::block_backward(&p.spec, &p.x.to_f64(), &p.params.map(f64::from), &dy.to_f64())?;
        report("grad.x (all rows) vs f64 CPU reference", compare_f32(dx.data(), want.x.data()));
        for ((s, g), w) in p.spec.param_specs().iter().zip(grads.flat()).zip(want.params.flat()) {
            report(&format!("grad.{}", s.name), compare_f32(g.data(), w.data()));
        }
    } else if p.spec.chain.batch_norm().is_some() {
        println!(
            "  check     skipped: a BatchNorm's statistics span every row, so sampled rows have other ones, and \
             all rows are too many for the f64 CPU check here (host check --backward covers it)"
        );
    } else {
        let rows = super::sample_rows(batch, n);
        let n = rows.len();
        let pick = |t: &Tensor<f32>, w: usize| Tensor::from_fn(&[n, w], |e| t.data()[rows[e / w] * w + e % w] as f64);
        let x_rows = pick(&p.x, in_f)?;
        let out_w = dy.len() / batch;
        let dy_rows = pick(dy, out_w)?.reshape(&p.spec.output_shape(n))?;
        let (_, want) = reference::block_backward(&p.spec, &x_rows, &p.params.map(f64::from), &dy_rows)?;
        let got: Vec<f32> = rows.iter().flat_map(|&r| dx.row(r).iter().copied()).collect();
        report(&format!("grad.x ({n} rows) vs f64 CPU reference"), compare_f32(&got, want.x.data()));
        println!(
            "  check     parameter gradients: too large for the f64 CPU check here (host check --backward covers them)"
        );
    }
    Ok(if failed.is_empty() {
        Ok(())
    } else {
        Err(Failure::CheckFailed(format!("gradients differ from the reference: {}", failed.join(", "))))
    })
}

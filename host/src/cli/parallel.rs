//! `--tensor-parallel N` of `host forward` and `host backward`: the block split over
//! GPUs `0..N` of this process (NCCL between them), or on the CPU backend over ranks
//! run in turn (the same split and combination, for checking it without GPUs).

use super::{Backend, Problem};
use crate::block::Params;
use crate::cpu;
use crate::error::{Error, Result};
use crate::gpu::collective::Collective;
use crate::gpu::parallel::TensorParallel;
use crate::gpu::{Gpu, Phases, open_ranks};
use crate::parallel::{TensorSplit, cpu as tp_cpu};
use crate::tensor::Tensor;
use std::time::Instant;

/// What a split run gives the command's summary.
pub struct SplitRun {
    pub backend: String,
    pub y: Tensor<f32>,
    /// Input and parameter gradients (backward only).
    pub grads: Option<(Tensor<f32>, Params<f32>)>,
    pub ms: f64,
    pub timing: String,
    /// Forward FLOPs the ranks perform together (a folded avgpool shrinks each GEMM).
    pub flops: f64,
}

fn refuse_bf16(p: &Problem) -> Result<()> {
    if p.bf16.is_some() {
        return Err(Error::Unsupported(
            "--tensor-parallel runs FP32 tensors (any --precision of the GEMMs); a bf16 model's files run on one GPU"
                .into(),
        ));
    }
    Ok(())
}

fn describe(split: &TensorSplit, what: &str) -> String {
    let shard = split.shard();
    format!(
        "{what}, {} ranks of Linear({}, {}) -> {}{}",
        split.ranks(),
        shard.in_features,
        shard.out_features,
        shard.chain,
        if split.reduces_row_max() { " (row max all-reduced)" } else { " (columns gathered)" }
    )
}

/// `p`'s forward split over `ranks`; `backward` adds the gradients of `L = sum(y * dy)`.
pub fn run(p: &Problem, ranks: usize, backend: &Backend, dy: Option<&Tensor<f32>>, repeat: usize) -> Result<SplitRun> {
    refuse_bf16(p)?;
    let split = TensorSplit::new(&p.spec, ranks)?;
    let shards = (0..ranks).map(|r| split.shard_params(&p.params, r)).collect::<Result<Vec<_>>>()?;
    match backend {
        Backend::Cpu => {
            let opts = cpu::Options::default();
            let t0 = Instant::now();
            let (y, grads) = match dy {
                None => (tp_cpu::forward(&split, &p.x, &shards, &opts)?, None),
                Some(dy) => {
                    let (y, g) = tp_cpu::backward(&split, &p.x, &shards, dy, &opts)?;
                    (y, Some((g.x, g.params)))
                }
            };
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            let backend = describe(&split, &format!("cpu: {}, ranks run in turn", cpu::describe(cpu::Precision::Fp32)));
            let flops = p.spec.forward_flops(p.x.rows());
            Ok(SplitRun { backend, y, grads, ms, timing: "one run, wall clock".into(), flops })
        }
        Backend::Gpu(gpu) => {
            let gpus = open_ranks(ranks, gpu.tuning())?;
            let names: Vec<String> = gpus.iter().map(|g| g.props.name.clone()).collect();
            let tp = TensorParallel::new(Collective::new(gpus)?, &p.spec, &p.params)?.with_precision(p.precision);
            let link = if tp.collective().is_nccl() { "NCCL" } else { "host memory" };
            let backend = describe(&split, &format!("gpu: {} ({link}), {} GEMMs", names.join(" + "), p.precision));
            let xs = tp.upload_input(&p.x)?;
            let mut breakdown = None;
            let (y, grads, times) = match dy {
                None => {
                    let y = tp.forward(&p.x)?;
                    let times = timed(tp.collective().gpus(), repeat, || tp.forward_ranks(&xs).map(drop))?;
                    (y, None, times)
                }
                Some(dy) => {
                    let (y, g) = tp.forward_backward(&p.x, dy)?;
                    let dys = tp.upload_grad_output(dy)?;
                    // Where a step's time goes: how long the host takes to queue each
                    // half (one thread queues every rank's work) and each rank's stream
                    // time for the forward and for the backward with `dX`'s all-reduce.
                    let gpus = tp.collective().gpus();
                    let mut steps = Vec::new();
                    let times = timed(gpus, repeat, || {
                        let mut phases = gpus.iter().map(Phases::start).collect::<Result<Vec<_>>>()?;
                        let t0 = Instant::now();
                        let (_, saved) = tp.forward_train_ranks(&xs)?;
                        let queued_forward = t0.elapsed().as_secs_f64() * 1e3;
                        for (p, gpu) in phases.iter_mut().zip(gpus) {
                            p.mark(gpu, "forward")?;
                        }
                        let t1 = Instant::now();
                        tp.backward_ranks(&xs, saved, &dys)?;
                        let queued_backward = t1.elapsed().as_secs_f64() * 1e3;
                        for (p, gpu) in phases.iter_mut().zip(gpus) {
                            p.mark(gpu, "backward")?;
                        }
                        steps.push((queued_forward, queued_backward, phases));
                        Ok(())
                    })?;
                    breakdown = Some(step_breakdown(&steps)?);
                    (y, Some((g.x, g.params)), times)
                }
            };
            let mut timing = format!("median of {} after a checked run, wall clock over all ranks", times.len());
            if let Some(b) = breakdown {
                timing.push_str(&b);
            }
            let flops = tp.blocks().iter().map(|b| b.executed_flops(p.x.rows())).sum();
            Ok(SplitRun { backend, y, grads, ms: times[times.len() / 2], timing, flops })
        }
    }
}

/// The median step's (by the host's queueing time) breakdown: the host's time to queue
/// the forward and the backward, and each rank's stream time for them.
fn step_breakdown(steps: &[(f64, f64, Vec<Phases>)]) -> Result<String> {
    let mut order: Vec<usize> = (0..steps.len()).collect();
    order.sort_by(|&a, &b| (steps[a].0 + steps[a].1).total_cmp(&(steps[b].0 + steps[b].1)));
    let Some(&median) = order.get(order.len() / 2) else { return Ok(String::new()) };
    let (queued_forward, queued_backward, phases) = &steps[median];
    let mut ranks = Vec::new();
    for p in phases {
        let ms: Vec<String> = p.millis()?.iter().map(|(_, ms)| format!("{ms:.3}")).collect();
        ranks.push(ms.join(" + "));
    }
    Ok(format!(
        "; host queued the forward in {queued_forward:.3} ms and the backward in {queued_backward:.3}; \
         rank streams, forward + backward with dX's all-reduce: {}",
        ranks.join(", ")
    ))
}

/// Sorted wall-clock milliseconds of `repeat` runs of `work`, every rank idle before
/// and done after each.
fn timed(gpus: &[Gpu], repeat: usize, mut work: impl FnMut() -> Result<()>) -> Result<Vec<f64>> {
    let sync = || gpus.iter().try_for_each(Gpu::synchronize);
    let mut times = Vec::new();
    for _ in 0..repeat.max(1) {
        sync()?;
        let t0 = Instant::now();
        work()?;
        sync()?;
        times.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok(times)
}

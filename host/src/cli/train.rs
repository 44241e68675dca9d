//! `host train`: fits a two-block MLP to a teacher network of the same shape on
//! synthetic data, with a mean-squared-error loss and Adam or SGD, on the GPU (or the
//! CPU). Both blocks sit on one autograd tape, so the gradient flows from the loss
//! through block 2 into block 1.

use super::{Backend, DeviceChoice, Failure, TuningArgs};
use crate::block::{BlockSpec, Params, random_input};
use crate::chain::{Chain, Preset};
use crate::cpu;
use crate::error::{Error, Result};
use crate::gpu::block::GpuBlock;
use crate::gpu::collective::{Collective, Reduce};
use crate::gpu::optim::{AdamState, adam_step, mse_loss_grad, sgd_step};
use crate::gpu::tape::GpuGrad;
use crate::gpu::{DeviceTensor, Phases, open_ranks};
use crate::parallel::BatchSplit;
use crate::reference;
use crate::tape::{Tape, VarId};
use crate::tensor::Tensor;
use clap::ValueEnum;
use rand::SeedableRng;
use rand::rngs::StdRng;
use std::rc::Rc;
use std::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Optimizer {
    Adam,
    Sgd,
}

#[derive(clap::Args, Debug)]
pub struct TrainArgs {
    /// Chain of block 1 (a model name M1..M5 or an `--ops` chain).
    #[arg(long, default_value = "M1")]
    block1: String,
    /// Chain of block 2.
    #[arg(long, default_value = "M5")]
    block2: String,
    /// Groups of every GroupNorm.
    #[arg(long, default_value_t = 16)]
    groups: usize,
    /// IN,HIDDEN,OUT features.
    #[arg(long, default_value = "256,512,256")]
    dims: String,
    /// Rows per step.
    #[arg(long, default_value_t = 256)]
    batch: usize,
    /// Batches of synthetic data, cycled through.
    #[arg(long, default_value_t = 8)]
    batches: usize,
    #[arg(long, default_value_t = 100)]
    steps: usize,
    #[arg(long, value_enum, default_value = "adam")]
    optimizer: Optimizer,
    #[arg(long, default_value_t = 2e-3)]
    lr: f32,
    #[arg(long, value_enum, default_value = "auto")]
    device: DeviceChoice,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Train on GPUs 0..N of this process, each on its 1/N of every batch's rows, the
    /// gradients averaged through NCCL (the same steps as one GPU on the whole batch);
    /// with --device cpu, N ranks run in turn.
    #[arg(long, value_name = "N", default_value_t = 1)]
    data_parallel: usize,
    /// With --data-parallel: every rank on GPU 0, meeting through host memory (checks
    /// the split's arithmetic on a machine with one GPU; no faster).
    #[arg(long)]
    ranks_share_gpu: bool,
    #[command(flatten)]
    tuning: TuningArgs,
}

/// Above this many FLOPs per batch the teacher runs on the FP32 CPU backend, not the
/// f64 reference.
const FAST_TEACHER_FLOPS: f64 = 2e9;

fn chain(text: &str, groups: usize) -> Result<Chain> {
    let chain = match text.parse::<Preset>() {
        Ok(p) => p.chain(),
        Err(_) => text.parse::<Chain>()?,
    };
    Ok(chain.with_groups(groups))
}

/// The two blocks' specs.
fn specs(a: &TrainArgs) -> Result<(BlockSpec, BlockSpec)> {
    let dims: Vec<usize> = a
        .dims
        .split(',')
        .map(|d| d.trim().parse().map_err(|_| Error::Argument(format!("--dims {}: expected IN,HIDDEN,OUT", a.dims))))
        .collect::<Result<_>>()?;
    let [i, h, o] = dims[..] else {
        return Err(Error::Argument(format!("--dims {}: expected IN,HIDDEN,OUT", a.dims)));
    };
    if a.batch == 0 || a.batches == 0 {
        return Err(Error::Argument("--batch and --batches must be at least 1".into()));
    }
    let s1 = BlockSpec::new(i, h, chain(&a.block1, a.groups)?)?;
    let hidden = s1.output_shape(1);
    if hidden.len() != 2 {
        return Err(Error::Chain(format!("block 1 (`{}`) must keep a feature axis to feed block 2", s1.chain)));
    }
    let s2 = BlockSpec::new(hidden[1], o, chain(&a.block2, a.groups)?)?;
    Ok((s1, s2))
}

/// A progress bar and the loss, one line per step.
fn report(step: usize, steps: usize, loss: f64, first: f64) {
    let width = 30;
    let done = (step * width).div_ceil(steps.max(1));
    let bar: String = (0..width).map(|i| if i < done { '#' } else { '.' }).collect();
    println!("step {step:>5}/{steps} [{bar}] loss {loss:.6} ({:.1}% of the first)", 100.0 * loss / first);
}

pub fn run(a: &TrainArgs) -> Result<(), Failure> {
    let (s1, s2) = specs(a)?;
    let mut rng = StdRng::seed_from_u64(a.seed);
    let student = (Params::init(&s1, &mut rng), Params::init(&s2, &mut rng));
    let teacher = (Params::init(&s1, &mut rng), Params::init(&s2, &mut rng));
    // Synthetic data: inputs from N(0, 1), targets from the teacher: computed in f64,
    // or by the multithreaded FP32 CPU backend where that would take long (the f64
    // reference is one thread; a throughput run's batches are GFLOPs each).
    let fast_teacher = (s1.forward_flops(a.batch) + s2.forward_flops(a.batch)) > FAST_TEACHER_FLOPS;
    let data: Vec<(Tensor<f32>, Tensor<f32>)> = (0..a.batches)
        .map(|_| {
            let x = random_input(a.batch, s1.in_features, &mut rng)?;
            let y = if fast_teacher {
                let opts = cpu::Options::new(cpu::Precision::Fp32);
                let h = cpu::forward(&s1, &x, &teacher.0, &opts)?;
                cpu::forward(&s2, &h, &teacher.1, &opts)?
            } else {
                let h = reference::block_forward(&s1, &x.to_f64(), &teacher.0.map(f64::from))?;
                reference::block_forward(&s2, &h, &teacher.1.map(f64::from))?.to_f32()
            };
            Ok((x, y))
        })
        .collect::<Result<_>>()?;

    let split = BatchSplit::new(a.batch, a.data_parallel)?;
    let backend = Backend::open(a.device, a.tuning.tuning())?;
    println!(
        "host train: 2 blocks, Linear({}, {}) -> {} | Linear({}, {}) -> {}",
        s1.in_features, s1.out_features, s1.chain, s2.in_features, s2.out_features, s2.chain
    );
    println!(
        "  {} x {} rows of synthetic data (teacher of the same shape), MSE loss, {:?} lr {}, {} steps",
        a.batches, a.batch, a.optimizer, a.lr, a.steps
    );
    let t0 = Instant::now();
    let losses = match &backend {
        Backend::Gpu(gpu) => {
            let ranks = match (a.data_parallel, a.ranks_share_gpu) {
                (n, true) => Collective::in_host_memory(vec![(**gpu).clone(); n])?,
                (1, false) => Collective::in_host_memory(vec![(**gpu).clone()])?,
                (n, false) => Collective::over_nccl(open_ranks(n, gpu.tuning())?)?,
            };
            let names: Vec<String> = ranks.gpus().iter().map(|g| g.props.name.clone()).collect();
            let link = match (a.data_parallel, ranks.is_nccl()) {
                (1, _) => String::new(),
                (n, true) => format!(", data parallel over {n} GPUs (gradients averaged by NCCL)"),
                (n, false) => format!(", data parallel over {n} ranks on one GPU (gradients averaged in host memory)"),
            };
            println!("  backend gpu: {}{link}", names.join(" + "));
            let (losses, times) = train_gpu(&ranks, split, a, (&s1, &s2), student, &data)?;
            if let Some(t) = times {
                let reduce = match (split.ranks, ranks.is_nccl()) {
                    (1, _) => String::new(),
                    (_, true) => {
                        format!(", {:.3} ms of it in the gradients' NCCL all-reduce (rank 0)", t.all_reduce_ms)
                    }
                    (_, false) => format!(", {:.3} ms of it averaging the gradients in host memory", t.all_reduce_ms),
                };
                println!("steps 2..{}: {:.3} ms per step{reduce}", a.steps, t.step_ms);
            }
            losses
        }
        Backend::Cpu => {
            let ranks = match a.data_parallel {
                1 => String::new(),
                n => format!(", data parallel over {n} ranks run in turn"),
            };
            println!("  backend cpu: {}{ranks}", crate::cpu::describe(crate::cpu::Precision::Fp32));
            train_cpu(split, a, (&s1, &s2), student, &data)?
        }
    };
    let (first, last) = (losses[0], *losses.last().unwrap());
    println!(
        "done in {:.2} s: loss {first:.6} -> {last:.6} ({:.1}% of the first)",
        t0.elapsed().as_secs_f64(),
        100.0 * last / first
    );
    if last.partial_cmp(&first) != Some(std::cmp::Ordering::Less) {
        return Err(Failure::CheckFailed(format!("the loss did not fall ({first} -> {last})")));
    }
    Ok(())
}

/// Where a GPU training step's time goes, over the steps after the first (which
/// pays for module loads and the collectives' first use).
struct StepTimes {
    /// Wall time per step, all ranks.
    step_ms: f64,
    /// Rank 0's stream time in the gradients' all-reduce per step (CUDA events; with
    /// NCCL it includes waiting for the other ranks to reach it).
    all_reduce_ms: f64,
}

/// One rank of the GPU trainer: its replica of the two blocks, its optimiser state
/// and its rows of every batch.
struct GpuRank {
    blocks: [Rc<GpuBlock>; 2],
    adam: Vec<Vec<AdamState>>,
    data: Vec<(DeviceTensor, DeviceTensor)>,
}

fn train_gpu(
    ranks: &Collective,
    split: BatchSplit,
    a: &TrainArgs,
    (s1, s2): (&BlockSpec, &BlockSpec),
    student: (Params<f32>, Params<f32>),
    data: &[(Tensor<f32>, Tensor<f32>)],
) -> Result<(Vec<f64>, Option<StepTimes>)> {
    let mut state: Vec<GpuRank> = ranks
        .gpus()
        .iter()
        .enumerate()
        .map(|(r, gpu)| {
            let blocks = [Rc::new(GpuBlock::new(gpu, s1, &student.0)?), Rc::new(GpuBlock::new(gpu, s2, &student.1)?)];
            let data = data
                .iter()
                .map(|(x, y)| {
                    let y2 = y.clone().reshape(&[y.rows(), y.len() / y.rows()])?;
                    Ok((gpu.upload(&split.slice(x, r)?)?, gpu.upload(&split.slice(&y2, r)?)?))
                })
                .collect::<Result<_>>()?;
            let adam = blocks
                .iter()
                .map(|b| {
                    b.params
                        .shapes()
                        .iter()
                        .map(|shape| Ok(AdamState { m: gpu.zeros(shape)?, v: gpu.zeros(shape)? }))
                        .collect::<Result<_>>()
                })
                .collect::<Result<_>>()?;
            Ok(GpuRank { blocks, adam, data })
        })
        .collect::<Result<_>>()?;
    let mut losses = Vec::new();
    let (mut timed_from, mut all_reduce_ms) = (None, 0.0);
    for step in 1..=a.steps {
        if step == 2 {
            ranks.synchronize()?;
            timed_from = Some(Instant::now());
        }
        // Every rank's forward is queued before any waits (the loss), so the GPUs overlap.
        let mut taped = Vec::new();
        for (gpu, rank) in ranks.gpus().iter().zip(&state) {
            let (x, _) = &rank.data[(step - 1) % rank.data.len()];
            let mut tape = Tape::<GpuGrad>::new();
            let x_var = tape.leaf();
            let vars: Vec<Vec<VarId>> =
                rank.blocks.iter().map(|b| b.params.shapes().iter().map(|_| tape.leaf()).collect()).collect();
            // The input gets no gradient use here; a copy keeps the dataset's tensor ours.
            let x_in = Rc::new(gpu.copy_range(x, 0..x.len())?.reshape(&x.shape)?);
            let (h, h_var) = rank.blocks[0].forward_taped(gpu, &mut tape, x_in, x_var, &vars[0])?;
            let (y, y_var) = rank.blocks[1].forward_taped(gpu, &mut tape, h, h_var, &vars[1])?;
            taped.push((tape, vars, y, y_var));
        }
        // Each rank's mean loss over its rows; their mean is the whole batch's (equal rows).
        let mut loss = 0.0;
        let mut seeds = Vec::new();
        for ((gpu, rank), (_, _, y, _)) in ranks.gpus().iter().zip(&state).zip(&taped) {
            let (_, target) = &rank.data[(step - 1) % rank.data.len()];
            let (l, dy) = mse_loss_grad(gpu, y, target)?;
            loss += l / split.ranks as f64;
            seeds.push(dy);
        }
        // Gradients in [`Params::flat`] order per block, per rank.
        let mut grads: Vec<Vec<Vec<DeviceTensor>>> = Vec::new();
        for ((gpu, (tape, vars, y, y_var)), dy) in ranks.gpus().iter().zip(taped).zip(seeds) {
            drop(y);
            let mut g = tape.backward(y_var, GpuGrad::new(gpu, dy))?;
            let per_block = vars
                .iter()
                .map(|vs| {
                    vs.iter()
                        .map(|v| {
                            g.take(*v).map(|g| g.t).ok_or_else(|| Error::Argument("a parameter got no gradient".into()))
                        })
                        .collect::<Result<Vec<_>>>()
                })
                .collect::<Result<_>>()?;
            grads.push(per_block);
        }
        let mut reduce_phases = None;
        if split.ranks > 1 {
            let mut phases = Phases::start(&ranks.gpus()[0])?;
            // Each rank's gradient is of its rows' mean loss: their mean over the ranks
            // is the whole batch's.
            for bi in 0..2 {
                for pi in 0..grads[0][bi].len() {
                    let mut bufs: Vec<_> = grads.iter_mut().map(|g| &mut g[bi][pi].buf).collect();
                    ranks.all_reduce(&mut bufs, Reduce::Avg)?;
                }
            }
            phases.mark(&ranks.gpus()[0], "all-reduce")?;
            reduce_phases = Some(phases);
        }
        for ((gpu, rank), grads) in ranks.gpus().iter().zip(&mut state).zip(grads) {
            for (bi, (block, block_grads)) in rank.blocks.iter_mut().zip(grads).enumerate() {
                // The tape's closures held the only other references; they are gone now.
                let block = Rc::get_mut(block).ok_or_else(|| Error::Argument("a block is still referenced".into()))?;
                for (pi, (p, g)) in block.params.flat_f32_mut()?.into_iter().zip(block_grads).enumerate() {
                    match a.optimizer {
                        Optimizer::Adam => adam_step(gpu, p, &g, &mut rank.adam[bi][pi], a.lr, step as i32)?,
                        Optimizer::Sgd => sgd_step(gpu, p, &g, a.lr)?,
                    }
                }
                block.refold(gpu)?;
            }
        }
        // Read after the optimiser's launches are queued, so the wait costs the GPUs nothing.
        if let (Some(phases), true) = (reduce_phases, step > 1) {
            all_reduce_ms += phases.millis()?.iter().map(|(_, ms)| ms).sum::<f64>();
        }
        report(step, a.steps, loss, losses.first().copied().unwrap_or(loss));
        losses.push(loss);
    }
    ranks.synchronize()?;
    let times = timed_from.map(|t0| {
        let steps = (a.steps - 1) as f64;
        StepTimes { step_ms: t0.elapsed().as_secs_f64() * 1e3 / steps, all_reduce_ms: all_reduce_ms / steps }
    });
    Ok((losses, times))
}

fn train_cpu(
    split: BatchSplit,
    a: &TrainArgs,
    (s1, s2): (&BlockSpec, &BlockSpec),
    mut student: (Params<f32>, Params<f32>),
    data: &[(Tensor<f32>, Tensor<f32>)],
) -> Result<Vec<f64>> {
    let zeros = |p: &Params<f32>| p.map(|_| 0.0f32);
    let mut moments = [(zeros(&student.0), zeros(&student.0)), (zeros(&student.1), zeros(&student.1))];
    let opts = cpu::Options::default();
    let mut losses = Vec::new();
    for step in 1..=a.steps {
        let (x_all, target_all) = &data[(step - 1) % data.len()];
        // Each rank's gradients of its rows' mean loss, averaged over the ranks.
        let mut loss = 0.0;
        let mut sum: Option<(Params<f32>, Params<f32>)> = None;
        for rank in 0..split.ranks {
            let (x, target) = (split.slice(x_all, rank)?, split.slice(target_all, rank)?);
            let mut tape = Tape::<Tensor<f32>>::new();
            let x_var = tape.leaf();
            let v1: Vec<VarId> = student.0.flat().iter().map(|_| tape.leaf()).collect();
            let v2: Vec<VarId> = student.1.flat().iter().map(|_| tape.leaf()).collect();
            let (h, h_var) = cpu::block_forward_taped(&mut tape, s1, &x, x_var, &student.0, &v1, &opts)?;
            let (y, y_var) = cpu::block_forward_taped(&mut tape, s2, &h, h_var, &student.1, &v2, &opts)?;
            let n = y.len() as f64;
            loss += y.data().iter().zip(target.data()).map(|(&p, &t)| ((p - t) as f64).powi(2)).sum::<f64>()
                / n
                / split.ranks as f64;
            let dy = Tensor::new(
                y.shape(),
                y.data().iter().zip(target.data()).map(|(&p, &t)| (2.0 * (p - t) as f64 / n) as f32).collect(),
            )?;
            let mut grads = tape.backward(y_var, dy)?;
            let mut take = |spec: &BlockSpec, vars: &[VarId]| -> Result<Params<f32>> {
                let flat = vars
                    .iter()
                    .map(|v| grads.take(*v).ok_or_else(|| Error::Argument("a parameter got no gradient".into())))
                    .collect::<Result<_>>()?;
                Params::from_flat(spec, flat)
            };
            let g = (take(s1, &v1)?, take(s2, &v2)?);
            sum = Some(match sum {
                None => g,
                Some(mut s) => {
                    for (acc, g) in
                        s.0.flat_mut().into_iter().chain(s.1.flat_mut()).zip(g.0.flat().into_iter().chain(g.1.flat()))
                    {
                        acc.data_mut().iter_mut().zip(g.data()).for_each(|(a, b)| *a += b);
                    }
                    s
                }
            });
        }
        let mut mean = sum.ok_or_else(|| Error::Argument("no ranks".into()))?;
        if split.ranks > 1 {
            for g in mean.0.flat_mut().into_iter().chain(mean.1.flat_mut()) {
                g.data_mut().iter_mut().for_each(|v| *v /= split.ranks as f32);
            }
        }
        for (bi, (params, grads)) in [(&mut student.0, &mean.0), (&mut student.1, &mean.1)].into_iter().enumerate() {
            let (m, v) = &mut moments[bi];
            for (((p, g), m), v) in params.flat_mut().into_iter().zip(grads.flat()).zip(m.flat_mut()).zip(v.flat_mut())
            {
                step_cpu(a, step, p, g, m, v);
            }
        }
        report(step, a.steps, loss, losses.first().copied().unwrap_or(loss));
        losses.push(loss);
    }
    Ok(losses)
}

/// The same update as the GPU's `adam_step` / `sgd_step` kernels.
fn step_cpu(a: &TrainArgs, t: usize, p: &mut Tensor<f32>, g: &Tensor<f32>, m: &mut Tensor<f32>, v: &mut Tensor<f32>) {
    let (b1, b2, eps) = (0.9f32, 0.999f32, 1e-8f32);
    let (c1, c2) = (1.0 / (1.0 - b1.powi(t as i32)), 1.0 / (1.0 - b2.powi(t as i32)));
    for (((p, &g), m), v) in p.data_mut().iter_mut().zip(g.data()).zip(m.data_mut()).zip(v.data_mut()) {
        match a.optimizer {
            Optimizer::Sgd => *p -= a.lr * g,
            Optimizer::Adam => {
                *m = b1 * *m + (1.0 - b1) * g;
                *v = b2 * *v + (1.0 - b2) * g * g;
                *p -= a.lr * (*m * c1) / ((*v * c2).sqrt() + eps);
            }
        }
    }
}

//! `host bench`: times each block on the GPU against cuBLAS's SGEMM alone, same
//! process, same shapes, strict FP32.

use super::{BlockArgs, Failure, TuningArgs, no_gpu_reason};
use crate::block::random_input;
use crate::error::{Error, Result};
use crate::gpu::block::GpuBlock;
use crate::gpu::cublas::{Cublas, Operand};
use crate::gpu::elementwise::to_half;
use crate::gpu::{DeviceTensor, Gpu, Phases, Tuning};
use crate::precision::Precision;
use crate::tensor::Bf16;
use rand::SeedableRng;
use rand::rngs::StdRng;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// Models to time, comma-separated (each at its seed size unless --shape is given).
    #[arg(long, default_value = "M1,M2,M3,M4,M5")]
    models: String,
    /// Epilogue chain instead of the models' (times one block).
    #[arg(long)]
    ops: Option<String>,
    /// BATCH,IN,OUT for every model timed.
    #[arg(long)]
    shape: Option<String>,
    /// Number of groups of every GroupNorm.
    #[arg(long)]
    groups: Option<usize>,
    /// Timed runs per measurement (the median is reported), after 3 warm-up runs.
    #[arg(long, default_value_t = 20)]
    repeat: usize,
    /// Time forward + backward (all gradients) against cuBLAS's three GEMMs
    /// (forward, dX, dW) instead of the forward against one.
    #[arg(long)]
    backward: bool,
    /// Arithmetic of our GEMMs; cuBLAS runs the same math (SGEMM for fp32 and tf32x3,
    /// TF32 tensor-op math for tf32, its bf16 GEMM for bf16). bf16 times a bf16 model:
    /// bf16 tensors in and out, against cuBLAS's bf16 GEMM on the same bf16 operands
    /// with bf16 output.
    #[arg(long, value_enum, default_value = "fp32")]
    precision: Precision,
    /// With --precision bf16: time FP32 tensors with bf16 GEMMs instead (operands
    /// rounded in every call, FP32 output), against cuBLAS's bf16 GEMM on bf16 copies
    /// with FP32 output.
    #[arg(long)]
    fp32_tensors: bool,
    /// Time each model's forward three times, one row each: as the tuning flags say
    /// (production: `gemv_tc_*` at 1-64 rows of bf16 and TF32/3xTF32), with
    /// `--no-gemv-tensor-cores` (`gemv_*` up to 8 rows) and with `--no-gemv` (the tile
    /// GEMMs): the small-batch kernels side by side at `--shape ROWS,IN,OUT`.
    #[arg(long, conflicts_with = "backward")]
    small_batch_kernels: bool,
    /// Also write the table as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    #[command(flatten)]
    tuning: TuningArgs,
}

/// One row of the table.
struct Row {
    model: String,
    shape: (usize, usize, usize),
    path: String,
    ours_ms: f64,
    cublas_ms: f64,
    tflops: f64,
}

fn median_ms(gpu: &Gpu, repeat: usize, mut work: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..3 {
        work()?;
    }
    gpu.synchronize()?;
    let mut t = (0..repeat.max(1)).map(|_| gpu.time_ms(&mut work)).collect::<Result<Vec<_>>>()?;
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

/// cuBLAS's forward GEMM `y = x w^T` (or, given `(dz, dx, dw)`, its forward, dX and dW
/// GEMMs), median milliseconds; the three separately are printed too.
#[allow(clippy::too_many_arguments)]
fn time_cublas<T: Operand>(
    gpu: &Gpu,
    cublas: &Cublas,
    repeat: usize,
    model: &str,
    (x, w): (&T, &T),
    y: &mut DeviceTensor,
    grads: Option<(&T, &mut DeviceTensor, &mut DeviceTensor)>,
) -> Result<f64> {
    let Some((dz, dx, dw)) = grads else {
        return median_ms(gpu, repeat, || cublas.forward(x, w, y));
    };
    let each = [
        median_ms(gpu, repeat, || cublas.forward(x, w, y))?,
        median_ms(gpu, repeat, || cublas.grad_input(dz, w, dx))?,
        median_ms(gpu, repeat, || cublas.grad_weight(dz, x, dw))?,
    ];
    eprintln!("{model} cuBLAS (ms): forward {:.3}, dX {:.3}, dW {:.3}", each[0], each[1], each[2]);
    median_ms(gpu, repeat, || {
        cublas.forward(x, w, y)?;
        cublas.grad_input(dz, w, dx)?;
        cublas.grad_weight(dz, x, dw)
    })
}

pub fn run(a: &BenchArgs) -> Result<(), Failure> {
    let gpu = Gpu::open(0)
        .map_err(|e| {
            Error::NoGpu(format!(
                "{}; `host bench` times the GPU kernels against cuBLAS and needs a CUDA GPU of compute \
                 capability 9.0 (H100, H200) with libcublas (on the CPU, `host forward --device cpu` and \
                 `host backward --device cpu` time the CPU backend)",
                no_gpu_reason(e)
            ))
        })?
        .with_tuning(a.tuning.tuning());
    let cublas = Cublas::new(&gpu, a.precision == Precision::Tf32)?;
    let models: Vec<&str> = if a.ops.is_some() { vec!["custom"] } else { a.models.split(',').map(str::trim).collect() };
    let tuning = a.tuning.tuning();
    let tunings = match a.small_batch_kernels {
        true => vec![
            tuning,
            Tuning { gemv_tensor_cores: false, ..tuning },
            Tuning { gemv: false, gemv_tensor_cores: false, ..tuning },
        ],
        false => vec![tuning],
    };
    let mut rows = Vec::new();
    for (model, tuning) in models.iter().flat_map(|m| tunings.iter().map(move |t| (*m, *t))) {
        let gpu = gpu.clone().with_tuning(tuning);
        let args = BlockArgs {
            model: Some(if a.ops.is_some() { "M1".into() } else { model.into() }),
            ops: a.ops.clone(),
            shape: a.shape.clone(),
            groups: a.groups,
            seed: 1,
            weights: None,
            input: None,
            precision: Some(a.precision),
        };
        let p = args.problem()?;
        let (b, i, o) = (p.x.rows(), p.spec.in_features, p.spec.out_features);
        if a.precision == Precision::Bf16 && !a.fp32_tensors {
            let (ours, cublas_ms, path, flops) = time_bf16_model(&gpu, &cublas, a, model, &p)?;
            let tflops = flops / (ours * 1e-3) / 1e12;
            eprintln!("{model}: ours {ours:.3} ms, cuBLAS {cublas_ms:.3} ms ({path})");
            rows.push(Row { model: p.name, shape: (b, i, o), path, ours_ms: ours, cublas_ms, tflops });
            continue;
        }
        let mut block = GpuBlock::new(&gpu, &p.spec, &p.params)?.with_precision(a.precision);
        // FP8: the weight quantised once, as between optimizer steps (or for inference).
        block.refold(&gpu)?;
        let x = gpu.upload(&p.x)?;
        let ws = block.workspace(&gpu, b)?;
        let path = block.describe(&gpu, &ws.plan);
        let passes = if a.backward { 3.0 } else { 1.0 };
        // Rate of the arithmetic actually done (a folded avgpool shrinks the GEMMs).
        let flops = passes * block.executed_flops(b);
        let mut rng = StdRng::seed_from_u64(2);
        let ours = if a.backward {
            drop(ws);
            let dy = gpu.upload(&random_input(b, p.spec.features_at(p.spec.chain.0.len()), &mut rng)?)?;
            let ms = median_ms(&gpu, a.repeat, || {
                let (_, saved) = block.forward_train(&gpu, &x, false)?;
                block.backward(&gpu, &x, saved, &dy).map(drop)
            })?;
            // One more run, marked phase by phase, for the breakdown.
            let mut phases = Phases::start(&gpu)?;
            let (_, saved) = block.forward_train(&gpu, &x, false)?;
            phases.mark(&gpu, "forward (saving z)")?;
            block.backward_timed(&gpu, &x, saved, &dy, Some(&mut phases))?;
            let parts: Vec<String> = phases.millis()?.iter().map(|(n, t)| format!("{n} {t:.3}")).collect();
            eprintln!("{model} phases (ms): {}", parts.join(", "));
            ms
        } else {
            let mut ws = ws;
            median_ms(&gpu, a.repeat, || block.forward_into(&gpu, &x, &mut ws, None))?
        };
        drop(block);

        let w = gpu.upload(&p.params.linear_weight)?;
        let mut y = gpu.poisoned(&[b, o])?;
        // The backward's operands and outputs, only when timed.
        let mut grads = if a.backward {
            Some((gpu.upload(&random_input(b, o, &mut rng)?)?, gpu.poisoned(&[b, i])?, gpu.poisoned(&[o, i])?))
        } else {
            None
        };
        let cublas_ms = if a.precision == Precision::Bf16 || a.precision.is_fp8() {
            // cuBLAS's bf16 GEMM on bf16 copies, made before timing (a bf16 model would
            // hold its tensors in bf16 already): FP8's peer too.
            let (xb, wb) = (to_half::<Bf16>(&gpu, &x)?, to_half::<Bf16>(&gpu, &w)?);
            let dzb = grads.as_ref().map(|(dz, ..)| to_half::<Bf16>(&gpu, dz)).transpose()?;
            let grads = grads.as_mut().zip(dzb.as_ref()).map(|((_, dx, dw), dzb)| (dzb, dx, dw));
            time_cublas(&gpu, &cublas, a.repeat, model, (&xb, &wb), &mut y, grads)?
        } else {
            let grads = grads.as_mut().map(|(dz, dx, dw)| (&*dz, dx, dw));
            time_cublas(&gpu, &cublas, a.repeat, model, (&x, &w), &mut y, grads)?
        };
        let tflops = flops / (ours * 1e-3) / 1e12;
        eprintln!("{model}: ours {ours:.3} ms, cuBLAS {cublas_ms:.3} ms ({path})");
        rows.push(Row { model: p.name, shape: (b, i, o), path, ours_ms: ours, cublas_ms, tflops });
    }

    let (what, peer) = if a.backward { ("forward+backward", "cuBLAS 3 GEMMs") } else { ("forward", "cuBLAS GEMM") };
    println!(
        "device: {} ({} SMs, kernels from {:?}); {what}, precision {} (cuBLAS: {}); median of {} runs, CUDA events",
        gpu.props.name,
        gpu.props.multiprocessors,
        gpu.kernel_image(),
        a.precision,
        match (a.precision, a.fp32_tensors) {
            (Precision::Tf32, _) => "TF32 tensor-op math",
            (Precision::Bf16, true) => "bf16 GEMM on bf16 copies, FP32 accumulation and output; ours on FP32 tensors",
            (Precision::Bf16, false) =>
                "bf16 GEMM, FP32 accumulation, bf16 output; ours and cuBLAS on a bf16 model's bf16 tensors",
            (Precision::Fp8 | Precision::Fp8GwBf16, _) => {
                "bf16 GEMM on bf16 copies, FP32 output; ours FP8 on FP32 tensors, x quantised per call, W once"
            }
            _ => "SGEMM, FP32",
        },
        a.repeat
    );
    println!("{:<7} {:<20} {:>9} {:>15} {:>7} {:>9}  path", "model", "shape", "ours ms", peer, "ratio", "TFLOP/s");
    for r in &rows {
        let shape = format!("{}x{}x{}", r.shape.0, r.shape.1, r.shape.2);
        println!(
            "{:<7} {:<20} {:>9.3} {:>15.3} {:>7.2} {:>9.1}  {}",
            r.model,
            shape,
            r.ours_ms,
            r.cublas_ms,
            r.ours_ms / r.cublas_ms,
            r.tflops,
            r.path
        );
    }
    if let Some(path) = &a.json {
        let items: Vec<String> = rows
            .iter()
            .map(|r| {
                format!(
                    "  {{\"model\": \"{}\", \"shape\": [{}, {}, {}], \"ours_ms\": {:.5}, \"cublas_ms\": {:.5}, \
                     \"ratio\": {:.4}, \"tflops\": {:.3}, \"path\": \"{}\"}}",
                    r.model,
                    r.shape.0,
                    r.shape.1,
                    r.shape.2,
                    r.ours_ms,
                    r.cublas_ms,
                    r.ours_ms / r.cublas_ms,
                    r.tflops,
                    r.path.replace('"', "'")
                )
            })
            .collect();
        let text = format!(
            "{{\"device\": \"{}\", \"precision\": \"{}\", \"backward\": {}, \"results\": [\n{}\n]}}\n",
            gpu.props.name,
            a.precision,
            a.backward,
            items.join(",\n")
        );
        std::fs::write(path, text).map_err(|e| Error::file(path, e))?;
    }
    Ok(())
}

/// A bf16 model's block (`GpuBlock<Bf16>`: the problem's values rounded to bf16 once,
/// before timing) and cuBLAS's bf16 GEMMs on the same bf16 tensors with bf16 output:
/// `(ours ms, cuBLAS ms, path, FLOPs)`.
fn time_bf16_model(
    gpu: &Gpu,
    cublas: &Cublas,
    a: &BenchArgs,
    model: &str,
    p: &super::Problem,
) -> Result<(f64, f64, String, f64)> {
    let (b, i, o) = (p.x.rows(), p.spec.in_features, p.spec.out_features);
    let block = GpuBlock::new_bf16(gpu, &p.spec, &p.params.map(Bf16::from_f32))?;
    let x = gpu.upload(&p.x.to_bf16())?;
    let ws = block.workspace(gpu, b)?;
    let path = block.describe(gpu, &ws.plan);
    let flops = if a.backward { 3.0 } else { 1.0 } * block.executed_flops(b);
    let mut rng = StdRng::seed_from_u64(2);
    let ours = if a.backward {
        drop(ws);
        let dy = gpu.upload(&random_input(b, p.spec.features_at(p.spec.chain.0.len()), &mut rng)?.to_bf16())?;
        median_ms(gpu, a.repeat, || {
            let (_, saved) = block.forward_train(gpu, &x, false)?;
            block.backward(gpu, &x, saved, &dy).map(drop)
        })?
    } else {
        let mut ws = ws;
        median_ms(gpu, a.repeat, || block.forward_into(gpu, &x, &mut ws, None))?
    };
    let w = gpu.upload(&p.params.linear_weight.to_bf16())?;
    drop(block);
    let mut y = gpu.poisoned_as::<Bf16>(&[b, o])?;
    let cublas_ms = if a.backward {
        let dz = gpu.upload(&random_input(b, o, &mut rng)?.to_bf16())?;
        let (mut dx, mut dw) = (gpu.poisoned_as::<Bf16>(&[b, i])?, gpu.poisoned_as::<Bf16>(&[o, i])?);
        let each = [
            median_ms(gpu, a.repeat, || cublas.forward(&x, &w, &mut y))?,
            median_ms(gpu, a.repeat, || cublas.grad_input(&dz, &w, &mut dx))?,
            median_ms(gpu, a.repeat, || cublas.grad_weight(&dz, &x, &mut dw))?,
        ];
        eprintln!("{model} cuBLAS bf16 (ms): forward {:.3}, dX {:.3}, dW {:.3}", each[0], each[1], each[2]);
        median_ms(gpu, a.repeat, || {
            cublas.forward(&x, &w, &mut y)?;
            cublas.grad_input(&dz, &w, &mut dx)?;
            cublas.grad_weight(&dz, &x, &mut dw)
        })?
    } else {
        median_ms(gpu, a.repeat, || cublas.forward(&x, &w, &mut y))?
    };
    Ok((ours, cublas_ms, path, flops))
}

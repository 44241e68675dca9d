//! `host bench`: times each block on the GPU against cuBLAS's SGEMM alone, same
//! process, same shapes, strict FP32.

use super::{BlockArgs, Failure};
use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::gpu::cublas::Cublas;
use crate::gpu::forward::GpuBlock;
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
    /// Also write the table as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
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

pub fn run(a: &BenchArgs) -> Result<(), Failure> {
    let gpu = Gpu::open(0)?;
    let cublas = Cublas::new(&gpu)?;
    let models: Vec<&str> = if a.ops.is_some() { vec!["custom"] } else { a.models.split(',').map(str::trim).collect() };
    let mut rows = Vec::new();
    for model in models {
        let args = BlockArgs {
            model: if a.ops.is_some() { "M1".into() } else { model.into() },
            ops: a.ops.clone(),
            shape: a.shape.clone(),
            groups: a.groups,
            seed: 1,
            weights: None,
            input: None,
        };
        let p = args.problem()?;
        let (b, i, o) = (p.x.rows(), p.spec.in_features, p.spec.out_features);
        let block = GpuBlock::new(&gpu, &p.spec, &p.params)?;
        let x = gpu.upload(&p.x)?;
        let mut ws = block.workspace(&gpu, b)?;
        let ours = median_ms(&gpu, a.repeat, || block.forward_into(&gpu, &x, &mut ws))?;
        let path = block.describe(&ws.plan);
        let flops = block.executed_flops(b);
        drop((block, ws));

        let w = gpu.upload(&p.params.linear_weight)?;
        let mut y = gpu.poisoned(&[b, o])?;
        let cublas_ms = median_ms(&gpu, a.repeat, || cublas.sgemm(&x, &w, &mut y))?;
        // Rate of the arithmetic actually done (a folded avgpool shrinks the GEMM).
        let tflops = flops / (ours * 1e-3) / 1e12;
        eprintln!("{model}: ours {ours:.3} ms, cuBLAS SGEMM {cublas_ms:.3} ms ({path})");
        rows.push(Row { model: p.name, shape: (b, i, o), path, ours_ms: ours, cublas_ms, tflops });
    }

    println!(
        "device: {} ({} SMs); strict FP32; median of {} runs, CUDA events",
        gpu.props.name, gpu.props.multiprocessors, a.repeat
    );
    println!(
        "{:<7} {:<20} {:>9} {:>12} {:>7} {:>9}  path",
        "model", "shape", "ours ms", "cuBLAS ms", "ratio", "TFLOP/s"
    );
    for r in &rows {
        let shape = format!("{}x{}x{}", r.shape.0, r.shape.1, r.shape.2);
        println!(
            "{:<7} {:<20} {:>9.3} {:>12.3} {:>7.2} {:>9.1}  {}",
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
                    "  {{\"model\": \"{}\", \"shape\": [{}, {}, {}], \"ours_ms\": {:.5}, \"cublas_sgemm_ms\": {:.5}, \
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
            "{{\"device\": \"{}\", \"precision\": \"fp32\", \"results\": [\n{}\n]}}\n",
            gpu.props.name,
            items.join(",\n")
        );
        std::fs::write(path, text).map_err(|e| Error::file(path, e))?;
    }
    Ok(())
}

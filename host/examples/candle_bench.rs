//! The five seed models (docs/MODELS.md) on candle's CUDA device: `host::candle::FusedLinear`
//! against the same block written with candle's own ops, f32 and bf16 tensors, forward on
//! plain tensors (inference) and forward + backward through candle's autograd (the
//! parameters and `x` are `Var`s).
//!
//! Protocol `stream` (docs/PERFORMANCE.md): calls back to back on candle's stream, the
//! device synchronised once after each round of `ITERS` calls; the median of `ROUNDS`
//! rounds, milliseconds per call, host dispatch included as a candle user sees it.
//! Before timing, each model's output and gradients are compared with candle's.
//!
//! The GEMM arithmetic: for f32 tensors candle's FP32 (cuBLAS SGEMM) and TF32
//! (`set_gemm_reduced_precision_f32`), ours in FP32, 3xTF32 (FP32's accuracy) and TF32;
//! for bf16 tensors both in bf16.
//!
//! `cargo run --release -p host --no-default-features --features candle-cuda --example candle_bench`
//! (docs/RUST.md: building `candle-cuda`). `--models M1,M3` and `--dtypes f32,bf16` pick.

use candle_core::{DType, Device, Error, Module, Result, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use host::Precision;
use host::candle::FusedLinear;
use std::collections::HashMap;
use std::time::Instant;

const ITERS: usize = 20;
const ROUNDS: usize = 5;

struct Model {
    name: &'static str,
    chain: &'static str,
    batch: usize,
    inf: usize,
    outf: usize,
}

const MODELS: [Model; 5] = [
    Model { name: "M1", chain: "groupnorm(256),swish,mul,swish", batch: 1024, inf: 8192, outf: 8192 },
    Model { name: "M2", chain: "swish,bias,groupnorm(64)", batch: 32768, inf: 1024, outf: 4096 },
    Model { name: "M3", chain: "groupnorm(512),leakyrelu(0.01),double", batch: 1024, inf: 8192, outf: 8192 },
    Model { name: "M4", chain: "avgpool(16),gelu,scale(2),max", batch: 1024, inf: 8192, outf: 8192 },
    Model { name: "M5", chain: "bias,hardtanh(-1,1),mish,groupnorm(256)", batch: 1024, inf: 8192, outf: 8192 },
];

/// candle's GroupNorm over `(batch, channels)` (it wants `(N, C, L)`: L = 1).
fn group_norm(z: &Tensor, groups: usize, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    let gn = candle_nn::GroupNorm::new(w.clone(), b.clone(), z.dim(1)?, groups, 1e-5)?;
    gn.forward(&z.unsqueeze(2)?)?.squeeze(2)
}

/// Each model's block in candle's ops, from the parameters in the fused block's order.
fn candle_block(m: &Model, x: &Tensor, p: &[Tensor]) -> Result<Tensor> {
    let z = x.matmul(&p[0].t()?)?.broadcast_add(&p[1])?;
    let silu = candle_nn::ops::silu;
    match m.name {
        "M1" => silu(&silu(&group_norm(&z, 256, &p[2], &p[3])?)?.broadcast_mul(&p[4])?),
        "M2" => group_norm(&silu(&z)?.broadcast_add(&p[2])?, 64, &p[3], &p[4]),
        "M3" => candle_nn::ops::leaky_relu(&group_norm(&z, 512, &p[2], &p[3])?, 0.01)?.affine(2.0, 0.0),
        "M4" => {
            let (b, n) = z.dims2()?;
            z.reshape((b, n / 16, 16))?.mean(2)?.gelu_erf()?.affine(2.0, 0.0)?.max_keepdim(1)
        }
        "M5" => {
            let h = z.broadcast_add(&p[2])?.clamp(-1f32, 1f32)?;
            // Mish: h tanh(softplus(h)); |h| <= 1, so ln(1 + e^h) needs no guard.
            let mish = (&h * (h.exp()? + 1.0)?.log()?.tanh()?)?;
            group_norm(&mish, 256, &p[3], &p[4])
        }
        other => unreachable!("no candle version of {other}"),
    }
}

/// Milliseconds per call: the median over rounds of `ITERS` back-to-back calls.
fn time(dev: &Device, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..3 {
        f()?;
    }
    dev.synchronize()?;
    let mut rounds = Vec::new();
    for _ in 0..ROUNDS {
        let t = Instant::now();
        for _ in 0..ITERS {
            f()?;
        }
        dev.synchronize()?;
        rounds.push(t.elapsed().as_secs_f64() * 1e3 / ITERS as f64);
    }
    rounds.sort_by(f64::total_cmp);
    Ok(rounds[ROUNDS / 2])
}

/// The largest difference between `a` and `b` over `b`'s largest magnitude.
fn rel_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    let a = a.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let b = b.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let scale = b.iter().fold(f32::MIN_POSITIVE, |m, v| m.max(v.abs()));
    Ok(a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale)
}

/// One model in one dtype: the worst difference from candle's ops (output and every
/// gradient, over their largest magnitude, and which), then one table row per mode.
/// Chains with kinks (M3's LeakyReLU, M5's Hardtanh) differ most: where `z` lies within
/// a GEMM's rounding of a kink, the two sides may take different derivatives.
fn measure(m: &Model, dtype: DType, dev: &Device) -> Result<Vec<String>> {
    let varmap = VarMap::new();
    let base = FusedLinear::from_chain(m.inf, m.outf, m.chain, VarBuilder::from_varmap(&varmap, dtype, dev))?;
    let names: Vec<String> = base.spec().param_specs().into_iter().map(|s| s.name).collect();
    let params: Vec<Tensor> = {
        let data = varmap.data().lock().unwrap();
        names.iter().map(|n| data[n].as_tensor().clone()).collect()
    };
    // Inference: the same values as plain tensors (nothing tracks gradients).
    let plain: HashMap<String, Tensor> = names.iter().cloned().zip(params.iter().map(Tensor::detach)).collect();
    let plain_params: Vec<Tensor> = names.iter().map(|n| plain[n].clone()).collect();
    let infer = FusedLinear::from_chain(m.inf, m.outf, m.chain, VarBuilder::from_tensors(plain, dtype, dev))?;
    let x = Tensor::randn(0f32, 1.0, (m.batch, m.inf), dev)?.to_dtype(dtype)?;
    let xv = Var::from_tensor(&x)?;

    // The same values and gradients as candle's ops first (f32: 3xTF32 against SGEMM).
    let f32_ = dtype == DType::F32;
    let checked = if f32_ { base.clone().with_precision(Precision::Tf32x3) } else { base.clone() };
    let (y, y_c) = (checked.forward(xv.as_tensor())?, candle_block(m, xv.as_tensor(), &params)?);
    let dy = Tensor::randn(0f32, 1.0, y_c.shape(), dev)?.to_dtype(dtype)?;
    let g = (y.reshape(y_c.shape())? * &dy)?.sum_all()?.backward()?;
    let g_c = (&y_c * &dy)?.sum_all()?.backward()?;
    let mut worst = (rel_diff(&y, &y_c)?, "y".to_string());
    let named = std::iter::once(("x", xv.as_tensor())).chain(names.iter().map(String::as_str).zip(&params));
    for (name, t) in named {
        let d = rel_diff(g.get(t).expect("a gradient"), g_c.get(t).expect("a gradient"))?;
        if d > worst.0 {
            worst = (d, format!("d{name}"));
        }
    }
    drop((g, g_c));

    let mut rows = Vec::new();
    for train in [false, true] {
        let (x_in, p_in) = if train { (xv.as_tensor(), &params) } else { (&x, &plain_params) };
        let candle = || -> Result<()> {
            let y = candle_block(m, x_in, p_in)?;
            if train {
                (&y * &dy)?.sum_all()?.backward()?;
            }
            Ok(())
        };
        let ours = |precision: Precision| -> Result<f64> {
            let block = if train { base.clone() } else { infer.clone() }.with_precision(precision);
            time(dev, || {
                let y = block.forward(x_in)?;
                if train {
                    (y.reshape(dy.shape())? * &dy)?.sum_all()?.backward()?;
                }
                Ok(())
            })
        };
        let mode = if train { "fwd+bwd" } else { "fwd" };
        let mut row = vec![
            format!("{} {}x{}x{}", m.name, m.batch, m.inf, m.outf),
            format!("{dtype:?}").to_lowercase(),
            mode.into(),
            format!("{:.1e} ({})", worst.0, worst.1),
        ];
        if f32_ {
            candle_core::cuda::set_gemm_reduced_precision_f32(false);
            let c32 = time(dev, candle)?;
            candle_core::cuda::set_gemm_reduced_precision_f32(true);
            let ctf = time(dev, candle)?;
            candle_core::cuda::set_gemm_reduced_precision_f32(false);
            let (o32, o3, otf) = (ours(Precision::Fp32)?, ours(Precision::Tf32x3)?, ours(Precision::Tf32)?);
            row.extend([
                format!("{c32:.3}"),
                format!("{ctf:.3}"),
                format!("{o32:.3} ({:.2}x)", c32 / o32),
                format!("{o3:.3} ({:.2}x)", c32 / o3),
                format!("{otf:.3} ({:.2}x)", ctf / otf),
            ]);
        } else {
            let c16 = time(dev, candle)?;
            let o16 = ours(Precision::Fp32)?;
            row.extend([
                format!("{c16:.3}"),
                "–".into(),
                format!("{o16:.3} ({:.2}x)", c16 / o16),
                "–".into(),
                "–".into(),
            ]);
        }
        eprintln!("{}", row.join(" | "));
        rows.push(format!("| {} |", row.join(" | ")));
    }
    Ok(rows)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let models: Option<Vec<String>> = arg("--models").map(|v| v.split(',').map(str::to_owned).collect());
    let dtypes = arg("--dtypes").unwrap_or_else(|| "f32,bf16".into());
    let dtypes: Vec<DType> =
        dtypes.split(',').map(str::parse).collect::<std::result::Result<_, _>>().map_err(Error::wrap)?;
    let dev = Device::new_cuda(0)?;
    let mut table = Vec::new();
    for m in MODELS.iter().filter(|m| models.as_ref().is_none_or(|p| p.iter().any(|n| n == m.name))) {
        for &dtype in &dtypes {
            table.extend(measure(m, dtype, &dev)?);
        }
    }
    println!();
    println!(
        "candle's CUDA device, protocol stream, ms per call, median of {ROUNDS} rounds of {ITERS} calls; ratios: \
         candle's time over ours (f32: FP32 and 3xTF32 over candle FP32, TF32 over candle TF32; bf16 over candle bf16)"
    );
    println!();
    println!(
        "| model | dtype | mode | max rel diff vs candle | candle (FP32 / bf16) | candle TF32 | ours (FP32 / bf16) \
         | ours 3xTF32 | ours TF32 |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for row in table {
        println!("{row}");
    }
    Ok(())
}

//! GPU kernels against the f64 CPU reference, on fresh random inputs, into outputs
//! poisoned with NaN. Ignored without a GPU: run them with `--include-ignored` on a
//! GPU machine (scripts/device-run.sh does). They fail, never skip, if no GPU opens.

use host::block::random_input;
use host::check::{FP32_REL, compare_f32};
use host::gpu::block::GpuBlock;
use host::gpu::{Gpu, Tuning};
use host::reference;
use host::{BlockSpec, Chain, Params, Preset, Tensor};
use rand::SeedableRng;
use rand::rngs::StdRng;

/// The plain GEMM is held to 1e-5: rounding of a k-term f32 sum stays well under.
const GEMM_REL: f64 = 1e-5;

fn gpu() -> Gpu {
    Gpu::open(0).unwrap_or_else(|e| panic!("these tests need a GPU: {e}"))
}

/// A block's parameters ([`Params::random`]), an input of `batch` rows and an output
/// gradient, drawn in that order from `rng`.
fn random_case(spec: &BlockSpec, batch: usize, rng: &mut StdRng) -> (Params<f32>, Tensor<f32>, Tensor<f32>) {
    let params = Params::random(spec, rng);
    let (x, dy) = random_io(spec, batch, rng);
    (params, x, dy)
}

/// An input of `batch` rows and a gradient of the block's output, drawn in that order.
fn random_io(spec: &BlockSpec, batch: usize, rng: &mut StdRng) -> (Tensor<f32>, Tensor<f32>) {
    let x = random_input(batch, spec.in_features, rng).unwrap();
    let out = spec.output_shape(batch);
    let dy = random_input(1, out.iter().product(), rng).unwrap().reshape(&out).unwrap();
    (x, dy)
}

/// The plain GEMM with bias (an empty chain: the FMA kernel `gemm_fma_nt_*`, split-K
/// where the tiles are few) at shapes below, at and above its tiles and not multiples
/// of them, held to 1e-5.
#[test]
#[ignore = "needs a CUDA GPU"]
fn plain_gemm_matches_reference_at_odd_shapes() {
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(7);
    for (m, k, n) in
        [(1, 1, 1), (33, 77, 96), (64, 16, 64), (65, 17, 63), (127, 300, 129), (1000, 1024, 1000), (256, 8192, 384)]
    {
        let spec = BlockSpec::new(k, n, Chain::default()).unwrap();
        let params = Params::init(&spec, &mut rng);
        let x = random_input(m, k, &mut rng).unwrap();
        let block = GpuBlock::new(&gpu, &spec, &params).unwrap();
        let y = block.forward(&gpu, &x).unwrap();
        let p64 = params.map(f64::from);
        let want = reference::linear::linear_forward(&x.to_f64(), &p64.linear_weight, &p64.linear_bias).unwrap();
        let c = compare_f32(y.data(), want.data());
        println!("plain GEMM m={m:<5} k={k:<5} n={n:<5} rel {:.2e} max abs {:.2e}", c.rel, c.max_abs);
        assert!(c.passes(GEMM_REL), "({m}, {k}, {n}): {c:?}");
    }
}

/// Every preset, plus chains the presets do not cover, through the GPU block forward.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_block_forward_matches_reference() {
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(11);
    let mut cases: Vec<(String, Chain, (usize, usize, usize))> = vec![
        ("M1".into(), Preset::M1.chain().with_groups(4), (33, 77, 96)),
        ("M2".into(), Preset::M2.chain().with_groups(4), (33, 77, 96)),
        ("M3".into(), Preset::M3.chain().with_groups(4), (33, 77, 96)),
        ("M4".into(), Preset::M4.chain(), (33, 77, 96)),
        ("M5".into(), Preset::M5.chain().with_groups(4), (33, 77, 96)),
        ("M1 groups of 24".into(), Preset::M1.chain().with_groups(4), (5, 50, 96)),
        ("M2 groups of 48, 1 row".into(), Preset::M2.chain().with_groups(2), (1, 33, 96)),
        // Enough tiles for the fused kernel, with ragged edges: 16-byte and scalar loads.
        ("M1 fused, k % 4 == 0".into(), Preset::M1.chain().with_groups(125), (1100, 520, 1000)),
        ("M5 fused, odd k".into(), Preset::M5.chain().with_groups(125), (1100, 517, 1000)),
        ("M3 fused, groups of 128".into(), Preset::M3.chain().with_groups(8), (1030, 300, 1024)),
        // Few tiles, deep k: split-K, then the row-wise epilogue.
        ("M1 split-K".into(), Preset::M1.chain().with_groups(8), (64, 4096, 256)),
        ("M4 folded, split-K".into(), Preset::M4.chain(), (100, 2048, 512)),
    ];
    for (text, shape) in [
        ("bias,mish,groupnorm(3),mul,gelu", (17, 45, 30)),
        ("leakyrelu(0.2),hardtanh(-0.5,0.7),avgpool(3),scale(-1.5),max", (9, 31, 100)),
        ("groupnorm(1),swish", (3, 8, 5000)),
        // The whole-row ops (row-wise epilogue; LayerNorm as GroupNorm(1), fused at 128).
        ("sum,max,mean,logsumexp,logsumexp", (17, 45, 300)),
        ("bias,min,swish,scale(-2)", (9, 31, 100)),
        ("logsumexp,leakyrelu(0.01),gelu", (33, 77, 5000)),
        ("softmax,scale(3),mul,maxpool(3),layernorm,gelu", (17, 45, 301)),
        ("layernorm(1e-3),mul,rmsnorm,bias,softmax", (33, 77, 96)),
        ("layernorm,swish", (300, 520, 128)),
        ("rmsnorm(1e-6),maxpool(4),softmax,max", (64, 4096, 256)), // split-K
    ] {
        cases.push((text.into(), text.parse().unwrap(), shape));
    }
    for (name, chain, (b, i, o)) in cases {
        let spec = BlockSpec::new(i, o, chain).unwrap();
        let params = Params::random(&spec, &mut rng);
        let x = random_input(b, i, &mut rng).unwrap();
        let block = GpuBlock::new(&gpu, &spec, &params).unwrap();
        let path = block.describe(&gpu, &block.plan(&gpu, b));
        let y = block.forward(&gpu, &x).unwrap();
        let want = reference::block_forward(&spec, &x.to_f64(), &params.map(f64::from)).unwrap();
        assert_eq!(y.shape(), want.shape(), "{name}");
        let c = compare_f32(y.data(), want.data());
        println!("{name:<40} ({b}, {i}, {o}) rel {:.2e} max abs {:.2e}  [{path}]", c.rel, c.max_abs);
        assert!(c.passes(FP32_REL), "{name}: {c:?}");
    }
}

/// Gradients of `x` and every parameter against the f64 reference's, for every preset
/// and chains covering every op, at small odd shapes; both fused and row-wise forwards.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_block_backward_matches_reference() {
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(13);
    let mut cases: Vec<(String, Chain, (usize, usize, usize))> = Preset::ALL
        .iter()
        .map(|p| {
            let chain = if *p == Preset::M4 { p.chain() } else { p.chain().with_groups(4) };
            (p.to_string(), chain, (33, 77, 96))
        })
        .collect();
    for (text, shape) in [
        // Fusable chains: fused forward, tile-wise backward (ragged rows and columns).
        ("groupnorm(8),swish,mul,swish", (300, 520, 256)),
        ("swish,bias,groupnorm(3)", (70, 33, 96)),
        ("bias,hardtanh(-1,1),mish,groupnorm(125)", (130, 64, 1000)),
        ("groupnorm(1),leakyrelu(0.01),scale(2)", (70, 40, 128)),
        ("bias,mish,groupnorm(3),mul,gelu", (17, 45, 30)),
        ("leakyrelu(0.2),hardtanh(-0.5,0.7),avgpool(3),scale(-1.5),max", (9, 31, 100)),
        ("gelu,max,scale(3),leakyrelu(0.2)", (5, 20, 40)),
        ("", (7, 13, 9)),
        // The whole-row ops, forward and backward.
        ("sum,max,mean,logsumexp,logsumexp", (17, 45, 300)),
        ("bias,min,swish,scale(-2)", (9, 31, 100)),
        ("mish,mean,tanh", (9, 31, 100)),
        // A bias op before a folded mean (KernelBench 51): its gradient is the bias's.
        ("bias,mean,logsumexp,gelu", (17, 45, 300)),
        ("logsumexp,leakyrelu(0.01),gelu", (33, 77, 5000)),
        ("softmax,scale(3),mul,maxpool(3),layernorm,gelu", (17, 45, 301)),
        ("layernorm(1e-3),mul,rmsnorm,bias,softmax,logsumexp", (33, 77, 96)),
        ("layernorm,swish", (300, 520, 128)),
        ("rmsnorm(1e-6),maxpool(4),softmax,max", (64, 4096, 256)),
        ("avgpool(4),groupnorm(2),swish", (64, 1024, 64)), // folded, split-K
    ] {
        cases.push((format!("`{text}`"), text.parse().unwrap(), shape));
    }
    for (name, chain, (b, i, o)) in cases {
        let spec = BlockSpec::new(i, o, chain).unwrap();
        let (params, x, dy) = random_case(&spec, b, &mut rng);
        let block = GpuBlock::new(&gpu, &spec, &params).unwrap();
        let got = block.forward_backward(&gpu, &x, &dy).unwrap();
        let (_, want) = reference::block_backward(&spec, &x.to_f64(), &params.map(f64::from), &dy.to_f64()).unwrap();
        let mut report = vec![("x".to_string(), compare_f32(got.x.data(), want.x.data()))];
        for ((s, g), w) in spec.param_specs().iter().zip(got.params.flat()).zip(want.params.flat()) {
            assert_eq!(g.shape(), w.shape(), "{name}: {}", s.name);
            report.push((s.name.clone(), compare_f32(g.data(), w.data())));
        }
        let worst = report.iter().map(|(_, c)| c.rel).fold(0.0, f64::max);
        println!("{name:<66} ({b}, {i}, {o}) worst rel {worst:.2e}");
        for (what, c) in &report {
            assert!(c.passes(FP32_REL), "{name}: grad of {what}: {c:?}");
        }
    }
}

/// GroupNorm over groups of two channels (the row-wise backward), where the gradient
/// is `eps rstd^3 (g1 - g2) / 2` and the general formula's `1 - xhat^2` cancels to
/// noise in f32 once the variance dwarfs eps (the scale puts it near 1e6 eps; the max
/// leaves a row's only gradient in one group). Compared with the exact gradients at
/// the device's own `z`: over two channels the gradient goes as `(z1 - z2)^-3`, so
/// f32's rounding of a near-tied pair of `z` alone moves it beyond 1e-4.
#[test]
#[ignore = "needs a CUDA GPU"]
fn group_norm_backward_over_two_channel_groups() {
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(23);
    for (text, (b, i, o)) in
        [("scale(50),groupnorm(48),swish", (40, 64, 96)), ("scale(50),groupnorm(48),max", (5, 16, 96))]
    {
        let spec = BlockSpec::new(i, o, text.parse().unwrap()).unwrap();
        let (params, x, dy) = random_case(&spec, b, &mut rng);
        let block = GpuBlock::new(&gpu, &spec, &params).unwrap();
        let got = block.forward_backward(&gpu, &x, &dy).unwrap();
        assert_eq!(got.z.shape(), [b, o]);
        let (x64, p64, dy64) = (x.to_f64(), params.map(f64::from), dy.to_f64());
        let (_, want) = reference::block_backward_at(&spec, &x64, &p64, &dy64, &got.z.to_f64()).unwrap();
        let report = got.compare(&spec, &want);
        let worst = report.iter().map(|(_, c)| c.rel).fold(0.0, f64::max);
        println!("{text:<34} ({b}, {i}, {o}) at the device's z: worst rel {worst:.2e}");
        for (what, c) in &report {
            assert!(c.passes(FP32_REL), "{text}: grad of {what}: {c:?}");
        }
    }
}

/// The tensor-core GEMMs, fused and row-wise paths, ragged shapes: the forward and
/// every gradient against the exact function's, each precision at its tolerance
/// (3xTF32 at FP32's). The gradients of chains with kinks rely on the refinement of
/// `z` near them (see `kink_refinement_gives_the_exact_functions_gradients`).
#[test]
#[ignore = "needs a CUDA GPU"]
fn tensor_core_precisions_match_reference() {
    use host::Precision;
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(19);
    let cases: [(&str, (usize, usize, usize)); 10] = [
        ("groupnorm(8),swish,mul,swish", (300, 520, 256)),
        // A row sum or mean after biases and scalings, folded: one output column
        // (KernelBench 14, 18, 51).
        ("scale(0.5),sum,scale(1.5)", (100, 2048, 4096)),
        ("mean,max,logsumexp", (70, 1032, 3000)),
        ("bias,bias,double,sum", (100, 2048, 4096)),
        // The row dot's one-value path (`k % 4 != 0`), its column sums in ranges.
        ("scale(-0.5),mean,gelu", (2100, 1023, 300)),
        // Deep enough `k` for the TF32 and bf16 forwards' TMA kernels (ragged `m`, `n`;
        // k % 32 != 0 and k % 64 != 0; k % 8 == 0, which bf16's TMA wants).
        ("groupnorm(65),swish,mul,swish", (300, 4104, 520)),
        // More tiles than SMs (the TF32 forward's persistent blocks loop), ragged `k`.
        ("groupnorm(325),swish", (2100, 200, 2600)),
        ("bias,hardtanh(-1,1),mish,groupnorm(125)", (130, 517, 1000)),
        ("avgpool(16),gelu,scale(2),max", (100, 2048, 512)),
        ("swish,bias,groupnorm(4)", (65, 1024, 96)),
    ];
    for precision in [Precision::Tf32x3, Precision::Tf32, Precision::Bf16, Precision::Fp16] {
        for (text, (b, i, o)) in cases {
            let spec = BlockSpec::new(i, o, text.parse().unwrap()).unwrap();
            let params = Params::init(&spec, &mut rng);
            let (x, dy) = random_io(&spec, b, &mut rng);
            let block = GpuBlock::new(&gpu, &spec, &params).unwrap().with_precision(precision);
            let report = f32_report(&gpu, &block, &params, (&x, &dy));
            let worst = report.iter().map(|(_, c)| c.rel).fold(0.0, f64::max);
            println!("{precision:<7} {text:<42} ({b}, {i}, {o}) worst rel {worst:.2e}");
            for (what, c) in &report {
                assert!(c.passes(precision.tolerance()), "{precision} {text}: {what}: {c:?}");
            }
        }
    }
}

/// The refinement of `z` near kinks, at sizes where TF32's and bf16's rounding of `z`
/// puts dozens of LeakyReLU / Hardtanh inputs on the wrong side of their kinks (M3's
/// and M5's chains, M4's arg-max): with it, every gradient is within the precision's
/// tolerance of the exact function's. Without it the M3-like TF32 case must miss by
/// more than that tolerance (~1e-2), or the case would not exercise the refinement.
#[test]
#[ignore = "needs a CUDA GPU"]
fn kink_refinement_gives_the_exact_functions_gradients() {
    use host::Precision;
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(23);
    // The first two are scanned in registers (`kink_scan_tiles`), the others row by
    // row (`kink_scan`: a folded AvgPool and a max; groups of 25 channels, a ragged k).
    // The last two carry the radius through the whole-row ops to a MaxPool's and a
    // row min's ties.
    let cases: [(&str, (usize, usize, usize)); 6] = [
        ("groupnorm(64),leakyrelu(0.01),double", (512, 4096, 1024)),
        ("bias,hardtanh(-1,1),mish,groupnorm(32)", (512, 4096, 1024)),
        ("avgpool(16),gelu,scale(2),max", (1024, 2048, 2048)),
        ("groupnorm(40),leakyrelu(0.01),double", (512, 4100, 1000)),
        ("rmsnorm,maxpool(4),gelu,min", (512, 4096, 1024)),
        ("layernorm,mul,softmax,scale(1000),maxpool(2),logsumexp", (512, 4096, 1024)),
    ];
    for precision in [Precision::Tf32, Precision::Bf16] {
        for (n_case, (text, (b, i, o))) in cases.into_iter().enumerate() {
            let spec = BlockSpec::new(i, o, text.parse().unwrap()).unwrap();
            let (params, x, dy) = random_case(&spec, b, &mut rng);
            let (_, want) =
                reference::block_backward(&spec, &x.to_f64(), &params.map(f64::from), &dy.to_f64()).unwrap();
            let block = GpuBlock::new(&gpu, &spec, &params).unwrap().with_precision(precision);
            let worst = |refine: bool| {
                let gpu = gpu.clone().with_tuning(Tuning { kink_refinement: refine, ..Tuning::default() });
                let got = block.forward_backward(&gpu, &x, &dy).unwrap();
                got.compare(&spec, &want).into_iter().max_by(|a, b| a.1.rel.total_cmp(&b.1.rel)).unwrap()
            };
            let (what_off, off) = worst(false);
            let (what_on, on) = worst(true);
            println!(
                "{precision:<5} {text:<40} ({b}, {i}, {o}): worst gradient {what_off} {:.2e} as computed, \
                 {what_on} {:.2e} refined",
                off.rel, on.rel
            );
            assert!(on.passes(precision.tolerance()), "{precision} {text}: refined {what_on}: {on:?}");
            if precision == Precision::Tf32 && n_case == 0 {
                assert!(!off.passes(precision.tolerance()), "{text}: no kink flipped without refinement: {off:?}");
            }
        }
    }
}

/// A block of `text` at `(batch, in, out)` in `precision` on random inputs: its forward
/// and every gradient against the f64 reference, at the precision's tolerance.
fn assert_block_matches_reference(
    gpu: &Gpu,
    text: &str,
    (b, i, o): (usize, usize, usize),
    precision: host::Precision,
    rng: &mut StdRng,
) {
    let spec = BlockSpec::new(i, o, text.parse().unwrap()).unwrap();
    let (params, x, dy) = random_case(&spec, b, rng);
    let block = GpuBlock::new(gpu, &spec, &params).unwrap().with_precision(precision);
    let path = block.describe(gpu, &block.plan(gpu, b));
    let y = block.forward(gpu, &x).unwrap();
    let got = block.forward_backward(gpu, &x, &dy).unwrap();
    let p64 = params.map(f64::from);
    let want_y = reference::block_forward(&spec, &x.to_f64(), &p64).unwrap();
    let (_, want) = reference::block_backward(&spec, &x.to_f64(), &p64, &dy.to_f64()).unwrap();
    let mut report = vec![("y".to_string(), compare_f32(y.data(), want_y.data()))];
    report.extend(got.compare(&spec, &want));
    let worst = report.iter().map(|(_, c)| c.rel).fold(0.0, f64::max);
    println!("{precision:<7} {text:<66} ({b}, {i}, {o}) worst rel {worst:.2e}  [{path}]");
    for (what, c) in &report {
        assert!(c.passes(precision.tolerance()), "{precision} {text}: {what}: {c:?}");
    }
}

/// Sigmoid and GELU's tanh form on every path, forward and backward against the f64
/// reference: the row-wise epilogue and the fused FP32 kernel, both kink scans carrying
/// their radius to a kink after them (with TF32's refinement), the tensor-core
/// precisions, and the persistent TF32 kernel's epilogue on the fragments.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sigmoid_and_gelu_tanh_match_reference_on_every_path() {
    use host::Precision::{self, Bf16, Fp32, Tf32, Tf32x3};
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(29);
    let cases: [(&str, (usize, usize, usize), Precision); 11] = [
        ("sigmoid", (17, 45, 30), Fp32),
        ("gelu_tanh", (17, 45, 30), Fp32),
        ("bias,gelu_tanh,groupnorm(3),sigmoid,mul", (33, 77, 96), Fp32),
        ("gelu_tanh,avgpool(3),scale(2),max", (9, 31, 100), Fp32),
        ("bias,sigmoid,mul,gelu_tanh", (1100, 520, 1000), Fp32),
        ("groupnorm(125),gelu_tanh,leakyrelu(0.2),sigmoid", (1100, 517, 1000), Fp32),
        ("sigmoid,bias,gelu_tanh", (300, 1032, 520), Tf32x3),
        ("sigmoid,bias,gelu_tanh", (300, 1032, 520), Bf16),
        // Kinks after the new ops: scanned in registers, then row by row (a folded pool, a max).
        ("groupnorm(64),gelu_tanh,leakyrelu(0.01),sigmoid,hardtanh(0.2,0.7)", (512, 4096, 1024), Tf32),
        ("avgpool(16),gelu_tanh,scale(2),max", (1024, 2048, 2048), Tf32),
        ("sigmoid,mul,gelu_tanh", (300, 1032, 520), Bf16),
    ];
    for (text, shape, precision) in cases {
        assert_block_matches_reference(&gpu, text, shape, precision, &mut rng);
    }
    // The persistent TF32 kernel (its epilogue on the wgmma fragments), on sampled rows.
    for chain in ["sigmoid,bias,gelu_tanh", "gelu_tanh,mul,sigmoid"] {
        let (b, i, o) = (2100, 1036, 2600);
        let spec = BlockSpec::new(i, o, chain.parse().unwrap()).unwrap();
        let params = Params::random(&spec, &mut rng);
        let x = random_input(b, i, &mut rng).unwrap();
        let block = GpuBlock::new(&gpu, &spec, &params).unwrap().with_precision(Tf32);
        let path = block.describe(&gpu, &block.plan(&gpu, b));
        assert!(path.contains("gemm_tma_tf32_nt"), "expected gemm_tma_tf32_nt, got {path}");
        let y = block.forward(&gpu, &x).unwrap();
        let rows: Vec<usize> = (0..b).step_by(131).chain([b - 1]).collect();
        let pick = |data: &[f32], width: usize| -> Vec<f32> {
            rows.iter().flat_map(|&r| data[r * width..(r + 1) * width].iter().copied()).collect()
        };
        let xs = Tensor::new(&[rows.len(), i], pick(x.data(), i)).unwrap();
        let want = reference::block_forward(&spec, &xs.to_f64(), &params.map(f64::from)).unwrap();
        let c = compare_f32(&pick(y.data(), o), want.data());
        println!("tf32 persistent {chain:<30} ({b}, {i}, {o}): rel {:.2e}  [{path}]", c.rel);
        assert!(c.passes(Tf32.tolerance()), "tf32 persistent {chain}: {c:?}");
    }
}

/// The `residual` op (the Linear's output added back: KernelBench 70) on the row-wise
/// kernels' paths: after the tile GEMMs (FP32, TF32, 3xTF32, bf16 operands), split-K
/// parts summed with the bias, the small-batch kernels, a 16-bit model; forward and
/// every gradient against the f64 reference.
#[test]
#[ignore = "needs a CUDA GPU"]
fn residual_chains_match_reference_on_every_path() {
    use host::Precision::{self, Bf16, Fp32, Tf32, Tf32x3};
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(70);
    let cases: [(&str, (usize, usize, usize), Precision); 7] = [
        ("sigmoid,scale(2),residual", (33, 77, 96), Fp32),
        ("mul,softmax,groupnorm(4),residual", (65, 130, 64), Fp32),
        ("sigmoid,scale(2),residual", (300, 1032, 520), Tf32x3),
        ("sigmoid,scale(2),residual", (300, 1032, 520), Bf16),
        // Few rows and a deep `k`: split-K parts, summed with the bias by the row-wise epilogue.
        ("gelu,residual", (96, 8192, 256), Tf32),
        // The small-batch kernels' `z`, then the row-wise epilogue.
        ("tanh,bias,residual", (8, 1024, 1024), Tf32),
        ("residual", (3, 256, 320), Fp32),
    ];
    for (text, shape, precision) in cases {
        assert_block_matches_reference(&gpu, text, shape, precision, &mut rng);
    }
    // A bf16 model's blocks: bf16 `y`, `dy` and `dz` on the row-wise kernels.
    let spec = BlockSpec::new(1024, 520, "sigmoid,scale(2),residual".parse().unwrap()).unwrap();
    let params = Params::init(&spec, &mut rng).map(host::tensor::Bf16::from_f32);
    let x = random_input(300, 1024, &mut rng).unwrap().to_half::<host::tensor::Bf16>();
    let dy = random_input(300, 520, &mut rng).unwrap().to_half::<host::tensor::Bf16>();
    let block = GpuBlock::new_half(&gpu, &spec, &params).unwrap();
    let got = block.forward_backward(&gpu, &x, &dy).unwrap();
    let report = half_report(&spec, &params, (&x, &dy), &got);
    for (what, c) in &report {
        assert!(c.passes(host::precision::BF16_STORED_REL), "bf16 model residual: {what}: {c:?}");
    }
}

/// A row's lone doubtful values recomputed one by one (`refine_values`, for M5's chain:
/// a Hardtanh before its GroupNorm; `k` divisible by 4 and not): every value rewritten
/// is the exact `z` rounded once, every Hardtanh input is then on the exact function's
/// side of its kinks (beyond f32's own rounding of the sum), and far fewer values are
/// rewritten than `refine_z` rewrites over whole chunks with the path off (so it ran).
#[test]
#[ignore = "needs a CUDA GPU"]
fn kink_values_refined_one_by_one_are_exact() {
    use host::Precision;
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(31);
    for ((b, i, o), chain) in [
        ((512, 4096, 1024), "bias,hardtanh(-1,1),mish,groupnorm(32)"),
        ((300, 1001, 520), "bias,hardtanh(-1,1),groupnorm(65)"),
    ] {
        let spec = BlockSpec::new(i, o, chain.parse().unwrap()).unwrap();
        let (params, x, _) = random_case(&spec, b, &mut rng);
        let block = GpuBlock::new(&gpu, &spec, &params).unwrap().with_precision(Precision::Tf32);
        let xd = gpu.upload(&x).unwrap();
        let p = params.ops[0][0].data();
        let (w, lb) = (params.linear_weight.to_f64(), params.linear_bias.to_f64());
        let exact = reference::linear::linear_forward(&x.to_f64(), &w, &lb).unwrap();
        let exact = exact.data();
        let (_, saved) = block.forward_train(&gpu, &xd, false).unwrap();
        let computed = gpu.download(&saved.z).unwrap();
        let mut rewritten = [0usize; 2];
        for (n_path, values) in [true, false].into_iter().enumerate() {
            let gpu = gpu.clone().with_tuning(Tuning { kink_values: values, ..Tuning::default() });
            let (_, mut saved) = block.forward_train(&gpu, &xd, false).unwrap();
            block.refine_saved(&gpu, &xd, &mut saved).unwrap();
            let z = gpu.download(&saved.z).unwrap();
            let mut wrong_side = 0;
            for (e, (&got, &was)) in z.data().iter().zip(computed.data()).enumerate() {
                let want = exact[e] as f32;
                if got.to_bits() != was.to_bits() {
                    rewritten[n_path] += 1;
                    let ulp = f32::from_bits(want.abs().to_bits() + 1) - want.abs();
                    assert!((got - want).abs() <= ulp, "{chain} ({b}, {i}, {o}): z[{e}] = {got}, exact {want}");
                }
                let pc = f64::from(p[e % o]);
                let (v, ve) = (f64::from(got + p[e % o]), exact[e] + pc);
                let side = |v: f64| (v > -1.0) as u8 + (v >= 1.0) as u8;
                if side(v) != side(ve) && (ve.abs() - 1.0).abs() > 1e-6 {
                    wrong_side += 1;
                }
            }
            println!(
                "{chain:<40} ({b}, {i}, {o}) one by one {values}: {} values rewritten, {wrong_side} on the \
                 wrong side of a kink",
                rewritten[n_path]
            );
            assert_eq!(wrong_side, 0, "{chain}: one by one {values}");
        }
        assert!(rewritten[0] > 0 && rewritten[0] * 4 < rewritten[1], "{chain}: rewritten {rewritten:?}");
    }
}

/// The persistent TMA kernels (TF32, 3xTF32 and bf16) looping over more tiles than there are
/// SMs (17 x 11 tiles of 128 x 256), at k = 4096 and at a ragged k = 1036 with groups
/// of 4 channels; groups of 128 at a ragged batch; a deep k = 8192 with a narrow output;
/// output rows that are not 16-byte multiples:
/// sampled rows against the f64 reference (rows are independent, so a row subset of `x`
/// gives the reference's rows), each held to its precision's tolerance.
#[test]
#[ignore = "needs a CUDA GPU"]
fn tf32_persistent_forward_matches_reference_rows() {
    use host::Precision;
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(23);
    let cases = [
        ((2100, 4096, 2600), "groupnorm(325),swish,mul,swish", Precision::Tf32, "gemm_tma_tf32_nt"),
        ((2100, 1036, 2600), "swish,bias,groupnorm(650)", Precision::Tf32, "gemm_tma_tf32_nt"),
        ((1001, 1024, 2560), "groupnorm(20),mish,bias", Precision::Tf32, "gemm_tma_tf32_nt"),
        ((4100, 8192, 512), "gelu", Precision::Tf32, "gemm_tma_tf32_nt"),
        // Rows of 2562 floats: not 16-byte multiples, the stores' 8-byte path.
        ((1001, 1024, 2562), "swish,bias", Precision::Tf32, "gemm_tma_tf32_nt"),
        ((2100, 4096, 2600), "groupnorm(325),swish,mul,swish", Precision::Tf32x3, "gemm_tma_tf32x3_nt"),
        ((2100, 1036, 2600), "swish,bias,groupnorm(650)", Precision::Tf32x3, "gemm_tma_tf32x3_nt"),
        ((2100, 4096, 2600), "groupnorm(325),swish,mul,swish", Precision::Bf16, "gemm_tma_bf16_nt"),
        // A ragged last k-tile (1032 = 16 x 64 + 8) and groups of 128 at a ragged batch.
        ((2100, 1032, 2600), "swish,bias,groupnorm(650)", Precision::Bf16, "gemm_tma_bf16_nt"),
        ((1001, 1024, 2560), "groupnorm(20),mish,bias", Precision::Bf16, "gemm_tma_bf16_nt"),
    ];
    for ((b, i, o), chain, precision, kernel) in cases {
        let spec = BlockSpec::new(i, o, chain.parse().unwrap()).unwrap();
        let params = Params::init(&spec, &mut rng);
        let x = random_input(b, i, &mut rng).unwrap();
        let block = GpuBlock::new(&gpu, &spec, &params).unwrap().with_precision(precision);
        let path = block.describe(&gpu, &block.plan(&gpu, b));
        assert!(path.contains(kernel), "expected {kernel}, got {path}");
        let y = block.forward(&gpu, &x).unwrap();
        let rows: Vec<usize> = (0..b).step_by(131).chain([b - 1]).collect();
        let pick = |data: &[f32], width: usize| -> Vec<f32> {
            rows.iter().flat_map(|&r| data[r * width..(r + 1) * width].iter().copied()).collect()
        };
        let xs = host::Tensor::new(&[rows.len(), i], pick(x.data(), i)).unwrap();
        let want = reference::block_forward(&spec, &xs.to_f64(), &params.map(f64::from)).unwrap();
        let c = compare_f32(&pick(y.data(), o), want.data());
        println!(
            "{precision} persistent ({b}, {i}, {o}), {} rows: rel {:.2e} max abs {:.2e}  [{path}]",
            rows.len(),
            c.rel,
            c.max_abs
        );
        assert!(c.passes(precision.tolerance()), "{precision} {chain}: {c:?}");
    }
}

/// Split-K at few tiles and a deep `k`, each range's sums added by a second kernel with
/// the bias before the chain: tile-wise (`epilogue_split_tiles`) for a chain the GEMM
/// could fuse, row-wise for one that needs whole rows (groups of 24). On the TMA
/// kernels: 3xTF32 in 16 ranges of 33 16-deep k-tiles, and forced into 4 ranges of up
/// to 129 (each flushing once within its range); a bf16 and an fp16 model reading their
/// tensors as stored (8 ranges). TF32's ranges on `gemm_wgmma`, a ragged width (1030:
/// the tile kernel's 4-byte path) among them. Forward and every gradient (the training
/// forward's saved `z` comes from the split sums) against the f64 reference.
#[test]
#[ignore = "needs a CUDA GPU"]
fn split_k_sums_match_reference() {
    use host::Precision;
    let gpu = gpu();
    let four = gpu.clone().with_tuning(Tuning { split_k: Some(4), ..Tuning::default() });
    let mut rng = StdRng::seed_from_u64(31);
    let m1 = |groups: usize| format!("groupnorm({groups}),swish,mul,swish");
    let (tiles, rows) = ("+ epilogue_split_tiles", "+ epilogue_rows");
    for (gpu, precision, dims, chain, kernel, splits, end) in [
        (&gpu, Precision::Tf32x3, (100, 8200, 1024), m1(32), "gemm_tma_tf32x3_nt", 16, tiles),
        (&four, Precision::Tf32x3, (100, 8200, 1024), m1(32), "gemm_tma_tf32x3_nt", 4, tiles),
        (&four, Precision::Tf32x3, (100, 8200, 768), m1(32), "gemm_tma_tf32x3_nt", 4, rows),
        (&gpu, Precision::Tf32, (200, 2056, 768), m1(32), "gemm_wgmma_tf32_nt_vec4", 4, rows),
        (&gpu, Precision::Tf32, (200, 2056, 1024), m1(32), "gemm_wgmma_tf32_nt_vec4", 4, tiles),
        (&gpu, Precision::Tf32, (200, 2056, 1030), "swish,bias".to_string(), "gemm_wgmma_tf32_nt_vec4", 4, tiles),
    ] {
        let spec = BlockSpec::new(dims.1, dims.2, chain.parse().unwrap()).unwrap();
        let block = GpuBlock::new(gpu, &spec, &Params::init(&spec, &mut rng)).unwrap().with_precision(precision);
        let path = block.describe(gpu, &block.plan(gpu, dims.0));
        assert!(path.contains(&format!("{kernel} split-K x{splits} {end}")), "{path}");
        assert_block_matches_reference(gpu, &chain, dims, precision, &mut rng);
    }
    for (dims, chain, path_has) in [
        ((100, 2048, 1024), m1(32), "split-K x8 + epilogue_split_tiles"),
        ((100, 2048, 768), m1(32), "split-K x8 + epilogue_rows"),
    ] {
        let (bf16, f16) = (host::precision::BF16_STORED_REL, host::precision::FP16_STORED_REL);
        split_k_half_model::<host::tensor::Bf16>(&gpu, dims, &chain, path_has, bf16, &mut rng);
        split_k_half_model::<host::tensor::F16>(&gpu, dims, &chain, path_has, f16, &mut rng);
    }
}

/// An FP32 block's `y` (a forward alone) and every gradient (a training forward and the
/// backward) on `x` and `dy`, against the f64 reference.
fn f32_report(
    gpu: &Gpu,
    block: &GpuBlock,
    params: &Params<f32>,
    (x, dy): (&Tensor<f32>, &Tensor<f32>),
) -> Vec<(String, host::check::Comparison)> {
    let spec = &block.spec;
    let y = block.forward(gpu, x).unwrap();
    let got = block.forward_backward(gpu, x, dy).unwrap();
    let p64 = params.map(f64::from);
    let want_y = reference::block_forward(spec, &x.to_f64(), &p64).unwrap();
    let (_, want) = reference::block_backward(spec, &x.to_f64(), &p64, &dy.to_f64()).unwrap();
    let mut report = vec![("y".to_string(), compare_f32(y.data(), want_y.data()))];
    report.extend(got.compare(spec, &want));
    report
}

/// A 16-bit model's `y` and every gradient (`got`) against the f64 reference from the
/// same 16-bit values.
fn half_report<H: host::gpu::HalfElement>(
    spec: &BlockSpec,
    params: &Params<H>,
    (x, dy): (&Tensor<H>, &Tensor<H>),
    got: &host::gpu::block::HostGrads,
) -> Vec<(String, host::check::Comparison)> {
    let (x64, dy64) = (x.to_f32().to_f64(), dy.to_f32().to_f64());
    let p64 = params.map(|v| f64::from(v.to_f32()));
    let want_y = reference::block_forward(spec, &x64, &p64).unwrap();
    let (_, want) = reference::block_backward(spec, &x64, &p64, &dy64).unwrap();
    let mut report = vec![("y".to_string(), compare_f32(got.y.data(), want_y.data()))];
    report.extend(got.compare(spec, &want));
    report
}

/// 16-bit models of `H` with each of `cases` (chain, `(b, i, o)`): the plan is `plan`,
/// and `y` and every gradient of a training step are within `tol` of the f64 reference.
fn half_models_on_plan<H: host::gpu::HalfElement>(
    gpu: &Gpu,
    cases: &[(&str, (usize, usize, usize))],
    plan: &host::gpu::dispatch::Plan,
    tol: f64,
    rng: &mut StdRng,
) {
    for &(text, (b, i, o)) in cases {
        let spec = BlockSpec::new(i, o, text.parse().unwrap()).unwrap();
        let params = Params::init(&spec, rng).map(H::from_f32);
        let x = random_input(b, i, rng).unwrap().to_half::<H>();
        let out = spec.output_shape(b);
        let dy = random_input(1, out.iter().product(), rng).unwrap().reshape(&out).unwrap().to_half::<H>();
        let block = GpuBlock::new_half(gpu, &spec, &params).unwrap();
        assert_eq!(&block.plan(gpu, b), plan, "{} {text}", H::NAME);
        let path = block.describe(gpu, plan);
        let got = block.forward_backward(gpu, &x, &dy).unwrap();
        for (what, c) in &half_report(&spec, &params, (&x, &dy), &got) {
            println!("{} model {text} ({b}, {i}, {o}) {what}: rel {:.2e}  [{path}]", H::NAME, c.rel);
            assert!(c.passes(tol), "{} model {text}: {what}: {c:?}", H::NAME);
        }
    }
}

/// [`split_k_sums_match_reference`] for a 16-bit model of `H` at `(b, i, o)` with
/// `chain`, its path described with `path_has`.
fn split_k_half_model<H: host::gpu::HalfElement>(
    gpu: &Gpu,
    (b, i, o): (usize, usize, usize),
    chain: &str,
    path_has: &str,
    tol: f64,
    rng: &mut StdRng,
) {
    let spec = BlockSpec::new(i, o, chain.parse().unwrap()).unwrap();
    let params = Params::init(&spec, rng).map(H::from_f32);
    let x = random_input(b, i, rng).unwrap().to_half::<H>();
    let dy = random_input(b, o, rng).unwrap().to_half::<H>();
    let block = GpuBlock::new_half(gpu, &spec, &params).unwrap();
    let path = block.describe(gpu, &block.plan(gpu, b));
    // (Split, on the forward's split twin: `gemm_tma_*_nt_split`.)
    let split = path.contains("_nt_split (");
    assert!(path.contains(path_has) && path.contains("as stored") && split, "{}: {path}", H::NAME);
    let got = block.forward_backward(gpu, &x, &dy).unwrap();
    let report = half_report(&spec, &params, (&x, &dy), &got);
    for (what, c) in &report {
        println!("{} model split-K ({b}, {i}, {o}) {what}: rel {:.2e}  [{path}]", H::NAME, c.rel);
        assert!(c.passes(tol), "{} model split-K: {what}: {c:?}", H::NAME);
    }
}

/// A 16-bit model's folded AvgPool: its means as two halves in the type, two GEMMs on
/// `x` as stored (split-K ranges, or one range each where the tuning forces it), and
/// without TMA the 3xTF32 GEMM on FP32 means; a chain the second kernel runs tile-wise
/// and one it runs on rows. A whole row's sum or mean (one column) runs the row dot on
/// FP32 column means whatever the tuning, `k` a multiple of 4 or not (the kernels'
/// one-value path), enough rows that the column sums split into ranges. Forward and
/// every gradient against the f64 reference from the same 16-bit values, outputs
/// poisoned.
#[test]
#[ignore = "needs a CUDA GPU"]
fn folded_avgpool_halves_match_reference() {
    use host::gpu::dispatch::Plan;
    fn check<H: host::gpu::HalfElement>(base: &Gpu, tol: f64, rng: &mut StdRng) {
        let cases = [
            ("avgpool(16),gelu,scale(2),max", (192, 2048, 1024)),
            ("avgpool(8),swish,groupnorm(4)", (130, 1024, 2048)),
            // A whole row's sum or mean: one output column, its fold in passes.
            ("scale(0.5),sum,scale(1.5)", (96, 2048, 4096)),
            ("sum,max,mean,logsumexp,logsumexp", (64, 1024, 8192)),
            ("bias,mean,logsumexp,gelu", (96, 2048, 4096)),
            ("bias,scale(-2),sum", (2100, 1023, 300)),
            ("mean", (1, 4096, 8192)),
        ];
        let tunings = [
            (Tuning::default(), "twice"),
            (Tuning { split_k: Some(1), ..Tuning::default() }, "twice"),
            (Tuning { tma: false, ..Tuning::default() }, "FP32 folded weight"),
        ];
        for (text, (b, i, o)) in cases {
            let spec = BlockSpec::new(i, o, text.parse().unwrap()).unwrap();
            let params = Params::init(&spec, rng).map(H::from_f32);
            let x = random_input(b, i, rng).unwrap().to_half::<H>();
            let out = spec.output_shape(b);
            let dy = random_input(1, out.iter().product(), rng).unwrap().reshape(&out).unwrap().to_half::<H>();
            for (tuning, path_has) in tunings {
                let gpu = base.clone().with_tuning(tuning);
                let block = GpuBlock::new_half(&gpu, &spec, &params).unwrap();
                let plan = block.plan(&gpu, b);
                let path = block.describe(&gpu, &plan);
                let one_column = !text.starts_with("avgpool");
                let path_has = if one_column { "row dot" } else { path_has };
                assert!(path.contains(path_has), "{} {text} {tuning:?}: {path}", H::NAME);
                assert_eq!(one_column, plan == Plan::RowDot, "{} {text}: {plan:?}", H::NAME);
                // Two GEMMs of as many ranges each (2 or 8 tiles here: split where not forced).
                let want = |s: usize| if tuning.split_k == Some(1) { s == 2 } else { s >= 8 && s.is_multiple_of(2) };
                if path_has == "twice" {
                    assert!(
                        matches!(plan, Plan::GemmThenRows { splits } if want(splits)),
                        "{} {text}: {plan:?}",
                        H::NAME
                    );
                }
                let got = block.forward_backward(&gpu, &x, &dy).unwrap();
                let report = half_report(&spec, &params, (&x, &dy), &got);
                let worst = report.iter().map(|(_, c)| c.rel).fold(0.0, f64::max);
                println!("{} model {text} ({b}, {i}, {o}) worst rel {worst:.2e}: {path}", H::NAME);
                for (what, c) in &report {
                    assert!(c.passes(tol), "{} model {text} {tuning:?}: {what}: {c:?}", H::NAME);
                }
            }
        }
    }
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(41);
    check::<host::tensor::Bf16>(&gpu, host::precision::BF16_STORED_REL, &mut rng);
    check::<host::tensor::F16>(&gpu, host::precision::FP16_STORED_REL, &mut rng);
}

/// A layer of one output feature (unfolded): the row dot forward and its `outer` and
/// `column_dot` backward, on an FP32 model in every precision and on bf16 and fp16
/// models as stored, `k` a multiple of the 16-byte chunks or not, one row or many.
/// Forward and every gradient against the f64 reference, outputs poisoned.
#[test]
#[ignore = "needs a CUDA GPU"]
fn one_output_feature_matches_reference() {
    use host::Precision;
    use host::gpu::dispatch::Plan;
    let cases = [("sigmoid", (300, 1000, 1)), ("bias,leakyrelu(0.1),scale(2)", (37, 1023, 1)), ("gelu", (1, 4096, 1))];
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(43);
    for precision in [Precision::Fp32, Precision::Tf32x3, Precision::Tf32, Precision::Bf16] {
        for (text, (b, i, o)) in cases {
            let spec = BlockSpec::new(i, o, text.parse().unwrap()).unwrap();
            let params = Params::init(&spec, &mut rng);
            let x = random_input(b, i, &mut rng).unwrap();
            let dy = random_input(b, o, &mut rng).unwrap();
            let block = GpuBlock::new(&gpu, &spec, &params).unwrap().with_precision(precision);
            assert_eq!(block.plan(&gpu, b), Plan::RowDot, "{precision} {text}");
            let report = f32_report(&gpu, &block, &params, (&x, &dy));
            for (what, c) in &report {
                println!("{precision:<7} {text} ({b}, {i}, {o}) {what}: rel {:.2e}", c.rel);
                assert!(c.passes(precision.tolerance()), "{precision} {text}: {what}: {c:?}");
            }
        }
    }
    half_models_on_plan::<host::tensor::Bf16>(&gpu, &cases, &Plan::RowDot, host::precision::BF16_STORED_REL, &mut rng);
    half_models_on_plan::<host::tensor::F16>(&gpu, &cases, &Plan::RowDot, host::precision::FP16_STORED_REL, &mut rng);
}

/// Chains that reduce each row once after fusable ops (KernelBench 22, 56, 64, 75, 80):
/// the TMA GEMM's epilogue stores row partials and `row_partials_finish` ends the chain
/// (`Plan::RowPartials`), forward (no `z` written) and training forward (`z` saved)
/// alike, with outputs poisoned. Ragged `m` and `n` (the last half tile's columns
/// partly past `n`), enough tiles to run unsplit; the FP32 block in bf16 and TF32,
/// bf16 and fp16 models as stored; 3xTF32, whose runs of `k` are summed in the GEMM's
/// output, on the row-wise path.
#[test]
#[ignore = "needs a CUDA GPU"]
fn row_partials_match_reference() {
    use host::Precision;
    use host::gpu::dispatch::Plan;
    let cases = [
        ("scale(2),hardtanh(-10,10),logsumexp", (1100, 1024, 2000)),
        ("logsumexp,leakyrelu(0.01),gelu", (1100, 1024, 2000)),
        ("max,scale(0.5),gelu", (1030, 2048, 2200)),
        ("groupnorm(125),min,scale(-1)", (1100, 1024, 2000)),
        ("sigmoid,sum", (1100, 1024, 2000)),
        ("swish,mean,tanh", (1030, 2048, 2200)),
    ];
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(47);
    for precision in [Precision::Tf32x3, Precision::Tf32, Precision::Bf16] {
        for (text, (b, i, o)) in cases {
            let spec = BlockSpec::new(i, o, text.parse().unwrap()).unwrap();
            let params = Params::init(&spec, &mut rng);
            let (x, dy) = random_io(&spec, b, &mut rng);
            let block = GpuBlock::new(&gpu, &spec, &params).unwrap().with_precision(precision);
            let plan = block.plan(&gpu, b);
            // (3xTF32 adds its runs of `k` up in the GEMM's output: the row-wise path.)
            match precision {
                Precision::Bf16 => assert_eq!(plan, Plan::RowPartials, "{precision} {text}"),
                Precision::Tf32x3 => assert_eq!(plan, Plan::GemmThenRows { splits: 1 }, "{precision} {text}"),
                _ => {}
            }
            let path = block.describe(&gpu, &plan);
            let report = f32_report(&gpu, &block, &params, (&x, &dy));
            for (what, c) in &report {
                println!("{precision:<7} {text} ({b}, {i}, {o}) {what}: rel {:.2e}  [{path}]", c.rel);
                assert!(c.passes(precision.tolerance()), "{precision} {text}: {what}: {c:?}");
            }
        }
    }
    let plan = &Plan::RowPartials;
    half_models_on_plan::<host::tensor::Bf16>(&gpu, &cases, plan, host::precision::BF16_STORED_REL, &mut rng);
    half_models_on_plan::<host::tensor::F16>(&gpu, &cases, plan, host::precision::FP16_STORED_REL, &mut rng);
}

/// The linear gradients on the TMA kernels, TF32 and 3xTF32: `dW = dZ^T X` (`dZ` as
/// stored, through `gemm_tma_*_tk`; a batch of at least `MIN_K` rows) and `dX = dZ W`
/// (`W` as stored, `gemm_tma_*_tk_t`; `n` of at least `MIN_K`),
/// at ragged sizes (`m` % 32, `n` % 32, `k` % 32 != 0; an odd `k` too, so `dW` rows are
/// not 8-byte aligned) — into NaN-poisoned `dW`s, against the f64 reference, each held
/// to its precision's tolerance.
#[test]
#[ignore = "needs a CUDA GPU"]
fn tf32_linear_gradients_match_reference() {
    use host::Precision;
    use host::gpu::dispatch::{Role, Storage, route};
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(29);
    // 3xTF32 flushes every 2048 of `k`: dW's k = 4100 in three runs, and dX's k = 4100
    // in three, the last tile of the batch ragged. Then batches of 12 (dX's `B` nearly
    // all zero-filled rows; dW on `gemm_wgmma`), and of 4, 1 and 7 (dW as the rows'
    // outer products, in quads and, at k = 261, one by one; dX of one row from a W of
    // 4100 x 264, above DOT_DX_MAX_WEIGHTS: W's weighted rows still, and of one row of
    // 261 columns, which the one-row split sums read value by value).
    for (m, n, k) in [
        (4100, 1028, 260),
        (1028, 4100, 264),
        (1028, 1100, 261),
        (12, 1028, 260),
        (4, 1028, 260),
        (1, 1028, 260),
        (1, 4100, 264),
        (1, 1028, 261),
        (7, 1030, 261),
    ] {
        let x = random_input(m, k, &mut rng).unwrap();
        let dz = random_input(m, n, &mut rng).unwrap();
        let w = random_input(n, k, &mut rng).unwrap();
        for precision in [Precision::Tf32, Precision::Tf32x3] {
            // W and dZ read as stored: `A` through registers.
            let kernel = |role| route(precision, role, (m, n, k), Storage::F32, gpu.tuning().tma).kernel.name();
            let dw_kernel = match m {
                1024.. => format!("gemm_tma_{precision}_tk"),
                ..=8 => "outer".to_string(),
                _ => format!("gemm_wgmma_{precision}_dw_vec4"),
            };
            assert_eq!(kernel(Role::GradWeight), dw_kernel);
            if m <= 8 {
                // A few rows' `dX`: `W`'s rows weighted by `dz`'s, one pass.
                assert_eq!(kernel(Role::GradInput), if m == 1 { "column_dot" } else { "column_dots" });
            } else if k % 4 == 0 {
                assert_eq!(kernel(Role::GradInput), format!("gemm_tma_{precision}_tk_t"));
            }
            check_linear_gradients(&gpu, precision, (&x, &dz, &w));
        }
        if m <= 8 {
            // Strict FP32 takes the same outer products.
            assert_eq!(route(Precision::Fp32, Role::GradWeight, (m, n, k), Storage::F32, true).kernel.name(), "outer");
            check_linear_gradients(&gpu, Precision::Fp32, (&x, &dz, &w));
        }
    }
}

/// `dW = dZ^T X` (into a NaN-poisoned `dW`, on the side stream) and `dX = dZ W` in
/// `precision` against the f64 reference, at the precision's tolerance.
fn check_linear_gradients(
    gpu: &Gpu,
    precision: host::Precision,
    (x, dz, w): (&host::Tensor<f32>, &host::Tensor<f32>, &host::Tensor<f32>),
) {
    use host::gpu::gemm::{grad_input, grad_weight_into};
    let (m, k, n) = (x.shape()[0], x.shape()[1], w.shape()[0]);
    let (want_dx, want_dw, _) = reference::linear::linear_backward(&x.to_f64(), &w.to_f64(), &dz.to_f64()).unwrap();
    let (x_dev, dz_dev, w_dev) = (gpu.upload(x).unwrap(), gpu.upload(dz).unwrap(), gpu.upload(w).unwrap());
    let side = gpu.side_stream().clone();
    let mut dw = gpu.poisoned(&[n, k]).unwrap();
    let scratch = grad_weight_into(gpu, precision, &side, &dz_dev, &x_dev, &mut dw).unwrap();
    gpu.order(&side, gpu.stream()).unwrap();
    let dx = grad_input(gpu, precision, &dz_dev, &w_dev).unwrap();
    let (got_dw, got_dx) = (gpu.download(&dw).unwrap(), gpu.download(&dx).unwrap());
    drop(scratch);
    for (what, got, want) in [("dW", &got_dw, &want_dw), ("dX", &got_dx, &want_dx)] {
        let c = compare_f32(got.data(), want.data());
        println!("{precision} {what} ({m}, {n}, {k}): rel {:.2e} max abs {:.2e}", c.rel, c.max_abs);
        assert!(c.passes(precision.tolerance()), "{precision} {what} ({m}, {n}, {k}): {c:?}");
    }
}

/// The bf16 linear gradients on the TMA kernel (`gemm_tma_bf16_nt` after transposing
/// `W`, resp. `dZ` and `X`): batches and widths of 1024+ divisible by 8, a ragged `k`
/// divisible by 4 (the one-pass transpose-and-round) and an odd one (`W` and `X`
/// transposed in FP32, then rounded; `dW` rows not 8-byte aligned), into NaN-poisoned
/// `dW`s, against the f64 reference at bf16's tolerance.
#[test]
#[ignore = "needs a CUDA GPU"]
fn bf16_linear_gradients_match_reference() {
    use host::Precision;
    use host::gpu::dispatch::{Role, Storage, route};
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(31);
    let precision = Precision::Bf16;
    for (m, n, k) in [(4104, 1032, 260), (1032, 1104, 261)] {
        let x = random_input(m, k, &mut rng).unwrap();
        let dz = random_input(m, n, &mut rng).unwrap();
        let w = random_input(n, k, &mut rng).unwrap();
        assert_eq!(
            route(precision, Role::GradInput, (m, n, k), Storage::F32, gpu.tuning().tma).kernel.name(),
            "gemm_tma_bf16_nt"
        );
        check_linear_gradients(&gpu, precision, (&x, &dz, &w));
    }
}

/// Blocks chained on one GPU tape, block A used twice (`A(B(A(x)))`), so its
/// parameters' gradients are sums the tape accumulates: all match the CPU f64 tape.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_tape_chains_blocks_and_accumulates() {
    use host::gpu::tape::GpuGrad;
    use host::tape::{Tape, VarId};
    use std::rc::Rc;
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(17);
    let s1 = BlockSpec::new(40, 64, "groupnorm(4),swish".parse().unwrap()).unwrap();
    let s2 = BlockSpec::new(64, 40, "bias,gelu".parse().unwrap()).unwrap();
    let (p1, p2) = (Params::init(&s1, &mut rng), Params::init(&s2, &mut rng));
    let x = random_input(9, 40, &mut rng).unwrap();

    // GPU: y = B(A(x)); then z = A(y) reuses block A's parameters, so they get two
    // contributions, summed by the tape.
    let (a, b) = (Rc::new(GpuBlock::new(&gpu, &s1, &p1).unwrap()), Rc::new(GpuBlock::new(&gpu, &s2, &p2).unwrap()));
    let mut tape = Tape::<GpuGrad>::new();
    let x_var = tape.leaf();
    let v1: Vec<VarId> = p1.flat().iter().map(|_| tape.leaf()).collect();
    let v2: Vec<VarId> = p2.flat().iter().map(|_| tape.leaf()).collect();
    let (h, h_var) = a.forward_taped(&gpu, &mut tape, Rc::new(gpu.upload(&x).unwrap()), x_var, &v1).unwrap();
    let (y, y_var) = b.forward_taped(&gpu, &mut tape, h, h_var, &v2).unwrap();
    let (_, z_var) = a.forward_taped(&gpu, &mut tape, y, y_var, &v1).unwrap();
    let dz = random_input(9, 64, &mut rng).unwrap();
    let mut grads = tape.backward(z_var, GpuGrad::new(&gpu, gpu.upload(&dz).unwrap())).unwrap();
    let got_x = gpu.download(&grads.take(x_var).unwrap().t).unwrap();
    let got_p1: Vec<_> = v1.iter().map(|v| gpu.download(&grads.take(*v).unwrap().t).unwrap()).collect();

    // CPU f64 reference of the same graph.
    let mut tape = Tape::<host::Tensor<f64>>::new();
    let x_var = tape.leaf();
    let (q1, q2) = (p1.map(f64::from), p2.map(f64::from));
    let v1: Vec<VarId> = q1.flat().iter().map(|_| tape.leaf()).collect();
    let v2: Vec<VarId> = q2.flat().iter().map(|_| tape.leaf()).collect();
    let (h, h_var) = reference::block_forward_taped(&mut tape, &s1, &x.to_f64(), x_var, &q1, &v1).unwrap();
    let (y, y_var) = reference::block_forward_taped(&mut tape, &s2, &h, h_var, &q2, &v2).unwrap();
    let (_, z_var) = reference::block_forward_taped(&mut tape, &s1, &y, y_var, &q1, &v1).unwrap();
    let mut want = tape.backward(z_var, dz.to_f64()).unwrap();
    let c = compare_f32(got_x.data(), want.take(x_var).unwrap().data());
    println!("two-block tape: grad x rel {:.2e}", c.rel);
    assert!(c.passes(FP32_REL), "grad x: {c:?}");
    for ((s, g), v) in s1.param_specs().iter().zip(&got_p1).zip(&v1) {
        let c = compare_f32(g.data(), want.take(*v).unwrap().data());
        println!("two-block tape: grad {} (used twice) rel {:.2e}", s.name, c.rel);
        assert!(c.passes(FP32_REL), "grad {}: {c:?}", s.name);
    }
}

/// The GPU runs the cubin the build embedded (`host::gpu::KERNELS_CUBIN`), not the PTX
/// the driver would compile before the first launch.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_gpu_loads_the_embedded_cubin() {
    assert!(!host::gpu::KERNELS_CUBIN.is_empty(), "built without ptxas: no cubin embedded");
    assert_eq!(gpu().kernel_image(), host::gpu::KernelImage::Cubin);
}

/// On a machine without a driver, opening the GPU is an error that says why (no panic);
/// with one, it opens. Runs everywhere.
#[test]
fn opening_the_gpu_never_panics() {
    match (host::gpu::driver_present(), Gpu::open(0)) {
        (Err(_), Err(e)) => assert!(e.to_string().starts_with("no GPU: "), "{e}"),
        (Err(_), Ok(_)) => panic!("a GPU opened although no driver library was found"),
        (Ok(()), r) => {
            if let Err(e) = r {
                // A driver without a usable device is still a clean error.
                assert!(matches!(e, host::Error::NoGpu(_) | host::Error::Cuda { .. }), "{e}");
            }
        }
    }
}

/// A bf16 model's block (`GpuBlock<Bf16>`: `x`, `W`, `y`, `dy`, `dX`, `dW` in bf16)
/// against the f64 reference from the same bf16 values, at shapes that take each path:
/// the GEMMs on the tensors as stored (forward fused or before the row-wise epilogue,
/// `dX`, `dW`), the bf16 tile-wise backward, and the FP32 fallbacks (rows not 16-byte
/// aligned, odd widths, a folded AvgPool, the row-wise backward). Outputs poisoned.
#[test]
#[ignore = "needs a CUDA GPU"]
fn bf16_model_blocks_match_reference() {
    half_model_blocks_match_reference::<host::tensor::Bf16>(host::precision::BF16_STORED_REL, 29);
}

/// [`bf16_model_blocks_match_reference`] for an fp16 model (`GpuBlock<F16>`, the fp16
/// kernels), at its own tolerance.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fp16_model_blocks_match_reference() {
    half_model_blocks_match_reference::<host::tensor::F16>(host::precision::FP16_STORED_REL, 37);
}

/// The body of the 16-bit model tests: every path's shapes, each against the f64
/// reference from the same 16-bit values, held to `tol`.
fn half_model_blocks_match_reference<H: host::gpu::HalfElement>(tol: f64, seed: u64) {
    let gpu = gpu();
    let name = H::NAME;
    let mut rng = StdRng::seed_from_u64(seed);
    let cases: [(&str, (usize, usize, usize)); 9] = [
        ("", (300, 520, 264)),
        ("groupnorm(65),swish,mul,swish", (300, 4104, 520)),
        // More tiles than SMs (persistent blocks loop over tiles).
        ("groupnorm(325),swish", (2100, 200, 2600)),
        // `k` = 517: widened copies for the forward and both GEMMs of the backward.
        ("bias,hardtanh(-1,1),mish,groupnorm(125)", (130, 517, 1000)),
        // Folded AvgPool, max: the FP32 forward and row-wise backward, dW in FP32 spread.
        ("avgpool(16),gelu,scale(2),max", (100, 2048, 512)),
        ("swish,bias,groupnorm(4)", (65, 1024, 96)),
        // Odd width: pairs of 16-bit stores end early; dz widened.
        ("swish", (64, 256, 77)),
        // Not fusable (avgpool inside): the GEMM into FP32 `z`, then rows.
        ("leakyrelu(0.2),hardtanh(-0.5,0.7),avgpool(3),scale(-1.5),max", (9, 32, 100)),
        ("groupnorm(256),swish,mul,swish", (1024, 2048, 2048)),
    ];
    for (text, (b, i, o)) in cases {
        let spec = BlockSpec::new(i, o, text.parse().unwrap()).unwrap();
        let params = Params::init(&spec, &mut rng).map(H::from_f32);
        let x = random_input(b, i, &mut rng).unwrap().to_half::<H>();
        let out = spec.output_shape(b);
        let dy = random_input(1, out.iter().product(), &mut rng).unwrap().reshape(&out).unwrap().to_half::<H>();
        let block = GpuBlock::new_half(&gpu, &spec, &params).unwrap();
        let got = block.forward_backward(&gpu, &x, &dy).unwrap();
        let report = half_report(&spec, &params, (&x, &dy), &got);
        let worst = report.iter().map(|(_, c)| c.rel).fold(0.0, f64::max);
        println!(
            "{name} model {text:<62} ({b}, {i}, {o}) worst rel {worst:.2e}: {}",
            block.describe(&gpu, &block.plan(&gpu, b))
        );
        for (what, c) in &report {
            assert!(c.passes(tol), "{name} model {text}: {what}: {c:?}");
        }
    }
}

/// A few rows, a depth of whole 8-value chunks: the small-batch kernels, forward and
/// gradients (the training forward saves `z` from them), outputs poisoned. Strict FP32
/// runs `gemv_f32` up to 8 rows; TF32, bf16 and fp16 models run `gemv_tc_*` up to
/// `GEMV_TC_ROWS` where `gemv_tc_wins` (1, 3, 8, 9, 16, 24, 32, 33 and 41 rows: 1 to 6
/// `n8` fragments, each count its own main loop; partial ones), 64 and 65 rows the tile
/// GEMMs. Chains on the 32-column slabs (groups of 32 and 16;
/// per-channel parameters offset per slab), and chains left to the row-wise epilogue
/// (groups wider than a slab, a width not whole slabs, a row max). Depths that are not
/// whole units of the warps' split (32 bf16 or 16 FP32 values per unit, 8 units a
/// round), and shallower than one round (idle warps). `dW` of up to 8 rows: the rows'
/// outer products (`outer`, `outer_sum_*`), in quads and, at odd widths, one by one;
/// `dX` of up to 8 rows: `W`'s rows weighted by `dz`'s (`column_dot_*`, `column_dots_*`),
/// of one row from a `W` above `DOT_DX_MAX_WEIGHTS` too (its ranges' sums in one row's
/// form, the last column block ragged); a 16-bit model's on the tensor cores (`dx_tc_*`:
/// ranges of `W`'s rows whose last unit is partial, a last slab of 8 columns, and one
/// range of 264 rows over 66 slabs).
#[test]
#[ignore = "needs a CUDA GPU"]
fn small_batches_match_reference() {
    use host::Precision;
    use host::gpu::dispatch::{Plan, gemv_tc_wins};
    use host::precision::{BF16_STORED_REL, FP16_STORED_REL};
    use host::tensor::{Bf16, F16};
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(31);
    let cases: [(&str, (usize, usize, usize), bool); 20] = [
        ("groupnorm(16),swish,mul,swish", (8, 520, 512), true),
        ("groupnorm(16),swish,mul,swish", (9, 520, 512), true),
        ("bias,mish,groupnorm(32),mul,gelu", (6, 64, 1024), true),
        ("bias,mish,groupnorm(64),mul,gelu", (16, 64, 1024), true),
        ("bias,mish,groupnorm(32),mul,gelu", (24, 64, 1024), true),
        ("sigmoid,gelu_tanh,bias", (32, 96, 1024), true),
        ("bias,mish,groupnorm(64),mul,gelu", (41, 72, 1024), true),
        ("sigmoid,gelu_tanh,bias", (1, 1024, 1024), true),
        ("swish,bias", (1, 1032, 1096), false),
        ("swish,bias,groupnorm(2)", (3, 1024, 512), false),
        ("swish,bias,groupnorm(2)", (33, 1000, 512), false),
        ("groupnorm(1),leakyrelu(0.01),scale(2)", (64, 256, 1024), false),
        ("gelu,tanh", (5, 96, 77), false),
        // A 16-bit dX of 4 rows in one range of W's 264 rows (66 slabs of 32 columns).
        ("gelu,tanh", (4, 2112, 264), false),
        // 8.4 M weights: 65 slabs, the last of 8 columns, over 5 ranges of W's rows, the
        // last of 8.
        ("swish,bias", (2, 2056, 4104), false),
        ("", (16, 1000, 1000), false),
        ("avgpool(4),gelu,scale(2),max", (2, 264, 512), false),
        ("leakyrelu(0.2),hardtanh(-0.5,0.7),avgpool(3),scale(-1.5),max", (7, 32, 96), false),
        ("groupnorm(128),swish,mul,swish", (64, 4096, 4096), true),
        ("swish,groupnorm(8)", (65, 512, 256), true),
    ];
    for (text, (b, i, o), in_kernel) in cases {
        let spec = BlockSpec::new(i, o, text.parse().unwrap()).unwrap();
        let (params, x, dy) = random_case(&spec, b, &mut rng);
        let folded = text.starts_with("avgpool");
        // The plan where a tensor-core kernel serves the block (`tc`) or only `gemv_*`.
        let planned = |plan: &Plan, tc: bool| {
            let small = if tc { gemv_tc_wins(b, i, o, gpu.props.multiprocessors) } else { b <= 8 };
            match folded || !small {
                true => !matches!(plan, Plan::Gemv { .. }),
                false => *plan == Plan::Gemv { chain: in_kernel, tensor_cores: tc },
            }
        };
        // FP32 model: strict FP32 and 3xTF32 on `gemv_f32`, TF32 on `gemv_tc_*`.
        for precision in [Precision::Fp32, Precision::Tf32, Precision::Tf32x3] {
            let block = GpuBlock::new(&gpu, &spec, &params).unwrap().with_precision(precision);
            let plan = block.plan(&gpu, b);
            assert!(planned(&plan, precision == Precision::Tf32), "{precision} {text} ({b} rows): {plan:?}");
            let got = block.forward_backward(&gpu, &x, &dy).unwrap();
            let path = block.describe(&gpu, &plan);
            let name = format!("small batch {precision} {b} rows {text}");
            check_step(&name, &spec, &got, (&x, &params, &dy), precision.tolerance(), &path);
        }
        // bf16 model: x, W, y as stored.
        let p16 = params.map(Bf16::from_f32);
        let (x16, dy16) = (x.to_bf16(), dy.to_bf16());
        let block = GpuBlock::new_bf16(&gpu, &spec, &p16).unwrap();
        let plan = block.plan(&gpu, b);
        assert!(planned(&plan, true), "bf16 {text} ({b} rows): {plan:?}");
        let got = block.forward_backward(&gpu, &x16, &dy16).unwrap();
        let (x, p, dy) = (x16.to_f32(), p16.map(Bf16::to_f32), dy16.to_f32());
        let path = block.describe(&gpu, &plan);
        let name = format!("small batch bf16 {b} rows {text}");
        check_step(&name, &spec, &got, (&x, &p, &dy), BF16_STORED_REL, &path);
        // fp16 model: the same on the fp16 kernels.
        let (x, p, dy) = (x.to_f16(), params.map(F16::from_f32), dy.to_f16());
        let block = GpuBlock::new_half(&gpu, &spec, &p).unwrap();
        let plan = block.plan(&gpu, b);
        assert!(planned(&plan, true), "fp16 {text} ({b} rows): {plan:?}");
        let got = block.forward_backward(&gpu, &x, &dy).unwrap();
        let (x, p, dy) = (x.to_f32(), p.map(F16::to_f32), dy.to_f32());
        let path = block.describe(&gpu, &plan);
        let name = format!("small batch fp16 {b} rows {text}");
        check_step(&name, &spec, &got, (&x, &p, &dy), FP16_STORED_REL, &path);
    }
}

/// `dX` at few rows, split in its depth (the layer's outputs): depths that are not whole
/// ranges of the kernels' k-tiles (4100 and 4104 outputs: 15 and 13 ranges, the last
/// shorter), and a forced count of 64 (43 ranges of 3 k-tiles), for FP32 blocks in TF32
/// and 3xTF32 (`gemm_wgmma_*_dx`) and bf16 and fp16 models (`gemm_tma_*_nn`); every
/// gradient against the f64 reference, outputs poisoned.
#[test]
#[ignore = "needs a CUDA GPU"]
fn split_dx_matches_reference() {
    use host::Precision;
    use host::gpu::dispatch::{dx_grid_splits, dx_splits};
    use host::precision::{BF16_STORED_REL, FP16_STORED_REL};
    use host::tensor::{Bf16, F16};
    let base = gpu();
    let sms = base.props.multiprocessors;
    let mut rng = StdRng::seed_from_u64(41);
    let cases = [
        // (More than 8 rows: fewer take `W`'s weighted rows, `column_dots`.)
        ("swish,bias", (12, 1024, 4100), None),
        ("gelu", (9, 264, 4104), None),
        ("bias,tanh", (13, 512, 4100), Some(64)),
    ];
    for (text, (b, i, o), forced) in cases {
        let gpu = base.clone().with_tuning(Tuning { split_k: forced, ..base.tuning() });
        let spec = BlockSpec::new(i, o, text.parse().unwrap()).unwrap();
        let (params, x, dy) = random_case(&spec, b, &mut rng);
        assert!(dx_grid_splits(b, o, i, sms, forced) > 1, "{text}: FP32 dX unsplit");
        for precision in [Precision::Tf32, Precision::Tf32x3] {
            let block = GpuBlock::new(&gpu, &spec, &params).unwrap().with_precision(precision);
            let got = block.forward_backward(&gpu, &x, &dy).unwrap();
            let path = block.describe(&gpu, &block.plan(&gpu, b));
            let name = format!("split dX {precision} {b} x {i} x {o} {text} (split_k {forced:?})");
            check_step(&name, &spec, &got, (&x, &params, &dy), precision.tolerance(), &path);
        }
        if o % 8 != 0 {
            continue; // a 16-bit model's dX kernel wants rows of 8 values
        }
        assert!(dx_splits(b, o, i, sms, forced) > 1, "{text}: 16-bit dX unsplit");
        let p16 = params.map(Bf16::from_f32);
        let (x16, dy16) = (x.to_bf16(), dy.to_bf16());
        let block = GpuBlock::new_bf16(&gpu, &spec, &p16).unwrap();
        let got = block.forward_backward(&gpu, &x16, &dy16).unwrap();
        let path = block.describe(&gpu, &block.plan(&gpu, b));
        let (xf, pf, dyf) = (x16.to_f32(), p16.map(Bf16::to_f32), dy16.to_f32());
        check_step(
            &format!("split dX bf16 {b} x {i} x {o} {text}"),
            &spec,
            &got,
            (&xf, &pf, &dyf),
            BF16_STORED_REL,
            &path,
        );
        let (xh, ph, dyh) = (x.to_f16(), params.map(F16::from_f32), dy.to_f16());
        let block = GpuBlock::new_half(&gpu, &spec, &ph).unwrap();
        let got = block.forward_backward(&gpu, &xh, &dyh).unwrap();
        let path = block.describe(&gpu, &block.plan(&gpu, b));
        let (xf, pf, dyf) = (xh.to_f32(), ph.map(F16::to_f32), dyh.to_f32());
        check_step(
            &format!("split dX fp16 {b} x {i} x {o} {text}"),
            &spec,
            &got,
            (&xf, &pf, &dyf),
            FP16_STORED_REL,
            &path,
        );
    }
}

/// The tensor-core small-batch kernel against the FP32-FMA one and the tile GEMMs
/// (switched by the tuning) on the same bf16 model and TF32 block: the forward's `y`
/// to the reference's tolerance each way, so the A/B timings of `host bench` compare
/// equal work.
#[test]
#[ignore = "needs a CUDA GPU"]
fn small_batch_kernels_agree_across_tunings() {
    use host::Precision;
    use host::gpu::dispatch::Plan;
    use host::tensor::Bf16;
    let base = gpu();
    let mut rng = StdRng::seed_from_u64(37);
    let spec = BlockSpec::new(1024, 1024, "groupnorm(32),swish".parse().unwrap()).unwrap();
    for b in [1, 8] {
        let (params, x, _) = random_case(&spec, b, &mut rng);
        let want = reference::block_forward(&spec, &x.to_f64(), &params.map(f64::from)).unwrap();
        let tunings = [
            (Tuning::default(), true),
            (Tuning { gemv_tensor_cores: false, ..Tuning::default() }, true),
            (Tuning { gemv: false, ..Tuning::default() }, false),
        ];
        for (tuning, gemv) in tunings {
            let gpu = base.clone().with_tuning(tuning);
            let block = GpuBlock::new(&gpu, &spec, &params).unwrap().with_precision(Precision::Tf32);
            let plan = block.plan(&gpu, b);
            assert_eq!(matches!(plan, Plan::Gemv { .. }), gemv, "{tuning:?}: {plan:?}");
            let c = compare_f32(block.forward(&gpu, &x).unwrap().data(), want.data());
            println!("{b} rows TF32 {:<60} rel {:.2e}", block.describe(&gpu, &plan), c.rel);
            assert!(c.passes(Precision::Tf32.tolerance()), "{tuning:?}: {c:?}");
            let p16 = params.map(Bf16::from_f32);
            let block = GpuBlock::new_bf16(&gpu, &spec, &p16).unwrap();
            let x16 = x.to_bf16();
            let want16 =
                reference::block_forward(&spec, &x16.to_f32().to_f64(), &p16.map(|v| f64::from(v.to_f32()))).unwrap();
            let mut ws = block.workspace(&gpu, b).unwrap();
            block.forward_into(&gpu, &gpu.upload(&x16).unwrap(), &mut ws, None).unwrap();
            let y = gpu.download(&ws.y).unwrap().to_f32();
            let c = compare_f32(y.data(), want16.data());
            println!("{b} rows bf16 {:<60} rel {:.2e}", block.describe(&gpu, &ws.plan), c.rel);
            assert!(c.passes(host::precision::BF16_STORED_REL), "{tuning:?}: {c:?}");
        }
    }
}

/// Holds a training step's output and every gradient to `tol` of the f64 reference at
/// the same inputs (`x`, the parameters and `dy` as the GPU saw them), and prints them.
fn check_step(
    name: &str,
    spec: &BlockSpec,
    got: &host::gpu::block::HostGrads,
    (x, params, dy): (&Tensor<f32>, &Params<f32>, &Tensor<f32>),
    tol: f64,
    path: &str,
) {
    let (x64, p64, dy64) = (x.to_f64(), params.map(f64::from), dy.to_f64());
    let want_y = reference::block_forward(spec, &x64, &p64).unwrap();
    let (_, want) = reference::block_backward(spec, &x64, &p64, &dy64).unwrap();
    let mut report = vec![("y".to_string(), compare_f32(got.y.data(), want_y.data()))];
    report.extend(got.compare(spec, &want));
    let worst = report.iter().map(|(_, c)| c.rel).fold(0.0, f64::max);
    println!("{name:<66} worst rel {worst:.2e}: {path}");
    for (what, c) in &report {
        assert!(c.passes(tol), "{name}: {what}: {c:?}");
    }
}

/// Chains with a BatchNorm on batch statistics (KernelBench 33/39, 84, 41, 97, and ops on
/// both sides of it) in FP32, 3xTF32 and bf16 GEMMs, on every forward plan (the small-batch
/// kernel at 6 rows, split-K at few rows and a deep `k`, the fused GEMM, ragged widths),
/// into poisoned outputs: `y` against the f64 reference at the precision's tolerance,
/// every gradient and the batch statistics against the reference at the GPU's own `z`
/// (the backward's and the column reduction's own error, FP32's; `dX` and `dW` the
/// precision's, from its GEMMs). A Linear bias straight
/// before the BatchNorm has a gradient of exactly 0: held to FP32_REL of the largest
/// BatchNorm gradient instead.
#[test]
#[ignore = "needs a CUDA GPU"]
fn batch_norm_chains_match_reference() {
    use host::Precision;
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(31);
    let cases: [(&str, (usize, usize, usize)); 7] = [
        ("scale(2),batchnorm", (300, 520, 256)),
        ("batchnorm,scale(1.5),softmax", (1024, 256, 1000)),
        ("bn,gelu,leakyrelu(0)", (6, 300, 512)),
        ("bn,bias,scale(0.5),swish", (33, 4104, 130)),
        ("bias,mish,bn,mul,groupnorm(8),max", (130, 517, 1024)),
        ("tanh,bn(1e-3),mul,gelu_tanh", (3, 64, 96)),
        ("leakyrelu(0.2),batchnorm,avgpool(4),sum", (2100, 200, 260)),
    ];
    for precision in [Precision::Fp32, Precision::Tf32x3, Precision::Bf16] {
        for (text, (b, i, o)) in cases {
            let spec = BlockSpec::new(i, o, text.parse().unwrap()).unwrap();
            let (params, x, dy) = random_case(&spec, b, &mut rng);
            let block = GpuBlock::new(&gpu, &spec, &params).unwrap().with_precision(precision);
            let what = format!("{precision} {text} ({b}, {i}, {o})");
            let y = block.forward(&gpu, &x).unwrap();
            let p64 = params.map(f64::from);
            let want_y = reference::block_forward(&spec, &x.to_f64(), &p64).unwrap();
            let c = compare_f32(y.data(), want_y.data());
            assert!(c.passes(precision.tolerance()), "{what}: y {c:?}");

            let got = block.forward_backward(&gpu, &x, &dy).unwrap();
            let c = compare_f32(got.y.data(), want_y.data());
            assert!(c.passes(precision.tolerance()), "{what}: training y {c:?}");
            let z64 = got.z.to_f64();
            let (_, mut want) = reference::block_backward_at(&spec, &x.to_f64(), &p64, &dy.to_f64(), &z64).unwrap();
            if want.params.linear_bias.data().iter().all(|g| g.abs() < 1e-9) {
                let scale = want.params.ops.iter().flatten().flat_map(|t| t.data()).fold(0.0f64, |m, g| m.max(g.abs()));
                let worst = got.params.linear_bias.data().iter().fold(0.0f32, |m, g| m.max(g.abs()));
                assert!(f64::from(worst) <= FP32_REL * scale, "{what}: lin.bias gradient {worst} (0 exactly)");
                want.params.linear_bias = got.params.linear_bias.to_f64();
            }
            for (name, c) in got.compare(&spec, &want) {
                // `dX = dZ W` and `dW = dZ^T X` run in the precision's GEMMs (bf16: `dZ`
                // rounded to bf16, 2.4e-3 on the H100); the rest is the FP32 epilogue's.
                let gemm = name == "x" || name == "lin.weight";
                let bar = if gemm { precision.tolerance().max(FP32_REL) } else { FP32_REL };
                assert!(c.passes(bar), "{what}: {name}: {c:?}");
            }

            // The batch statistics, at the GPU's own z.
            let dx = gpu.upload(&x).unwrap();
            let (_, saved, stats) = block.forward_train_stats(&gpu, &dx, true).unwrap();
            let stats = gpu.download(&stats.expect("a BatchNorm's statistics")).unwrap();
            let z = gpu.download(&saved.z).unwrap().to_f64();
            let want = reference::batch_norm_stats(&spec, &p64, &z).unwrap().unwrap();
            let (mean, var) = stats.data()[..2 * o].split_at(o);
            assert!(compare_f32(mean, &want.mean).passes(FP32_REL), "{what}: mean {:?}", compare_f32(mean, &want.mean));
            assert!(compare_f32(var, &want.var).passes(FP32_REL), "{what}: var {:?}", compare_f32(var, &want.var));
            println!("{what}: ok");
        }
    }
}

/// One row is refused with a reason.
#[test]
#[ignore = "needs a CUDA GPU"]
fn batch_norm_refuses_one_row() {
    let gpu = gpu();
    let spec = BlockSpec::new(16, 32, "scale(2),batchnorm".parse().unwrap()).unwrap();
    let mut rng = StdRng::seed_from_u64(32);
    let (params, x, _) = random_case(&spec, 1, &mut rng);
    let block = GpuBlock::new(&gpu, &spec, &params).unwrap();
    let e = block.forward(&gpu, &x).expect_err("one row refused").to_string();
    assert!(e.contains("more than 1 row"), "{e}");
}

/// 16-bit models' blocks with a BatchNorm (`x`, the weight, `y`, `dy`, `dX`, `dW` in
/// bf16 or fp16; the statistics and the chain in FP32): the GEMM as stored (or on
/// widened copies where `k` is not whole 16-byte rows), the output and every gradient
/// against the reference at the GPU's own `z`, `dX` and `dW` at the model's tolerance
/// (their GEMMs round `dZ` to the type), the rest at FP32's; the statistics too.
#[test]
#[ignore = "needs a CUDA GPU"]
fn batch_norm_in_16_bit_models_matches_reference() {
    fn check<H: host::gpu::HalfElement>(tol: f64, seed: u64) {
        let gpu = gpu();
        let mut rng = StdRng::seed_from_u64(seed);
        let cases: [(&str, (usize, usize, usize)); 4] = [
            ("scale(2),batchnorm", (300, 520, 256)),
            ("bn,bias,scale(0.5),swish", (33, 4104, 136)),
            ("bias,mish,bn,mul,groupnorm(8),max", (130, 517, 1024)),
            ("batchnorm,scale(1.5),softmax", (1024, 256, 1000)),
        ];
        for (text, (b, i, o)) in cases {
            let spec = BlockSpec::new(i, o, text.parse().unwrap()).unwrap();
            let params = Params::init(&spec, &mut rng).map(H::from_f32);
            let x = random_input(b, i, &mut rng).unwrap().to_half::<H>();
            let out = spec.output_shape(b);
            let dy = random_input(1, out.iter().product(), &mut rng).unwrap().reshape(&out).unwrap().to_half::<H>();
            let block = GpuBlock::new_half(&gpu, &spec, &params).unwrap();
            let what = format!("{} {text} ({b}, {i}, {o})", H::NAME);
            let got = block.forward_backward(&gpu, &x, &dy).unwrap();
            let (x64, dy64) = (x.to_f32().to_f64(), dy.to_f32().to_f64());
            let p64 = params.map(|v| f64::from(v.to_f32()));
            let want_y = reference::block_forward(&spec, &x64, &p64).unwrap();
            let c = compare_f32(got.y.data(), want_y.data());
            assert!(c.passes(tol), "{what}: y {c:?}");
            let (_, mut want) = reference::block_backward_at(&spec, &x64, &p64, &dy64, &got.z.to_f64()).unwrap();
            if want.params.linear_bias.data().iter().all(|g| g.abs() < 1e-9) {
                let scale = want.params.ops.iter().flatten().flat_map(|t| t.data()).fold(0.0f64, |m, g| m.max(g.abs()));
                let worst = got.params.linear_bias.data().iter().fold(0.0f32, |m, g| m.max(g.abs()));
                assert!(f64::from(worst) <= FP32_REL * scale, "{what}: lin.bias gradient {worst} (0 exactly)");
                want.params.linear_bias = got.params.linear_bias.to_f64();
            }
            for (name, c) in got.compare(&spec, &want) {
                let gemm = name == "x" || name == "lin.weight";
                // (The small gradients are FP32, but summed from `dy` in the model's type.)
                let bar = if gemm { tol } else { tol.max(FP32_REL) };
                assert!(c.passes(bar), "{what}: {name}: {c:?}");
            }
            let dx = gpu.upload(&x).unwrap();
            let (_, saved, stats) = block.forward_train_stats(&gpu, &dx, true).unwrap();
            let stats = gpu.download(&stats.expect("a BatchNorm's statistics")).unwrap();
            let z = gpu.download(&saved.z).unwrap().to_f64();
            let want = reference::batch_norm_stats(&spec, &p64, &z).unwrap().unwrap();
            let (mean, var) = stats.data()[..2 * o].split_at(o);
            assert!(compare_f32(mean, &want.mean).passes(FP32_REL), "{what}: mean");
            assert!(compare_f32(var, &want.var).passes(FP32_REL), "{what}: var");
            println!("{what}: ok ({})", block.describe(&gpu, &block.plan(&gpu, b)));
        }
    }
    check::<host::tensor::Bf16>(host::precision::BF16_STORED_REL, 33);
    check::<host::tensor::F16>(host::precision::FP16_STORED_REL, 34);
}

/// The GPU's FP8 quantisation (kernels-gpu/src/fp8.rs) gives the CPU emulation's
/// bytes and scales exactly (`host::fp8::quantise`), by rows and by columns transposed
/// (the batch padded with zeros), from FP32 and bf16 sources, over rows spanning 60
/// binades, a row of zeros, saturating values and a NaN; a weight's copies for `dX`
/// (its rows' bytes transposed, the scales moved onto `dZ`); and rows longer than the
/// 8192 values the row kernel holds in registers.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fp8_quantisation_matches_the_emulation_bit_for_bit() {
    use host::fp8::{Axis, E4M3, moved_scales, quantise};
    use host::gpu::gemm::fp8::{Fp8Matrix, quantise_columns_t, quantise_grad, quantise_rows, quantise_weight};
    use host::tensor::Bf16;
    let gpu = gpu();
    let (rows, cols) = (70, 272);
    let mut rng = StdRng::seed_from_u64(81);
    let mut data: Vec<f32> = random_input(rows, cols, &mut rng).unwrap().data().to_vec();
    for (r, row) in data.chunks_mut(cols).enumerate() {
        let s = 2f32.powi(r as i32 - 30);
        row.iter_mut().for_each(|v| *v *= s);
    }
    data[5 * cols..6 * cols].fill(0.0);
    data[7 * cols + 3] = 1e30; // saturates nothing: the scale makes it 448 exactly or less
    data[9 * cols + 11] = f32::NAN; // row 9 and column 11: NaN scales
    // bf16 sources: the same values rounded to bf16 (exact in f32), the emulation on those.
    let bf16: Vec<Bf16> = data.iter().map(|&v| Bf16::from_f32(v)).collect();
    let widened: Vec<f32> = bf16.iter().map(|v| v.to_f32()).collect();
    let bytes = |m: &Fp8Matrix| gpu.stream().clone_dtoh(&*m.values).unwrap();
    let scales = |m: &Fp8Matrix| gpu.stream().clone_dtoh(&*m.inv_scales).unwrap();
    let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
    for (source, values) in [("f32", &data), ("bf16", &widened)] {
        let (by_rows, by_cols) = if source == "f32" {
            let t = gpu.upload(&Tensor::new(&[rows, cols], data.clone()).unwrap()).unwrap();
            (
                quantise_rows(&gpu, gpu.stream(), &t, "t").unwrap(),
                quantise_columns_t(&gpu, gpu.stream(), &t, "t").unwrap(),
            )
        } else {
            let t = gpu.upload(&Tensor::new(&[rows, cols], bf16.clone()).unwrap()).unwrap();
            (
                quantise_rows(&gpu, gpu.stream(), &t, "t").unwrap(),
                quantise_columns_t(&gpu, gpu.stream(), &t, "t").unwrap(),
            )
        };
        let want = quantise(values, rows, cols, Axis::Rows, E4M3);
        let (got, inv) = (bytes(&by_rows), scales(&by_rows));
        assert_eq!((by_rows.rows, by_rows.cols, by_rows.pitch), (rows, cols, cols));
        for (i, (&b, &w)) in got.iter().zip(&want.values).enumerate() {
            assert!(same(E4M3.decode(b), w), "{source} by rows, value {i}: {} against {w}", E4M3.decode(b));
        }
        for (r, (&g, &s)) in inv.iter().zip(&want.scales).enumerate() {
            assert!(same(g, 1.0 / s), "{source} by rows, row {r}: inverse scale {g} against 1/{s}");
        }
        let want = quantise(values, rows, cols, Axis::Cols, E4M3);
        let (got, inv) = (bytes(&by_cols), scales(&by_cols));
        let pitch = rows.next_multiple_of(16);
        assert_eq!((by_cols.rows, by_cols.cols, by_cols.pitch), (cols, rows, pitch));
        for c in 0..cols {
            for r in 0..pitch {
                let g = E4M3.decode(got[c * pitch + r]);
                let w = if r < rows { want.values[r * cols + c] } else { 0.0 };
                assert!(same(g, w), "{source} by columns, ({r}, {c}): {g} against {w}");
            }
            assert!(same(inv[c], 1.0 / want.scales[c]), "{source} column {c}: {} against 1/{}", inv[c], want.scales[c]);
        }
        assert!(inv[11].is_nan() && scales(&by_rows)[9].is_nan(), "{source}: a NaN gives NaN scales");
    }
    // A weight's copies for dX (`quantise_weight`): its rows' bytes transposed, the
    // scales moved onto dZ's columns, and dZ quantised with them, as the emulation's recipe.
    let (n, k, m) = (48, cols, 20);
    let w: Vec<f32> = data[10 * cols..(10 + n) * cols].to_vec(); // rows of 2^-20..2^27, no NaN
    let wq = quantise_weight(&gpu, gpu.stream(), &gpu.upload(&Tensor::new(&[n, k], w.clone()).unwrap()).unwrap(), "w")
        .unwrap();
    let want = quantise(&w, n, k, Axis::Rows, E4M3);
    let (t, inv_t) = (bytes(&wq.rows_t), scales(&wq.rows_t));
    assert_eq!((wq.rows_t.rows, wq.rows_t.cols, wq.rows_t.pitch), (k, n, n));
    for c in 0..k {
        for r in 0..n {
            let (g, w) = (E4M3.decode(t[c * n + r]), want.values[r * k + c]);
            assert!(same(g, w), "weight transposed, ({r}, {c}): {g} against {w}");
        }
    }
    let (mult, col) = moved_scales(&want.scales);
    assert!(inv_t.iter().all(|&v| same(v, 1.0 / col)), "dX's column factors: {inv_t:?} against 1/{col}");
    let got_mult = gpu.stream().clone_dtoh(&*wq.dz_scales).unwrap();
    assert!(got_mult.iter().zip(&mult).all(|(&g, &w)| same(g, w)), "dZ's multipliers: {got_mult:?} against {mult:?}");
    let dz = random_input(m, n, &mut rng).unwrap();
    let dzq = quantise_grad(&gpu, gpu.stream(), &gpu.upload(&dz).unwrap(), &wq).unwrap();
    let moved: Vec<f32> = dz.data().chunks(n).flat_map(|r| r.iter().zip(&mult).map(|(v, m)| v * m)).collect();
    let want = quantise(&moved, m, n, Axis::Rows, E4M3);
    let (got, inv) = (bytes(&dzq), scales(&dzq));
    assert!(got.iter().zip(&want.values).all(|(&b, &w)| same(E4M3.decode(b), w)), "dZ's bytes");
    assert!(inv.iter().zip(&want.scales).all(|(&g, &s)| same(g, 1.0 / s)), "dZ's inverse scales");
    // Rows longer than the 8192 values a block holds in registers: read twice.
    let (rows, cols) = (3, 8192 + 16);
    let long = random_input(rows, cols, &mut rng).unwrap();
    let q = quantise_rows(&gpu, gpu.stream(), &gpu.upload(&long).unwrap(), "long").unwrap();
    let want = quantise(long.data(), rows, cols, Axis::Rows, E4M3);
    assert!(bytes(&q).iter().zip(&want.values).all(|(&b, &w)| same(E4M3.decode(b), w)), "long rows' bytes");
    assert!(scales(&q).iter().zip(&want.scales).all(|(&g, &s)| same(g, 1.0 / s)), "long rows' scales");
}

/// FP8 blocks on the GPU (`gemm_tma_e4m3_nt` for all three GEMMs, the weight quantised
/// per call or cached by `refold`) against the f64 reference at FP8's tolerance, and
/// against the CPU emulation, which quantises to the same bytes: the two differ only
/// in the order and accumulation of the FP32 sums, held to 1e-2 (a wrong scale or
/// transpose is off by O(1)). Ragged batches (padded in `dW`), ragged tiles, several
/// `k`-tiles, a folded AvgPool (reference only: the GPU quantises the folded weight, the
/// emulation the weight), the fused, row-wise and BatchNorm plans; also `Fp8GwBf16`.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fp8_blocks_match_the_reference_and_the_emulation() {
    use host::Precision;
    use host::cpu::{self, Options};
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(88);
    let cases: [(&str, (usize, usize, usize)); 5] = [
        ("groupnorm(8),swish,mul,swish", (300, 512, 256)),
        ("bias,hardtanh(-1,1),mish", (40, 1024, 528)),
        ("softmax", (33, 2048, 512)),
        // (Not `max`: its arg-max moves with FP8's percent-level error of `z`, and its
        // gradient with it; the refinement near kinks does not run in FP8.)
        ("avgpool(4),gelu,logsumexp", (64, 256, 1024)),
        ("scale(2),batchnorm(1e-5),tanh", (96, 512, 272)),
    ];
    for precision in [Precision::Fp8, Precision::Fp8GwBf16] {
        let emulated = cpu::Precision::emulating(precision).unwrap();
        for (text, (b, i, o)) in cases {
            let spec = BlockSpec::new(i, o, text.parse().unwrap()).unwrap();
            let params = Params::init(&spec, &mut rng);
            let (x, dy) = random_io(&spec, b, &mut rng);
            let p64 = params.map(f64::from);
            let want_y = reference::block_forward(&spec, &x.to_f64(), &p64).unwrap();
            let (_, want) = reference::block_backward(&spec, &x.to_f64(), &p64, &dy.to_f64()).unwrap();
            let emu_y = cpu::forward(&spec, &x, &params, &Options::new(emulated)).unwrap();
            let mut want = want;
            // Before a BatchNorm the Linear bias's gradient is 0 exactly (the batch mean
            // takes every shift): held to a bar of the other gradients' scale instead.
            let bias_is_zero = want.params.linear_bias.data().iter().all(|g| g.abs() < 1e-9);
            for cached in [false, true] {
                let mut block = GpuBlock::new(&gpu, &spec, &params).unwrap().with_precision(precision);
                if cached {
                    block.refold(&gpu).unwrap();
                }
                let y = block.forward(&gpu, &x).unwrap();
                let got = block.forward_backward(&gpu, &x, &dy).unwrap();
                // The emulation's backward at the GPU's `z` (a kink's side follows `z`; the
                // two `z`s differ by the sums' order); a folded AvgPool's `z` is pooled.
                let folded = text.starts_with("avgpool");
                let z = if folded { None } else { Some(&got.z) };
                let mut emu = match z {
                    Some(z) => {
                        let g = cpu::backward_at(&spec, &x, &params, &dy, z, &Options::new(emulated)).unwrap();
                        host::reference::BlockGrads { x: g.x.to_f64(), params: g.params.map(f64::from) }
                    }
                    None => host::reference::BlockGrads { x: want.x.clone(), params: want.params.clone() },
                };
                if bias_is_zero {
                    let scale =
                        want.params.ops.iter().flatten().flat_map(|t| t.data()).fold(0.0f64, |m, g| m.max(g.abs()));
                    let worst = got.params.linear_bias.data().iter().fold(0.0f32, |m, g| m.max(g.abs()));
                    assert!(
                        f64::from(worst) <= 1e-3 * scale,
                        "{precision} {text}: lin.bias gradient {worst} (0 exactly)"
                    );
                    want.params.linear_bias = got.params.linear_bias.to_f64();
                    emu.params.linear_bias = got.params.linear_bias.to_f64();
                }
                let mut report = vec![("y".to_string(), compare_f32(y.data(), want_y.data()))];
                report.extend(got.compare(&spec, &want));
                let worst = report.iter().map(|(_, c)| c.rel).fold(0.0, f64::max);
                let mut vs_emulation = vec![("y".to_string(), compare_f32(y.data(), emu_y.to_f64().data()))];
                vs_emulation.extend(got.compare(&spec, &emu));
                let apart = vs_emulation.iter().map(|(_, c)| c.rel).fold(0.0, f64::max);
                println!(
                    "{precision:<11} {text:<32} ({b}, {i}, {o}) cached {cached:<5} worst rel {worst:.2e}, from the emulation {apart:.2e}"
                );
                for (what, c) in &report {
                    assert!(c.passes(precision.tolerance()), "{precision} {text}: {what}: {c:?}");
                }
                if !folded {
                    for (what, c) in &vs_emulation {
                        assert!(c.passes(1e-2), "{precision} {text}: {what} against the emulation: {c:?}");
                    }
                }
            }
        }
    }
}

/// `with_input_grad(false)`: the backward computes no `dX` (`backward_parts` gives
/// `None`, `backward` refuses with a clear error) and the same `dW` and small gradients
/// as the full backward, in FP32, 3xTF32, FP8 and a bf16 model.
#[test]
#[ignore = "needs a CUDA GPU"]
fn backward_without_input_grad_gives_the_same_parameter_gradients() {
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(91);
    let spec = BlockSpec::new(512, 256, "groupnorm(8),swish".parse().unwrap()).unwrap();
    let (params, x, dy) = random_case(&spec, 128, &mut rng);
    for precision in [host::Precision::Fp32, host::Precision::Tf32x3, host::Precision::Fp8] {
        let (xd, dyd) = (gpu.upload(&x).unwrap(), gpu.upload(&dy).unwrap());
        let block = GpuBlock::new(&gpu, &spec, &params).unwrap().with_precision(precision);
        let run = |block: &GpuBlock| {
            let (_, saved) = block.forward_train(&gpu, &xd, true).unwrap();
            let (outs, small) = block.small_grads_by_backward(&gpu).unwrap();
            let (dx, dw, (db, ops)) = block.backward_parts(&gpu, &xd, saved, &dyd, None, outs.as_ref(), small).unwrap();
            let flat: Vec<Tensor<f32>> = std::iter::once(&dw)
                .chain(std::iter::once(&db))
                .chain(ops.iter().flatten())
                .map(|t| gpu.download(t).unwrap())
                .collect();
            (dx.is_some(), flat)
        };
        let (with_dx, full) = run(&block);
        let block = block.with_input_grad(false);
        let (without_dx, part) = run(&block);
        assert!(with_dx && !without_dx, "{precision:?}: dx computed only where asked");
        for (i, (a, b)) in full.iter().zip(&part).enumerate() {
            let c = compare_f32(b.data(), &a.data().iter().map(|&v| f64::from(v)).collect::<Vec<_>>());
            assert!(c.passes(1e-6), "{precision:?}: parameter gradient {i} differs without dx: {c:?}");
        }
        let (_, saved) = block.forward_train(&gpu, &xd, false).unwrap();
        let e = block.backward(&gpu, &xd, saved, &dyd).err().expect("backward() needs dx").to_string();
        assert!(e.contains("with_input_grad(false)"), "{e}");
    }
    // A bf16 model.
    let params16 = params.map(host::tensor::Bf16::from_f32);
    let (x16, dy16) = (x.to_half::<host::tensor::Bf16>(), dy.to_half::<host::tensor::Bf16>());
    let (xd, dyd) = (gpu.upload(&x16).unwrap(), gpu.upload(&dy16).unwrap());
    let block = GpuBlock::new_bf16(&gpu, &spec, &params16).unwrap();
    // (The sums copied out of the slots here, written by the chain backward above.)
    let small16 = |b: &GpuBlock<host::tensor::Bf16>, g: &Gpu, slots: Option<&host::gpu::DeviceTensor>| {
        b.small_grads(g, slots.expect("the slots, without outs"))
    };
    let run = |block: &GpuBlock<host::tensor::Bf16>| {
        let (_, saved) = block.forward_train(&gpu, &xd, true).unwrap();
        let (dx, dw, (db, _)) = block.backward_parts(&gpu, &xd, saved, &dyd, None, None, small16).unwrap();
        (dx.is_some(), gpu.download(&dw).unwrap().to_f32(), gpu.download(&db).unwrap())
    };
    let (with_dx, dw_full, db_full) = run(&block);
    let block = block.with_input_grad(false);
    let (without_dx, dw_part, db_part) = run(&block);
    assert!(with_dx && !without_dx, "bf16: dx computed only where asked");
    assert_eq!(dw_full.data(), dw_part.data(), "bf16: dW differs without dx");
    assert_eq!(db_full.data(), db_part.data(), "bf16: the bias gradient differs without dx");
}

/// A 16-bit model's bias and chain parameters read as stored (`DeviceVector::Bf16` /
/// `F16`: what `GpuBlock::new_half` and the PyTorch op pass) give bit for bit the output
/// and every gradient of the same block over FP32 copies of them: the kernels widen each
/// value exactly on load and run the same FP32 epilogue. One case per forward and
/// backward path: the fused TMA GEMM with its chain and tile-wise backward, the
/// row-wise epilogue and backward (`Fp32Params`: widened by the host), the small-batch
/// kernel, split-K's tile-wise sums, a folded AvgPool (its bias means), row partials, a
/// BatchNorm's column kernels, kink refinement (its bias widened), and an FP8 GEMM.
#[test]
#[ignore = "needs a CUDA GPU"]
fn half_params_read_as_stored_equal_fp32_copies() {
    use host::Precision;
    use host::gpu::block::DeviceParams;
    use host::tensor::{Bf16, F16};
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(47);
    type Case = (&'static str, (usize, usize, usize), Option<Precision>);
    let cases: [Case; 12] = [
        ("bias,groupnorm(32),swish,mul,hardtanh(-0.5,0.5)", (256, 512, 1024), None),
        ("groupnorm(4),softmax", (96, 256, 1000), None),
        ("bias,mish,groupnorm(32),mul,gelu", (8, 512, 1024), None),
        ("groupnorm(16),swish,mul,swish", (48, 2048, 512), None),
        ("avgpool(4),bias,gelu,scale(2),max", (64, 256, 1024), None),
        ("mul,swish,sum", (128, 512, 2048), None),
        ("bias,batchnorm(1e-5),mul,gelu", (64, 256, 512), None),
        ("groupnorm(8),leakyrelu(0.01),scale(2)", (128, 512, 1024), None),
        ("rmsnorm(1e-6),mul", (32, 256, 768), None),
        ("bias,groupnorm(8),swish", (256, 512, 1024), Some(Precision::Fp8)),
        ("layernorm(1e-5),bias,leakyrelu(0.01)", (17, 300, 520), None),
        ("mul,bias,hardtanh(-0.2,0.2),tanh", (5, 1000, 1000), None),
    ];
    for (text, (b, i, o), precision) in cases {
        let spec = BlockSpec::new(i, o, text.parse().unwrap()).unwrap();
        let (params, x, dy) = random_case(&spec, b, &mut rng);
        fn pair<H: host::gpu::HalfElement>(
            gpu: &Gpu,
            spec: &BlockSpec,
            (params, x, dy): (&Params<f32>, &Tensor<f32>, &Tensor<f32>),
            precision: Option<Precision>,
            name: &str,
        ) {
            let p: Params<H> = params.map(H::from_f32);
            let (x, dy) = (x.map(H::from_f32), dy.map(H::from_f32));
            let precision = precision.unwrap_or(Precision::of_storage(H::DTYPE).unwrap());
            let stored =
                GpuBlock::from_device_in(gpu, spec, DeviceParams::upload_half(gpu, &p).unwrap(), precision).unwrap();
            let widened = DeviceParams {
                linear_weight: gpu.upload(&p.linear_weight).unwrap(),
                linear_bias: gpu.upload(&p.linear_bias.to_f32()).unwrap(),
                ops: p.ops.iter().map(|v| v.iter().map(|t| gpu.upload(&t.to_f32()).unwrap()).collect()).collect(),
            };
            let copies: Vec<host::gpu::DeviceVector> = std::iter::once(&widened.linear_bias)
                .chain(widened.ops.iter().flatten())
                .map(|t| gpu.upload(&gpu.download(t).unwrap()).unwrap().into())
                .collect();
            let widened = GpuBlock::from_device_in(gpu, spec, widened, precision).unwrap();
            // The stored block switched to FP32 copies of its vectors (what the PyTorch op's
            // backward does where its chain backward reads FP32), its fold kept.
            let switched = GpuBlock::from_device_in(gpu, spec, DeviceParams::upload_half(gpu, &p).unwrap(), precision)
                .unwrap()
                .with_vectors(gpu, copies)
                .unwrap();
            let plan = stored.plan(gpu, x.shape()[0]);
            let path = stored.describe(gpu, &plan);
            let (a, w) =
                (stored.forward_backward(gpu, &x, &dy).unwrap(), widened.forward_backward(gpu, &x, &dy).unwrap());
            let s = switched.forward_backward(gpu, &x, &dy).unwrap();
            let same = |u: &[f32], v: &[f32]| u.iter().zip(v).all(|(p, q)| p.to_bits() == q.to_bits());
            for (b, which) in [(&w, "FP32 copies"), (&s, "FP32 copies by with_vectors")] {
                assert!(same(a.y.data(), b.y.data()), "{name}: y differs on {which} ({path})");
                assert!(same(a.x.data(), b.x.data()), "{name}: dX differs on {which} ({path})");
                for (k, (g, h)) in a.params.flat().iter().zip(b.params.flat()).enumerate() {
                    assert!(same(g.data(), h.data()), "{name}: gradient {k} differs on {which} ({path})");
                }
            }
            println!("{name:<66} bitwise equal: {path}");
        }
        let io = (&params, &x, &dy);
        pair::<Bf16>(&gpu, &spec, io, precision, &format!("bf16 {b}x{i}x{o} {text}"));
        pair::<F16>(&gpu, &spec, io, precision, &format!("fp16 {b}x{i}x{o} {text}"));
    }
}

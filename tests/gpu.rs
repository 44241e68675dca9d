//! GPU kernels against the f64 CPU reference, on fresh random inputs, into outputs
//! poisoned with NaN. Ignored without a GPU: run them with `--include-ignored` on a
//! GPU machine (scripts/device-run.sh does). They fail, never skip, if no GPU opens.

use host::block::random_input;
use host::check::{FP32_REL, compare_f32};
use host::gpu::forward::GpuBlock;
use host::gpu::{Gpu, gemm::tiled::gemm_bias_tiled};
use host::reference;
use host::{BlockSpec, Chain, Params, Preset};
use rand::SeedableRng;
use rand::rngs::StdRng;

/// The issue asks the plain GEMM for 1e-5; rounding of a k-term f32 sum stays well under.
const GEMM_REL: f64 = 1e-5;

fn gpu() -> Gpu {
    Gpu::open(0).unwrap_or_else(|e| panic!("these tests need a GPU: {e}"))
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn tiled_gemm_matches_reference_at_odd_shapes() {
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(7);
    // Shapes below, at and above the 64x64x16 tile, and not multiples of it.
    for (m, k, n) in
        [(1, 1, 1), (33, 77, 96), (64, 16, 64), (65, 17, 63), (127, 300, 129), (1000, 1024, 1000), (256, 8192, 384)]
    {
        let spec = BlockSpec::new(k, n, Chain::default()).unwrap();
        let params = Params::init(&spec, &mut rng);
        let x = random_input(m, k, &mut rng).unwrap();
        let dx = gpu.upload(&x).unwrap();
        let dw = gpu.upload(&params.linear_weight).unwrap();
        let db = gpu.upload(&params.linear_bias).unwrap();
        let mut dy = gpu.poisoned(&[m, n]).unwrap();
        gemm_bias_tiled(&gpu, &dx, &dw, &db, &mut dy).unwrap();
        let y = gpu.download(&dy).unwrap();
        let p64 = params.map(f64::from);
        let want = reference::linear::linear_forward(&x.to_f64(), &p64.linear_weight, &p64.linear_bias).unwrap();
        let c = compare_f32(y.data(), want.data());
        println!("gemm_bias_tiled m={m:<5} k={k:<5} n={n:<5} rel {:.2e} max abs {:.2e}", c.rel, c.max_abs);
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
    ] {
        cases.push((text.into(), text.parse().unwrap(), shape));
    }
    for (name, chain, (b, i, o)) in cases {
        let spec = BlockSpec::new(i, o, chain).unwrap();
        let mut params = Params::init(&spec, &mut rng);
        // Non-trivial GroupNorm affine, so a swapped gamma/beta cannot pass.
        for p in params.ops.iter_mut().flatten() {
            *p = random_input(1, p.len(), &mut rng).unwrap().reshape(p.shape()).unwrap();
        }
        let x = random_input(b, i, &mut rng).unwrap();
        let block = GpuBlock::new(&gpu, &spec, &params).unwrap();
        let path = block.describe(&block.plan(&gpu, b));
        let y = block.forward(&gpu, &x).unwrap();
        let want = reference::block_forward(&spec, &x.to_f64(), &params.map(f64::from)).unwrap();
        assert_eq!(y.shape(), want.shape(), "{name}");
        let c = compare_f32(y.data(), want.data());
        println!("{name:<40} ({b}, {i}, {o}) rel {:.2e} max abs {:.2e}  [{path}]", c.rel, c.max_abs);
        assert!(c.passes(FP32_REL), "{name}: {c:?}");
    }
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

//! Several ranks on the GPU: NCCL's all-reduce over every GPU present, and tensor
//! parallel blocks against the f64 reference, with ranks sharing GPU 0 (host-memory
//! collective: the split's kernels and combination at 2 and 4 ranks on any machine)
//! and one rank per GPU over NCCL. Ignored without a GPU; they fail, never skip, if no
//! GPU opens. Tolerance: the FP32 blocks' `FP32_REL` (`host::check`), as `tests/gpu.rs`.

use host::block::random_input;
use host::check::{FP32_REL, compare_f32};
use host::gpu::collective::{Collective, Reduce};
use host::gpu::parallel::TensorParallel;
use host::gpu::{Gpu, Tuning, device_count, open_ranks};
use host::parallel::{RowMaxKey, TensorSplit};
use host::{BlockSpec, Params, Preset, Tensor, reference};
use rand::SeedableRng;
use rand::rngs::StdRng;

fn gpu() -> Gpu {
    Gpu::open(0).unwrap_or_else(|e| panic!("these tests need a GPU: {e}"))
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn nccl_all_reduces_over_every_gpu() {
    let n = device_count().unwrap();
    let gpus = open_ranks(n, Tuning::default()).unwrap();
    let c = Collective::over_nccl(gpus).unwrap_or_else(|e| panic!("NCCL over {n} GPUs: {e}"));
    assert!(c.is_nccl());
    let len = 1000;
    for op in [Reduce::Sum, Reduce::Avg, Reduce::Max] {
        let mut bufs: Vec<_> = c
            .gpus()
            .iter()
            .enumerate()
            .map(|(r, g)| {
                let t = Tensor::from_fn(&[len], |i| (r + 1) as f32 * i as f32).unwrap();
                g.upload(&t).unwrap()
            })
            .collect();
        let mut refs: Vec<_> = bufs.iter_mut().map(|t| &mut t.buf).collect();
        c.all_reduce(&mut refs, op).unwrap();
        let total = (n * (n + 1) / 2) as f32;
        for (g, t) in c.gpus().iter().zip(&bufs) {
            let got = g.download(t).unwrap();
            for (i, &v) in got.data().iter().enumerate() {
                let want = match op {
                    Reduce::Sum => total * i as f32,
                    Reduce::Avg => total * i as f32 / n as f32,
                    Reduce::Max => (n as f32) * i as f32,
                };
                assert!((v - want).abs() <= 1e-6 * want.abs(), "{op:?} over {n} GPUs at {i}: {v} vs {want}");
            }
        }
    }
    // Row-max keys: the largest value wins, ties go to the lower rank.
    let mut keys: Vec<_> = c
        .gpus()
        .iter()
        .enumerate()
        .map(|(r, g)| {
            let words: Vec<u64> = [2.0, -1.0, r as f32].iter().map(|&v| RowMaxKey::new(v, r, n).0).collect();
            let mut buf = g.zeroed_buf::<u64>(g.stream(), 3).unwrap();
            g.stream().memcpy_htod(&words, &mut *buf).unwrap();
            buf
        })
        .collect();
    let mut refs: Vec<_> = keys.iter_mut().collect();
    c.all_reduce(&mut refs, Reduce::Max).unwrap();
    for (g, k) in c.gpus().iter().zip(&keys) {
        let got: Vec<_> = g.stream().clone_dtoh(&**k).unwrap().into_iter().map(RowMaxKey).collect();
        let got: Vec<_> = got.iter().map(|k| (k.value(), k.owner(n))).collect();
        assert_eq!(got, [(2.0, 0), (-1.0, 0), ((n - 1) as f32, n - 1)]);
    }
}

/// Each preset (16 groups, 1024 channels; M4's windows of 16) split over `ranks`, its
/// output and every gradient against the f64 reference.
fn check_presets(collective: impl Fn() -> Collective, label: &str) {
    let mut rng = StdRng::seed_from_u64(5);
    for preset in Preset::ALL {
        let spec = BlockSpec::new(128, 1024, preset.chain().with_groups(16)).unwrap();
        let c = collective();
        let ranks = c.gpus().len();
        if !TensorSplit::valid_counts(&spec).unwrap().contains(&ranks) {
            panic!("{preset:?} does not split over {ranks} ranks");
        }
        let params = Params::random(&spec, &mut rng);
        let x = random_input(96, 128, &mut rng).unwrap();
        let out = spec.output_shape(96);
        let dy = random_input(1, out.iter().product(), &mut rng).unwrap().reshape(&out).unwrap();
        let tp = TensorParallel::new(c, &spec, &params).unwrap();
        let y = tp.forward(&x).unwrap();
        let (y2, g) = tp.forward_backward(&x, &dy).unwrap();
        let (want_y, want) =
            reference::block_backward(&spec, &x.to_f64(), &params.map(f64::from), &dy.to_f64()).unwrap();
        let what = format!("{preset:?} over {ranks} ranks ({label})");
        let check = |name: &str, got: &Tensor<f32>, want: &Tensor<f64>| {
            assert_eq!(got.shape(), want.shape(), "{what}: {name}");
            let c = compare_f32(got.data(), want.data());
            assert!(c.passes(FP32_REL), "{what}: {name} {c:?}");
        };
        check("y", &y, &want_y);
        check("y (training forward)", &y2, &want_y);
        check("grad x", &g.x, &want.x);
        for ((s, got), w) in spec.param_specs().iter().zip(g.params.flat()).zip(want.params.flat()) {
            check(&format!("grad {}", s.name), got, w);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn tensor_parallel_ranks_sharing_one_gpu_match_reference() {
    let g = gpu();
    for ranks in [2, 4] {
        check_presets(
            || {
                let c = Collective::new(vec![g.clone(); ranks]).unwrap();
                assert!(!c.is_nccl());
                c
            },
            "ranks sharing GPU 0, host-memory collective",
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn tensor_parallel_over_every_gpu_with_nccl_matches_reference() {
    let n = device_count().unwrap();
    check_presets(
        || Collective::over_nccl(open_ranks(n, Tuning::default()).unwrap()).unwrap(),
        "one rank per GPU, NCCL",
    );
}

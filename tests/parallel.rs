//! Tensor parallel without a GPU: every preset and random chains split over the
//! counts of ranks their groups allow, each rank running its shard on the CPU backend
//! (`host::parallel::cpu`), against the unsplit block on the same backend.
//!
//! Tolerance: `FP32_REL` (`host::check`), norm-wise. A rank's Linear output is the
//! unsplit one's rows of `W` times `x`, its epilogue sees the same whole groups, and
//! the input gradient is a sum of the ranks' partial sums: the results differ from the
//! unsplit block's by f32 rounding only. The chains here have no kinks (LeakyReLU,
//! Hardtanh) or ties that a rounding could flip; the presets' kinks are drawn away
//! from their inputs by the random data with probability ~1 at these sizes.

mod common;

use common::{random_params, random_tensor};
use host::check::{FP32_REL, compare_f32};
use host::cpu::{self, Options};
use host::parallel::{TensorSplit, cpu as tp};
use host::{BlockSpec, Chain, Op, Pointwise, Preset, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn check(spec: &BlockSpec, batch: usize, ranks: usize, rng: &mut StdRng) {
    let split = TensorSplit::new(spec, ranks).unwrap();
    let params = random_params(spec, rng).map(|v| v as f32);
    let x = random_tensor(rng, &[batch, spec.in_features]).to_f32();
    let dy = random_tensor(rng, &spec.output_shape(batch)).to_f32();
    let opts = Options::default();
    let (want_y, want) = cpu::backward(spec, &x, &params, &dy, &opts).unwrap();
    let shards: Vec<_> = (0..ranks).map(|r| split.shard_params(&params, r).unwrap()).collect();

    let y = tp::forward(&split, &x, &shards, &opts).unwrap();
    let (y2, got) = tp::backward(&split, &x, &shards, &dy, &opts).unwrap();
    let label = format!("{} over {ranks} ranks, batch {batch}", spec.chain);
    let close = |name: &str, got: &Tensor<f32>, want: &Tensor<f32>| {
        assert_eq!(got.shape(), want.shape(), "{label}: {name}");
        let c = compare_f32(got.data(), want.to_f64().data());
        assert!(c.passes(FP32_REL), "{label}: {name} {c:?}");
    };
    close("y", &y, &want_y);
    assert_eq!(y, y2, "{label}: the training forward's y");
    close("grad x", &got.x, &want.x);
    for ((s, g), w) in spec.param_specs().iter().zip(got.params.flat()).zip(want.params.flat()) {
        close(&format!("grad {}", s.name), g, w);
    }
}

#[test]
fn presets_over_every_count_their_groups_allow() {
    let mut rng = StdRng::seed_from_u64(7);
    for preset in Preset::ALL {
        // Seed-size chains on 512 channels: 16 groups of 32, M4's windows of 16.
        let spec = BlockSpec::new(48, 512, preset.chain().with_groups(16)).unwrap();
        let counts = TensorSplit::valid_counts(&spec).unwrap();
        for &ranks in counts.iter().filter(|&&r| r <= 8) {
            check(&spec, 6, ranks, &mut rng);
        }
    }
}

#[test]
fn random_smooth_chains() {
    let mut rng = StdRng::seed_from_u64(11);
    let smooth =
        [Pointwise::Bias, Pointwise::Mul, Pointwise::Scale, Pointwise::Swish, Pointwise::Gelu, Pointwise::Tanh];
    for case in 0..40 {
        let out: usize = [8, 24, 48, 64, 96][rng.random_range(0..5)];
        let mut ops = Vec::new();
        let mut f = out;
        for _ in 0..rng.random_range(0..5) {
            let op = match rng.random_range(0..5) {
                0 => {
                    let groups: Vec<usize> = (1..=f).filter(|g| f.is_multiple_of(*g) && f / g >= 4).collect();
                    if groups.is_empty() {
                        continue;
                    }
                    Op::GroupNorm { groups: groups[rng.random_range(0..groups.len())], eps: 1e-5 }
                }
                1 if f.is_multiple_of(2) => Op::AvgPool(2),
                _ => Op::of(smooth[rng.random_range(0..smooth.len())]),
            };
            f = op.out_features(f).unwrap();
            ops.push(op);
        }
        if rng.random_bool(0.3) {
            ops.push(Op::RowMax);
        }
        let spec = BlockSpec::new(rng.random_range(1..40), out, Chain(ops)).unwrap();
        let counts = TensorSplit::valid_counts(&spec).unwrap();
        let ranks = counts[rng.random_range(0..counts.len())];
        check(&spec, [1, 3, 8][case % 3], ranks, &mut rng);
    }
}

#[test]
fn refusals_name_the_counts_that_work() {
    let spec = BlockSpec::new(32, 96, "groupnorm(6),swish".parse().unwrap()).unwrap();
    let err = TensorSplit::new(&spec, 4).unwrap_err().to_string();
    assert!(err.contains("groupnorm(6)") && err.contains("1, 2, 3, 6"), "{err}");
}

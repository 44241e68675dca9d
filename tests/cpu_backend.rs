//! The CPU backend (`host::cpu`) against the f64 reference: random shapes and chains,
//! the five models at a small size, forward and backward, two blocks on one tape,
//! the emulated TF32/bf16 operands, FP8 (e4m3 with row-wise scales, emulated), NaN/Inf,
//! and refused input.
//!
//! Tolerances are those of `host::check` (its module says why): the backend's f32
//! results are held to `FP32_REL` (norm-wise relative error) against the reference
//! computed in f64 from the same f32 inputs; with TF32 or bf16 operands, to `TF32_REL`
//! or `BF16_REL`. Gradients are compared with the reference's at the backend's own
//! Linear output `z` (`block_backward_at`), so that a `z` whose f32 rounding puts it
//! on the other side of a kink (LeakyReLU's 0, Hardtanh's bounds) does not count as
//! a backward error: the backward's own error is what is measured.

mod common;

use common::{random_params, random_tensor};
use host::chain::Reduce;
use host::check::{BF16_REL, FP8_REL, FP32_REL, TF32_REL, compare_f32};
use host::cpu::{self, Options, Precision};
use host::reference::{self, BlockGrads};
use host::tape::{Tape, VarId};
use host::{BlockSpec, Chain, Op, Params, Preset, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Batches, input and output features: ones, primes, and sizes that are not multiples
/// of the SIMD widths.
const BATCHES: [usize; 6] = [1, 2, 3, 5, 17, 40];
const INS: [usize; 6] = [1, 3, 8, 31, 77, 130];
const OUTS: [usize; 12] = [1, 2, 3, 5, 7, 8, 12, 15, 16, 24, 33, 96];

/// A random op valid for `f` features (any group count dividing `f`, any pool size).
/// `for_backward` leaves out GroupNorms over groups of two channels: their output is
/// `±1 / sqrt(1 + eps / d^2)` (`d` half the two values' difference), almost constant,
/// so their input gradient is a difference of O(1) terms that cancel to ~eps: f32's
/// rounding of those terms is then large against the result (4e-3 relative was
/// seen), without anything being wrong.
fn random_op(rng: &mut StdRng, f: usize, for_backward: bool) -> Op {
    match rng.random_range(0..17) {
        0..=7 => Op::random_pointwise(rng),
        11 => Op::Reduce(Reduce::ALL[rng.random_range(0..4)]),
        12 => Op::Softmax,
        13 => Op::MaxPool(rng.random_range(1..=f)),
        // LayerNorm over two features, RMSNorm over one: as GroupNorm over groups of two.
        14 if !(for_backward && f == 2) => Op::LayerNorm { eps: if rng.random_bool(0.5) { 1e-5 } else { 1e-3 } },
        15 if !(for_backward && f == 1) => Op::RmsNorm { eps: if rng.random_bool(0.5) { 1e-5 } else { 1e-3 } },
        8 => {
            let divisors: Vec<usize> =
                (1..=f).filter(|g| f.is_multiple_of(*g) && !(for_backward && f / g == 2)).collect();
            let groups = divisors[rng.random_range(0..divisors.len())];
            Op::GroupNorm { groups, eps: if rng.random_bool(0.5) { 1e-5 } else { 1e-3 } }
        }
        9 => Op::AvgPool(rng.random_range(1..=f)),
        _ => Op::RowMax,
    }
}

/// A random block: sizes from the lists above and 0 to 5 ops.
fn random_spec(rng: &mut StdRng, for_backward: bool) -> (BlockSpec, usize) {
    let (batch, in_f, out_f) = (
        BATCHES[rng.random_range(0..BATCHES.len())],
        INS[rng.random_range(0..INS.len())],
        OUTS[rng.random_range(0..OUTS.len())],
    );
    let mut ops = Vec::new();
    let mut f = out_f;
    for _ in 0..rng.random_range(0..=5) {
        let op = random_op(rng, f, for_backward);
        // After a reduction no per-channel parameter (refused there).
        if ops.iter().any(Op::reduces_row) && !op.param_bases().is_empty() {
            continue;
        }
        f = op.out_features(f).unwrap();
        ops.push(op);
    }
    // Now and then the Linear's output added back, where the width allows (KernelBench 70).
    if f == out_f && !ops.iter().any(|op| matches!(op, Op::BatchNorm { .. })) && rng.random_range(0..4) == 0 {
        ops.push(Op::Residual);
    }
    (BlockSpec::new(in_f, out_f, Chain(ops)).unwrap(), batch)
}

/// f32 data for the backend and the same values in f64 for the reference.
struct Case {
    spec: BlockSpec,
    x: Tensor<f32>,
    params: Params<f32>,
    dy: Tensor<f32>,
}

impl Case {
    fn new(spec: BlockSpec, batch: usize, rng: &mut StdRng) -> Case {
        let params = random_params(&spec, rng).map(|v| v as f32);
        let x = random_tensor(rng, &[batch, spec.in_features]).to_f32();
        let dy = random_tensor(rng, &spec.output_shape(batch)).to_f32();
        Case { spec, x, params, dy }
    }

    fn what(&self) -> String {
        format!(
            "Linear({}, {}) -> {} at batch {}",
            self.spec.in_features,
            self.spec.out_features,
            self.spec.chain,
            self.x.rows()
        )
    }

    /// The reference's output and gradients in f64, at the Linear output `z` if given.
    fn reference(&self, z: Option<&Tensor<f32>>) -> (Tensor<f64>, BlockGrads<f64>) {
        let (x, p, dy) = (self.x.to_f64(), self.params.map(f64::from), self.dy.to_f64());
        match z {
            Some(z) => reference::block_backward_at(&self.spec, &x, &p, &dy, &z.to_f64()).unwrap(),
            None => reference::block_backward(&self.spec, &x, &p, &dy).unwrap(),
        }
    }
}

fn assert_close(what: &str, got: &Tensor<f32>, want: &Tensor<f64>, tol: f64) {
    assert_eq!(got.shape(), want.shape(), "{what}: shapes");
    let c = compare_f32(got.data(), want.data());
    assert!(
        c.passes(tol),
        "{what}: {c:?} (got {} where the reference has {})",
        got.data()[c.worst],
        want.data()[c.worst]
    );
}

/// Every gradient of `got` against `want`, named as the parameters are.
fn assert_grads_close(what: &str, spec: &BlockSpec, got: &BlockGrads<f32>, want: &BlockGrads<f64>, tol: f64) {
    assert_close(&format!("{what}: grad x"), &got.x, &want.x, tol);
    for ((s, g), w) in spec.param_specs().iter().zip(got.params.flat()).zip(want.params.flat()) {
        assert_close(&format!("{what}: grad {}", s.name), g, w, tol);
    }
}

#[test]
fn forward_matches_the_f64_reference_on_random_chains() {
    let mut rng = StdRng::seed_from_u64(11);
    let opts = Options::default();
    for _ in 0..120 {
        let (spec, batch) = random_spec(&mut rng, false);
        let case = Case::new(spec, batch, &mut rng);
        let what = case.what();
        let y = cpu::forward(&case.spec, &case.x, &case.params, &opts).unwrap();
        let want = reference::block_forward(&case.spec, &case.x.to_f64(), &case.params.map(f64::from)).unwrap();
        assert_close(&what, &y, &want, FP32_REL);
        // Keeping z changes nothing else; z is the Linear output.
        let (y2, z) = cpu::forward_saving(&case.spec, &case.x, &case.params, &opts).unwrap();
        assert_eq!(y, y2, "{what}");
        let (_, z_want) =
            reference::block_forward_saving(&case.spec, &case.x.to_f64(), &case.params.map(f64::from)).unwrap();
        assert_close(&format!("{what}: z"), &z, &z_want, FP32_REL);
    }
}

#[test]
fn backward_matches_the_f64_reference_on_random_chains() {
    let mut rng = StdRng::seed_from_u64(12);
    let opts = Options::default();
    for _ in 0..120 {
        let (spec, batch) = random_spec(&mut rng, true);
        let case = Case::new(spec, batch, &mut rng);
        let what = case.what();
        let (y, grads) = cpu::backward(&case.spec, &case.x, &case.params, &case.dy, &opts).unwrap();
        let (_, z) = cpu::forward_saving(&case.spec, &case.x, &case.params, &opts).unwrap();
        let (y_want, grads_want) = case.reference(Some(&z));
        assert_close(&what, &y, &y_want, FP32_REL);
        assert_grads_close(&what, &case.spec, &grads, &grads_want, FP32_REL);
        // The two-call form gives the same bits.
        let again = cpu::backward_at(&case.spec, &case.x, &case.params, &case.dy, &z, &opts).unwrap();
        assert_eq!(again, grads, "{what}");
    }
}

/// The five models, with small groups (24 channels each) as `host check` runs them.
#[test]
fn the_five_models_match_forward_and_backward() {
    let mut rng = StdRng::seed_from_u64(13);
    for preset in Preset::ALL {
        let chain = if preset.chain().has_group_norm() { preset.chain().with_groups(4) } else { preset.chain() };
        let case = Case::new(BlockSpec::new(77, 96, chain).unwrap(), 33, &mut rng);
        let (y, grads) = cpu::backward(&case.spec, &case.x, &case.params, &case.dy, &Options::default()).unwrap();
        let (_, z) = cpu::forward_saving(&case.spec, &case.x, &case.params, &Options::default()).unwrap();
        let (y_want, grads_want) = case.reference(Some(&z));
        assert_close(&format!("{preset}"), &y, &y_want, FP32_REL);
        assert_grads_close(&format!("{preset}"), &case.spec, &grads, &grads_want, FP32_REL);
    }
}

/// TF32 and bf16 operands: within their tolerances, and visibly rounded (their
/// error is well above FP32's).
#[test]
fn tf32_and_bf16_operands_round_as_on_the_gpu() {
    let mut rng = StdRng::seed_from_u64(14);
    let spec = BlockSpec::new(130, 96, "bias,gelu,groupnorm(8),mul".parse().unwrap()).unwrap();
    let case = Case::new(spec, 40, &mut rng);
    let (y_want, _) = case.reference(None);
    for (precision, tol) in [(Precision::Fp32, FP32_REL), (Precision::Tf32, TF32_REL), (Precision::Bf16, BF16_REL)] {
        let opts = Options::new(precision);
        let (y, grads) = cpu::backward(&case.spec, &case.x, &case.params, &case.dy, &opts).unwrap();
        let (_, z) = cpu::forward_saving(&case.spec, &case.x, &case.params, &opts).unwrap();
        let (_, grads_want) = case.reference(Some(&z));
        let what = format!("{precision:?}");
        assert_close(&what, &y, &y_want, tol);
        assert_grads_close(&what, &case.spec, &grads, &grads_want, tol);
        let rel = compare_f32(y.data(), y_want.data()).rel;
        if precision == Precision::Fp32 {
            assert!(rel < 1e-6, "{what}: {rel:e}");
        } else {
            assert!(rel > 1e-5, "{what}: rel err {rel:e}: are the operands rounded at all?");
        }
    }
}

/// Two blocks on one tape (what `host train` runs) against the reference's tape in f64.
#[test]
fn two_blocks_on_one_tape() {
    let mut rng = StdRng::seed_from_u64(15);
    let s1 = BlockSpec::new(31, 48, Preset::M1.chain().with_groups(6)).unwrap();
    let s2 = BlockSpec::new(48, 24, Preset::M5.chain().with_groups(3)).unwrap();
    let (p1, p2) = (random_params(&s1, &mut rng), random_params(&s2, &mut rng));
    let x = random_tensor(&mut rng, &[9, 31]);
    let dy = random_tensor(&mut rng, &[9, 24]);

    let mut tape = Tape::<Tensor<f32>>::new();
    let x_var = tape.leaf();
    let (p1_32, p2_32) = (p1.map(|v| v as f32), p2.map(|v| v as f32));
    let v1: Vec<VarId> = p1.flat().iter().map(|_| tape.leaf()).collect();
    let v2: Vec<VarId> = p2.flat().iter().map(|_| tape.leaf()).collect();
    let opts = Options::default();
    let (h, h_var) = cpu::block_forward_taped(&mut tape, &s1, &x.to_f32(), x_var, &p1_32, &v1, &opts).unwrap();
    let (y, y_var) = cpu::block_forward_taped(&mut tape, &s2, &h, h_var, &p2_32, &v2, &opts).unwrap();
    let mut grads = tape.backward(y_var, dy.to_f32()).unwrap();

    let mut tape64 = Tape::<Tensor<f64>>::new();
    let x_var64 = tape64.leaf();
    let w1: Vec<VarId> = p1.flat().iter().map(|_| tape64.leaf()).collect();
    let w2: Vec<VarId> = p2.flat().iter().map(|_| tape64.leaf()).collect();
    let (h64, h_var64) = reference::block_forward_taped(&mut tape64, &s1, &x, x_var64, &p1, &w1).unwrap();
    let (y64, y_var64) = reference::block_forward_taped(&mut tape64, &s2, &h64, h_var64, &p2, &w2).unwrap();
    let mut grads64 = tape64.backward(y_var64, dy).unwrap();

    assert_close("y", &y, &y64, FP32_REL);
    assert_close("grad x", &grads.take(x_var).unwrap(), &grads64.take(x_var64).unwrap(), FP32_REL);
    for (i, (a, b)) in v1.iter().chain(&v2).zip(w1.iter().chain(&w2)).enumerate() {
        assert_close(&format!("parameter {i}"), &grads.take(*a).unwrap(), &grads64.take(*b).unwrap(), FP32_REL);
    }
}

/// NaN and Inf in `x` end where the reference puts them (`compare` counts a non-finite
/// value against a finite one, or a different one, as a failure).
#[test]
fn nan_and_inf_go_where_the_reference_puts_them() {
    let mut rng = StdRng::seed_from_u64(16);
    for text in [
        "groupnorm(4),swish,mul,swish",
        "leakyrelu,hardtanh(-2,2),max",
        "bias,hardtanh,mish,groupnorm(8)",
        "avgpool(3),gelu",
    ] {
        let spec = BlockSpec::new(16, 32, text.parse().unwrap()).unwrap();
        let mut case = Case::new(spec, 5, &mut rng);
        case.x.data_mut()[16 + 3] = f32::NAN;
        case.x.data_mut()[2 * 16] = f32::INFINITY;
        case.x.data_mut()[3 * 16 + 5] = f32::NEG_INFINITY;
        let y = cpu::forward(&case.spec, &case.x, &case.params, &Options::default()).unwrap();
        let want = reference::block_forward(&case.spec, &case.x.to_f64(), &case.params.map(f64::from)).unwrap();
        assert_close(text, &y, &want, FP32_REL);
        assert!(y.data().iter().any(|v| !v.is_finite()), "{text}: the NaN row must stay NaN");
    }
}

/// Misshapen input is an error naming what is wrong, never a panic.
#[test]
fn bad_input_is_an_error() {
    let mut rng = StdRng::seed_from_u64(17);
    let case = Case::new(BlockSpec::new(8, 12, "bias,groupnorm(3)".parse().unwrap()).unwrap(), 4, &mut rng);
    let opts = Options::default();
    let (_, z) = cpu::forward_saving(&case.spec, &case.x, &case.params, &opts).unwrap();
    let err = |r: Result<(), host::Error>| r.unwrap_err().to_string();

    let x_bad = Tensor::full(&[4, 9], 0.0f32).unwrap();
    let e = err(cpu::forward(&case.spec, &x_bad, &case.params, &opts).map(drop));
    assert!(e.contains("tensor `x`") && e.contains("expected shape (batch, 8)"), "{e}");
    let x_empty = Tensor::full(&[0, 8], 0.0f32).unwrap();
    assert!(err(cpu::forward(&case.spec, &x_empty, &case.params, &opts).map(drop)).contains("empty"));

    let mut p_bad = case.params.clone();
    p_bad.ops[1][0] = Tensor::full(&[11], 1.0f32).unwrap();
    let e = err(cpu::forward(&case.spec, &case.x, &p_bad, &opts).map(drop));
    assert!(e.contains("tensor `gn.weight`") && e.contains("[12]"), "{e}");
    let mut p_bad = case.params.clone();
    p_bad.ops.pop();
    assert!(err(cpu::forward(&case.spec, &case.x, &p_bad, &opts).map(drop)).contains("2 ops"));
    let mut p_bad = case.params.clone();
    p_bad.ops[0].clear();
    assert!(err(cpu::forward(&case.spec, &case.x, &p_bad, &opts).map(drop)).contains("takes 1 parameter"));

    let dy_bad = Tensor::full(&[4, 11], 0.0f32).unwrap();
    let e = err(cpu::backward(&case.spec, &case.x, &case.params, &dy_bad, &opts).map(drop));
    assert!(e.contains("tensor `dy`") && e.contains("[4, 12]"), "{e}");
    let e = err(cpu::backward_at(&case.spec, &case.x, &case.params, &dy_bad, &z, &opts).map(drop));
    assert!(e.contains("tensor `dy`"), "{e}");
    let z_bad = Tensor::full(&[3, 12], 0.0f32).unwrap();
    let e = err(cpu::backward_at(&case.spec, &case.x, &case.params, &case.dy, &z_bad, &opts).map(drop));
    assert!(e.contains("tensor `z`") && e.contains("[4, 12]"), "{e}");

    let mut tape = Tape::<Tensor<f32>>::new();
    let x_var = tape.leaf();
    let e = err(cpu::block_forward_taped(&mut tape, &case.spec, &case.x, x_var, &case.params, &[], &opts).map(drop));
    assert!(e.contains("tape variables"), "{e}");
}

/// Chains with a BatchNorm (KernelBench 33/39, 84, 41, 97, and ops on both sides):
/// forward, every gradient and the batch statistics against the f64 reference; over 2
/// rows too, where each output is `±gamma / sqrt(1 + eps / d^2)` and the input's gradient
/// is ~eps (the backend takes its exact form there, as the GPU's GroupNorm of two channels).
#[test]
fn batch_norm_chains_match_the_reference() {
    let mut rng = StdRng::seed_from_u64(18);
    let opts = Options::default();
    for (chain, batch, k, n) in [
        ("scale(2),batchnorm", 3, 5, 7),
        ("swish,batchnorm(1e-2)", 2, 5, 7),
        ("scale(-0.5),batchnorm(1e-3)", 33, 31, 24),
        ("batchnorm,scale(1.5),softmax", 40, 8, 33),
        ("bn,gelu,leakyrelu(0.0)", 17, 77, 96),
        ("bn,bias,scale(0.5),swish", 130, 31, 15),
        ("bias,mish,bn,mul,groupnorm(3),max", 5, 3, 12),
    ] {
        let case = Case::new(BlockSpec::new(k, n, chain.parse().unwrap()).unwrap(), batch, &mut rng);
        let what = case.what();
        let (y, grads) = cpu::backward(&case.spec, &case.x, &case.params, &case.dy, &opts).unwrap();
        let (y2, z) = cpu::forward_saving(&case.spec, &case.x, &case.params, &opts).unwrap();
        assert_eq!(y, y2, "{what}");
        let (y_want, mut grads_want) = case.reference(Some(&z));
        assert_close(&what, &y, &y_want, FP32_REL);
        // After ops that are affine per feature, the BatchNorm removes the Linear bias:
        // its gradient is 0 (f64 rounding in the reference), the sum of `dz` over rows,
        // which cancels; held to FP32_REL of the largest `bn.bias` gradient instead.
        if grads_want.params.linear_bias.data().iter().all(|g| g.abs() < 1e-12) {
            let scale =
                grads_want.params.ops.iter().flatten().flat_map(|t| t.data()).fold(0.0f64, |m, g| m.max(g.abs()));
            let worst = grads.params.linear_bias.data().iter().fold(0.0f32, |m, g| m.max(g.abs()));
            assert!(f64::from(worst) <= FP32_REL * scale, "{what}: lin.bias gradient {worst} (0 exactly)");
            grads_want.params.linear_bias = grads.params.linear_bias.to_f64();
        }
        assert_grads_close(&what, &case.spec, &grads, &grads_want, FP32_REL);
        let (mean, var) = cpu::batch_norm_stats(&case.spec, &case.params, &z).unwrap().unwrap();
        let want = reference::batch_norm_stats(&case.spec, &case.params.map(f64::from), &z.to_f64()).unwrap().unwrap();
        let n = mean.len();
        assert_close(
            &format!("{what}: mean"),
            &Tensor::new(&[n], mean).unwrap(),
            &Tensor::new(&[n], want.mean).unwrap(),
            FP32_REL,
        );
        assert_close(
            &format!("{what}: var"),
            &Tensor::new(&[n], var).unwrap(),
            &Tensor::new(&[n], want.var).unwrap(),
            FP32_REL,
        );
    }
}

/// A BatchNorm in the wrong place, or over one row, is a clear error.
#[test]
fn batch_norm_refuses_one_row_and_other_places() {
    let spec = BlockSpec::new(4, 6, "scale(2),batchnorm".parse().unwrap()).unwrap();
    let mut rng = StdRng::seed_from_u64(19);
    let case = Case::new(spec, 1, &mut rng);
    let e = cpu::forward(&case.spec, &case.x, &case.params, &Options::default()).unwrap_err().to_string();
    assert!(e.contains("more than 1 row") && e.contains("Expected more than 1 value per channel"), "{e}");
    let e = case.spec.check_batch(1).unwrap_err().to_string();
    assert!(e.contains("more than 1 row"), "{e}");
    let e = reference::block_forward(&case.spec, &case.x.to_f64(), &case.params.map(f64::from)).unwrap_err();
    assert!(e.to_string().contains("more than 1 row"), "{e}");
    for (chain, why) in
        [("softmax,batchnorm", "after `softmax`"), ("bn,bn", "once in a chain"), ("max,bn", "after `max`")]
    {
        let e = BlockSpec::new(4, 6, chain.parse().unwrap()).unwrap_err().to_string();
        assert!(e.contains(why), "{chain}: {e}");
    }
    assert!(BlockSpec::new(4, 6, "bn,softmax,max".parse().unwrap()).is_ok());
}

/// The largest norm-wise relative error over the input's and every parameter's gradient.
fn worst_grad(got: &BlockGrads<f32>, want: &BlockGrads<f64>) -> f64 {
    std::iter::once((&got.x, &want.x))
        .chain(got.params.flat().into_iter().zip(want.params.flat()))
        .map(|(g, w)| compare_f32(g.data(), w.data()).rel)
        .fold(0.0, f64::max)
}

/// FP8 on random blocks: the output against the reference within `FP8_REL`, and every
/// gradient against the reference's at the backend's own `z` (a `z` 4% off crosses a
/// kink or changes a row's maximum now and then: see `FP8_REL`). `fp8_gw_bf16` gives
/// the same output and `dX` bit for bit, and a `dW` within bf16's bar. Blocks of 8
/// features or more each side and 3 rows or more: over fewer terms a sum can cancel
/// beyond e4m3's 4 significant bits (`dX = 0.13 (w1 - w2)` came out 0, `w1` and `w2`
/// rounding to one value: 100% off), which no norm-wise bar covers (docs/NUMERICS.md).
/// Worst seen here: 0.10 (`y`, three rows of a min and mean), 6.1e-2 (a gradient).
#[test]
fn fp8_matches_the_f64_reference_on_random_chains() {
    let mut rng = StdRng::seed_from_u64(21);
    let (fp8, gw_bf16) = (Options::new(Precision::Fp8), Options::new(Precision::Fp8GwBf16));
    for _ in 0..120 {
        let (spec, batch) = loop {
            let (spec, batch) = random_spec(&mut rng, true);
            if spec.in_features >= 8 && spec.out_features >= 8 && batch >= 3 {
                break (spec, batch);
            }
        };
        let case = Case::new(spec, batch, &mut rng);
        let what = format!("fp8 {}", case.what());
        let (y_want, _) = case.reference(None);
        let (y, grads) = cpu::backward(&case.spec, &case.x, &case.params, &case.dy, &fp8).unwrap();
        let (_, z) = cpu::forward_saving(&case.spec, &case.x, &case.params, &fp8).unwrap();
        let (_, grads_want) = case.reference(Some(&z));
        assert_close(&what, &y, &y_want, FP8_REL);
        assert_grads_close(&what, &case.spec, &grads, &grads_want, FP8_REL);

        let (y2, grads2) = cpu::backward(&case.spec, &case.x, &case.params, &case.dy, &gw_bf16).unwrap();
        assert_eq!((&y2, &grads2.x), (&y, &grads.x), "{what}: fp8_gw_bf16's forward and dX");
        let w = &grads_want.params.linear_weight;
        assert_close(&format!("{what}: fp8_gw_bf16's dW"), &grads2.params.linear_weight, w, BF16_REL);
    }
}

/// The five models at a small size in FP8: output and gradients within `FP8_REL` of the
/// reference — at the backend's own `z`, and for the chains without a kink or a row
/// maximum (M1, M2) of the exact one too; and the error in FP8's band: over 10x bf16's on
/// the same case (the operands are quantised), and around e4m3's per-product standard
/// deviation (no more than `FP8_REL`, no less than a quarter of the deviation).
#[test]
fn the_five_models_in_fp8() {
    let mut rng = StdRng::seed_from_u64(22);
    let sigma = f64::from(host::precision::FP8_PRODUCT_SIGMA);
    for preset in Preset::ALL {
        let chain = if preset.chain().has_group_norm() { preset.chain().with_groups(4) } else { preset.chain() };
        let case = Case::new(BlockSpec::new(77, 96, chain).unwrap(), 33, &mut rng);
        let what = format!("fp8 {preset}");
        let (y_want, exact) = case.reference(None);
        let opts = Options::new(Precision::Fp8);
        let (y, grads) = cpu::backward(&case.spec, &case.x, &case.params, &case.dy, &opts).unwrap();
        let (_, z) = cpu::forward_saving(&case.spec, &case.x, &case.params, &opts).unwrap();
        let (_, at_z) = case.reference(Some(&z));
        assert_close(&what, &y, &y_want, FP8_REL);
        assert_grads_close(&what, &case.spec, &grads, &at_z, FP8_REL);
        if matches!(preset, Preset::M1 | Preset::M2) {
            assert_grads_close(&format!("{what} (exact z)"), &case.spec, &grads, &exact, FP8_REL);
        }
        // z itself: about one per-product standard deviation off.
        let (_, z_want) =
            reference::block_forward_saving(&case.spec, &case.x.to_f64(), &case.params.map(f64::from)).unwrap();
        let z_rel = compare_f32(z.data(), z_want.data()).rel;
        assert!((0.5 * sigma..2.0 * sigma).contains(&z_rel), "{what}: z off by {z_rel:e}, e4m3 predicts ~{sigma:e}");

        let bf16 = Options::new(Precision::Bf16);
        let (y16, grads16) = cpu::backward(&case.spec, &case.x, &case.params, &case.dy, &bf16).unwrap();
        let (_, z16) = cpu::forward_saving(&case.spec, &case.x, &case.params, &bf16).unwrap();
        let (_, at_z16) = case.reference(Some(&z16));
        let (rel8, rel16) = (compare_f32(y.data(), y_want.data()).rel, compare_f32(y16.data(), y_want.data()).rel);
        assert!(rel8 > 10.0 * rel16 && rel8 > 0.25 * sigma, "{what}: y {rel8:e} against bf16's {rel16:e}");
        let (g8, g16) = (worst_grad(&grads, &at_z), worst_grad(&grads16, &at_z16));
        assert!(g8 > 10.0 * g16 && g8 > 0.25 * sigma, "{what}: gradients {g8:e} against bf16's {g16:e}");
    }
}

/// Inputs that stress the scales: a row of zeros stays exactly zero (scale 1, not NaN);
/// a row 10^6 times larger than the others is scaled on its own (its neighbours keep
/// their precision); a NaN reaches only its own row's output.
#[test]
fn fp8_scales_rows_on_their_own() {
    let mut rng = StdRng::seed_from_u64(23);
    let spec = BlockSpec::new(40, 24, "gelu".parse().unwrap()).unwrap();
    let mut case = Case::new(spec, 6, &mut rng);
    let opts = Options::new(Precision::Fp8);
    let row = |t: &mut Tensor<f32>, r: usize, f: &dyn Fn(f32) -> f32| {
        let c = t.cols();
        t.data_mut()[r * c..(r + 1) * c].iter_mut().for_each(|v| *v = f(*v));
    };
    row(&mut case.x, 1, &|_| 0.0);
    row(&mut case.x, 2, &|v| v * 1e6);
    let (y_want, _) = case.reference(None);
    let (_, z) = cpu::forward_saving(&case.spec, &case.x, &case.params, &opts).unwrap();
    let (_, z_want) =
        reference::block_forward_saving(&case.spec, &case.x.to_f64(), &case.params.map(f64::from)).unwrap();
    // The zero row's z is the bias exactly.
    assert_eq!(z.row(1), case.params.linear_bias.data());
    for r in [0, 2, 3] {
        let rel = compare_f32(z.row(r), z_want.row(r)).rel;
        assert!(rel < FP8_REL, "row {r}: {rel:e}");
    }
    let y = cpu::forward(&case.spec, &case.x, &case.params, &opts).unwrap();
    assert_close("fp8 with a zero row and a huge one", &y, &y_want, FP8_REL);
    row(&mut case.x, 4, &|v| if v > 0.0 { f32::NAN } else { v });
    let y = cpu::forward(&case.spec, &case.x, &case.params, &opts).unwrap();
    for r in 0..6 {
        assert_eq!(y.row(r).iter().all(|v| v.is_nan()), r == 4, "row {r}: {:?}", y.row(r));
    }
}

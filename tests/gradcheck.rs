//! The reference's backwards against central finite differences in f64: every op
//! (for its input and each parameter), all five models through the tape
//! (`block_backward`) for `x` and every parameter, a few other chains, and two
//! blocks chained on one tape. The loss is `L = sum(y * r)` with a fixed random
//! `r` (passed as `dy`), so every component of every gradient is exercised.
//! Inputs are asserted to sit away from the kinks (LeakyReLU's 0, Hardtanh's
//! bounds, ties of a row max or min or of a MaxPool window), where a finite difference would straddle two branches.

use host::chain::Reduce;
use host::check::{FD_REL, FD_STEP, compare};
use host::reference::linear::linear_forward;
use host::reference::{block_backward, block_forward, block_forward_taped, op_backward, op_forward};
use host::tape::{Tape, VarId};
use host::{BlockSpec, Chain, Op, Params, Pointwise, Preset, Tensor};
mod common;
use common::{random_params, random_tensor};
use rand::SeedableRng;
use rand::rngs::StdRng;

/// Closest an input may come to a kink: perturbations of `FD_STEP` move the
/// intermediate values by about that much, so this leaves a wide margin.
const KINK_MARGIN: f64 = 1e-4;

fn dot(a: &Tensor<f64>, b: &Tensor<f64>) -> f64 {
    assert_eq!(a.shape(), b.shape(), "loss weights must have the output's shape");
    a.data().iter().zip(b.data()).map(|(x, y)| x * y).sum()
}

/// Central differences of `loss` with respect to each element of `t`, which
/// `loss` reads; `t` is restored afterwards.
fn fd_gradient<S>(state: &mut S, t: impl Fn(&mut S) -> &mut Tensor<f64>, loss: impl Fn(&S) -> f64) -> Vec<f64> {
    let n = t(state).len();
    (0..n)
        .map(|i| {
            let v = t(state).data()[i];
            t(state).data_mut()[i] = v + FD_STEP;
            let plus = loss(state);
            t(state).data_mut()[i] = v - FD_STEP;
            let minus = loss(state);
            t(state).data_mut()[i] = v;
            (plus - minus) / (2.0 * FD_STEP)
        })
        .collect()
}

fn assert_gradient(what: &str, analytic: &Tensor<f64>, fd: &[f64]) {
    let c = compare(analytic.data(), fd);
    assert!(
        c.passes(FD_REL),
        "{what}: analytic vs finite differences {c:?} (analytic {} vs fd {} at {})",
        analytic.data()[c.worst],
        fd[c.worst],
        c.worst
    );
    // A gradient that is zero everywhere would make the check vacuous.
    assert!(fd.iter().any(|&g| g.abs() > 1e-3), "{what}: the gradient is (nearly) zero everywhere");
}

/// Asserts that `x`, about to enter `op`, is at least `KINK_MARGIN` from its kinks.
fn assert_away_from_kinks(op: &Op, x: &Tensor<f64>) {
    match *op {
        Op::Pointwise(Pointwise::LeakyRelu, _) => {
            let closest = x.data().iter().map(|v| v.abs()).fold(f64::INFINITY, f64::min);
            assert!(closest > KINK_MARGIN, "{op}: an input is {closest} from 0");
        }
        Op::Pointwise(Pointwise::Hardtanh, [lo, hi]) => {
            let closest = x
                .data()
                .iter()
                .map(|v| (v - f64::from(lo)).abs().min((v - f64::from(hi)).abs()))
                .fold(f64::INFINITY, f64::min);
            assert!(closest > KINK_MARGIN, "{op}: an input is {closest} from a bound");
        }
        Op::RowMax | Op::Reduce(Reduce::Min) | Op::MaxPool(_) => {
            let cols = x.shape()[1];
            let window = if let Op::MaxPool(k) = *op { k } else { cols };
            for r in x.data().chunks(cols) {
                for w in r.chunks_exact(window) {
                    let mut sorted = w.to_vec();
                    sorted.sort_by(|a, b| b.total_cmp(a));
                    let gap = if *op == Op::Reduce(Reduce::Min) {
                        sorted[window - 2..].iter().fold(f64::INFINITY, |a, &b| b - a).abs()
                    } else if window > 1 {
                        sorted[0] - sorted[1]
                    } else {
                        f64::INFINITY
                    };
                    assert!(window < 2 || gap > KINK_MARGIN, "{op}: the top two of a window are within {KINK_MARGIN}");
                }
            }
        }
        _ => {}
    }
}

/// Runs the block op by op (through the public per-op forwards) to check every
/// kinked op's input; the block's gradients are checked separately.
fn assert_block_away_from_kinks(spec: &BlockSpec, x: &Tensor<f64>, params: &Params<f64>) {
    let mut h = linear_forward(x, &params.linear_weight, &params.linear_bias).unwrap();
    for (op, p) in spec.chain.0.iter().zip(&params.ops) {
        if *op == Op::Residual {
            break; // the last op, no kink
        }
        assert_away_from_kinks(op, &h);
        h = op_forward(op, &h, p).unwrap().0;
    }
}

// ---------------------------------------------------------------- single ops

/// Checks `op`'s backward for its input and each parameter at input `x`.
fn check_op(op: Op, x: Tensor<f64>, params: Vec<Tensor<f64>>, rng: &mut StdRng) {
    assert_away_from_kinks(&op, &x);
    let (y, saved) = op_forward(&op, &x, &params).unwrap();
    let r = random_tensor(rng, y.shape());
    let (dx, dparams) = op_backward(&op, &saved, &params, &r).unwrap();
    assert_eq!(dx.shape(), x.shape(), "{op}: dx shape");
    assert_eq!(dparams.len(), params.len(), "{op}: one gradient per parameter");

    let mut state = (x, params);
    let loss = |s: &(Tensor<f64>, Vec<Tensor<f64>>)| dot(&op_forward(&op, &s.0, &s.1).unwrap().0, &r);
    let fd = fd_gradient(&mut state, |s| &mut s.0, loss);
    assert_gradient(&format!("{op} dx"), &dx, &fd);
    for (j, dp) in dparams.iter().enumerate() {
        assert_eq!(dp.shape(), state.1[j].shape(), "{op}: parameter {j} gradient shape");
        let fd = fd_gradient(&mut state, |s| &mut s.1[j], loss);
        assert_gradient(&format!("{op} parameter {j}"), dp, &fd);
    }
}

#[test]
fn every_op_backward_matches_finite_differences() {
    let mut rng = StdRng::seed_from_u64(21);
    let (batch, features) = (3, 30);
    let gn = |groups, eps| Op::GroupNorm { groups, eps };
    let ops = [
        Op::of(Pointwise::Bias),
        Op::of(Pointwise::Mul),
        Op::Pointwise(Pointwise::Scale, [-1.5, 0.0]),
        Op::Pointwise(Pointwise::Scale, [2.0, 0.0]),
        Op::of(Pointwise::Swish),
        Op::of(Pointwise::Mish),
        Op::of(Pointwise::Gelu),
        Op::of(Pointwise::Tanh),
        Op::of(Pointwise::Sigmoid),
        Op::of(Pointwise::GeluTanh),
        Op::Pointwise(Pointwise::LeakyRelu, [0.01, 0.0]),
        Op::Pointwise(Pointwise::LeakyRelu, [0.2, 0.0]),
        Op::Pointwise(Pointwise::Hardtanh, [-1.0, 1.0]),
        Op::Pointwise(Pointwise::Hardtanh, [-0.5, 0.7]),
        gn(5, 1e-5),    // group size 6
        gn(10, 1e-5),   // 3
        gn(3, 1e-3),    // 10
        gn(1, 1e-5),    // the whole row
        Op::AvgPool(4), // 7 outputs, 2 trailing features
        Op::AvgPool(1),
        Op::AvgPool(30),
        Op::RowMax,
        Op::Reduce(Reduce::Sum),
        Op::Reduce(Reduce::Mean),
        Op::Reduce(Reduce::Min),
        Op::Reduce(Reduce::LogSumExp),
        Op::Softmax,
        Op::MaxPool(4), // 7 outputs, 2 trailing features
        Op::MaxPool(1),
        Op::MaxPool(30),
        Op::LayerNorm { eps: 1e-5 },
        Op::RmsNorm { eps: 1e-5 },
        Op::RmsNorm { eps: f32::EPSILON },
        Op::BatchNorm { eps: 1e-5 },
        Op::BatchNorm { eps: 1e-2 },
    ];
    // Every per-element op of the registry is checked here.
    for kind in Pointwise::ALL {
        assert!(ops.iter().any(|op| matches!(op, Op::Pointwise(k, _) if k == kind)), "{kind:?} is not gradchecked");
    }
    for op in ops {
        // Spread 2x wider than a standard normal, so the activations' tails are covered too.
        let x = random_tensor(&mut rng, &[batch, features]).map(|v| 2.0 * v);
        let params = op.param_bases().iter().map(|_| random_tensor(&mut rng, &[features])).collect();
        check_op(op, x, params, &mut rng);
    }
}

#[test]
fn activation_backwards_hold_far_out() {
    let mut rng = StdRng::seed_from_u64(22);
    // Large magnitudes, where a naive softplus or sigmoid would overflow.
    let x = Tensor::new(&[2, 6], vec![-30.0, -15.0, -8.5, 8.5, 15.0, 30.0, -12.3, -4.1, -0.3, 0.2, 3.7, 11.9]).unwrap();
    for kind in
        [Pointwise::Swish, Pointwise::Mish, Pointwise::Gelu, Pointwise::Tanh, Pointwise::Sigmoid, Pointwise::GeluTanh]
    {
        check_op(Op::of(kind), x.clone(), vec![], &mut rng);
    }
}

// ---------------------------------------------------------------- blocks

/// Checks `block_backward` for `x` and every parameter of a `(batch, in)` input.
fn check_block(spec: &BlockSpec, batch: usize, rng: &mut StdRng) {
    let what = format!("`{}` at ({batch},{})->{}", spec.chain, spec.in_features, spec.out_features);
    let x = random_tensor(rng, &[batch, spec.in_features]);
    let params = random_params(spec, rng);
    assert_block_away_from_kinks(spec, &x, &params);
    let r = random_tensor(rng, &spec.output_shape(batch));

    let (y, grads) = block_backward(spec, &x, &params, &r).unwrap();
    assert_eq!(y, block_forward(spec, &x, &params).unwrap(), "{what}: taped and plain forward differ");

    let mut state = (x, params);
    let loss = |s: &(Tensor<f64>, Params<f64>)| dot(&block_forward(spec, &s.0, &s.1).unwrap(), &r);
    let fd = fd_gradient(&mut state, |s| &mut s.0, loss);
    assert_gradient(&format!("{what} dx"), &grads.x, &fd);
    let names: Vec<String> = spec.param_specs().into_iter().map(|s| s.name).collect();
    for (j, name) in names.iter().enumerate() {
        let fd = fd_gradient(&mut state, |s| s.1.flat_mut().swap_remove(j), loss);
        assert_gradient(&format!("{what} d{name}"), grads.params.flat()[j], &fd);
    }
}

/// A preset at test size: `groups` GroupNorm groups and M4's pool kernel 4.
fn small_chain(preset: Preset, groups: usize) -> Chain {
    let chain = preset.chain().with_groups(groups);
    Chain(chain.0.into_iter().map(|op| if let Op::AvgPool(_) = op { Op::AvgPool(4) } else { op }).collect())
}

#[test]
fn all_five_models_match_finite_differences_for_x_and_every_parameter() {
    let mut rng = StdRng::seed_from_u64(23);
    // (batch, in, out, groups): group sizes 6, 15, 3 and 8; batches and widths off any tile.
    let shapes = [(3, 7, 30, 5), (5, 11, 45, 3), (3, 11, 30, 10), (5, 7, 24, 3)];
    for preset in Preset::ALL {
        for (batch, k, n, groups) in shapes {
            let spec = BlockSpec::new(k, n, small_chain(preset, groups)).unwrap();
            check_block(&spec, batch, &mut rng);
        }
    }
}

#[test]
fn other_chains_match_finite_differences() {
    let mut rng = StdRng::seed_from_u64(24);
    for (chain, n) in [
        ("", 30),
        ("bias,mish,groupnorm(3),mul,gelu", 45),
        ("leakyrelu(0.2),hardtanh(-0.5,0.7),avgpool(3),scale(-1.5),max", 31),
        ("swish,gn(5,1e-3),bias,hardtanh,gn(2),scale(0.5),mul", 30),
        ("gelu,max,scale(3),leakyrelu(0.2)", 24),
        // Reductions after reductions, and per-element ops on one value per row.
        ("sum,max,mean,logsumexp,logsumexp", 30),
        ("logsumexp,leakyrelu(0.2),gelu", 24),
        ("bias,min,swish,scale(-2)", 17),
        ("mish,mean,tanh", 13),
        ("softmax,scale(3),mul,maxpool(3),layernorm,gelu", 31),
        ("layernorm(1e-3),mul,rmsnorm,bias,softmax,logsumexp", 24),
        ("rmsnorm(1e-6),maxpool(2),softmax,max", 30),
        ("double,mish,avgpool(2),groupnorm(4)", 24),
        ("mul,mul,bias,swish,bias", 13),
        ("sigmoid,mul,gelu_tanh,groupnorm(3),bias,sigmoid", 30),
        // KernelBench's BatchNorm blocks (33, 84, 41, 97) after a nonlinear op: straight
        // after the Linear (or a scale) the BatchNorm removes its bias, whose gradient
        // is then 0 (tests/cpu_backend.rs checks those as they are).
        ("swish,scale(2),batchnorm", 13),
        ("tanh,batchnorm,scale(1.5),softmax", 13),
        ("gelu,bn,gelu,leakyrelu(0.2)", 13),
        ("mish,bn(1e-3),bias,scale(0.5),swish", 13),
        ("bias,mish,mul,bn,groupnorm(3),max", 30),
        // The Linear's output added back (KernelBench 70), after per-element and
        // whole-row ops that keep the features, and alone.
        ("sigmoid,scale(2),residual", 13),
        ("mul,softmax,groupnorm(3),residual", 30),
        ("residual", 11),
    ] {
        let spec = BlockSpec::new(7, n, chain.parse().unwrap()).unwrap();
        check_block(&spec, 3, &mut rng);
    }
}

#[test]
fn two_blocks_on_one_tape_match_finite_differences() {
    let mut rng = StdRng::seed_from_u64(25);
    let a = BlockSpec::new(7, 12, "bias,mish,groupnorm(3),mul,gelu".parse().unwrap()).unwrap();
    let b = BlockSpec::new(12, 10, "leakyrelu(0.2),hardtanh(-0.5,0.7),avgpool(3),scale(-1.5),max".parse().unwrap())
        .unwrap();
    let batch = 5;
    let x = random_tensor(&mut rng, &[batch, 7]);
    let (pa, pb) = (random_params(&a, &mut rng), random_params(&b, &mut rng));
    let r = random_tensor(&mut rng, &b.output_shape(batch));
    let forward = |x: &Tensor<f64>, pa: &Params<f64>, pb: &Params<f64>| {
        block_forward(&b, &block_forward(&a, x, pa).unwrap(), pb).unwrap()
    };
    assert_block_away_from_kinks(&a, &x, &pa);
    assert_block_away_from_kinks(&b, &block_forward(&a, &x, &pa).unwrap(), &pb);

    let mut tape = Tape::new();
    let x_var = tape.leaf();
    let a_vars: Vec<VarId> = pa.flat().iter().map(|_| tape.leaf()).collect();
    let b_vars: Vec<VarId> = pb.flat().iter().map(|_| tape.leaf()).collect();
    let (h, h_var) = block_forward_taped(&mut tape, &a, &x, x_var, &pa, &a_vars).unwrap();
    let (y, y_var) = block_forward_taped(&mut tape, &b, &h, h_var, &pb, &b_vars).unwrap();
    assert_eq!(tape.len(), 1 + 5 + 1 + 5 + 1, "one node per op, plus the reshape after max");
    assert_eq!(y, forward(&x, &pa, &pb));
    let mut grads = tape.backward(y_var, r.clone()).unwrap();

    let mut state = (x, pa, pb);
    let loss = |s: &(Tensor<f64>, Params<f64>, Params<f64>)| dot(&forward(&s.0, &s.1, &s.2), &r);
    let fd = fd_gradient(&mut state, |s| &mut s.0, loss);
    assert_gradient("two blocks dx", &grads.take(x_var).unwrap(), &fd);
    for (j, var) in a_vars.iter().enumerate() {
        let fd = fd_gradient(&mut state, |s| s.1.flat_mut().swap_remove(j), loss);
        assert_gradient(&format!("two blocks, A parameter {j}"), &grads.take(*var).unwrap(), &fd);
    }
    for (j, var) in b_vars.iter().enumerate() {
        let fd = fd_gradient(&mut state, |s| s.2.flat_mut().swap_remove(j), loss);
        assert_gradient(&format!("two blocks, B parameter {j}"), &grads.take(*var).unwrap(), &fd);
    }
}

#[test]
fn taped_forward_refuses_a_wrong_number_of_parameter_variables() {
    let mut rng = StdRng::seed_from_u64(26);
    let spec = BlockSpec::new(7, 30, small_chain(Preset::M1, 5)).unwrap();
    let params = random_params(&spec, &mut rng);
    let x = random_tensor(&mut rng, &[3, 7]);
    let mut tape = Tape::new();
    let x_var = tape.leaf();
    let vars: Vec<VarId> = (0..params.flat().len() - 1).map(|_| tape.leaf()).collect();
    let err = block_forward_taped(&mut tape, &spec, &x, x_var, &params, &vars).unwrap_err();
    assert!(matches!(err, host::Error::Argument(_)), "{err}");
}

/// `block_backward_at` (the gradients at a given Linear output `z`, which `host check`
/// uses to separate a device backward's error from its forward's): at `z = x W^T + b`
/// it is `block_backward`; at the `z` of another input `x2` the chain's gradients
/// (`dx` = `dz W` and every op parameter's) are those of `block_backward` at `x2`,
/// while `dW` still pairs `dz` with `x`; a `z` of the wrong shape is refused.
#[test]
fn backward_at_a_given_z_uses_it_for_the_chain_and_x_for_the_weights() {
    use host::check::F64_REL;
    use host::reference::block_backward_at;
    let mut rng = StdRng::seed_from_u64(27);
    let spec = BlockSpec::new(7, 32, "bias,hardtanh(-1,1),mish,groupnorm(4)".parse().unwrap()).unwrap();
    let params = random_params(&spec, &mut rng);
    let (x, x2) = (random_tensor(&mut rng, &[5, 7]), random_tensor(&mut rng, &[5, 7]));
    let dy = random_tensor(&mut rng, &[5, 32]);
    let close = |what: &str, a: &Tensor<f64>, b: &Tensor<f64>| {
        let c = compare(a.data(), b.data());
        assert!(c.rel <= F64_REL, "{what}: {c:?}");
    };

    let z = linear_forward(&x, &params.linear_weight, &params.linear_bias).unwrap();
    let (_, want) = block_backward(&spec, &x, &params, &dy).unwrap();
    let (_, got) = block_backward_at(&spec, &x, &params, &dy, &z).unwrap();
    close("dx at the exact z", &got.x, &want.x);
    for (j, (g, w)) in got.params.flat().iter().zip(want.params.flat()).enumerate() {
        close(&format!("parameter {j} at the exact z"), g, w);
    }

    let z2 = linear_forward(&x2, &params.linear_weight, &params.linear_bias).unwrap();
    let (_, at_x2) = block_backward(&spec, &x2, &params, &dy).unwrap();
    let (_, got) = block_backward_at(&spec, &x, &params, &dy, &z2).unwrap();
    close("dx at z2", &got.x, &at_x2.x);
    close("lin.bias at z2", &got.params.linear_bias, &at_x2.params.linear_bias);
    for (j, (g, w)) in got.params.ops.iter().flatten().zip(at_x2.params.ops.iter().flatten()).enumerate() {
        close(&format!("op parameter {j} at z2"), g, w);
    }
    let c = compare(got.params.linear_weight.data(), at_x2.params.linear_weight.data());
    assert!(c.rel > 1e-3, "dW must pair dz with x, not x2: {c:?}");

    let err = block_backward_at(&spec, &x, &params, &dy, &random_tensor(&mut rng, &[5, 31])).unwrap_err();
    assert!(matches!(err, host::Error::Shape(_)), "{err}");
}

//! The CPU reference against naive f64 loops written here from the definitions in
//! `docs/MODELS.md`, independently of the reference's code: every op's
//! forward (and the backwards that have a plain closed form), all five presets, and
//! f32 against f64. Shapes are deliberately odd (batch 3 or 5, features 24/30/45,
//! group sizes 3, 5, 6, 8, 12, 15, outputs not multiples of 8).

// The naive versions index like the formulas, on purpose.
#![allow(clippy::needless_range_loop)]

use host::chain::Reduce;
use host::check::{F64_REL, FP32_REL, compare, compare_f32};
use host::reference::activation::{
    gelu_tanh, gelu_tanh_grad, hardtanh_grad, leaky_relu_grad, mish, mish_grad, pointwise_grad, sigmoid, softplus,
    swish, swish_grad,
};
use host::reference::group_norm::group_norm_forward;
use host::reference::linear::{linear_backward, linear_forward};
use host::reference::reduce::{avg_pool_backward, avg_pool_forward, row_max_backward, row_max_forward};
use host::reference::{Real, block_backward, block_forward, op_backward, op_forward};
use host::{BlockSpec, Chain, Error, Op, Params, Pointwise, Preset, Tensor};
mod common;
use common::{random_params, random_tensor};
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand_distr::{Distribution, StandardNormal};

type Rows = Vec<Vec<f64>>;
/// An op and its naive elementwise formula.
type Elementwise = (Op, Box<dyn Fn(f64) -> f64>);

// ---------------------------------------------------------------- helpers

fn normals(rng: &mut StdRng, n: usize) -> Vec<f64> {
    (0..n).map(|_| StandardNormal.sample(rng)).collect()
}

fn rows_of(t: &Tensor<f64>) -> Rows {
    let cols = t.shape()[1];
    t.data().chunks(cols).map(<[f64]>::to_vec).collect()
}

fn flatten(rows: &Rows) -> Vec<f64> {
    rows.iter().flatten().copied().collect()
}

/// `got` within `F64_REL` of `want`, norm-wise, with no unexpected NaN.
fn assert_close(what: &str, got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    let c = compare(got, want);
    assert!(c.passes(F64_REL), "{what}: {c:?} (got {} vs want {} at {})", got[c.worst], want[c.worst], c.worst);
}

/// The decimal a chain constant was written as: what the f64 reference computes with.
fn constant(v: f32) -> f64 {
    v.to_string().parse().unwrap()
}

// ---------------------------------------------------------------- naive ops

fn naive_linear(x: &Rows, w: &Rows, b: &[f64]) -> Rows {
    let mut y = vec![vec![0.0; w.len()]; x.len()];
    for i in 0..x.len() {
        for n in 0..w.len() {
            let mut acc = 0.0;
            for k in 0..x[i].len() {
                acc += x[i][k] * w[n][k];
            }
            y[i][n] = acc + b[n];
        }
    }
    y
}

/// `(dx, dW, db)` of `y = x W^T + b`.
fn naive_linear_backward(x: &Rows, w: &Rows, dy: &Rows) -> (Rows, Rows, Vec<f64>) {
    let (batch, k_in, n_out) = (x.len(), x[0].len(), w.len());
    let mut dx = vec![vec![0.0; k_in]; batch];
    let mut dw = vec![vec![0.0; k_in]; n_out];
    let mut db = vec![0.0; n_out];
    for i in 0..batch {
        for n in 0..n_out {
            db[n] += dy[i][n];
            for k in 0..k_in {
                dx[i][k] += dy[i][n] * w[n][k];
                dw[n][k] += dy[i][n] * x[i][k];
            }
        }
    }
    (dx, dw, db)
}

fn naive_group_norm(x: &Rows, groups: usize, eps: f64, gamma: &[f64], beta: &[f64]) -> Rows {
    let size = x[0].len() / groups;
    let mut y = x.clone();
    for (row, out) in x.iter().zip(y.iter_mut()) {
        for g in 0..groups {
            let members = &row[g * size..(g + 1) * size];
            let mean = members.iter().sum::<f64>() / size as f64;
            let var = members.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / size as f64;
            for c in g * size..(g + 1) * size {
                out[c] = (row[c] - mean) / (var + eps).sqrt() * gamma[c] + beta[c];
            }
        }
    }
    y
}

/// BatchNorm1d in training mode: each column by its mean and biased variance over the rows.
fn naive_batch_norm(x: &Rows, eps: f64, gamma: &[f64], beta: &[f64]) -> Rows {
    let n = x.len() as f64;
    let mut y = x.clone();
    for c in 0..x[0].len() {
        let mean = x.iter().map(|row| row[c]).sum::<f64>() / n;
        let var = x.iter().map(|row| (row[c] - mean).powi(2)).sum::<f64>() / n;
        for (row, out) in x.iter().zip(y.iter_mut()) {
            out[c] = (row[c] - mean) / (var + eps).sqrt() * gamma[c] + beta[c];
        }
    }
    y
}

fn naive_swish(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}
fn naive_mish(x: f64) -> f64 {
    x * (1.0 + x.exp()).ln().tanh()
}
fn naive_gelu(x: f64) -> f64 {
    0.5 * x * (1.0 + libm::erf(x / 2f64.sqrt()))
}

/// `(e^x - e^-x) / (e^x + e^-x)`, as `1 - 2 / (e^{2x} + 1)` (no overflow to inf/inf).
fn naive_tanh(x: f64) -> f64 {
    1.0 - 2.0 / ((2.0 * x).exp() + 1.0)
}
fn naive_sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}
/// PyTorch's `gelu(x, approximate="tanh")` as written: `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
fn naive_gelu_tanh(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
}
fn naive_leaky_relu(x: f64, slope: f64) -> f64 {
    if x > 0.0 { x } else { slope * x }
}
fn naive_hardtanh(x: f64, lo: f64, hi: f64) -> f64 {
    x.clamp(lo, hi)
}

fn naive_avg_pool(x: &Rows, k: usize) -> Rows {
    x.iter()
        .map(|row| (0..row.len() / k).map(|j| row[j * k..j * k + k].iter().sum::<f64>() / k as f64).collect())
        .collect()
}

/// Max of each row, as a `(B, 1)` column so a chain can go on after it.
fn naive_row_max(x: &Rows) -> Rows {
    x.iter().map(|row| vec![row.iter().copied().fold(f64::NEG_INFINITY, f64::max)]).collect()
}

fn map_rows(x: &Rows, f: impl Fn(f64) -> f64) -> Rows {
    x.iter().map(|row| row.iter().map(|&v| f(v)).collect()).collect()
}

/// The whole block, naively: Linear, then the chain op by op.
fn naive_block(spec: &BlockSpec, x: &Rows, p: &Params<f64>) -> Vec<f64> {
    let w = rows_of(&p.linear_weight);
    let mut h = naive_linear(x, &w, p.linear_bias.data());
    let z = h.clone();
    for (op, params) in spec.chain.0.iter().zip(&p.ops) {
        let param = |i: usize| params[i].data();
        h = match *op {
            Op::Residual => h.iter().zip(&z).map(|(row, z)| row.iter().zip(z).map(|(v, z)| v + z).collect()).collect(),
            Op::Pointwise(Pointwise::Bias, _) => {
                h.iter().map(|row| row.iter().zip(param(0)).map(|(v, b)| v + b).collect()).collect()
            }
            Op::Pointwise(Pointwise::Mul, _) => {
                h.iter().map(|row| row.iter().zip(param(0)).map(|(v, w)| v * w).collect()).collect()
            }
            Op::Pointwise(Pointwise::Scale, [s, _]) => map_rows(&h, |v| constant(s) * v),
            Op::Pointwise(Pointwise::Swish, _) => map_rows(&h, naive_swish),
            Op::Pointwise(Pointwise::Mish, _) => map_rows(&h, naive_mish),
            Op::Pointwise(Pointwise::Gelu, _) => map_rows(&h, naive_gelu),
            Op::Pointwise(Pointwise::Tanh, _) => map_rows(&h, naive_tanh),
            Op::Pointwise(Pointwise::Sigmoid, _) => map_rows(&h, naive_sigmoid),
            Op::Pointwise(Pointwise::GeluTanh, _) => map_rows(&h, naive_gelu_tanh),
            Op::Pointwise(Pointwise::LeakyRelu, [s, _]) => map_rows(&h, |v| naive_leaky_relu(v, constant(s))),
            Op::Pointwise(Pointwise::Hardtanh, [lo, hi]) => {
                map_rows(&h, |v| naive_hardtanh(v, constant(lo), constant(hi)))
            }
            Op::GroupNorm { groups, eps } => naive_group_norm(&h, groups, constant(eps), param(0), param(1)),
            Op::AvgPool(k) => naive_avg_pool(&h, k),
            Op::RowMax => naive_row_max(&h),
            Op::Reduce(r) => naive_reduce(&h, r),
            Op::Softmax => naive_softmax(&h),
            Op::MaxPool(k) => naive_max_pool(&h, k),
            Op::LayerNorm { eps } => naive_group_norm(&h, 1, constant(eps), param(0), param(1)),
            Op::RmsNorm { eps } => naive_rms_norm(&h, constant(eps), param(0)),
            Op::BatchNorm { eps } => naive_batch_norm(&h, constant(eps), param(0), param(1)),
        };
    }
    flatten(&h)
}

/// A row reduction, as a `(B, 1)` column (logsumexp unshifted: the values are O(1)).
fn naive_reduce(x: &Rows, r: Reduce) -> Rows {
    x.iter()
        .map(|row| {
            vec![match r {
                Reduce::Sum => row.iter().sum(),
                Reduce::Mean => row.iter().sum::<f64>() / row.len() as f64,
                Reduce::Min => row.iter().copied().fold(f64::INFINITY, f64::min),
                Reduce::LogSumExp => row.iter().map(|v| v.exp()).sum::<f64>().ln(),
            }]
        })
        .collect()
}

fn naive_softmax(x: &Rows) -> Rows {
    x.iter()
        .map(|row| {
            let total: f64 = row.iter().map(|v| v.exp()).sum();
            row.iter().map(|v| v.exp() / total).collect()
        })
        .collect()
}

fn naive_max_pool(x: &Rows, k: usize) -> Rows {
    x.iter()
        .map(|row| {
            (0..row.len() / k)
                .map(|j| row[j * k..(j + 1) * k].iter().copied().fold(f64::NEG_INFINITY, f64::max))
                .collect()
        })
        .collect()
}

fn naive_rms_norm(x: &Rows, eps: f64, w: &[f64]) -> Rows {
    x.iter()
        .map(|row| {
            let rms = (row.iter().map(|v| v * v).sum::<f64>() / row.len() as f64 + eps).sqrt();
            row.iter().zip(w).map(|(v, w)| v / rms * w).collect()
        })
        .collect()
}

// ---------------------------------------------------------------- linear

#[test]
fn linear_matches_naive_loops_forward_and_backward() {
    let mut rng = StdRng::seed_from_u64(1);
    // (batch, in, out): odd sizes, a 1x1x1, and one big enough for nalgebra's blocked GEMM.
    for (batch, k, n) in [(3, 11, 30), (5, 7, 45), (1, 1, 1), (2, 1, 3), (17, 130, 67)] {
        let x = random_tensor(&mut rng, &[batch, k]);
        let w = random_tensor(&mut rng, &[n, k]);
        let b = random_tensor(&mut rng, &[n]);
        let dy = random_tensor(&mut rng, &[batch, n]);
        let what = format!("linear ({batch},{k})x({n},{k})");

        let y = linear_forward(&x, &w, &b).unwrap();
        assert_eq!(y.shape(), [batch, n]);
        assert_close(&what, y.data(), &flatten(&naive_linear(&rows_of(&x), &rows_of(&w), b.data())));

        let (dx, dw, db) = linear_backward(&x, &w, &dy).unwrap();
        let (ndx, ndw, ndb) = naive_linear_backward(&rows_of(&x), &rows_of(&w), &rows_of(&dy));
        assert_eq!((dx.shape(), dw.shape(), db.shape()), (&[batch, k][..], &[n, k][..], &[n][..]));
        assert_close(&format!("{what} dx"), dx.data(), &flatten(&ndx));
        assert_close(&format!("{what} dW"), dw.data(), &flatten(&ndw));
        assert_close(&format!("{what} db"), db.data(), &ndb);
    }
}

#[test]
fn linear_refuses_mismatched_shapes() {
    let x = Tensor::full(&[3, 7], 1.0f64).unwrap();
    let w = Tensor::full(&[5, 6], 1.0f64).unwrap();
    let b = Tensor::full(&[5], 0.0f64).unwrap();
    assert!(matches!(linear_forward(&x, &w, &b), Err(Error::Shape(_))));
    let w = Tensor::full(&[5, 7], 1.0f64).unwrap();
    assert!(matches!(linear_forward(&x, &w, &Tensor::full(&[4], 0.0).unwrap()), Err(Error::Tensor { .. })));
    assert!(matches!(linear_backward(&x, &w, &Tensor::full(&[3, 4], 0.0).unwrap()), Err(Error::Tensor { .. })));
}

// ---------------------------------------------------------------- group norm

#[test]
fn group_norm_matches_naive_loops() {
    let mut rng = StdRng::seed_from_u64(2);
    // (channels, groups): group sizes 6, 15, 5, 3, 8, 12, 1, and the whole row.
    for (channels, groups) in [(30, 5), (45, 3), (45, 9), (45, 15), (24, 3), (24, 2), (24, 24), (30, 1)] {
        for eps in [1e-5f32, 1e-3] {
            // An offset mean checks that the variance is not the cancelling E[x^2] - mean^2.
            let x = random_tensor(&mut rng, &[3, channels]).map(|v| 3.0 * v + 20.0);
            let gamma = random_tensor(&mut rng, &[channels]);
            let beta = random_tensor(&mut rng, &[channels]);
            let (y, stats) = group_norm_forward(&x, groups, f64::from_chain_constant(eps), &gamma, &beta).unwrap();
            let want = naive_group_norm(&rows_of(&x), groups, constant(eps), gamma.data(), beta.data());
            assert_close(&format!("groupnorm({groups}) of {channels}, eps {eps}"), y.data(), &flatten(&want));

            let size = channels / groups;
            assert_eq!((stats.mean.len(), stats.rstd.len()), (3 * groups, 3 * groups));
            for b in 0..3 {
                for g in 0..groups {
                    let members = &x.row(b)[g * size..(g + 1) * size];
                    let mean = members.iter().sum::<f64>() / size as f64;
                    let var = members.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / size as f64;
                    let rstd = 1.0 / (var + constant(eps)).sqrt();
                    assert_close("saved mean", &[stats.mean[b * groups + g]], &[mean]);
                    assert_close("saved rstd", &[stats.rstd[b * groups + g]], &[rstd]);
                }
            }
        }
    }
}

/// A group of equal values (as a Hardtanh clamp leaves it; here a chain constant's
/// decimal, which no f64 sum of 130 copies holds exactly) normalises to exactly 0, and
/// the gradient of `gamma` is exactly 0: an analytically zero result must not come out
/// as rounding noise, which no relative comparison can judge.
#[test]
fn group_norm_of_a_constant_group_is_exactly_zero() {
    use host::reference::group_norm::group_norm_backward;
    let v = constant(-1.4249208);
    let x = Tensor::new(&[1, 130], vec![v; 130]).unwrap();
    let gamma = Tensor::new(&[130], (0..130).map(|i| 0.5 + i as f64 / 100.0).collect()).unwrap();
    let beta = Tensor::new(&[130], vec![0.25; 130]).unwrap();
    let (y, stats) = group_norm_forward(&x, 1, 1e-5, &gamma, &beta).unwrap();
    assert!(y.data().iter().all(|&e| e == 0.25), "{:?}", &y.data()[..4]);
    let dy = Tensor::new(&[1, 130], (0..130).map(|i| (i as f64).sin()).collect()).unwrap();
    let (_, dgamma, _) = group_norm_backward(&x, &stats, &gamma, &dy).unwrap();
    assert!(dgamma.data().iter().all(|&e| e == 0.0), "{:?}", &dgamma.data()[..4]);
}

#[test]
fn group_norm_refuses_groups_that_do_not_divide() {
    let x = Tensor::full(&[2, 30], 1.0f64).unwrap();
    let ones = Tensor::full(&[30], 1.0f64).unwrap();
    assert!(matches!(group_norm_forward(&x, 7, 1e-5, &ones, &ones), Err(Error::Argument(_))));
    assert!(matches!(group_norm_forward(&x, 0, 1e-5, &ones, &ones), Err(Error::Argument(_))));
    assert!(matches!(group_norm_forward(&x, 5, 0.0, &ones, &ones), Err(Error::Argument(_))));
}

// ---------------------------------------------------------------- activations

/// Inputs over the interesting range, plus random ones.
fn activation_inputs(rng: &mut StdRng) -> Tensor<f64> {
    let mut v: Vec<f64> = (-80..=80).map(|i| i as f64 / 10.0).collect();
    v.extend(normals(rng, 79).iter().map(|x| 3.0 * x));
    Tensor::new(&[3, 80], v).unwrap()
}

#[test]
fn activations_match_naive_formulas() {
    let mut rng = StdRng::seed_from_u64(3);
    let x = activation_inputs(&mut rng);
    let cases: Vec<Elementwise> = vec![
        (Op::of(Pointwise::Swish), Box::new(naive_swish)),
        (Op::of(Pointwise::Mish), Box::new(naive_mish)),
        (Op::of(Pointwise::Gelu), Box::new(naive_gelu)),
        (Op::of(Pointwise::Tanh), Box::new(naive_tanh)),
        (Op::of(Pointwise::Sigmoid), Box::new(naive_sigmoid)),
        (Op::of(Pointwise::GeluTanh), Box::new(naive_gelu_tanh)),
        (Op::Pointwise(Pointwise::LeakyRelu, [0.01, 0.0]), Box::new(|v| naive_leaky_relu(v, 0.01))),
        (Op::Pointwise(Pointwise::LeakyRelu, [0.2, 0.0]), Box::new(|v| naive_leaky_relu(v, 0.2))),
        (Op::Pointwise(Pointwise::Hardtanh, [-1.0, 1.0]), Box::new(|v| naive_hardtanh(v, -1.0, 1.0))),
        (Op::Pointwise(Pointwise::Hardtanh, [-0.5, 0.7]), Box::new(|v| naive_hardtanh(v, -0.5, 0.7))),
        (Op::Pointwise(Pointwise::Scale, [-1.5, 0.0]), Box::new(|v| -1.5 * v)),
    ];
    for (op, f) in cases {
        let (y, _) = op_forward(&op, &x, &[]).unwrap();
        let want: Vec<f64> = x.data().iter().map(|&v| f(v)).collect();
        assert_close(&op.to_string(), y.data(), &want);
    }
}

#[test]
fn activations_stay_finite_and_exact_at_extremes() {
    for x in [-1000.0f64, -100.0, -40.0, 40.0, 100.0, 1000.0] {
        for (name, v) in [("mish", mish(x)), ("mish'", mish_grad(x)), ("swish", swish(x)), ("swish'", swish_grad(x))] {
            assert!(v.is_finite(), "{name}({x}) = {v}");
        }
    }
    assert_eq!(softplus(1000.0f64), 1000.0);
    assert_eq!(mish(100.0f64), 100.0);
    assert_eq!(mish_grad(100.0f64), 1.0);
    // Far left: softplus(x) = e^x to within rounding, where ln(1 + e^x) would give 0.
    assert!((softplus(-40.0f64) / (-40.0f64).exp() - 1.0).abs() < 1e-15);
    assert!((mish(-40.0f64) / (-40.0 * (-40.0f64).exp()) - 1.0).abs() < 1e-15);
    assert_eq!(swish(-1000.0f64), 0.0);
    // f32 too: no overflow of exp inside.
    assert_eq!(mish(100.0f32), 100.0);
    assert!(mish(-100.0f32).is_finite() && swish(-200.0f32).is_finite());
}

#[test]
fn sigmoid_and_gelu_tanh_hold_at_extremes() {
    // Where `x^3` or `x^2` overflows, the value and slope are those of the limits.
    for x in [1e20f32, 1e30, f32::MAX] {
        assert_eq!((gelu_tanh(x), gelu_tanh_grad(x)), (x, 1.0), "gelu_tanh at {x}");
        assert_eq!((gelu_tanh(-x), gelu_tanh_grad(-x)), (0.0, 0.0), "gelu_tanh at -{x}");
        assert_eq!((sigmoid(x), sigmoid(-x)), (1.0, 0.0));
    }
    assert_eq!((gelu_tanh(1e200f64), gelu_tanh_grad(1e200f64)), (1e200, 1.0));
    assert_eq!(gelu_tanh_grad(-1e200f64), 0.0);
    // The tails keep their relative accuracy in f32 (no `1 + tanh` or `1 - s` cancelling):
    // f32 within a few roundings of f64, where the values are ~1e-8 to ~1e-30.
    let rel = |a: f32, b: f64| (f64::from(a) - b).abs() / b.abs();
    for x in [-4.0f32, -6.0, -7.5] {
        assert!(rel(gelu_tanh(x), gelu_tanh(f64::from(x))) < 1e-5, "gelu_tanh({x})");
        assert!(rel(gelu_tanh_grad(x), gelu_tanh_grad(f64::from(x))) < 1e-5, "gelu_tanh'({x})");
    }
    for x in [-20.0f32, -60.0, 20.0, 60.0] {
        let (g32, g64) = (pointwise_grad(Pointwise::Sigmoid, x, 0.0, 0.0, 0.0).0, (-x.abs() as f64).exp());
        assert!(rel(g32, g64 / (1.0 + g64).powi(2)) < 1e-5, "sigmoid'({x}) = {g32}");
    }
    assert!(rel(sigmoid(-60.0f32), (-60.0f64).exp()) < 1e-5);
}

#[test]
fn kink_gradients_follow_pytorch() {
    // LeakyReLU: slope at exactly 0; Hardtanh: 0 at the bounds, 1 strictly inside.
    assert_eq!(leaky_relu_grad(0.0f64, 0.01), 0.01);
    assert_eq!(leaky_relu_grad(1e-300f64, 0.01), 1.0);
    assert_eq!(leaky_relu_grad(-2.0f64, 0.2), 0.2);
    assert_eq!(hardtanh_grad(-1.0f64, -1.0, 1.0), 0.0);
    assert_eq!(hardtanh_grad(1.0f64, -1.0, 1.0), 0.0);
    assert_eq!(hardtanh_grad(0.999f64, -1.0, 1.0), 1.0);
    assert_eq!(hardtanh_grad(-0.999f64, -1.0, 1.0), 1.0);
    assert_eq!(hardtanh_grad(3.0f64, -1.0, 1.0), 0.0);
}

#[test]
fn piecewise_backwards_match_naive_derivatives() {
    let mut rng = StdRng::seed_from_u64(4);
    let x = activation_inputs(&mut rng);
    let dy = random_tensor(&mut rng, x.shape());
    let cases: Vec<Elementwise> = vec![
        (Op::Pointwise(Pointwise::LeakyRelu, [0.2, 0.0]), Box::new(|v| if v > 0.0 { 1.0 } else { 0.2 })),
        (Op::Pointwise(Pointwise::Hardtanh, [-0.5, 0.7]), Box::new(|v| if -0.5 < v && v < 0.7 { 1.0 } else { 0.0 })),
        (Op::Pointwise(Pointwise::Scale, [-1.5, 0.0]), Box::new(|_| -1.5)),
    ];
    for (op, df) in cases {
        let (_, saved) = op_forward(&op, &x, &[]).unwrap();
        let (dx, dparams) = op_backward(&op, &saved, &[], &dy).unwrap();
        assert!(dparams.is_empty());
        let want: Vec<f64> = x.data().iter().zip(dy.data()).map(|(&v, &g)| g * df(v)).collect();
        assert_close(&format!("{op} backward"), dx.data(), &want);
    }
}

// ---------------------------------------------------------------- channel ops

#[test]
fn channel_ops_match_naive_loops() {
    let mut rng = StdRng::seed_from_u64(5);
    let (batch, channels) = (5, 45);
    let x = random_tensor(&mut rng, &[batch, channels]);
    let p = random_tensor(&mut rng, &[channels]);
    let dy = random_tensor(&mut rng, &[batch, channels]);
    let (xr, dyr) = (rows_of(&x), rows_of(&dy));

    let mut sum_dy = vec![0.0; channels];
    let mut sum_dy_x = vec![0.0; channels];
    let (mut plus, mut times, mut dx_mul) = (xr.clone(), xr.clone(), xr.clone());
    for b in 0..batch {
        for c in 0..channels {
            plus[b][c] = xr[b][c] + p.data()[c];
            times[b][c] = xr[b][c] * p.data()[c];
            dx_mul[b][c] = dyr[b][c] * p.data()[c];
            sum_dy[c] += dyr[b][c];
            sum_dy_x[c] += dyr[b][c] * xr[b][c];
        }
    }

    let (bias, mul) = (Op::of(Pointwise::Bias), Op::of(Pointwise::Mul));
    let (y, saved) = op_forward(&bias, &x, std::slice::from_ref(&p)).unwrap();
    assert_close("bias", y.data(), &flatten(&plus));
    let (dx, dbias) = op_backward(&bias, &saved, std::slice::from_ref(&p), &dy).unwrap();
    assert_close("bias dx", dx.data(), dy.data());
    assert_close("bias dbias", dbias[0].data(), &sum_dy);

    let (y, saved) = op_forward(&mul, &x, std::slice::from_ref(&p)).unwrap();
    assert_close("mul", y.data(), &flatten(&times));
    let (dx, dw) = op_backward(&mul, &saved, std::slice::from_ref(&p), &dy).unwrap();
    assert_close("mul dx", dx.data(), &flatten(&dx_mul));
    assert_close("mul dw", dw[0].data(), &sum_dy_x);

    let short = Tensor::full(&[44], 0.0).unwrap();
    assert!(matches!(op_forward(&bias, &x, &[short]), Err(Error::Tensor { .. })));
}

// ---------------------------------------------------------------- reductions

#[test]
fn avg_pool_matches_naive_loops_with_a_zero_gradient_tail() {
    let mut rng = StdRng::seed_from_u64(6);
    for (features, k) in [(30, 4), (30, 3), (45, 7), (30, 30), (24, 1), (31, 16)] {
        let x = random_tensor(&mut rng, &[3, features]);
        let y = avg_pool_forward(&x, k).unwrap();
        assert_eq!(y.shape(), [3, features / k]);
        assert_close(&format!("avgpool({k}) of {features}"), y.data(), &flatten(&naive_avg_pool(&rows_of(&x), k)));

        let dy = random_tensor(&mut rng, &[3, features / k]);
        let dx = avg_pool_backward(&dy, k, features).unwrap();
        let mut want = vec![vec![0.0; features]; 3];
        for b in 0..3 {
            for i in 0..features / k * k {
                want[b][i] = dy.row(b)[i / k] / k as f64;
            }
        }
        assert_close(&format!("avgpool({k}) of {features} backward"), dx.data(), &flatten(&want));
        for b in 0..3 {
            assert!(dx.row(b)[features / k * k..].iter().all(|&g| g == 0.0), "tail gradient must be 0");
        }
    }
    assert!(avg_pool_forward(&Tensor::full(&[2, 5], 1.0f64).unwrap(), 6).is_err());
}

#[test]
fn row_max_matches_naive_loops() {
    let mut rng = StdRng::seed_from_u64(7);
    let x = random_tensor(&mut rng, &[5, 45]);
    let (y, argmax) = row_max_forward(&x).unwrap();
    assert_eq!(y.shape(), [5]);
    assert_close("max", y.data(), &flatten(&naive_row_max(&rows_of(&x))));
    let dy = random_tensor(&mut rng, &[5]);
    let dx = row_max_backward(&dy, &argmax, 45).unwrap();
    for b in 0..5 {
        let row = x.row(b);
        let best = (0..45).fold(0, |best, i| if row[i] > row[best] { i } else { best });
        for i in 0..45 {
            assert_eq!(dx.row(b)[i], if i == best { dy.data()[b] } else { 0.0 }, "row {b}, feature {i}");
        }
    }
}

#[test]
fn row_max_ties_go_to_the_first_and_nan_propagates_like_torch() {
    let x = Tensor::new(
        &[4, 5],
        vec![
            1.0,
            3.0,
            2.0,
            3.0,
            3.0, // tie: first 3.0, index 1
            1.0,
            f64::NAN,
            5.0,
            f64::NAN,
            0.0, // NaN wins, at its first occurrence
            f64::NAN,
            9.0,
            1.0,
            1.0,
            1.0, // NaN first
            -7.0,
            -7.0,
            -7.0,
            -7.0,
            -7.0, // all equal
        ],
    )
    .unwrap();
    let (y, argmax) = row_max_forward(&x).unwrap();
    assert_eq!(argmax, [1, 1, 0, 0]);
    assert_eq!(y.data()[0], 3.0);
    assert!(y.data()[1].is_nan() && y.data()[2].is_nan());
    assert_eq!(y.data()[3], -7.0);
    let dx = row_max_backward(&Tensor::full(&[4], 2.0).unwrap(), &argmax, 5).unwrap();
    assert_eq!(dx.row(0), [0.0, 2.0, 0.0, 0.0, 0.0]);
    assert_eq!(dx.row(1), [0.0, 2.0, 0.0, 0.0, 0.0]);
    assert_eq!(dx.row(3), [2.0, 0.0, 0.0, 0.0, 0.0]);
}

/// The whole-row ops' backwards against their closed forms, written here per element.
#[test]
fn whole_row_backwards_match_naive_formulas() {
    let mut rng = StdRng::seed_from_u64(31);
    let (batch, f) = (3, 10);
    let x = random_tensor(&mut rng, &[batch, f]);
    let xr = rows_of(&x);
    let w = random_tensor(&mut rng, &[f]);
    let run = |op: Op, params: &[Tensor<f64>], dy: &Tensor<f64>| {
        let (y, saved) = op_forward(&op, &x, params).unwrap();
        assert_eq!(y.shape(), dy.shape(), "{op}");
        op_backward(&op, &saved, params, dy).unwrap()
    };
    let dy1 = random_tensor(&mut rng, &[batch, 1]);
    let dyf = random_tensor(&mut rng, &[batch, f]);
    for r in Reduce::ALL {
        let (dx, _) = run(Op::Reduce(r), &[], &dy1);
        let y = naive_reduce(&xr, r);
        for b in 0..batch {
            let row = &xr[b];
            for j in 0..f {
                let d = dy1.data()[b];
                let want = match r {
                    Reduce::Sum => d,
                    Reduce::Mean => d / f as f64,
                    Reduce::Min => {
                        if row[j] == y[b][0] {
                            d
                        } else {
                            0.0
                        }
                    }
                    Reduce::LogSumExp => d * row[j].exp() / row.iter().map(|v| v.exp()).sum::<f64>(),
                };
                assert!((dx.row(b)[j] - want).abs() <= 1e-12 * (1.0 + want.abs()), "{r:?} ({b}, {j})");
            }
        }
    }
    // Softmax: dx_j = sum_i dy_i ds_i/dx_j, ds_i/dx_j = s_i (delta_ij - s_j).
    let (dx, _) = run(Op::Softmax, &[], &dyf);
    let s = naive_softmax(&xr);
    for b in 0..batch {
        for j in 0..f {
            let want: f64 = (0..f).map(|i| dyf.row(b)[i] * s[b][i] * (if i == j { 1.0 } else { 0.0 } - s[b][j])).sum();
            assert!((dx.row(b)[j] - want).abs() <= 1e-12, "softmax ({b}, {j})");
        }
    }
    // RMSNorm: dy_i dy/dx_j with y_i = w_i x_i r, dr/dx_j = -r^3 x_j / f; dw_j = sum_b dy x_j r.
    let eps = 1e-5;
    let (dx, dp) = run(Op::RmsNorm { eps: 1e-5 }, std::slice::from_ref(&w), &dyf);
    let mut dw = vec![0.0; f];
    for b in 0..batch {
        let row = &xr[b];
        let r = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / f as f64 + eps).sqrt();
        for j in 0..f {
            let want: f64 = (0..f)
                .map(|i| {
                    let dyi_dxj = w.data()[i] * (if i == j { r } else { 0.0 } - row[i] * r.powi(3) * row[j] / f as f64);
                    dyf.row(b)[i] * dyi_dxj
                })
                .sum();
            assert!((dx.row(b)[j] - want).abs() <= 1e-9, "rmsnorm ({b}, {j})");
            dw[j] += dyf.row(b)[j] * row[j] * r;
        }
    }
    assert_close("rmsnorm dw", dp[0].data(), &dw);
}

/// Ties and NaN of the row min and of MaxPool windows: the first, as torch.
#[test]
fn row_min_and_max_pool_ties_go_to_the_first_and_nan_propagates() {
    let nan = f64::NAN;
    let x = Tensor::new(&[2, 6], vec![3.0, 1.0, 1.0, 2.0, 2.0, 0.5, 4.0, nan, -1.0, nan, 5.0, 5.0]).unwrap();
    let ones = Tensor::full(&[2, 1], 1.0).unwrap();
    let min = Op::Reduce(Reduce::Min);
    let (y, saved) = op_forward(&min, &x, &[]).unwrap();
    assert_eq!(y.data()[0], 0.5);
    assert!(y.data()[1].is_nan());
    let (dx, _) = op_backward(&min, &saved, &[], &ones).unwrap();
    assert_eq!(dx.row(0), [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]);
    assert_eq!(dx.row(1), [0.0, 1.0, 0.0, 0.0, 0.0, 0.0]);
    let pool = Op::MaxPool(2);
    let (y, saved) = op_forward(&pool, &x, &[]).unwrap();
    assert_eq!(&y.data()[..3], [3.0, 2.0, 2.0]);
    assert!(y.data()[3].is_nan() && y.data()[4].is_nan() && y.data()[5] == 5.0);
    let (dx, _) = op_backward(&pool, &saved, &[], &Tensor::full(&[2, 3], 1.0).unwrap()).unwrap();
    assert_eq!(dx.row(0), [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]);
    assert_eq!(dx.row(1), [0.0, 1.0, 0.0, 1.0, 1.0, 0.0]);
}

/// logsumexp and softmax shift by the row max: no overflow at large values.
#[test]
fn logsumexp_and_softmax_hold_at_large_values() {
    let x = Tensor::new(&[2, 2], vec![1000.0, 1000.0, -1000.0, -1001.0]).unwrap();
    let lse = op_forward(&Op::Reduce(Reduce::LogSumExp), &x, &[]).unwrap().0;
    assert!((lse.data()[0] - (1000.0 + 2f64.ln())).abs() < 1e-9, "{lse:?}");
    assert!((lse.data()[1] - (-1000.0 + (1.0 + (-1f64).exp()).ln())).abs() < 1e-9, "{lse:?}");
    let s = op_forward(&Op::Softmax, &x, &[]).unwrap().0;
    assert_eq!(&s.data()[..2], [0.5, 0.5]);
    assert!((s.data()[2] - 1.0 / (1.0 + (-1f64).exp())).abs() < 1e-15);
}

// ---------------------------------------------------------------- blocks

/// A preset shrunk to test size: the given group count, and M4's pool kernel 4.
fn small_chain(preset: Preset, groups: usize) -> Chain {
    let chain = preset.chain().with_groups(groups);
    Chain(chain.0.into_iter().map(|op| if let Op::AvgPool(_) = op { Op::AvgPool(4) } else { op }).collect())
}

/// `(batch, in, out, groups)`: group sizes 6, 15, 3, 8 and 12.
const BLOCK_SHAPES: [(usize, usize, usize, usize); 5] =
    [(3, 11, 30, 5), (5, 7, 45, 3), (3, 7, 45, 15), (5, 11, 24, 3), (1, 13, 24, 2)];

#[test]
fn presets_match_a_naive_composition() {
    let mut rng = StdRng::seed_from_u64(8);
    for preset in Preset::ALL {
        for (batch, k, n, groups) in BLOCK_SHAPES {
            let spec = BlockSpec::new(k, n, small_chain(preset, groups)).unwrap();
            let params = random_params(&spec, &mut rng);
            let x = random_tensor(&mut rng, &[batch, k]);
            let y = block_forward(&spec, &x, &params).unwrap();
            assert_eq!(y.shape(), spec.output_shape(batch).as_slice(), "{preset}");
            let what = format!("{preset} `{}` at ({batch},{k})->{n}", spec.chain);
            assert_close(&what, y.data(), &naive_block(&spec, &rows_of(&x), &params));
            // The taped forward computes the same values.
            let (y_taped, _) = block_backward(&spec, &x, &params, &Tensor::full(y.shape(), 1.0).unwrap()).unwrap();
            assert_eq!(y_taped, y, "{what}: taped forward differs");
        }
    }
}

#[test]
fn other_chains_match_a_naive_composition() {
    let mut rng = StdRng::seed_from_u64(9);
    for (chain, n) in [
        ("", 30),
        ("bias,mish,groupnorm(3),mul,gelu", 45),
        ("leakyrelu(0.2),hardtanh(-0.5,0.7),avgpool(3),scale(-1.5),max", 31),
        ("swish,gn(5,1e-3),bias,hardtanh,gn(2),scale(0.5),mul", 30),
        ("gelu,max,scale(3),leakyrelu(0.2)", 24),
        ("double,mish,avgpool(2),groupnorm(4)", 24),
        ("sum,max,mean,logsumexp,logsumexp", 30),
        ("logsumexp,leakyrelu(0.2),gelu", 24),
        ("bias,min,swish,scale(-2)", 17),
        ("softmax,scale(3),mul,maxpool(3),layernorm,gelu", 31),
        ("layernorm(1e-3),mul,rmsnorm,bias,softmax,sum", 24),
        ("scale(2),batchnorm", 13),
        ("bn(1e-3),gelu,leakyrelu(0.0),bias,softmax", 24),
        ("bias,mish,bn,scale(-2),swish", 17),
        ("rmsnorm(1e-6),maxpool(4),softmax,max", 30),
        ("sigmoid,scale(2),residual", 13),
        ("softmax,groupnorm(5),residual", 30),
    ] {
        let spec = BlockSpec::new(7, n, chain.parse().unwrap()).unwrap();
        let params = random_params(&spec, &mut rng);
        let x = random_tensor(&mut rng, &[3, 7]);
        let y = block_forward(&spec, &x, &params).unwrap();
        assert_eq!(y.shape(), spec.output_shape(3).as_slice(), "`{chain}`");
        assert_close(&format!("`{chain}`"), y.data(), &naive_block(&spec, &rows_of(&x), &params));
    }
}

#[test]
fn f32_agrees_with_f64() {
    let mut rng = StdRng::seed_from_u64(10);
    let chains: Vec<Chain> = Preset::ALL
        .iter()
        .map(|&p| small_chain(p, 5))
        .chain(
            ["bias,mish,groupnorm(3),mul,gelu", "leakyrelu(0.2),hardtanh(-0.5,0.7),avgpool(3),scale(-1.5),max"]
                .map(|c| c.parse().unwrap()),
        )
        .collect();
    for chain in chains {
        let spec = BlockSpec::new(11, 30, chain).unwrap();
        // Draw in f64, round to f32, and give both precisions the same (f32) values.
        let params32 = random_params(&spec, &mut rng).map(|v| v as f32);
        let x32 = random_tensor(&mut rng, &[5, 11]).to_f32();
        let (params64, x64) = (params32.map(f64::from), x32.to_f64());
        let what = format!("`{}`", spec.chain);

        let y32 = block_forward(&spec, &x32, &params32).unwrap();
        let y64 = block_forward(&spec, &x64, &params64).unwrap();
        let c = compare_f32(y32.data(), y64.data());
        assert!(c.passes(FP32_REL), "{what} forward: {c:?}");

        let dy64 = random_tensor(&mut rng, y64.shape());
        let (_, g32) = block_backward(&spec, &x32, &params32, &dy64.to_f32()).unwrap();
        let (_, g64) = block_backward(&spec, &x64, &params64, &dy64).unwrap();
        let c = compare_f32(g32.x.data(), g64.x.data());
        assert!(c.passes(FP32_REL), "{what} dx: {c:?}");
        for (i, (a, b)) in g32.params.flat().iter().zip(g64.params.flat()).enumerate() {
            let c = compare_f32(a.data(), b.data());
            assert!(c.passes(FP32_REL), "{what} parameter {i}: {c:?}");
        }
    }
}

#[test]
fn chain_constants_are_their_decimals_in_f64() {
    assert_eq!(f64::from_chain_constant(0.01), 0.01);
    assert_eq!(f64::from_chain_constant(1e-5), 1e-5);
    assert_eq!(f64::from_chain_constant(-1.5), -1.5);
    assert_eq!(f32::from_chain_constant(0.01), 0.01f32);
}

#[test]
fn blocks_refuse_bad_shapes_with_errors() {
    let mut rng = StdRng::seed_from_u64(11);
    let spec = BlockSpec::new(7, 30, small_chain(Preset::M4, 5)).unwrap();
    let params = random_params(&spec, &mut rng);
    let x = random_tensor(&mut rng, &[3, 7]);

    assert!(matches!(block_forward(&spec, &random_tensor(&mut rng, &[3, 8]), &params), Err(Error::Tensor { .. })));
    // M4's output is (batch,): a (batch, 1) dy is refused.
    let err = block_backward(&spec, &x, &params, &Tensor::full(&[3, 1], 1.0).unwrap()).unwrap_err();
    assert!(matches!(err, Error::Shape(_)), "{err}");
    assert!(block_backward(&spec, &x, &params, &Tensor::full(&[3], 1.0).unwrap()).is_ok());

    let mut bad = params.clone();
    bad.linear_bias = Tensor::full(&[29], 0.0).unwrap();
    assert!(matches!(block_forward(&spec, &x, &bad), Err(Error::Tensor { .. })));
    let mut bad = params.clone();
    bad.ops.pop();
    assert!(matches!(block_forward(&spec, &x, &bad), Err(Error::Shape(_))));
}

//! Property test: for random shapes and random chains with valid parameters, the f64
//! CPU reference equals naive f64 loops written here from the definitions in
//! `docs/MODELS.md`, without the reference's code.

// The naive versions index like the formulas, on purpose.
#![allow(clippy::needless_range_loop)]

use host::chain::Reduce;
use host::check::{F64_REL, compare};
use host::reference::block_forward;
use host::{BlockSpec, Chain, Op, Params, Pointwise, Tensor};
use proptest::prelude::*;
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand_distr::{Distribution, StandardNormal};

type Rows = Vec<Vec<f64>>;

/// Outputs, including ones that are not multiples of 8 (or of anything).
const OUTS: [usize; 12] = [1, 2, 3, 5, 7, 8, 12, 15, 16, 24, 30, 33];
// Chain constants exactly representable in f32, so the f32 `Op` holds the same value.
const SCALES: [f32; 5] = [-2.0, -0.5, 0.25, 1.75, 2.0];
const SLOPES: [f32; 3] = [0.0, 0.125, 0.25];
const BOUNDS: [(f32, f32); 3] = [(-1.0, 1.0), (-0.5, 0.75), (-2.0, 0.25)];

/// A valid op for `f` features from two random numbers: groups any divisor of `f`,
/// pooling kernels from 1 to `f`.
fn pick_op(kind: u8, arg: u32, f: usize) -> Op {
    let arg = arg as usize;
    match kind % 22 {
        0 => Op::of(Pointwise::Bias),
        1 => Op::of(Pointwise::Mul),
        2 => Op::Pointwise(Pointwise::Scale, [SCALES[arg % SCALES.len()], 0.0]),
        3 => Op::of(Pointwise::Swish),
        4 => Op::of(Pointwise::Mish),
        5 => Op::of(Pointwise::Gelu),
        6 => Op::Pointwise(Pointwise::LeakyRelu, [SLOPES[arg % SLOPES.len()], 0.0]),
        7 => {
            let (lo, hi) = BOUNDS[arg % BOUNDS.len()];
            Op::Pointwise(Pointwise::Hardtanh, [lo, hi])
        }
        8 => {
            let divisors: Vec<usize> = (1..=f).filter(|g| f.is_multiple_of(*g)).collect();
            Op::GroupNorm {
                groups: divisors[arg % divisors.len()],
                eps: if arg.is_multiple_of(2) { 1e-5 } else { 1e-3 },
            }
        }
        9 => Op::AvgPool(1 + arg % f),
        10 => Op::of(Pointwise::Tanh),
        12 => Op::of(Pointwise::GeluTanh),
        13 => Op::of(Pointwise::Sigmoid),
        14 => Op::Reduce(Reduce::Sum),
        15 => Op::Reduce(Reduce::Mean),
        16 => Op::Reduce(Reduce::Min),
        17 => Op::Reduce(Reduce::LogSumExp),
        18 => Op::Softmax,
        19 => Op::MaxPool(1 + arg % f),
        20 => Op::LayerNorm { eps: if arg.is_multiple_of(2) { 1e-5 } else { 1e-3 } },
        21 => Op::RmsNorm { eps: if arg.is_multiple_of(2) { 1e-5 } else { 1e-3 } },
        _ => Op::RowMax,
    }
}

/// The decimal an f32 constant stands for (1e-5 is meant, not its f32 neighbour).
fn constant(v: f32) -> f64 {
    v.to_string().parse().unwrap()
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// The block from its definition: `x W^T + b`, then each op, row by row.
/// `params` are the chain's parameter vectors in order of use.
fn naive_block(x: &Rows, w: &Rows, b: &[f64], chain: &[Op], params: &[Vec<f64>]) -> Vec<f64> {
    let mut h: Rows = x
        .iter()
        .map(|row| (0..w.len()).map(|n| (0..row.len()).map(|k| row[k] * w[n][k]).sum::<f64>() + b[n]).collect())
        .collect();
    let z = h.clone();
    let mut next = params.iter();
    for op in chain {
        let elementwise = |h: &mut Rows, f: &dyn Fn(f64) -> f64| h.iter_mut().flatten().for_each(|v| *v = f(*v));
        match *op {
            Op::Residual => h.iter_mut().zip(&z).for_each(|(row, z)| row.iter_mut().zip(z).for_each(|(v, z)| *v += z)),
            Op::Pointwise(Pointwise::Bias, _) => {
                let p = next.next().unwrap();
                h.iter_mut().for_each(|row| (0..row.len()).for_each(|c| row[c] += p[c]));
            }
            Op::Pointwise(Pointwise::Mul, _) => {
                let p = next.next().unwrap();
                h.iter_mut().for_each(|row| (0..row.len()).for_each(|c| row[c] *= p[c]));
            }
            Op::Pointwise(Pointwise::Scale, [s, _]) => elementwise(&mut h, &|v| constant(s) * v),
            Op::Pointwise(Pointwise::Swish, _) => elementwise(&mut h, &|v| v * sigmoid(v)),
            Op::Pointwise(Pointwise::Mish, _) => elementwise(&mut h, &|v| v * v.exp().ln_1p().tanh()),
            // Phi(x) = erfc(-x / sqrt 2) / 2, computed here apart from the reference.
            Op::Pointwise(Pointwise::Gelu, _) => {
                elementwise(&mut h, &|v| 0.5 * v * libm::erfc(-v / std::f64::consts::SQRT_2))
            }
            Op::Pointwise(Pointwise::LeakyRelu, [s, _]) => {
                elementwise(&mut h, &|v| if v > 0.0 { v } else { constant(s) * v })
            }
            Op::Pointwise(Pointwise::Hardtanh, [lo, hi]) => {
                elementwise(&mut h, &|v| v.max(constant(lo)).min(constant(hi)))
            }
            Op::Pointwise(Pointwise::Tanh, _) => elementwise(&mut h, &|v| v.sinh() / v.cosh()),
            Op::Pointwise(Pointwise::Sigmoid, _) => elementwise(&mut h, &sigmoid),
            // (1 + tanh u) / 2 as e^u / (2 cosh u): `1 + tanh u` cancels in the negative
            // tail (a relative error of 1e-10 at u = -6 in f64); not the reference's sigmoid.
            Op::Pointwise(Pointwise::GeluTanh, _) => elementwise(&mut h, &|v| {
                let u = (2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v * v * v);
                v * if u > 350.0 { 1.0 } else { u.exp() / (2.0 * u.cosh()) }
            }),
            Op::GroupNorm { groups, eps } => {
                let (gamma, beta) = (next.next().unwrap(), next.next().unwrap());
                for row in h.iter_mut() {
                    let size = row.len() / groups;
                    for g in 0..groups {
                        let members = &row[g * size..(g + 1) * size];
                        let mean = members.iter().sum::<f64>() / size as f64;
                        let var = members.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / size as f64;
                        for c in g * size..(g + 1) * size {
                            row[c] = (row[c] - mean) / (var + constant(eps)).sqrt() * gamma[c] + beta[c];
                        }
                    }
                }
            }
            Op::AvgPool(k) => {
                h = h
                    .iter()
                    .map(|row| {
                        (0..row.len() / k).map(|j| row[j * k..(j + 1) * k].iter().sum::<f64>() / k as f64).collect()
                    })
                    .collect();
            }
            Op::RowMax => {
                h = h.iter().map(|row| vec![row.iter().copied().fold(f64::NEG_INFINITY, f64::max)]).collect();
            }
            Op::Reduce(r) => {
                h = h
                    .iter()
                    .map(|row| {
                        let n = row.len() as f64;
                        vec![match r {
                            Reduce::Sum => row.iter().sum::<f64>(),
                            Reduce::Mean => row.iter().sum::<f64>() / n,
                            Reduce::Min => row.iter().copied().fold(f64::INFINITY, f64::min),
                            // Unshifted: the values here are O(1).
                            Reduce::LogSumExp => row.iter().map(|v| v.exp()).sum::<f64>().ln(),
                        }]
                    })
                    .collect();
            }
            Op::Softmax => {
                for row in h.iter_mut() {
                    let total: f64 = row.iter().map(|v| v.exp()).sum();
                    row.iter_mut().for_each(|v| *v = v.exp() / total);
                }
            }
            Op::MaxPool(k) => {
                h = h
                    .iter()
                    .map(|row| {
                        (0..row.len() / k)
                            .map(|j| row[j * k..(j + 1) * k].iter().copied().fold(f64::NEG_INFINITY, f64::max))
                            .collect()
                    })
                    .collect();
            }
            Op::LayerNorm { eps } => {
                let (gamma, beta) = (next.next().unwrap(), next.next().unwrap());
                for row in h.iter_mut() {
                    let n = row.len() as f64;
                    let mean = row.iter().sum::<f64>() / n;
                    let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
                    for c in 0..row.len() {
                        row[c] = (row[c] - mean) / (var + constant(eps)).sqrt() * gamma[c] + beta[c];
                    }
                }
            }
            Op::RmsNorm { eps } => {
                let w = next.next().unwrap();
                for row in h.iter_mut() {
                    let rms = (row.iter().map(|v| v * v).sum::<f64>() / row.len() as f64 + constant(eps)).sqrt();
                    for c in 0..row.len() {
                        row[c] = row[c] / rms * w[c];
                    }
                }
            }
            Op::BatchNorm { eps } => {
                let (gamma, beta) = (next.next().unwrap(), next.next().unwrap());
                let n = h.len() as f64;
                for c in 0..h[0].len() {
                    let mean = h.iter().map(|row| row[c]).sum::<f64>() / n;
                    let var = h.iter().map(|row| (row[c] - mean) * (row[c] - mean)).sum::<f64>() / n;
                    for row in h.iter_mut() {
                        row[c] = (row[c] - mean) / (var + constant(eps)).sqrt() * gamma[c] + beta[c];
                    }
                }
            }
        }
    }
    assert!(next.next().is_none(), "every parameter used");
    h.into_iter().flatten().collect()
}

fn rows(t: &Tensor<f64>) -> Rows {
    t.data().chunks(t.shape()[1]).map(<[f64]>::to_vec).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn reference_matches_naive_loops(
        batch in 1usize..6,
        in_features in 1usize..12,
        out_features in prop::sample::select(&OUTS[..]),
        picks in prop::collection::vec((any::<u8>(), any::<u32>()), 0..5),
        residual in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let mut f = out_features;
        let mut ops = Vec::new();
        for (kind, arg) in picks {
            let op = pick_op(kind, arg, f);
            // After a reduction no per-channel parameter (refused there).
            if ops.iter().any(Op::reduces_row) && !op.param_bases().is_empty() {
                continue;
            }
            f = op.out_features(f).expect("picked ops are valid");
            ops.push(op);
        }
        // The Linear's output added back, where the width allows it.
        if residual && f == out_features {
            ops.push(Op::Residual);
        }
        let spec = BlockSpec::new(in_features, out_features, Chain(ops.clone())).unwrap();
        let mut rng = StdRng::seed_from_u64(seed);
        let mut normal = |shape: &[usize]| -> Tensor<f64> {
            Tensor::from_fn(shape, |_| StandardNormal.sample(&mut rng)).unwrap()
        };
        // Every parameter random (GroupNorm's too), the weight scaled so values stay O(1).
        let scale = 1.0 / (in_features as f64).sqrt();
        let tensors: Vec<Tensor<f64>> = spec.param_specs().iter().map(|s| {
            let t = normal(&s.shape);
            if s.name == "lin.weight" { t.map(|v| v * scale) } else { t }
        }).collect();
        let params = Params::from_flat(&spec, tensors).unwrap();
        let x = normal(&[batch, in_features]);

        let got = block_forward(&spec, &x, &params).unwrap();
        let chain_params: Vec<Vec<f64>> = params.ops.iter().flatten().map(|t| t.data().to_vec()).collect();
        let want = naive_block(&rows(&x), &rows(&params.linear_weight), params.linear_bias.data(), &ops, &chain_params);

        let has_max = ops.iter().any(Op::reduces_row);
        let shape_ok = if has_max { got.shape() == [batch] } else { got.shape() == [batch, f] };
        prop_assert!(shape_ok, "shape {:?} for {} features after `{}`", got.shape(), f, spec.chain);
        prop_assert_eq!(got.len(), want.len());
        let c = compare(got.data(), &want);
        prop_assert!(c.passes(F64_REL), "`{}` at ({}, {}, {}): {:?}", spec.chain, batch, in_features, out_features, c);
    }
}

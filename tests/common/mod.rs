//! Helpers shared by the reference tests (`reference_ops.rs`, `gradcheck.rs`).

use host::{BlockSpec, Params, Tensor};
use rand::rngs::StdRng;
use rand_distr::{Distribution, StandardNormal};

/// A tensor of standard normals.
pub fn random_tensor(rng: &mut StdRng, shape: &[usize]) -> Tensor<f64> {
    Tensor::from_fn(shape, |_| StandardNormal.sample(rng)).unwrap()
}

/// Normal parameters for every tensor of `spec` (GroupNorm's too, so none is
/// trivially 1 or 0); the Linear weight scaled by 1/sqrt(in) so activations stay O(1).
pub fn random_params(spec: &BlockSpec, rng: &mut StdRng) -> Params<f64> {
    let scale = 1.0 / (spec.in_features as f64).sqrt();
    let tensors = spec
        .param_specs()
        .iter()
        .map(|s| {
            let t = random_tensor(rng, &s.shape);
            if s.name == "lin.weight" { t.map(|v| v * scale) } else { t }
        })
        .collect();
    Params::from_flat(spec, tensors).unwrap()
}

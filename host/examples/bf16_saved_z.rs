//! What a bf16 model's saved state would cost in accuracy: the gradients of each preset
//! from the chain input `z` stored in FP32 (what the bf16 model saves) and in bf16,
//! against the exact gradients, all in f64 from the same bf16 `x` and weight (the f64
//! reference's `block_backward_at` takes `z` as given). No GPU: it isolates the error
//! of `z`'s storage from the kernels' own.
//!
//! Shapes: the seed sizes' group sizes (M1, M5: 32 channels, M2: 64, M3: 16) at 1024
//! channels and a batch of 256, KernelBench's `torch.rand` inputs, `dy` normal.
//!
//! `cargo run --release -p host --example bf16_saved_z`

use host::chain::Preset;
use host::tensor::Bf16;
use host::{BlockSpec, Params, Tensor, reference};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;

/// `||got - want|| / ||want||`.
fn rel(got: &Tensor<f64>, want: &Tensor<f64>) -> f64 {
    let (mut d, mut w) = (0.0, 0.0);
    for (g, r) in got.data().iter().zip(want.data()) {
        d += (g - r) * (g - r);
        w += r * r;
    }
    (d / w.max(f64::MIN_POSITIVE)).sqrt()
}

/// Fraction of values outside `allclose(atol = rtol = 1e-2)` of `want`.
fn outside(got: &Tensor<f64>, want: &Tensor<f64>) -> f64 {
    let n = got.data().iter().zip(want.data()).filter(|(g, r)| (*g - *r).abs() > 1e-2 + 1e-2 * r.abs()).count();
    n as f64 / got.len().max(1) as f64
}

fn main() -> host::Result<()> {
    let (batch, width) = (256, 1024);
    let mut rng = StdRng::seed_from_u64(7);
    println!("gradient error from z's storage alone (relative norm error against z exact; outside allclose(1e-2))");
    println!("{:<6}{:<16}{:>22}{:>22}", "model", "gradient", "z in FP32", "z in bf16");
    for preset in Preset::ALL {
        let (_, seed_in, seed_out) = preset.seed_shape();
        // The seed's channels per group, at `width` channels.
        let seed_groups = preset.chain().0.iter().find_map(|op| match op {
            host::chain::Op::GroupNorm { groups, .. } => Some(*groups),
            _ => None,
        });
        let chain = match seed_groups {
            Some(g) => preset.chain().with_groups(width / (seed_out / g)),
            None => preset.chain(),
        };
        let spec = BlockSpec::new(width.min(seed_in), width, chain)?;
        // A bf16 model: every parameter and input a bf16 value.
        let bf16 = |v: f32| Bf16::from_f32(v).to_f32();
        let params = Params::init(&spec, &mut rng).map(bf16);
        let x = Tensor::from_fn(&[batch, spec.in_features], |_| bf16(rng.random::<f32>()))?;
        let dy = Tensor::from_fn(&spec.output_shape(batch), |_| bf16(rng.sample::<f32, _>(StandardNormal)))?;
        let (x, params, dy) = (x.to_f64(), params.map(f64::from), dy.to_f64());

        let (_, z) = reference::block_forward_saving(&spec, &x, &params)?;
        let (_, exact) = reference::block_backward_at(&spec, &x, &params, &dy, &z)?;
        let stored = |round: fn(f64) -> f64| -> host::Result<_> {
            let z = z.map(round);
            Ok(reference::block_backward_at(&spec, &x, &params, &dy, &z)?.1)
        };
        let f32z = stored(|v| v as f32 as f64)?;
        let bf16z = stored(|v| Bf16::from_f32(v as f32).to_f32() as f64)?;
        let names = std::iter::once("x".to_string()).chain(spec.param_specs().into_iter().map(|s| s.name));
        let grads = |g: &reference::BlockGrads<f64>| -> Vec<Tensor<f64>> {
            std::iter::once(g.x.clone()).chain(g.params.flat().into_iter().cloned()).collect()
        };
        for ((name, want), (a, b)) in names.zip(grads(&exact)).zip(grads(&f32z).into_iter().zip(grads(&bf16z))) {
            println!(
                "{:<6}{:<16}{:>12.2e} ({:>5.2}%){:>12.2e} ({:>5.2}%)",
                preset.to_string(),
                name,
                rel(&a, &want),
                100.0 * outside(&a, &want),
                rel(&b, &want),
                100.0 * outside(&b, &want)
            );
        }
    }
    Ok(())
}

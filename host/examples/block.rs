//! One block through the `host` library, without the CLI: `Linear(256, 512)` followed by
//! `groupnorm(16),swish,mul,swish`, forward and backward, on the GPU where one is usable
//! (3xTF32 GEMMs) and on the CPU backend (`host::cpu`, f32) otherwise, checked against
//! the f64 reference.
//!
//! `cargo run --release -p host --example block`

use host::Precision;
use host::block::random_input;
use host::check::compare_f32;
use host::gpu::Gpu;
use host::gpu::block::GpuBlock;
use host::{BlockSpec, Params, Tensor, reference};
use rand::SeedableRng;
use rand::rngs::StdRng;

fn main() -> host::Result<()> {
    let (batch, in_features, out_features) = (64, 256, 512);
    let spec = BlockSpec::new(in_features, out_features, "groupnorm(16),swish,mul,swish".parse()?)?;
    let mut rng = StdRng::seed_from_u64(0);
    // Parameters drawn as PyTorch initialises them, named as its modules name them.
    let params = Params::init(&spec, &mut rng);
    let names: Vec<String> = spec.param_specs().into_iter().map(|s| s.name).collect();
    println!("block: Linear({in_features}, {out_features}) -> {}; parameters {names:?}", spec.chain);
    let x = random_input(batch, in_features, &mut rng)?;
    // The gradient of the output: that of `sum(y)`.
    let dy = Tensor::full(&spec.output_shape(batch), 1.0f32)?;

    // The exact answer: the reference in f64.
    let (y_ref, grads_ref) = reference::block_backward(&spec, &x.to_f64(), &params.map(f64::from), &dy.to_f64())?;

    let (backend, y, dx, dw) = match Gpu::open(0) {
        Ok(gpu) => {
            let block = GpuBlock::new(&gpu, &spec, &params)?.with_precision(Precision::Tf32x3);
            let got = block.forward_backward(&gpu, &x, &dy)?;
            (format!("GPU ({}), 3xTF32", gpu.props.name), got.y, got.x, got.params.linear_weight)
        }
        Err(why) => {
            // The CPU backend: f32 on every core.
            let (y, grads) = host::cpu::backward(&spec, &x, &params, &dy, &Default::default())?;
            (format!("CPU ({why})"), y, grads.x, grads.params.linear_weight)
        }
    };
    println!("backend: {backend}");
    for (name, got, want) in
        [("y", &y, &y_ref), ("grad x", &dx, &grads_ref.x), ("grad lin.weight", &dw, &grads_ref.params.linear_weight)]
    {
        let c = compare_f32(got.data(), want.data());
        println!("{name:16} {:?}: relative error {:.2e} against the f64 reference", want.shape(), c.rel);
        if !c.passes(1e-4) {
            return Err(host::Error::Argument(format!("{name} is {:.2e} from the reference", c.rel)));
        }
    }
    Ok(())
}

//! A small MLP trained with candle: two fused blocks (`host::candle::FusedLinear`:
//! Linear+GroupNorm+swish, then Linear+gelu) and a plain `candle_nn::Linear` head, beside the
//! same MLP written with `candle_nn::linear` and candle's own ops, from the same initial
//! weights. Both train with AdamW for 50 steps; their losses must agree to 1e-4 (relative)
//! at every step. On the CPU, or with `--cuda` on candle's CUDA device 0 (a build with the
//! feature `candle-cuda`, docs/RUST.md).
//!
//! `cargo run --release -p host --features candle --example candle_mlp [-- --cuda]`

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{AdamW, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use host::candle::FusedLinear;

const IN: usize = 64;
const HIDDEN: usize = 128;
const MID: usize = 64;
const OUT: usize = 10;
const BATCH: usize = 32;
const GROUPS: usize = 8;

struct Fused {
    b0: FusedLinear,
    b1: FusedLinear,
    head: candle_nn::Linear,
}

impl Fused {
    fn new(vb: VarBuilder) -> Result<Self> {
        Ok(Fused {
            b0: FusedLinear::from_chain(IN, HIDDEN, &format!("groupnorm({GROUPS}),swish"), vb.pp("b0"))?,
            b1: FusedLinear::from_chain(HIDDEN, MID, "gelu", vb.pp("b1"))?,
            head: candle_nn::linear(MID, OUT, vb.pp("head"))?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.head.forward(&self.b1.forward(&self.b0.forward(x)?)?)
    }
}

/// The same MLP in candle's ops; its parameters have the fused blocks' names
/// (`b0.lin.weight`, `b0.gn.weight`, ...).
struct Plain {
    lin0: candle_nn::Linear,
    gn: candle_nn::GroupNorm,
    lin1: candle_nn::Linear,
    head: candle_nn::Linear,
}

impl Plain {
    fn new(vb: VarBuilder) -> Result<Self> {
        Ok(Plain {
            lin0: candle_nn::linear(IN, HIDDEN, vb.pp("b0.lin"))?,
            gn: candle_nn::group_norm(GROUPS, HIDDEN, 1e-5, vb.pp("b0.gn"))?,
            lin1: candle_nn::linear(HIDDEN, MID, vb.pp("b1.lin"))?,
            head: candle_nn::linear(MID, OUT, vb.pp("head"))?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // candle's GroupNorm takes (N, C, L): L = 1.
        let h = self.gn.forward(&self.lin0.forward(x)?.unsqueeze(2)?)?.squeeze(2)?;
        let h = self.lin1.forward(&candle_nn::ops::silu(&h)?)?.gelu_erf()?;
        self.head.forward(&h)
    }
}

fn main() -> Result<()> {
    let dev = if std::env::args().any(|a| a == "--cuda") { Device::new_cuda(0)? } else { Device::Cpu };
    let fused_vars = VarMap::new();
    let fused = Fused::new(VarBuilder::from_varmap(&fused_vars, DType::F32, &dev))?;
    let plain_vars = VarMap::new();
    let plain = Plain::new(VarBuilder::from_varmap(&plain_vars, DType::F32, &dev))?;
    // The same initial weights: the fused model's, copied by name.
    {
        let (from, to) = (fused_vars.data().lock().unwrap(), plain_vars.data().lock().unwrap());
        assert_eq!(from.len(), to.len(), "both models have the same parameters");
        for (name, var) in from.iter() {
            let dst = to.get(name).unwrap_or_else(|| panic!("the plain model has no {name}"));
            dst.set(var.as_tensor())?;
        }
    }
    let x = Tensor::randn(0f32, 1.0, (BATCH, IN), &dev)?;
    let target = Tensor::randn(0f32, 1.0, (BATCH, OUT), &dev)?;
    let params = ParamsAdamW { lr: 1e-3, ..Default::default() };
    let mut opt_fused = AdamW::new(fused_vars.all_vars(), params.clone())?;
    let mut opt_plain = AdamW::new(plain_vars.all_vars(), params)?;
    println!("MLP {IN} -> {HIDDEN} (groupnorm({GROUPS}),swish) -> {MID} (gelu) -> {OUT}, batch {BATCH}, AdamW");
    for step in 0..50 {
        let loss_f = candle_nn::loss::mse(&fused.forward(&x)?, &target)?;
        let loss_p = candle_nn::loss::mse(&plain.forward(&x)?, &target)?;
        let (lf, lp) = (loss_f.to_scalar::<f32>()?, loss_p.to_scalar::<f32>()?);
        let rel = (lf - lp).abs() / lp.abs().max(f32::MIN_POSITIVE);
        if step % 10 == 0 || step == 49 {
            println!("step {step:2}: loss fused {lf:.6}  candle {lp:.6}  (relative difference {rel:.1e})");
        }
        assert!(rel <= 1e-4, "step {step}: the losses differ: fused {lf}, candle {lp}");
        opt_fused.backward_step(&loss_f)?;
        opt_plain.backward_step(&loss_p)?;
    }
    println!("the fused and the plain MLP agree to 1e-4 at every step");
    Ok(())
}

//! A whole block's forward pass on the GPU: which kernels run (the plan) and the
//! buffers they need.
//!
//! * **fused** — one kernel: `gemm_f32_fused_*` applies the bias and the whole chain
//!   to its accumulator tile before storing (pointwise ops; GroupNorm whose groups of
//!   4..=128 channels, a power of two, fall inside one 128-column tile).
//! * **gemm + rows** — two kernels: the GEMM (split along `k` into `s` partial
//!   products when its tiles alone would leave most SMs idle), then `epilogue_rows`,
//!   which adds the parts and the bias and runs any chain on whole rows: reductions
//!   across tiles (`max`), pooling, GroupNorm groups of any size.
//!
//! A chain that starts with `avgpool(k)` is folded into the weights first: averaging
//! blocks of `k` outputs of a Linear layer is a Linear layer with the rows of `W` and
//! `b` averaged in blocks of `k` (exact algebra, see models.md), `k` times less GEMM.

use super::epilogue::{DeviceChain, rows::epilogue_rows};
use super::gemm::simt::{Mode, gemm_f32_fused, kernel_name, not_fusable};
use super::{DeviceTensor, Gpu};
use crate::block::{BlockSpec, Params};
use crate::chain::{Chain, Op};
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use kernel_abi::gemm_simt::{BLOCK_K, BLOCK_M, BLOCK_N};

/// A block's parameters resident on the GPU, folded for the kernels.
pub struct GpuBlock {
    pub spec: BlockSpec,
    /// `k` of a leading avgpool folded into `weight` and `bias`.
    folded: Option<usize>,
    weight: DeviceTensor,
    bias: DeviceTensor,
    /// The chain the kernels run (without a folded avgpool).
    chain: DeviceChain,
    /// Why the fused kernel cannot run this chain, if it cannot.
    not_fusable: Option<String>,
}

/// Which kernels run for one batch size.
#[derive(Clone, Debug, PartialEq)]
pub enum Plan {
    Fused,
    GemmThenRows { splits: usize },
}

/// Buffers of one forward pass for a batch size, and the plan they serve.
pub struct Workspace {
    pub plan: Plan,
    /// GEMM output or its split-K parts (unused by the fused plan).
    z: Option<DeviceTensor>,
    /// The block's output, `(batch, features out)`.
    pub y: DeviceTensor,
}

impl GpuBlock {
    pub fn new(gpu: &Gpu, spec: &BlockSpec, params: &Params<f32>) -> Result<GpuBlock> {
        let (folded, weight, bias, kernel_spec, kernel_params) = match spec.chain.0.first() {
            Some(&Op::AvgPool(k)) => {
                let rest = Chain(spec.chain.0[1..].to_vec());
                let kspec = BlockSpec::new(spec.in_features, spec.out_features / k, rest)?;
                let (w, b) = fold_avg_pool(&params.linear_weight, &params.linear_bias, k)?;
                let kparams =
                    Params { linear_weight: w.clone(), linear_bias: b.clone(), ops: params.ops[1..].to_vec() };
                (Some(k), w, b, kspec, kparams)
            }
            _ => (None, params.linear_weight.clone(), params.linear_bias.clone(), spec.clone(), params.clone()),
        };
        let not_fusable =
            kernel_spec.chain.0.iter().enumerate().find_map(|(i, op)| not_fusable(op, kernel_spec.features_at(i)));
        Ok(GpuBlock {
            spec: spec.clone(),
            folded,
            weight: gpu.upload(&weight)?,
            bias: gpu.upload(&bias)?,
            chain: DeviceChain::upload(gpu, &kernel_spec, &kernel_params)?,
            not_fusable,
        })
    }

    /// Chooses the kernels for `batch` rows on this GPU.
    pub fn plan(&self, gpu: &Gpu, batch: usize) -> Plan {
        let (n, k) = (self.weight.shape[0], self.spec.in_features);
        let tiles = batch.div_ceil(BLOCK_M) * n.div_ceil(BLOCK_N);
        let sms = gpu.props.multiprocessors;
        // Too few tiles to occupy the GPU, and enough k to share out: split k.
        let splits = if tiles * 2 < sms && k >= 64 * BLOCK_K {
            (2 * sms).div_ceil(tiles).min(k / (32 * BLOCK_K)).clamp(1, 16)
        } else {
            1
        };
        match (&self.not_fusable, splits) {
            (None, 1) => Plan::Fused,
            _ => Plan::GemmThenRows { splits },
        }
    }

    /// Floating-point operations of the GEMM the kernels run (after any folding).
    pub fn executed_flops(&self, batch: usize) -> f64 {
        2.0 * batch as f64 * self.spec.in_features as f64 * self.weight.shape[0] as f64
    }

    /// Which kernels run, and why: for the summary line.
    pub fn describe(&self, plan: &Plan) -> String {
        let gemm = kernel_name(self.spec.in_features);
        let fold = self.folded.map_or(String::new(), |k| format!("; avgpool({k}) folded into the weights"));
        match plan {
            Plan::Fused => format!("fused: {gemm} with bias and chain in the epilogue (1 kernel{fold})"),
            Plan::GemmThenRows { splits } => {
                let why = match (&self.not_fusable, splits) {
                    (Some(reason), _) => reason.clone(),
                    (None, s) => format!("{s}-way split-K to fill the GPU"),
                };
                let split = if *splits > 1 { format!(" split-K x{splits}") } else { String::new() };
                format!("{gemm}{split} + epilogue_rows (2 kernels: {why}{fold})")
            }
        }
    }

    /// Allocates the buffers for `batch` rows (NaN-poisoned, so a missed element shows).
    pub fn workspace(&self, gpu: &Gpu, batch: usize) -> Result<Workspace> {
        let plan = self.plan(gpu, batch);
        let n = self.weight.shape[0];
        let z = match plan {
            Plan::Fused => None,
            Plan::GemmThenRows { splits: 1 } => Some(gpu.poisoned(&[batch, n])?),
            Plan::GemmThenRows { splits } => Some(gpu.poisoned(&[splits, batch, n])?),
        };
        let y = gpu.poisoned(&[batch, self.spec.features_at(self.spec.chain.0.len())])?;
        Ok(Workspace { plan, z, y })
    }

    /// Queues the forward of `x` into `ws.y`.
    pub fn forward_into(&self, gpu: &Gpu, x: &DeviceTensor, ws: &mut Workspace) -> Result<()> {
        if x.shape.get(1) != Some(&self.spec.in_features) || x.shape.first() != ws.y.shape.first() {
            return Err(Error::tensor("x", format!("shape {:?} does not fit this workspace", x.shape)));
        }
        match (&ws.plan, ws.z.as_mut()) {
            (Plan::Fused, _) => {
                gemm_f32_fused(gpu, x, &self.weight, &self.bias, &mut ws.y, Mode::Fused(Some(&self.chain)))
            }
            (Plan::GemmThenRows { splits: 1 }, Some(z)) => {
                gemm_f32_fused(gpu, x, &self.weight, &self.bias, z, Mode::Fused(None))?;
                epilogue_rows(gpu, &self.chain, z, None, &mut ws.y)
            }
            (Plan::GemmThenRows { splits }, Some(z)) => {
                gemm_f32_fused(gpu, x, &self.weight, &self.bias, z, Mode::Split(*splits))?;
                epilogue_rows(gpu, &self.chain, z, Some(&self.bias.buf), &mut ws.y)
            }
            (Plan::GemmThenRows { .. }, None) => unreachable!("workspace() allocates z for this plan"),
        }
    }

    /// Uploads `x`, runs the block and downloads the output (shape as the CPU reference's).
    pub fn forward(&self, gpu: &Gpu, x: &Tensor<f32>) -> Result<Tensor<f32>> {
        let batch = self.spec.check_input(x)?;
        let dx = gpu.upload(x)?;
        let mut ws = self.workspace(gpu, batch)?;
        self.forward_into(gpu, &dx, &mut ws)?;
        gpu.download(&ws.y)?.reshape(&self.spec.output_shape(batch))
    }
}

/// `W'[j] = mean(W[j k .. j k + k])`, `b'` likewise (f64 sums): AvgPool1d(k) of a Linear
/// layer's output as a Linear layer with `out / k` outputs. Trailing rows are dropped,
/// as AvgPool1d drops trailing features.
pub fn fold_avg_pool(w: &Tensor<f32>, b: &Tensor<f32>, k: usize) -> Result<(Tensor<f32>, Tensor<f32>)> {
    let (n, i) = (w.rows(), w.cols());
    if k == 0 || k > n {
        return Err(Error::Chain(format!("avgpool({k}) over {n} features")));
    }
    let n_out = n / k;
    let mut fw = vec![0.0f32; n_out * i];
    for (j, out) in fw.chunks_mut(i).enumerate() {
        for (c, o) in out.iter_mut().enumerate() {
            let s: f64 = (0..k).map(|e| w.data()[(j * k + e) * i + c] as f64).sum();
            *o = (s / k as f64) as f32;
        }
    }
    let fb = (0..n_out).map(|j| ((0..k).map(|e| b.data()[j * k + e] as f64).sum::<f64>() / k as f64) as f32).collect();
    Ok((Tensor::new(&[n_out, i], fw)?, Tensor::new(&[n_out], fb)?))
}

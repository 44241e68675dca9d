//! A whole block on the GPU, forward and backward: which kernels run (the plan), the
//! parameters they read and the state the backward keeps.
//!
//! Forward plans:
//! * **fused** — one kernel: `gemm_fma_nt_*` applies the bias and the whole chain to
//!   its accumulator tile before storing (pointwise ops; GroupNorm whose groups of
//!   4..=128 channels, a power of two, fall inside one 128-column tile).
//! * **gemm + rows** — two kernels: the GEMM (split along `k` into `s` partial
//!   products when its tiles alone would leave most SMs idle), then `epilogue_rows`,
//!   which adds the parts and the bias and runs any chain on whole rows: reductions
//!   across tiles (`max`), pooling, GroupNorm groups of any size.
//!
//! A chain that starts with `avgpool(k)` is folded into the weights first: averaging
//! blocks of `k` outputs of a Linear layer is a Linear layer with the rows of `W` and
//! `b` averaged in blocks of `k` (exact algebra, see models.md), `k` times less GEMM. A
//! leading row `sum` or `mean` after `bias` ops and constant scalings folds the same way
//! over the whole row, the bias ops' means added to the Linear's ([`dispatch::fold`]).
//! The backward works on the folded layer too and spreads its weight gradients back.
//!
//! Backward: the forward saves `z`, the chain's input (the GEMM output with bias).
//! Where the chain has a kink (LeakyReLU, Hardtanh, row max) or a GroupNorm of small
//! groups, a scan and `refine_z` first recompute in f64 the few chunks of `z` whose
//! rounding could put a kink's input on its other side (`epilogue/kinks.rs`).
//! `epilogue_rows_backward` turns `dy` into `dz` and the chain's parameter gradients
//! (recomputing each op's input from `z`), `sum_partials` finishes those, and two
//! GEMMs give `dX = dZ W` and `dW = dZ^T X`.

use super::dispatch::{self, Family, FoldedAs, Forward, SplitSums, not_fusable};
use super::dot;
use super::elementwise::{
    Convert, Vector, add_assign, convert_vectors, fold_rows_mean, fold_rows_mean_halves, unfold_rows_mean_grad,
};
use super::epilogue::kinks::{Refined, Scan, refine_near_kinks, scanned_prefix};
use super::epilogue::lanes::{GradOuts, epilogue_split_tiles, epilogue_tiles_backward, fits as tiles_fit};
use super::epilogue::rows::{epilogue_rows, epilogue_rows_backward};
use super::epilogue::{DeviceChain, partials};
use super::gemm::fp8::{self, Fp8Matrix, Fp8Weight};
use super::gemm::gemv::launch_gemv;
use super::gemm::linear::grad_input_fp8;
use super::gemm::{forward_gemm, grad_input, grad_weight};
use super::{DeviceElement, DeviceTensor, DeviceVector, Dtype, Gpu, Phases, VectorArg, VectorWord};
use crate::block::{BlockSpec, Params};
use crate::check::{Comparison, compare_f32};
use crate::error::{Error, Result};
use crate::precision::Precision;
use crate::reference::BlockGrads;
use crate::tensor::Tensor;

pub use super::dispatch::Plan;

/// [`fold_rows_mean`] of a parameter vector as stored: FP32 means.
fn fold_vector_mean(gpu: &Gpu, v: &DeviceVector, pool: usize) -> Result<DeviceTensor> {
    match v {
        DeviceVector::F32(t) => fold_rows_mean(gpu, t, pool),
        DeviceVector::Bf16(t) => fold_rows_mean(gpu, t, pool),
        DeviceVector::F16(t) => fold_rows_mean(gpu, t, pool),
    }
}

/// A block's parameters in device memory, in [`Params`]'s structure. The Linear
/// layer's weight is FP32 or, for a 16-bit model, of its type (`W`); the bias and the
/// chain's per-channel parameters are `V`: FP32 tensors (what Rust callers upload and
/// what gradients are), or a block's [`DeviceVector`]s, which may hold a 16-bit model's
/// parameters as stored (the epilogue widens them on load and computes in FP32, as
/// PyTorch does).
pub struct DeviceParams<W = f32, V = DeviceTensor> {
    pub linear_weight: DeviceTensor<W>,
    pub linear_bias: V,
    pub ops: Vec<Vec<V>>,
}

/// A parameter vector of [`DeviceParams`]: what its shape is.
pub trait ParamVector {
    fn shape(&self) -> &[usize];
}

impl<T> ParamVector for DeviceTensor<T> {
    fn shape(&self) -> &[usize] {
        &self.shape
    }
}

impl ParamVector for DeviceVector {
    fn shape(&self) -> &[usize] {
        DeviceVector::shape(self)
    }
}

impl<W, V: ParamVector> DeviceParams<W, V> {
    /// Every tensor's shape in [`BlockSpec::param_specs`] order.
    pub fn shapes(&self) -> Vec<&[usize]> {
        let mut v = vec![&self.linear_weight.shape[..], self.linear_bias.shape()];
        v.extend(self.ops.iter().flatten().map(|t| t.shape()));
        v
    }
}

impl<W, V: Into<DeviceVector>> DeviceParams<W, V> {
    /// The same parameters as a block holds them.
    pub fn into_vectors(self) -> DeviceParams<W, DeviceVector> {
        DeviceParams {
            linear_weight: self.linear_weight,
            linear_bias: self.linear_bias.into(),
            ops: self.ops.into_iter().map(|v| v.into_iter().map(Into::into).collect()).collect(),
        }
    }
}

impl DeviceParams<f32, DeviceVector> {
    /// All tensors in [`BlockSpec::param_specs`] order, where every one is FP32 (a
    /// block over FP32 tensors, as an optimizer updates them).
    pub fn flat_f32_mut(&mut self) -> Result<Vec<&mut DeviceTensor>> {
        let mut v = vec![&mut self.linear_weight, self.linear_bias.f32_mut()?];
        for t in self.ops.iter_mut().flatten() {
            v.push(t.f32_mut()?);
        }
        Ok(v)
    }
}

impl DeviceParams {
    pub fn upload(gpu: &Gpu, p: &Params<f32>) -> Result<DeviceParams> {
        Ok(DeviceParams {
            linear_weight: gpu.upload(&p.linear_weight)?,
            linear_bias: gpu.upload(&p.linear_bias)?,
            ops: p.ops.iter().map(|v| v.iter().map(|t| gpu.upload(t)).collect()).collect::<Result<_>>()?,
        })
    }

    /// All tensors in [`BlockSpec::param_specs`] order.
    pub fn flat(&self) -> Vec<&DeviceTensor> {
        let mut v = vec![&self.linear_weight, &self.linear_bias];
        v.extend(self.ops.iter().flatten());
        v
    }

    pub fn flat_mut(&mut self) -> Vec<&mut DeviceTensor> {
        let mut v = vec![&mut self.linear_weight, &mut self.linear_bias];
        v.extend(self.ops.iter_mut().flatten());
        v
    }

    pub fn download(&self, gpu: &Gpu, spec: &BlockSpec) -> Result<Params<f32>> {
        Params::from_flat(spec, self.flat().into_iter().map(|t| gpu.download(t)).collect::<Result<_>>()?)
    }
}

/// A block resident on the GPU, over FP32 tensors or (`GpuBlock<Bf16>`,
/// `GpuBlock<F16>`, see `block_half.rs`) a 16-bit model's.
pub struct GpuBlock<W = f32> {
    pub spec: BlockSpec,
    pub params: DeviceParams<W, DeviceVector>,
    /// A leading avgpool, or a whole row's sum or mean, folded into the GEMM.
    pub(super) folded: Option<Folded<W>>,
    /// The chain the kernels run (a fold's ops in place of what it folded). Points into
    /// `params`.
    pub(super) chain: DeviceChain,
    /// Why the fused kernel cannot run this chain, if it cannot.
    pub(super) not_fusable: Option<String>,
    /// The chain's first op index the kernels run (1 when an avgpool is folded).
    pub(super) first_op: usize,
    /// The chain's BatchNorm (its index and eps): `chain` then holds the ops before it,
    /// and `gpu/batch_norm.rs` runs it and the ops after it.
    pub(super) batch_norm: Option<(usize, f32)>,
    /// Arithmetic of the three GEMMs.
    pub precision: Precision,
    /// FP8: the GEMM's weight quantised for the forward and for `dX`, made by
    /// [`GpuBlock::refold`]; `None`: quantised per call.
    pub(super) fp8: Option<Fp8Cache>,
    /// Whether the backward computes `dX` ([`GpuBlock::with_input_grad`]).
    pub(super) input_grad: bool,
    /// A chain that reduces each row once, split where the reduction is
    /// ([`Plan::RowPartials`]).
    pub(super) row_partials: Option<RowPartials>,
}

/// The chain of [`Plan::RowPartials`] in two: the GEMM's (the ops up to the reduction,
/// which ends it) and the finishing kernel's (the per-element ops after it). Points
/// into the block's parameters, as its `chain`.
pub(super) struct RowPartials {
    pub(super) head: DeviceChain,
    pub(super) tail: DeviceChain,
}

/// The chains the kernels run over `params` (a fold's ops, on the pooled width, then
/// the spec's up to a BatchNorm), why the fused kernel cannot run it if it cannot, and
/// the chain of [`Plan::RowPartials`] in two where it applies.
fn device_chains<W>(
    gpu: &Gpu,
    spec: &BlockSpec,
    params: &DeviceParams<W, DeviceVector>,
) -> Result<(DeviceChain, Option<String>, Option<RowPartials>)> {
    let fold = dispatch::fold(spec);
    let first_op = fold.as_ref().map_or(0, |f| f.first_op);
    let batch_norm = spec.chain.batch_norm();
    let end = batch_norm.map_or(spec.chain.0.len(), |(k, _)| k);
    let before = fold.map_or(Vec::new(), |f| f.before);
    let ops = &spec.chain.0[first_op..end];
    let chain = DeviceChain::new(gpu, &before, ops, &params.ops[first_op..end])?;
    let not_fusable = before
        .iter()
        .map(|op| (op, spec.features_at(first_op)))
        .chain(ops.iter().enumerate().map(|(i, op)| (op, spec.features_at(first_op + i))))
        .find_map(|(op, width)| not_fusable(op, width));
    // (Not after a fold, whose ops are no slice of the spec's, nor before a BatchNorm.)
    let row_partials = match dispatch::row_partials_at(ops, |i| spec.features_at(first_op + i)) {
        Some(at) if before.is_empty() && first_op == 0 && batch_norm.is_none() => {
            let (head, tail) = (&ops[..=at], &ops[at + 1..]);
            let split = first_op + at + 1;
            let head = DeviceChain::new(gpu, &[], head, &params.ops[first_op..split])?;
            let tail = DeviceChain::new(gpu, &[], tail, &params.ops[split..end])?;
            Some(RowPartials { head, tail })
        }
        _ => None,
    };
    Ok((chain, not_fusable, row_partials))
}

/// The Linear layer's gradients: `dX` (`None` where the block computes none) and `dW`.
pub(super) type LinearGrads<W> = (Option<DeviceTensor<W>>, DeviceTensor<W>);

/// A leading AvgPool (or a whole row's sum or mean, [`dispatch::Fold`]) folded into the
/// Linear layer: its window, and the weight and bias of the GEMM the kernels run.
pub(super) struct Folded<W> {
    pub(super) pool: usize,
    pub(super) weight: FoldedWeight<W>,
    /// The bias's means (FP32, whatever the weight's type).
    pub(super) bias: DeviceTensor,
}

/// A folded weight, as the block's GEMMs take it.
pub(super) enum FoldedWeight<W> {
    /// FP32 means: an FP32 block's, and what FP8 quantises.
    Means(DeviceTensor),
    /// A 16-bit model's means as `hi + lo` in its own type ([`fold_rows_mean_halves`]):
    /// two GEMMs on `x` as stored, as accurate as 3xTF32 on the means, where rounding
    /// the means to the type moved M4's row max (`dx` 7.9e-2 from f64).
    Halves(DeviceTensor<W>, DeviceTensor<W>),
}

impl<W> Folded<W> {
    /// The GEMM's width: the pooled features.
    fn rows(&self) -> usize {
        match &self.weight {
            FoldedWeight::Means(w) => w.shape[0],
            FoldedWeight::Halves(hi, _) => hi.shape[0],
        }
    }
}

/// A block's weight quantised for its FP8 GEMMs, and the address it was quantised from.
pub(super) struct Fp8Cache {
    source: u64,
    pub(super) weight: Fp8Weight,
}

impl Fp8Cache {
    fn of<T: DeviceElement>(gpu: &Gpu, w: &DeviceTensor<T>) -> Result<Fp8Cache> {
        let weight = fp8::quantise_weight(gpu, gpu.stream(), w, "lin.weight")?;
        Ok(Fp8Cache { source: w.buf.device_address(), weight })
    }
}

/// Buffers of one forward pass for a batch size, and the plan they serve.
pub struct Workspace<T = f32> {
    pub plan: Plan,
    /// GEMM output or its split-K parts (unused by the fused plan).
    pub(super) z: Option<DeviceTensor>,
    /// The block's output, `(batch, features out)`.
    pub y: DeviceTensor<T>,
    /// A BatchNorm's batch statistics after a forward, `[mean; var; -mean; rstd]` `(4, F)`
    /// (`var` biased): what running statistics are updated from.
    pub stats: Option<DeviceTensor>,
}

/// What the forward keeps for the backward: the chain's input `(batch, n)`, `n` the
/// GEMM's width after any fold.
pub struct Saved {
    pub z: DeviceTensor,
    /// Whether `z` was refined near kinks already ([`GpuBlock::refine_saved`]).
    pub(super) refined: bool,
    /// Whether `z` may be refined in place: not where it is a caller's tensor (a
    /// framework's saved state, which a second backward reads again unchanged).
    pub(super) own: bool,
    /// A BatchNorm's batch mean and biased variance `(2, n)` from the forward, which the
    /// backward then reads instead of recomputing them from `z`.
    pub batch_stats: Option<DeviceTensor>,
}

impl Saved {
    /// The state a forward saved, handed back by a caller who keeps it: the backward
    /// refines a copy of it, never `z` itself.
    pub fn kept_by_caller(z: DeviceTensor) -> Saved {
        Saved { z, refined: false, own: false, batch_stats: None }
    }

    /// With a BatchNorm's statistics as the forward returned them (its first two rows;
    /// `None` without a BatchNorm).
    pub fn with_batch_stats(self, batch_stats: Option<DeviceTensor>) -> Saved {
        Saved { batch_stats, ..self }
    }
}

/// `dX` from [`GpuBlock::backward_parts`] where a caller needs it.
pub(super) fn input_grad<W>(dx: Option<DeviceTensor<W>>) -> Result<DeviceTensor<W>> {
    dx.ok_or_else(|| {
        Error::Unsupported("the block computes no input gradient (with_input_grad(false)): use backward_parts".into())
    })
}

/// Gradients of one block: of its input and of every parameter (the input's and the
/// Linear weight's in their own type, `W`).
pub struct DeviceGrads<W = f32> {
    pub x: DeviceTensor<W>,
    pub params: DeviceParams<W>,
}

impl GpuBlock {
    pub fn new(gpu: &Gpu, spec: &BlockSpec, params: &Params<f32>) -> Result<GpuBlock> {
        Self::from_device(gpu, spec, DeviceParams::upload(gpu, params)?)
    }
}

impl<W: DeviceElement> GpuBlock<W> {
    /// A block over parameters already in device memory (a framework's tensors,
    /// borrowed: [`Gpu::borrow_tensor`]), shaped as `spec` says, its GEMMs in FP32 (a
    /// 16-bit model's in its type's precision).
    pub fn from_device<V: Into<DeviceVector>>(
        gpu: &Gpu,
        spec: &BlockSpec,
        params: DeviceParams<W, V>,
    ) -> Result<GpuBlock<W>> {
        Self::from_device_in(gpu, spec, params, Precision::Fp32)
    }

    /// [`GpuBlock::from_device`] with its GEMMs in `precision` (as
    /// [`GpuBlock::with_precision`] takes it) from the start: a folded AvgPool's weight
    /// is then made once, in the form that precision's GEMMs read.
    pub fn from_device_in<V: Into<DeviceVector>>(
        gpu: &Gpu,
        spec: &BlockSpec,
        params: DeviceParams<W, V>,
        precision: Precision,
    ) -> Result<GpuBlock<W>> {
        let params = params.into_vectors();
        for (s, shape) in spec.param_specs().iter().zip(params.shapes()) {
            if shape != s.shape {
                return Err(Error::tensor(&s.name, format!("expected shape {:?}, got {:?}", s.shape, shape)));
            }
        }
        let fold = dispatch::fold(spec);
        let first_op = fold.as_ref().map_or(0, |f| f.first_op);
        let batch_norm = spec.chain.batch_norm();
        let (chain, not_fusable, row_partials) = device_chains(gpu, spec, &params)?;
        let mut block = GpuBlock {
            spec: spec.clone(),
            params,
            folded: None,
            chain,
            not_fusable,
            first_op,
            batch_norm,
            precision: Precision::Fp32,
            fp8: None,
            input_grad: true,
            row_partials,
        }
        .with_precision(precision);
        block.fold(gpu)?;
        Ok(block)
    }

    /// The same block over other bias and chain vectors of the same shapes (the Linear
    /// bias's, then each op's, in chain order) and values: FP32 copies of a 16-bit
    /// model's, for a backward that reads FP32. Its chains are remade; a folded weight
    /// is not.
    pub fn with_vectors(mut self, gpu: &Gpu, vectors: Vec<DeviceVector>) -> Result<GpuBlock<W>> {
        let mut flat = vectors.into_iter();
        let mut next = |name: &str, shape: &[usize]| -> Result<DeviceVector> {
            let v = flat.next().ok_or_else(|| Error::Shape(format!("no vector for `{name}`")))?;
            if v.shape() != shape {
                return Err(Error::tensor(name, format!("expected shape {shape:?}, got {:?}", v.shape())));
            }
            Ok(v)
        };
        let specs = self.spec.param_specs();
        let mut named = specs.iter().skip(1);
        let mut take = |current: &DeviceVector| {
            let s = named.next().ok_or_else(|| Error::Shape("more vectors than the block's parameters".into()))?;
            next(&s.name, current.shape())
        };
        let bias = take(&self.params.linear_bias)?;
        let ops = self.params.ops.iter().map(|op| op.iter().map(&mut take).collect()).collect::<Result<Vec<_>>>()?;
        if flat.next().is_some() {
            return Err(Error::Shape("more vectors than the block's parameters".into()));
        }
        self.params.linear_bias = bias;
        self.params.ops = ops;
        (self.chain, _, self.row_partials) = device_chains(gpu, &self.spec, &self.params)?;
        Ok(self)
    }

    /// The same block with its GEMMs in `precision` (a 16-bit model's are in its type's
    /// precision, or FP8).
    pub fn with_precision(mut self, precision: Precision) -> GpuBlock<W> {
        // A 16-bit model's GEMMs read its values as stored, or quantise them to FP8.
        self.precision = match Precision::of_storage(W::DTYPE) {
            Some(_) if precision.is_fp8() => precision,
            own => own.unwrap_or(precision),
        };
        self.fp8 = None;
        self
    }

    /// The same block with `dX` computed by its backward (`true`, the default) or not: an
    /// input that needs no gradient (data entering a model's first layer) saves the `dX`
    /// GEMM, a third of the backward's GEMM work. [`GpuBlock::backward_parts`] then gives
    /// `None` for it, and [`GpuBlock::backward`] refuses to run.
    pub fn with_input_grad(mut self, on: bool) -> GpuBlock<W> {
        self.input_grad = on;
        self
    }

    /// Recomputes what the block derives from its parameters after they changed
    /// (training): the folded weight and bias of a leading AvgPool, and in FP8 the
    /// quantised weight (until the first call, an FP8 block quantises it per call).
    pub fn refold(&mut self, gpu: &Gpu) -> Result<()> {
        self.fold(gpu)?;
        self.fp8 = None;
        let (n, k) = (self.gemm_width(), self.spec.in_features);
        if self.precision.is_fp8() && fp8::unsupported(k, n).is_none() {
            let mut made = None;
            self.fp8 = Some(match self.folded_means(gpu, &mut made)? {
                Some((w, _)) => Fp8Cache::of(gpu, w)?,
                None => Fp8Cache::of(gpu, &self.params.linear_weight)?,
            });
        }
        Ok(())
    }

    /// Folds a leading AvgPool (or a row sum or mean, [`dispatch::Fold`]) into the weight
    /// and bias: the weight's FP32 means, or for a 16-bit model outside FP8 its means as
    /// two halves in its type; the bias's means plus those of any leading `bias` ops.
    fn fold(&mut self, gpu: &Gpu) -> Result<()> {
        let Some(dispatch::Fold { pool, biases, .. }) = dispatch::fold(&self.spec) else { return Ok(()) };
        let w = &self.params.linear_weight;
        let whole_row = pool == self.spec.out_features;
        let weight = if whole_row {
            // One column (`Plan::RowDot` reads FP32 means, whatever the weight's type).
            FoldedWeight::Means(dot::column_dot(gpu, w, None, 1.0 / pool as f32)?)
        } else if W::DTYPE != Dtype::F32 && !self.precision.is_fp8() {
            let (hi, lo) = fold_rows_mean_halves(gpu, w, pool)?;
            FoldedWeight::Halves(hi, lo)
        } else {
            FoldedWeight::Means(fold_rows_mean(gpu, w, pool)?)
        };
        let mut bias = fold_vector_mean(gpu, &self.params.linear_bias, pool)?;
        // Leading `bias` ops add per feature as the Linear's bias does: their means too.
        for p in self.params.ops[..biases].iter().flatten() {
            add_assign(gpu, &mut bias, &fold_vector_mean(gpu, p, pool)?)?;
        }
        self.folded = Some(Folded { pool, weight, bias });
        Ok(())
    }

    /// A folded AvgPool's weight as FP32 means, and its bias (FP8 quantises the means;
    /// the FP32 kernels take them where a 16-bit model's shapes rule out its own): held,
    /// or folded from the weight into `made` where the block holds halves. `None`
    /// without a fold.
    pub(super) fn folded_means<'a>(
        &'a self,
        gpu: &Gpu,
        made: &'a mut Option<DeviceTensor>,
    ) -> Result<Option<(&'a DeviceTensor, VectorArg<'a>)>> {
        let Some(Folded { pool, weight, bias }) = &self.folded else { return Ok(None) };
        let means = match weight {
            FoldedWeight::Means(w) => w,
            FoldedWeight::Halves(..) => made.insert(fold_rows_mean(gpu, &self.params.linear_weight, *pool)?),
        };
        Ok(Some((means, VectorArg::f32(bias))))
    }

    /// The FP32 weight and the bias of a one-column layer, which [`Plan::RowDot`] and its
    /// backward read: a folded layer's column means, or the weight of a layer of one
    /// output feature (an FP32 block's as it is, a 16-bit block's widened into `made`).
    /// `None` for any other block, and in FP8 (its GEMMs take the weight quantised) or
    /// with a BatchNorm (its own forward).
    pub(super) fn row_dot_params<'a>(
        &'a self,
        gpu: &Gpu,
        made: &'a mut Option<DeviceTensor>,
    ) -> Result<Option<(&'a DeviceTensor, VectorArg<'a>)>> {
        if self.precision.is_fp8() || self.batch_norm.is_some() {
            return Ok(None);
        }
        match &self.folded {
            Some(Folded { weight: FoldedWeight::Means(w), bias, .. }) if w.shape[0] == 1 => {
                Ok(Some((w, VectorArg::f32(bias))))
            }
            None if self.spec.out_features == 1 => {
                let w = &self.params.linear_weight;
                let w32 = match W::DTYPE {
                    // SAFETY: an FP32 block's weight holds floats; the view lives no longer
                    // than the block that owns them.
                    Dtype::F32 => unsafe { gpu.borrow_tensor::<f32>(w.buf.device_address(), &w.shape)? },
                    // (The column sums of one row: its values widened.)
                    _ => dot::column_dot(gpu, w, None, 1.0)?,
                };
                Ok(Some((made.insert(w32), self.params.linear_bias.arg()?)))
            }
            _ => Ok(None),
        }
    }

    /// `dX` (where the block computes it) and `dW` of a one-column layer
    /// ([`GpuBlock::row_dot_params`]) from `dz (batch, 1)`, `x` the forward's input: `dX =
    /// dz w` and `dW`'s one row `dz^T x`, spread over the weight's rows where folded (and
    /// in the weight's type either way: the spread of one row over one rounds it).
    /// `None` for any other block.
    pub(super) fn row_dot_grads(
        &self,
        gpu: &Gpu,
        x: &DeviceTensor<W>,
        dz: &DeviceTensor<W>,
    ) -> Result<Option<LinearGrads<W>>> {
        let mut made = None;
        let Some((w, _)) = self.row_dot_params(gpu, &mut made)? else { return Ok(None) };
        let dx = if self.input_grad { Some(dot::outer(gpu, dz, w)?) } else { None };
        let n = self.spec.out_features;
        let pool = self.folded.as_ref().map_or(1, |f| f.pool);
        let dw = unfold_rows_mean_grad::<W>(gpu, &dot::column_dot(gpu, x, Some(dz), 1.0)?, n, pool)?;
        Ok(Some((dx, dw)))
    }

    /// Width of the GEMM the kernels run.
    pub(super) fn gemm_width(&self) -> usize {
        match &self.folded {
            Some(f) => f.rows(),
            None => self.params.linear_weight.shape[0],
        }
    }

    /// Chooses the kernels for `batch` rows on this GPU ([`dispatch::plan`]).
    pub fn plan(&self, gpu: &Gpu, batch: usize) -> Plan {
        dispatch::plan(self.forward_case(gpu, batch), gpu.props.multiprocessors, gpu.tuning().tma)
    }

    /// The block's forward of `batch` rows, as the dispatch sees it.
    pub(super) fn forward_case(&self, gpu: &Gpu, batch: usize) -> Forward {
        Forward {
            batch,
            n: self.gemm_width(),
            k: self.spec.in_features,
            dtype: W::DTYPE,
            folded: self.folded.as_ref().map(|f| match f.weight {
                FoldedWeight::Means(_) => FoldedAs::Means,
                FoldedWeight::Halves(..) => FoldedAs::Halves,
            }),
            fusable: self.not_fusable.is_none(),
            // (A folded block never takes the small-batch kernel, and its kernels' chain
            // is not a slice of the spec's.)
            gemv_chain: self.folded.is_none()
                && dispatch::gemv_chain_fits(&self.spec.chain.0[..self.chain.ops.len()], self.gemm_width()),
            w_aligned: self.params.linear_weight.buf.device_address().is_multiple_of(16),
            rows_fit: dispatch::rows_fit(self.gemm_width(), gpu.props.max_shared_per_block_optin),
            gemv: gpu.tuning().gemv,
            gemv_tc: gpu.tuning().gemv_tensor_cores && dispatch::gemv_tc_serves(W::DTYPE, self.precision),
            fp8: self.precision.is_fp8(),
            precision: self.precision,
            split_k: gpu.tuning().split_k,
            batch_norm: self.batch_norm.is_some(),
            row_partials: self.row_partials.is_some(),
        }
    }

    /// Floating-point operations of the GEMM the kernels run (after any folding).
    pub fn executed_flops(&self, batch: usize) -> f64 {
        2.0 * batch as f64 * self.spec.in_features as f64 * self.gemm_width() as f64
    }

    /// Which kernels run on `gpu` (its tuning picks among the GEMMs), and why: for the
    /// summary line.
    pub fn describe(&self, gpu: &Gpu, plan: &Plan) -> String {
        // (The forward's route depends on `n`, `k` and the split only.)
        let (_, route) =
            dispatch::forward_route(self.forward_case(gpu, 1), self.precision, plan, true, gpu.tuning().tma);
        let t = Precision::of_storage(W::DTYPE).map_or(String::new(), |p| p.to_string());
        // A folded weight's halves: two GEMMs of `splits / 2` ranges each.
        let halves = !route.widened && matches!(&self.folded, Some(Folded { weight: FoldedWeight::Halves(..), .. }));
        let per = match *plan {
            Plan::GemmThenRows { splits } if halves => splits / 2,
            Plan::GemmThenRows { splits } => splits,
            _ => 1,
        };
        let route = dispatch::Route { kernel: dispatch::split_kernel(route.kernel, per), ..route };
        let gemm = match (W::DTYPE, route.widened, plan, &self.folded) {
            (Dtype::F32, ..) => route.kernel.to_string(),
            (_, false, _, Some(_)) => {
                format!(
                    "{} twice ({t} x as stored, the folded weight's {t} halves; the sums added after)",
                    route.kernel
                )
            }
            (_, false, Plan::Fused, _) => format!("{} ({t} x, W, y as stored)", route.kernel),
            (_, false, ..) => format!("{} ({t} x, W as stored)", route.kernel),
            (_, true, _, Some(_)) => {
                format!("{} (FP32 copy of {t} x, the FP32 folded weight; y rounded)", route.kernel)
            }
            (_, true, _, None) => format!("{} (on FP32 copies of {t} x, W; y rounded)", route.kernel),
        };
        let fold = match (&self.folded, self.batch_norm) {
            // (The op the fold replaced: an AvgPool, or a whole row's sum or mean.)
            (Some(_), _) => format!("; {} folded into the weights", self.spec.chain.0[self.first_op - 1]),
            (_, Some((k, _))) if self.batch_norm_by_columns(k) => {
                "; then batch_norm_stats, batch_norm_finish and batch_norm_apply: the BatchNorm on batch \
                 statistics and the per-element ops after it, column by column"
                    .to_string()
            }
            (_, Some(_)) => "; then batch_norm_stats, batch_norm_finish and epilogue_rows: the BatchNorm on \
                             batch statistics and the ops after it, row by row"
                .to_string(),
            _ => String::new(),
        };
        let gemv = |chain: bool, tc: bool| {
            let out = if chain { W::DTYPE } else { Dtype::F32 };
            dispatch::gemv_kernel(W::DTYPE, out, self.precision, tc)
        };
        match *plan {
            Plan::Gemv { chain: true, tensor_cores } => format!(
                "{}: small batch, W streamed by every SM, the chain on its slabs (1 kernel)",
                gemv(true, tensor_cores)
            ),
            Plan::Gemv { chain: false, tensor_cores } => {
                let rounded = if W::DTYPE != Dtype::F32 { ", y rounded" } else { "" };
                format!(
                    "{}: small batch, W streamed by every SM + epilogue_rows (the chain needs whole rows{rounded})",
                    gemv(false, tensor_cores)
                )
            }
            Plan::Fused => format!("fused: {gemm} with bias and chain in the epilogue (1 kernel{fold})"),
            Plan::RowPartials => format!(
                "row partials: {gemm} with bias and chain up to its row reduction in the epilogue, storing each \
                 half tile's partials + {} (2 kernels: z stored only where saved)",
                partials::finish_kernel(W::DTYPE)
            ),
            Plan::RowDot => {
                let weight = if self.folded.is_some() { "the weight's FP32 column means" } else { "the FP32 weight" };
                let end = match dispatch::split_sums(self.not_fusable.is_none()) {
                    SplitSums::Tiles => "epilogue_split_tiles",
                    SplitSums::Rows => "epilogue_rows",
                };
                format!(
                    "row dot: {} ({} x as stored, {weight}) + {end} (2 kernels{fold}: one column)",
                    dispatch::dot_kernels(W::DTYPE).row_dot,
                    W::NAME
                )
            }
            Plan::GemmThenRows { splits } => {
                let why = match (&self.not_fusable, per) {
                    (Some(reason), _) => reason.clone(),
                    (None, 1) if halves => "the two GEMMs' sums added".to_string(),
                    (None, s) => format!("{s}-way split-K to fill the GPU"),
                };
                let each = if halves { " each" } else { "" };
                let split = if per > 1 { format!(" split-K x{per}{each}") } else { String::new() };
                let tiles = splits > 1 && dispatch::split_sums(self.not_fusable.is_none()) == SplitSums::Tiles;
                let end = if tiles { "epilogue_split_tiles" } else { "epilogue_rows" };
                format!("{gemm}{split} + {end} (2 kernels: {why}{fold})")
            }
        }
    }

    pub(super) fn out_width(&self) -> usize {
        self.spec.features_at(self.spec.chain.0.len())
    }

    /// Allocates the buffers for `batch` rows, NaN-poisoned (so a missed element shows).
    pub fn workspace(&self, gpu: &Gpu, batch: usize) -> Result<Workspace<W>> {
        self.workspace_with(gpu, batch, true)
    }

    /// Allocates the buffers for `batch` rows, poisoned or left as they come.
    pub fn workspace_with(&self, gpu: &Gpu, batch: usize, poison: bool) -> Result<Workspace<W>> {
        let plan = self.plan(gpu, batch);
        let n = self.gemm_width();
        let new = |shape: &[usize]| if poison { gpu.poisoned(shape) } else { gpu.alloc(shape) };
        // A 16-bit block's BatchNorm forward writes its own FP32 input (`block_half.rs`).
        let half_batch_norm = self.batch_norm.is_some() && W::DTYPE != Dtype::F32;
        let z = match plan {
            _ if half_batch_norm => None,
            Plan::Fused | Plan::Gemv { chain: true, .. } => None,
            Plan::RowPartials => Some(new(&[kernel_abi::epilogue::row_partials(n), batch, 2])?),
            Plan::GemmThenRows { splits: 1 } | Plan::Gemv { chain: false, .. } => Some(new(&[batch, n])?),
            Plan::GemmThenRows { splits } => Some(new(&[splits, batch, n])?),
            // (3-D: the split-K sums' second kernel takes it as one range.)
            Plan::RowDot => Some(new(&[1, batch, n])?),
        };
        let y_shape = [batch, self.out_width()];
        let y = if poison { gpu.poisoned_as::<W>(&y_shape)? } else { gpu.alloc_as::<W>(&y_shape)? };
        Ok(Workspace { plan, z, y, stats: None })
    }

    /// Split-K's partial products `z (splits, batch, n)` added with the bias `b`, then
    /// the chain, into `y` ([`dispatch::split_sums`]).
    pub(super) fn add_split_sums<T: DeviceElement>(
        &self,
        gpu: &Gpu,
        z: &DeviceTensor,
        b: VectorArg<'_>,
        y: &mut DeviceTensor<T>,
        save: Option<&mut DeviceTensor>,
    ) -> Result<()> {
        match dispatch::split_sums(self.not_fusable.is_none()) {
            SplitSums::Tiles => epilogue_split_tiles(gpu, Some(&self.chain), z, Some(b), y, save),
            SplitSums::Rows => epilogue_rows(gpu, &self.chain, z, Some(b), y, save),
        }
    }

    /// Whether the chain backward runs tile-wise ([`dispatch::tile_backward`]).
    pub(super) fn tile_backward(&self) -> bool {
        dispatch::tile_backward(self.not_fusable.is_none(), tiles_fit(&self.chain))
    }
}

impl<W: DeviceElement> GpuBlock<W> {
    /// The forward on FP32 operands `x` and `(w, b)` (the block's, or a bf16 block's
    /// widened copies) as `plan` says, into the FP32 `y`, its GEMM in `precision`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn forward_f32(
        &self,
        gpu: &Gpu,
        precision: Precision,
        x: &DeviceTensor,
        (w, b): (&DeviceTensor, VectorArg<'_>),
        (plan, mut z): (&Plan, Option<&mut DeviceTensor>),
        y: &mut DeviceTensor,
        save: Option<&mut DeviceTensor>,
    ) -> Result<()> {
        if let Plan::Gemv { chain, tensor_cores } = *plan {
            let kernel = dispatch::gemv_kernel(Dtype::F32, Dtype::F32, precision, tensor_cores);
            return match (chain, z) {
                (true, _) => launch_gemv(gpu, kernel, x, w, Some(b), Some(&self.chain), y, save),
                (false, Some(z)) => {
                    launch_gemv(gpu, kernel, x, w, Some(b), None, z, None)?;
                    epilogue_rows(gpu, &self.chain, z, None, y, save)
                }
                (false, None) => unreachable!("workspace() allocates z for this plan"),
            };
        }
        if let (Plan::RowDot, Some(z)) = (plan, z.as_deref_mut()) {
            dot::row_dot(gpu, x, w, z)?;
            return self.add_split_sums(gpu, z, b, y, save);
        }
        let mut gemm = forward_gemm(precision, x, w)?;
        gemm.w_fp8 = self.fp8_weight(w).map(|c| &c.rows);
        match (plan, z) {
            (Plan::Fused, _) => {
                gemm.bias = Some(b);
                gemm.chain = Some(&self.chain);
                gemm.launch(gpu, y, save)
            }
            (Plan::RowPartials, Some(parts)) => {
                let Some(rp) = &self.row_partials else {
                    return Err(Error::Unsupported("row partials for a chain without one reduction".into()));
                };
                gemm.bias = Some(b);
                if gemm.route(gpu.tuning()).family != Family::Tma {
                    // (The plan saw the TMA kernels; these operands take another GEMM.)
                    let mut z = gpu.alloc(&[x.shape[0], self.gemm_width()])?;
                    gemm.launch(gpu, &mut z, None)?;
                    return epilogue_rows(gpu, &self.chain, &z, None, y, save);
                }
                gemm.chain = Some(&rp.head);
                gemm.launch(gpu, parts, save)?;
                partials::row_partials_finish(gpu, parts, self.gemm_width(), (&rp.head, &rp.tail), y)
            }
            (Plan::GemmThenRows { splits: 1 }, Some(z)) => {
                gemm.bias = Some(b);
                gemm.launch(gpu, z, None)?;
                epilogue_rows(gpu, &self.chain, z, None, y, save)
            }
            (Plan::GemmThenRows { splits }, Some(z)) => {
                gemm.splits = *splits;
                gemm.launch(gpu, z, None)?;
                self.add_split_sums(gpu, z, b, y, save)
            }
            (Plan::GemmThenRows { .. } | Plan::RowPartials, None) => {
                unreachable!("workspace() allocates z for this plan")
            }
            (Plan::Gemv { .. } | Plan::RowDot, _) => unreachable!("returned above"),
        }
    }

    /// The same FP8 block with its weight already quantised by the caller (a framework's
    /// cache of [`fp8::quantise_weight`] of this weight). Not for a folded AvgPool's
    /// weight, which the block derives itself.
    pub fn with_fp8_weight(mut self, weight: Fp8Weight) -> Result<GpuBlock<W>> {
        let (n, k) = (self.spec.out_features, self.spec.in_features);
        if !self.precision.is_fp8() || self.folded.is_some() {
            return Err(Error::Unsupported(format!(
                "a quantised weight for a block in {} {}",
                self.precision,
                if self.folded.is_some() { "with a folded AvgPool" } else { "(not fp8)" }
            )));
        }
        let (r, t) = (&weight.rows, &weight.rows_t);
        if (r.rows, r.cols, r.pitch) != (n, k, k)
            || (t.rows, t.cols, t.pitch) != (k, n, n)
            || weight.dz_scales.len() != n
        {
            return Err(Error::tensor(
                "fp8 weight",
                format!("quantised copies of {}x{} and {}x{} for a weight of {n}x{k}", r.rows, r.cols, t.rows, t.cols),
            ));
        }
        let source = self.params.linear_weight.buf.device_address();
        self.fp8 = Some(Fp8Cache { source, weight });
        Ok(self)
    }

    /// The forward's FP8 copy of the GEMM's weight `w`: the block's cache where it was
    /// made from `w`, else quantised now and kept in `made`.
    pub(super) fn fp8_rows<'a, T: DeviceElement>(
        &'a self,
        gpu: &Gpu,
        w: &DeviceTensor<T>,
        made: &'a mut Option<Fp8Matrix>,
    ) -> Result<&'a Fp8Matrix> {
        self.fp8_cached(w, made, |c| &c.rows, || fp8::quantise_rows(gpu, gpu.stream(), w, "lin.weight"))
    }

    /// Every FP8 copy of the GEMM's weight `w` (`dX` needs them): the block's cache where
    /// it was made from `w`, else quantised now and kept in `made`.
    pub(super) fn fp8_whole<'a, T: DeviceElement>(
        &'a self,
        gpu: &Gpu,
        w: &DeviceTensor<T>,
        made: &'a mut Option<Fp8Weight>,
    ) -> Result<&'a Fp8Weight> {
        self.fp8_cached(w, made, |c| c, || fp8::quantise_weight(gpu, gpu.stream(), w, "lin.weight"))
    }

    /// `pick` of the cached FP8 weight where it was made from `w`, else `make()`'s, kept in `made`.
    fn fp8_cached<'a, T, M>(
        &'a self,
        w: &DeviceTensor<T>,
        made: &'a mut Option<M>,
        pick: fn(&Fp8Weight) -> &M,
        make: impl FnOnce() -> Result<M>,
    ) -> Result<&'a M> {
        match self.fp8_weight(w) {
            Some(c) => Ok(pick(c)),
            None => Ok(made.insert(make()?)),
        }
    }

    /// The cached FP8 weight, if it was quantised from `w` (the GEMM's weight).
    pub(super) fn fp8_weight<T>(&self, w: &DeviceTensor<T>) -> Option<&Fp8Weight> {
        self.fp8.as_ref().filter(|c| c.source == w.buf.device_address()).map(|c| &c.weight)
    }

    /// Where the small gradients lie in the chain backward's `slots`, as `(offset, len)`
    /// in values: the Linear bias's, then each op parameter's in chain order. `None`
    /// where an AvgPool is folded: the bias's gradient is then spread back by a kernel
    /// ([`GpuBlock::small_grads`] does it).
    pub fn small_grad_slots(&self) -> Option<Vec<(usize, usize)>> {
        if self.folded.is_some() {
            return None;
        }
        let n = self.gemm_width();
        let mut places = vec![(0, n)];
        for (i, op) in self.spec.chain.0.iter().enumerate().skip(self.first_op) {
            let f = self.spec.features_at(i);
            for _ in op.param_bases() {
                places.push((places.len() * n, f));
            }
        }
        Some(places)
    }

    /// Whether the chain backward writes the small gradients into their own vectors
    /// (`GradOuts`): tile-wise, the block's own parameters (no folded AvgPool).
    pub fn writes_small_grads(&self) -> bool {
        self.batch_norm.is_none() && self.tile_backward() && self.folded.is_none()
    }

    /// Whether the backward reads the bias and chain vectors as the block holds them:
    /// where its chain backward runs tile-wise on vectors of the block's own type.
    /// Otherwise a 16-bit model's are widened per launch, or better by its caller, once.
    pub fn backward_reads_params_as_stored(&self) -> bool {
        self.batch_norm.is_none() && self.tile_backward() && self.chain.params_stored_as(W::DTYPE)
    }

    /// The small gradients as [`GpuBlock::small_grads`] gives them, in FP32: new vectors
    /// the chain backward writes into where it can ([`GpuBlock::writes_small_grads`]),
    /// with the `outs` and `small` that [`GpuBlock::backward_parts`] takes for them.
    #[allow(clippy::type_complexity)]
    pub fn small_grads_by_backward(
        &self,
        gpu: &Gpu,
    ) -> Result<(
        Option<GradOuts>,
        impl FnOnce(&Self, &Gpu, Option<&DeviceTensor>) -> Result<(DeviceTensor, Vec<Vec<DeviceTensor>>)> + use<W>,
    )> {
        let mut made = None;
        let mut outs = None;
        if let Some(places) = self.small_grad_slots().filter(|_| self.writes_small_grads()) {
            let vectors = places.iter().map(|&(_, len)| gpu.alloc(&[len])).collect::<Result<Vec<_>>>()?;
            // SAFETY: each a new vector of its length, kept (in `made`) by the closure the
            // caller runs after the backward.
            outs = unsafe { GradOuts::new(vectors.iter().map(|v| (VectorWord::of_f32(&v.buf), v.len()))) };
            made = outs.as_ref().map(|_| vectors);
        }
        let small = move |block: &Self, gpu: &Gpu, slots: Option<&DeviceTensor>| match (slots, made) {
            (Some(slots), _) => block.small_grads(gpu, slots),
            (None, Some(vectors)) => {
                let mut it = vectors.into_iter();
                let db = it.next().ok_or_else(|| Error::Shape("no bias gradient".into()))?;
                let mut ops: Vec<Vec<DeviceTensor>> = (0..block.first_op).map(|_| Vec::new()).collect();
                for op in block.spec.chain.0.iter().skip(block.first_op) {
                    ops.push(
                        op.param_bases()
                            .iter()
                            .map(|_| it.next())
                            .collect::<Option<Vec<_>>>()
                            .ok_or_else(|| Error::Shape("fewer gradient vectors than chain parameters".into()))?,
                    );
                }
                Ok((db, ops))
            }
            (None, None) => Err(Error::Shape("the chain backward kept no gradient sums".into())),
        };
        Ok((outs, small))
    }

    /// The bias's and the chain parameters' gradients from the chain backward's sums
    /// `slots` (slot 0: the GEMM's bias; then each op parameter in chain order), spread
    /// back over the unfolded bias where an AvgPool was folded.
    pub fn small_grads(&self, gpu: &Gpu, slots: &DeviceTensor) -> Result<(DeviceTensor, Vec<Vec<DeviceTensor>>)> {
        let n = self.gemm_width();
        // Each gradient in a buffer of its own (the caller hands them out separately),
        // all copied out of `slots` by one launch.
        let mut copies = Vec::new();
        let mut slot = |s: usize, len: usize| -> Result<DeviceTensor> {
            let out = gpu.alloc(&[len])?;
            let src = slots.buf.device_address() + (s * n * 4) as u64;
            copies.push(Vector { src, dst: out.buf.device_address(), len, mode: Convert::F32 });
            Ok(out)
        };
        let db = slot(0, n)?;
        let mut ops: Vec<Vec<DeviceTensor>> = (0..self.first_op).map(|_| Vec::new()).collect();
        let mut s = 1;
        for (i, op) in self.spec.chain.0.iter().enumerate().skip(self.first_op) {
            let f = self.spec.features_at(i);
            let mut grads = Vec::new();
            for _ in op.param_bases() {
                grads.push(slot(s, f)?);
                s += 1;
            }
            ops.push(grads);
        }
        if slots.len() < s * n {
            return Err(Error::Shape(format!("{} gradient slots of {n} in {} values", s, slots.len())));
        }
        // SAFETY: every source lies inside `slots` (checked above), every destination is
        // a new buffer of its vector's length; both outlive the launch (stream order).
        unsafe { convert_vectors(gpu, gpu.stream(), &copies)? };
        let Some(f) = &self.folded else { return Ok((db, ops)) };
        // Folded: the bias's gradient spread back over the features, and the same for
        // each leading `bias` op folded with it (`dispatch::Fold::biases`).
        let unfold = |db: &DeviceTensor| unfold_rows_mean_grad::<f32>(gpu, db, self.spec.out_features, f.pool);
        let biases = dispatch::fold(&self.spec).map_or(0, |f| f.biases);
        for grads in &mut ops[..biases] {
            *grads = vec![unfold(&db)?];
        }
        Ok((unfold(&db)?, ops))
    }
}

impl GpuBlock {
    /// Weight and bias of the GEMM the kernels run (folded or the block's own).
    fn gemm_params(&self) -> Result<(&DeviceTensor, VectorArg<'_>)> {
        match &self.folded {
            Some(Folded { weight: FoldedWeight::Means(w), bias, .. }) => Ok((w, VectorArg::f32(bias))),
            // (`fold` gives an FP32 block its means.)
            Some(Folded { weight: FoldedWeight::Halves(..), .. }) => {
                Err(Error::Unsupported("an FP32 block's folded weight in 16-bit halves".into()))
            }
            None => Ok((&self.params.linear_weight, self.params.linear_bias.arg()?)),
        }
    }

    /// Queues the forward of `x` into `ws.y`; with `save`, also writes the chain's
    /// input there (the backward's saved state).
    pub fn forward_into(
        &self,
        gpu: &Gpu,
        x: &DeviceTensor,
        ws: &mut Workspace,
        save: Option<&mut DeviceTensor>,
    ) -> Result<()> {
        if x.shape.get(1) != Some(&self.spec.in_features) || x.shape.first() != ws.y.shape.first() {
            return Err(Error::tensor("x", format!("shape {:?} does not fit this workspace", x.shape)));
        }
        if let Some(bn) = self.batch_norm {
            self.spec.check_batch(x.shape[0])?;
            ws.stats = Some(self.forward_batch_norm(gpu, x, ws, save, bn)?);
            return Ok(());
        }
        self.forward_f32(gpu, self.precision, x, self.gemm_params()?, (&ws.plan, ws.z.as_mut()), &mut ws.y, save)
    }

    /// Uploads `x`, runs the block and downloads the output (shape as the CPU reference's).
    pub fn forward(&self, gpu: &Gpu, x: &Tensor<f32>) -> Result<Tensor<f32>> {
        let batch = self.spec.check_input(x)?;
        let dx = gpu.upload(x)?;
        let mut ws = self.workspace(gpu, batch)?;
        self.forward_into(gpu, &dx, &mut ws, None)?;
        gpu.download(&ws.y)?.reshape(&self.spec.output_shape(batch))
    }

    /// The forward of a training step: the output `(batch, features out)` and what the
    /// backward needs. `poison` NaN-fills the buffers first (for checks).
    pub fn forward_train(&self, gpu: &Gpu, x: &DeviceTensor, poison: bool) -> Result<(DeviceTensor, Saved)> {
        let (y, saved, stats) = self.forward_train_stats(gpu, x, poison)?;
        // A BatchNorm's backward reads the forward's statistics.
        Ok((y, saved.with_batch_stats(stats)))
    }

    /// [`GpuBlock::forward_train`] and a BatchNorm's batch statistics ([`Workspace::stats`]).
    pub fn forward_train_stats(
        &self,
        gpu: &Gpu,
        x: &DeviceTensor,
        poison: bool,
    ) -> Result<(DeviceTensor, Saved, Option<DeviceTensor>)> {
        let batch = x.shape[0];
        let mut ws = self.workspace_with(gpu, batch, poison)?;
        let shape = [batch, self.gemm_width()];
        let mut z = if poison { gpu.poisoned(&shape)? } else { gpu.alloc(&shape)? };
        self.forward_into(gpu, x, &mut ws, Some(&mut z))?;
        Ok((ws.y, Saved { z, refined: false, own: true, batch_stats: None }, ws.stats))
    }

    /// Recomputes exactly the chunks of the saved `z` where its rounding could flip a
    /// kink's derivative in the backward (once; [`GpuBlock::backward`] calls it), as
    /// `gpu`'s tuning allows ([`Tuning::kink_refinement`](super::Tuning::kink_refinement),
    /// [`Tuning::kink_values`](super::Tuning::kink_values)). Returns what was done.
    pub fn refine_saved(&self, gpu: &Gpu, x: &DeviceTensor, saved: &mut Saved) -> Result<Refined> {
        let tuning = gpu.tuning();
        // (Not in FP8: its `z` is a quantised product, percents off; its gradients are
        // that product's, as in the emulation and torchao's recipes.)
        if saved.refined || !tuning.kink_refinement || self.precision.is_fp8() {
            return Ok(Refined::Off);
        }
        let scan = if self.tile_backward() { Scan::Tiles { values: tuning.kink_values } } else { Scan::Rows };
        if !saved.own && scanned_prefix(&self.chain.ops, self.gemm_width()) > 0 {
            saved.z = gpu.copy_range(&saved.z, 0..saved.z.len())?.reshape(&saved.z.shape)?;
            saved.own = true;
        }
        let done = refine_near_kinks(gpu, &self.chain, scan, self.precision, x, self.gemm_params()?, &mut saved.z)?;
        saved.refined = true;
        if done == Refined::Done {
            // The forward's batch statistics are of the unrefined z: the backward takes
            // them again from the z it differentiates at.
            saved.batch_stats = None;
        }
        Ok(done)
    }

    /// Gradients of the input and of every parameter, given the gradient `dy` of the
    /// output (shaped `(batch, features out)` or as `output_shape`), the input `x` the
    /// forward saw and its saved state.
    pub fn backward(&self, gpu: &Gpu, x: &DeviceTensor, saved: Saved, dy: &DeviceTensor) -> Result<DeviceGrads> {
        self.backward_timed(gpu, x, saved, dy, None)
    }

    /// [`GpuBlock::backward`], marking its phases on `phases` if given.
    pub fn backward_timed(
        &self,
        gpu: &Gpu,
        x: &DeviceTensor,
        saved: Saved,
        dy: &DeviceTensor,
        phases: Option<&mut Phases>,
    ) -> Result<DeviceGrads> {
        let (outs, small) = self.small_grads_by_backward(gpu)?;
        let (dx, dw, (db, ops)) = self.backward_parts(gpu, x, saved, dy, phases, outs.as_ref(), small)?;
        Ok(DeviceGrads { x: input_grad(dx)?, params: DeviceParams { linear_weight: dw, linear_bias: db, ops } })
    }

    /// The backward up to the small gradients: `dX` (`None` where the block computes
    /// none: [`GpuBlock::with_input_grad`]), `dW`, and what `small` makes of the
    /// chain backward's parameter-gradient slots (see [`GpuBlock::small_grad_slots`]):
    /// [`GpuBlock::small_grads`], or a framework's own tensors in its parameters' dtypes.
    /// Where the chain backward runs tile-wise ([`GpuBlock::writes_small_grads`]) it
    /// writes them into `outs` itself and `small` gets no slots.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_parts<S>(
        &self,
        gpu: &Gpu,
        x: &DeviceTensor,
        mut saved: Saved,
        dy: &DeviceTensor,
        mut phases: Option<&mut Phases>,
        outs: Option<&GradOuts>,
        small: impl FnOnce(&Self, &Gpu, Option<&DeviceTensor>) -> Result<S>,
    ) -> Result<(Option<DeviceTensor>, DeviceTensor, S)> {
        let mut mark = |name| phases.as_deref_mut().map_or(Ok(()), |p| p.mark(gpu, name));
        if self.refine_saved(gpu, x, &mut saved)? == Refined::Done {
            mark("kink refinement")?;
        }
        let (w, _) = self.gemm_params()?;
        let (dz, slots) = if let Some(bn) = self.batch_norm {
            let (dz, slots) = match self.backward_batch_norm(gpu, (&saved.z, saved.batch_stats.as_ref()), dy, bn)? {
                Some(done) => done,
                None => self.backward_batch_norm_rows(gpu, (&saved.z, saved.batch_stats.as_ref()), dy, bn)?,
            };
            (dz, Some(slots))
        } else if self.tile_backward() {
            epilogue_tiles_backward(gpu, &self.chain, &saved.z, dy, outs.filter(|_| self.writes_small_grads()))?
        } else {
            let (dz, slots) = epilogue_rows_backward(gpu, &self.chain, &saved.z, dy, self.out_width())?;
            (dz, Some(slots))
        };
        drop(saved);
        mark("chain backward")?;
        if let Some((dx, dw)) = self.row_dot_grads(gpu, x, &dz)? {
            drop(dz);
            mark("dX and dW")?;
            let small = small(self, gpu, slots.as_ref())?;
            mark("gradient bookkeeping")?;
            return Ok((dx, dw, small));
        }
        // dW on the side stream, overlapping dX: each GEMM's last, partial wave of
        // tiles leaves SMs idle that the other fills. The main stream waits for the side
        // stream before anything after (dz's and the dW scratch's frees included) is queued.
        let side = gpu.side_stream();
        let (dw, dw_scratch) = grad_weight(gpu, self.precision, side, &dz, x)?;
        let dx = match self.fp8_weight(w) {
            _ if !self.input_grad => None,
            Some(c) if self.precision.is_fp8() => Some(grad_input_fp8(gpu, &dz, w, Some(c))?),
            _ => Some(grad_input(gpu, self.precision, &dz, w)?),
        };
        gpu.order(side, gpu.stream())?;
        mark("dX and dW GEMMs")?;
        drop((dz, dw_scratch));

        let dw = match &self.folded {
            Some(f) => unfold_rows_mean_grad::<f32>(gpu, &dw, self.spec.out_features, f.pool)?,
            None => dw,
        };
        let small = small(self, gpu, slots.as_ref())?;
        mark("gradient bookkeeping")?;
        Ok((dx, dw, small))
    }
}

/// Host-side results of [`GpuBlock::forward_backward`].
pub struct HostGrads {
    pub y: Tensor<f32>,
    pub x: Tensor<f32>,
    pub params: Params<f32>,
    /// The Linear output the forward saved and the backward used (after any refinement
    /// near kinks), `(batch, GEMM width)` (the pooled width where AvgPool is folded
    /// into the weights).
    pub z: Tensor<f32>,
}

impl HostGrads {
    /// These gradients against `want` (the f64 reference's), each by name: `x` first,
    /// then the parameters in [`BlockSpec::param_specs`] order.
    pub fn compare(&self, spec: &BlockSpec, want: &BlockGrads<f64>) -> Vec<(String, Comparison)> {
        let mut c = vec![("x".to_string(), compare_f32(self.x.data(), want.x.data()))];
        for ((s, g), w) in spec.param_specs().iter().zip(self.params.flat()).zip(want.params.flat()) {
            c.push((s.name.clone(), compare_f32(g.data(), w.data())));
        }
        c
    }
}

impl GpuBlock {
    /// Uploads `x` and `dy` (the output's gradient, shaped as the output), runs the
    /// training forward and the backward, and downloads the output and all gradients.
    pub fn forward_backward(&self, gpu: &Gpu, x: &Tensor<f32>, dy: &Tensor<f32>) -> Result<HostGrads> {
        let batch = self.spec.check_input(x)?;
        let out_shape = self.spec.output_shape(batch);
        if dy.shape() != out_shape.as_slice() {
            return Err(Error::tensor("dy", format!("expected shape {out_shape:?}, got {:?}", dy.shape())));
        }
        let dx = gpu.upload(x)?;
        let (y, mut saved) = self.forward_train(gpu, &dx, true)?;
        self.refine_saved(gpu, &dx, &mut saved)?;
        let z = gpu.download(&saved.z)?;
        let g = self.backward(gpu, &dx, saved, &gpu.upload(dy)?)?;
        Ok(HostGrads {
            y: gpu.download(&y)?.reshape(&out_shape)?,
            x: gpu.download(&g.x)?,
            params: g.params.download(gpu, &self.spec)?,
            z,
        })
    }
}

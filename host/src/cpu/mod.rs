//! The CPU backend: a block's forward and backward in f32, on every core.
//!
//! * The GEMMs (`x W^T`, and in the backward `dz W` and `dz^T x`) run on the `gemm`
//!   crate, whose kernels pick AVX2/AVX-512/NEON at run time, threaded on rayon's
//!   global pool (`RAYON_NUM_THREADS` sets its size). See `matmul.rs`.
//! * The forward computes the Linear output (in row panels when it is large, for
//!   progress) and runs the epilogue chain on each panel's rows in parallel
//!   (`epilogue.rs`: every op's f32 math). The backward recomputes each row's chain from the saved
//!   Linear output `z`, back-propagates it to `dz` (summing the chain parameters'
//!   gradients over rows in f32, tree-wise), then runs the two GEMMs.
//! * Precision: [`Precision::Fp32`] (the default) is strict FP32, what the CLI and
//!   the Python op run on the CPU whatever their precision. [`Precision::Tf32`] and
//!   [`Precision::Bf16`] / [`Precision::Fp16`] round every GEMM operand as the GPU's
//!   tensor cores take them (TF32: the low 13 mantissa bits dropped; bf16, fp16: to
//!   nearest even, fp16 to infinity beyond 65504 and to subnormals below 2^-14), still summing in
//!   f32: a library option to see those precisions' forward error on the CPU. Their
//!   gradients are those of the rounded `z`: unlike the GPU, this backend does not
//!   recompute in f64 the values of `z` whose rounding could flip a kink (LeakyReLU,
//!   Hardtanh, max), so against the f64 reference M3's and M5's TF32 gradients were
//!   off by 1.6e-2 (tolerance 2e-3). The epilogue is always f32.
//! * [`Precision::Fp8`] emulates Hopper's row-wise FP8 recipe: each GEMM's operands
//!   scaled along the dimensions the product keeps (the forward's `x` per row and `W`
//!   per output channel; `dX = dz W`: the forward's `W`, its scales moved onto `dz`'s
//!   columns, then `dz` per row (`fp8::moved_scales`); `dW = dz^T x`: `dz` per output
//!   feature, `x` per input feature) by a power of two that puts the
//!   largest magnitude in `(224, 448]`, rounded to e4m3, multiplied with f32 sums (a
//!   product of two e4m3 values is exact in f32), the scales then undone (exactly: they
//!   are powers of two) before the bias and the chain. [`Precision::Fp8GwBf16`] takes
//!   `dW`'s operands in bf16 instead. See `crate::fp8` and docs/NUMERICS.md.
//!
//! The backend shares no code with the f64 reference in [`crate::reference`]: the
//! reference is the oracle it is tested against (tests/cpu_backend.rs).

mod batch_norm;
mod epilogue;
mod matmul;
mod progress;

use crate::block::{BlockSpec, Params};
use crate::error::{Error, Result};
use crate::fp8::{self, Axis};
use crate::reference::BlockGrads;
use crate::tape::{Tape, VarId};
use crate::tensor::Tensor;
use epilogue::ChainRows;
use matmul::{MatRef, Tiles, matmul_rows, matmul_tiled};
use progress::Progress;
use rayon::prelude::*;
use std::borrow::Cow;

/// The arithmetic of the CPU backend's GEMMs (the epilogue is always f32).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    /// Strict FP32 products and sums.
    #[default]
    Fp32,
    /// Operands truncated to TF32 (10 mantissa bits, as the tensor cores read FP32
    /// registers), FP32 sums.
    Tf32,
    /// Operands rounded to bf16 (7 mantissa bits, to nearest even), FP32 sums.
    Bf16,
    /// Operands rounded to fp16 (10 mantissa bits, 5 exponent bits, to nearest even,
    /// as `cvt.rn.f16.f32`), FP32 sums.
    Fp16,
    /// Operands scaled row-wise and rounded to e4m3 in every GEMM, FP32 sums, the scales
    /// undone after (module docs).
    Fp8,
    /// [`Precision::Fp8`], but `dW`'s operands rounded to bf16 (unscaled), FP32 sums.
    Fp8GwBf16,
}

impl Precision {
    /// The CPU emulation of a GEMM precision the CLI or the Python package asks for:
    /// FP8's, or `None` for the others, which the CPU runs in FP32 (the GPU's roundings
    /// are a library option here, held to their own tolerances in the tests).
    pub fn emulating(p: crate::precision::Precision) -> Option<Precision> {
        match p {
            crate::precision::Precision::Fp8 => Some(Precision::Fp8),
            crate::precision::Precision::Fp8GwBf16 => Some(Precision::Fp8GwBf16),
            _ => None,
        }
    }

    /// `v` as this precision's GEMMs take it (NaN stays NaN, infinities stay). For FP8
    /// this is the e4m3 rounding alone: the GEMMs scale each row or column first.
    pub fn round(self, v: f32) -> f32 {
        if v.is_nan() {
            return v;
        }
        let bits = v.to_bits();
        match self {
            Precision::Fp32 => v,
            Precision::Tf32 => f32::from_bits(bits & 0xffff_e000),
            // Cannot overflow: the largest non-NaN pattern is 0xff80_0000.
            Precision::Bf16 => f32::from_bits((bits + 0x7fff + ((bits >> 16) & 1)) & 0xffff_0000),
            Precision::Fp16 => crate::tensor::F16::from_f32(v).to_f32(),
            Precision::Fp8 | Precision::Fp8GwBf16 => fp8::E4M3.round(v),
        }
    }
}

/// How a call runs.
#[derive(Clone, Debug, Default)]
pub struct Options {
    pub precision: Precision,
    /// Shows a progress line on stderr under this label once the work has taken a
    /// second and looks like taking two or more; `None` prints nothing.
    pub progress: Option<String>,
}

impl Options {
    pub fn new(precision: Precision) -> Self {
        Options { precision, progress: None }
    }

    pub fn with_progress(mut self, label: &str) -> Self {
        self.progress = Some(label.to_string());
        self
    }
}

/// Threads the backend runs on (rayon's global pool).
pub fn threads() -> usize {
    rayon::current_num_threads()
}

/// One line saying what computes: for the CLI's summaries.
pub fn describe(precision: Precision) -> String {
    let gemm = match precision {
        Precision::Fp32 => "f32 GEMMs",
        Precision::Tf32 => "f32 GEMMs of TF32-rounded operands",
        Precision::Bf16 => "f32 GEMMs of bf16-rounded operands",
        Precision::Fp16 => "f32 GEMMs of fp16-rounded operands",
        Precision::Fp8 => "f32 GEMMs of e4m3 operands with row-wise scales (fp8 emulated)",
        Precision::Fp8GwBf16 => "f32 GEMMs of e4m3 operands with row-wise scales, dW of bf16 ones (fp8 emulated)",
    };
    let threads = match threads() {
        1 => "1 thread".to_string(),
        n => format!("{n} threads"),
    };
    format!("{gemm} (gemm crate, {threads}), f32 epilogue")
}

/// The block's output for input `x` (inference).
pub fn forward(spec: &BlockSpec, x: &Tensor<f32>, params: &Params<f32>, opts: &Options) -> Result<Tensor<f32>> {
    let mut progress = Progress::new(opts.progress.as_deref(), spec.forward_flops(x.rows()));
    Ok(forward_impl(spec, x, params, opts.precision, false, &mut progress)?.0)
}

/// [`forward`] and the Linear output `z` `(batch, out)`: what [`backward_at`] takes.
pub fn forward_saving(
    spec: &BlockSpec,
    x: &Tensor<f32>,
    params: &Params<f32>,
    opts: &Options,
) -> Result<(Tensor<f32>, Tensor<f32>)> {
    let mut progress = Progress::new(opts.progress.as_deref(), spec.forward_flops(x.rows()));
    let (y, z) = forward_impl(spec, x, params, opts.precision, true, &mut progress)?;
    Ok((y, z.expect("kept when asked for")))
}

/// Gradients of `L = sum(y * dy)` with respect to `x` and every parameter, given the
/// Linear output `z` that [`forward_saving`] returned for the same `x` and `params`.
pub fn backward_at(
    spec: &BlockSpec,
    x: &Tensor<f32>,
    params: &Params<f32>,
    dy: &Tensor<f32>,
    z: &Tensor<f32>,
    opts: &Options,
) -> Result<BlockGrads<f32>> {
    let mut progress = Progress::new(opts.progress.as_deref(), 2.0 * spec.forward_flops(x.rows()));
    backward_impl(spec, x, params, dy, z, opts.precision, &mut progress)
}

/// Output and gradients: [`forward_saving`] then [`backward_at`], under one progress line.
pub fn backward(
    spec: &BlockSpec,
    x: &Tensor<f32>,
    params: &Params<f32>,
    dy: &Tensor<f32>,
    opts: &Options,
) -> Result<(Tensor<f32>, BlockGrads<f32>)> {
    let batch = spec.check_input(x)?;
    check_dy(spec, batch, dy)?;
    let mut progress = Progress::new(opts.progress.as_deref(), 3.0 * spec.forward_flops(batch));
    let (y, z) = forward_impl(spec, x, params, opts.precision, true, &mut progress)?;
    let z = z.expect("kept when asked for");
    let grads = backward_impl(spec, x, params, dy, &z, opts.precision, &mut progress)?;
    Ok((y, grads))
}

/// The block's forward recorded on `tape` as one node (inputs: `x_var`, then
/// `param_vars` in [`Params::flat`] order), as [`crate::reference::block_forward_taped`]
/// records the reference's: the tape's backward then runs [`backward_at`].
pub fn block_forward_taped(
    tape: &mut Tape<Tensor<f32>>,
    spec: &BlockSpec,
    x: &Tensor<f32>,
    x_var: VarId,
    params: &Params<f32>,
    param_vars: &[VarId],
    opts: &Options,
) -> Result<(Tensor<f32>, VarId)> {
    let n_params = params.flat().len();
    if param_vars.len() != n_params {
        return Err(Error::Argument(format!(
            "the block has {n_params} parameters, got {} tape variables for them",
            param_vars.len()
        )));
    }
    let (y, z) = forward_saving(spec, x, params, opts)?;
    let mut inputs = vec![x_var];
    inputs.extend_from_slice(param_vars);
    let (spec, x, params, opts) = (spec.clone(), x.clone(), params.clone(), opts.clone());
    let var = tape.record(&inputs, move |dy: Tensor<f32>| {
        let g = backward_at(&spec, &x, &params, &dy, &z, &opts)?;
        let p = g.params;
        let grads = [g.x, p.linear_weight, p.linear_bias].into_iter().chain(p.ops.into_iter().flatten());
        Ok(grads.map(Some).collect())
    });
    Ok((y, var))
}

/// Checks that `params` fit `spec`: one list per op, each op's count, every shape.
fn check_params(spec: &BlockSpec, params: &Params<f32>) -> Result<()> {
    let ops = &spec.chain.0;
    if params.ops.len() != ops.len() {
        return Err(Error::Shape(format!(
            "the chain `{}` has {} ops, the parameters have {} op entries",
            spec.chain,
            ops.len(),
            params.ops.len()
        )));
    }
    for (i, (op, p)) in ops.iter().zip(&params.ops).enumerate() {
        if p.len() != op.param_bases().len() {
            return Err(Error::Shape(format!(
                "op {} (`{op}`) takes {} parameter(s), got {}",
                i + 1,
                op.param_bases().len(),
                p.len()
            )));
        }
    }
    for (s, t) in spec.param_specs().iter().zip(params.flat()) {
        if t.shape() != s.shape.as_slice() {
            return Err(Error::tensor(&s.name, format!("expected shape {:?}, got {:?}", s.shape, t.shape())));
        }
    }
    Ok(())
}

fn check_dy(spec: &BlockSpec, batch: usize, dy: &Tensor<f32>) -> Result<()> {
    let want = spec.output_shape(batch);
    if dy.shape() != want.as_slice() {
        return Err(Error::tensor("dy", format!("expected the block's output shape {want:?}, got {:?}", dy.shape())));
    }
    Ok(())
}

/// The chain of `spec` with `params` (checked) as slices.
fn chain_rows<'a>(spec: &'a BlockSpec, params: &'a Params<f32>) -> ChainRows<'a> {
    let ops = &spec.chain.0;
    ChainRows {
        ops,
        params: params.ops.iter().map(|p| p.iter().map(Tensor::data).collect()).collect(),
        features: (0..=ops.len()).map(|i| spec.features_at(i)).collect(),
    }
}

/// A GEMM operand as `precision` takes it: the data itself for FP32, else a rounded copy.
/// (FP8 operands are scaled first: [`Operand::new`].)
fn operand(data: &[f32], precision: Precision) -> Cow<'_, [f32]> {
    match precision {
        Precision::Fp32 => Cow::Borrowed(data),
        p => Cow::Owned(data.par_iter().map(|&v| p.round(v)).collect()),
    }
}

/// A GEMM operand, the row-major `rows x cols` matrix as stored, as the GEMM takes it:
/// rounded as [`operand`] does, or for FP8 scaled along `axis` and rounded to e4m3,
/// with its scales (the product is then divided by them: [`fp8::unscale`]).
struct Operand<'a> {
    values: Cow<'a, [f32]>,
    scales: Option<Vec<f32>>,
}

impl<'a> Operand<'a> {
    fn new(data: &'a [f32], (rows, cols): (usize, usize), axis: Axis, precision: Precision) -> Self {
        match precision {
            Precision::Fp8 | Precision::Fp8GwBf16 => {
                let q = fp8::quantise(data, rows, cols, axis, fp8::E4M3);
                Operand { values: Cow::Owned(q.values), scales: Some(q.scales) }
            }
            p => Operand { values: operand(data, p), scales: None },
        }
    }
}

/// Divides the rows `r0..` of a product of `a` (scaled per row of the product) and `b`
/// (per column) by their scales, where they were scaled (FP8).
fn unscale(dst: &mut [f32], a: &Operand<'_>, r0: usize, b: &Operand<'_>) {
    if let (Some(sa), Some(sb)) = (&a.scales, &b.scales) {
        let rows = dst.len() / sb.len().max(1);
        fp8::unscale(dst, &sa[r0..r0 + rows], sb);
    }
}

/// The forward: `z = x W^T + b` in row panels, each panel's rows then through the
/// chain in parallel. Returns `y` (shaped as [`BlockSpec::output_shape`]) and, with
/// `keep_z`, `z`.
fn forward_impl(
    spec: &BlockSpec,
    x: &Tensor<f32>,
    params: &Params<f32>,
    precision: Precision,
    keep_z: bool,
    progress: &mut Progress,
) -> Result<(Tensor<f32>, Option<Tensor<f32>>)> {
    let batch = spec.check_input(x)?;
    check_params(spec, params)?;
    if let Some((k, eps)) = spec.chain.batch_norm() {
        return forward_batch_norm(spec, x, params, precision, (k, eps), progress)
            .map(|(y, z)| (y, keep_z.then_some(z)));
    }
    let (in_f, out_f) = (spec.in_features, spec.out_features);
    let chain = chain_rows(spec, params);
    let out_w = *chain.features.last().expect("features of the input at least");
    let mut y = Tensor::full(&[batch, out_w], 0.0f32)?;
    let mut z = if keep_z { Some(Tensor::full(&[batch, out_f], 0.0f32)?) } else { None };
    // FP8: x per row, W per output channel (its rows: the product's columns).
    let x_op = Operand::new(x.data(), (batch, in_f), Axis::Rows, precision);
    let w_op = Operand::new(params.linear_weight.data(), (out_f, in_f), Axis::Rows, precision);
    let a = MatRef::row_major(&x_op.values, batch, in_f);
    let b = MatRef::row_major(&w_op.values, out_f, in_f).t();
    let tiles = Tiles::new(batch, out_f, in_f);
    // Without `z` to keep, one panel's worth of it is reused.
    let mut panel = if keep_z { Vec::new() } else { Tensor::full(&[tiles.rows, out_f], 0.0f32)?.into_data() };
    let bias = params.linear_bias.data();
    for r0 in (0..batch).step_by(tiles.rows) {
        let r1 = (r0 + tiles.rows).min(batch);
        let zp = match &mut z {
            Some(z) => &mut z.data_mut()[r0 * out_f..r1 * out_f],
            None => &mut panel[..(r1 - r0) * out_f],
        };
        matmul_rows(zp, a, (r0, r1), b, tiles.cols, progress);
        unscale(zp, &x_op, r0, &w_op);
        let yp = &mut y.data_mut()[r0 * out_w..r1 * out_w];
        zp.par_chunks_mut(out_f).zip(yp.par_chunks_mut(out_w)).for_each_init(
            || vec![0.0f32; out_f],
            |row, (zr, yr)| {
                zr.iter_mut().zip(bias).for_each(|(v, &b)| *v += b);
                row.copy_from_slice(zr);
                let n = chain.forward(row);
                yr.copy_from_slice(&row[..n]);
            },
        );
    }
    Ok((y.reshape(&spec.output_shape(batch))?, z))
}

/// `z = x W^T + b` for every row (the BatchNorm's statistics need them all).
fn linear_all(
    spec: &BlockSpec,
    x: &Tensor<f32>,
    params: &Params<f32>,
    precision: Precision,
    progress: &mut Progress,
) -> Result<Tensor<f32>> {
    let batch = x.rows();
    let (in_f, out_f) = (spec.in_features, spec.out_features);
    let mut z = Tensor::full(&[batch, out_f], 0.0f32)?;
    // FP8: x per row, W per output channel (its rows: the product's columns).
    let x_op = Operand::new(x.data(), (batch, in_f), Axis::Rows, precision);
    let w_op = Operand::new(params.linear_weight.data(), (out_f, in_f), Axis::Rows, precision);
    let a = MatRef::row_major(&x_op.values, batch, in_f);
    let b = MatRef::row_major(&w_op.values, out_f, in_f).t();
    let tiles = Tiles::new(batch, out_f, in_f);
    for r0 in (0..batch).step_by(tiles.rows) {
        let r1 = (r0 + tiles.rows).min(batch);
        let zp = &mut z.data_mut()[r0 * out_f..r1 * out_f];
        matmul_rows(zp, a, (r0, r1), b, tiles.cols, progress);
        unscale(zp, &x_op, r0, &w_op);
    }
    let bias = params.linear_bias.data();
    z.data_mut().par_chunks_mut(out_f).for_each(|r| r.iter_mut().zip(bias).for_each(|(v, &b)| *v += b));
    Ok(z)
}

/// The BatchNorm's input `u`: the ops before it (op `k`) on each row of `z`.
fn batch_norm_input(spec: &BlockSpec, params: &Params<f32>, z: &Tensor<f32>, k: usize) -> Result<Tensor<f32>> {
    let before = batch_norm::before(spec, params, k);
    let mut u = z.clone();
    u.data_mut().par_chunks_mut(spec.out_features).for_each(|r| {
        before.forward(r);
    });
    Ok(u)
}

/// The forward of a chain with a BatchNorm (op `k`, `eps`): see `batch_norm.rs`.
fn forward_batch_norm(
    spec: &BlockSpec,
    x: &Tensor<f32>,
    params: &Params<f32>,
    precision: Precision,
    (k, eps): (usize, f32),
    progress: &mut Progress,
) -> Result<(Tensor<f32>, Tensor<f32>)> {
    let batch = x.rows();
    let z = linear_all(spec, x, params, precision, progress)?;
    let f = spec.out_features;
    let u = batch_norm_input(spec, params, &z, k)?;
    let (mean, rstd, _) = batch_norm::stats_f32(u.data(), f, eps);
    let after = batch_norm::after(spec, params, k, &mean, &rstd);
    let out_w = *after.features.last().expect("features of the input at least");
    let mut y = Tensor::full(&[batch, out_w], 0.0f32)?;
    u.data().par_chunks(f).zip(y.data_mut().par_chunks_mut(out_w)).for_each_init(
        || vec![0.0f32; f],
        |row, (ur, yr)| {
            row.copy_from_slice(ur);
            let n = after.forward(row);
            yr.copy_from_slice(&row[..n]);
        },
    );
    Ok((y.reshape(&spec.output_shape(batch))?, z))
}

/// The batch statistics of the BatchNorm of `spec`'s chain at the Linear output `z`
/// (what [`forward_saving`] returned): each feature's mean and biased variance over the
/// rows, or `None` for a chain without one. A caller keeping running statistics
/// (PyTorch's `running_mean`, `running_var`) updates them from these.
pub fn batch_norm_stats(
    spec: &BlockSpec,
    params: &Params<f32>,
    z: &Tensor<f32>,
) -> Result<Option<(Vec<f32>, Vec<f32>)>> {
    let Some((k, _)) = spec.chain.batch_norm() else { return Ok(None) };
    check_params(spec, params)?;
    if z.shape() != [z.rows(), spec.out_features] {
        return Err(Error::tensor("z", format!("expected (batch, {}), got {:?}", spec.out_features, z.shape())));
    }
    let u = batch_norm_input(spec, params, z, k)?;
    let (mean, var) = batch_norm::column_stats(u.data(), spec.out_features);
    Ok(Some((mean.iter().map(|&m| m as f32).collect(), var.iter().map(|&v| v as f32).collect())))
}

/// `dz`, the Linear bias's gradient and the chain parameters' gradients.
type ChainGrads = (Tensor<f32>, Vec<f32>, Vec<Vec<f32>>);

/// `dz`, the Linear bias's gradient and the chain's parameters' gradients of a chain
/// with a BatchNorm (op `k`): see `batch_norm.rs`.
fn dz_batch_norm(
    spec: &BlockSpec,
    params: &Params<f32>,
    dy: &Tensor<f32>,
    z: &Tensor<f32>,
    (k, eps): (usize, f32),
) -> Result<ChainGrads> {
    let (batch, f) = (z.rows(), spec.out_features);
    let u = batch_norm_input(spec, params, z, k)?;
    let (mean, rstd, _) = batch_norm::stats_f32(u.data(), f, eps);
    let after = batch_norm::after(spec, params, k, &mean, &rstd);
    let out_w = *after.features.last().expect("features of the input at least");
    let add = |mut a: Vec<Vec<f32>>, b: Vec<Vec<f32>>| {
        for (sa, sb) in a.iter_mut().zip(&b) {
            sa.iter_mut().zip(sb).for_each(|(s, v)| *s += v);
        }
        a
    };
    // g = d(after)/du at fixed statistics, row by row; dgamma, dbeta and the later ops'
    // parameters' gradients summed over rows.
    let mut g = Tensor::full(&[batch, f], 0.0f32)?;
    let d_after = g
        .data_mut()
        .par_chunks_mut(ROWS_PER_TASK * f)
        .enumerate()
        .map(|(task, g_rows)| {
            let mut dp = after.zero_grads();
            let mut scratch = after.scratch();
            for (j, gr) in g_rows.chunks_exact_mut(f).enumerate() {
                let r = task * ROWS_PER_TASK + j;
                let (ur, dyr) = (&u.data()[r * f..(r + 1) * f], &dy.data()[r * out_w..(r + 1) * out_w]);
                after.backward(ur, dyr, gr, &mut scratch, &mut dp);
            }
            dp
        })
        .reduce(|| after.zero_grads(), add);
    // du = g - gamma rstd (S1 + xhat S2) / N, S1 = dbeta, S2 = dgamma. Over two rows
    // xhat = ±sqrt(1 - eps rstd²) and the formula's 1 - xhat² cancels to noise when the
    // variance dwarfs eps: its exact value eps rstd² instead, du = (g - a S1 / 2) eps rstd².
    let (gamma, s2, s1) = (params.ops[k][0].data(), &d_after[0], &d_after[1]);
    let n = batch as f32;
    g.data_mut().par_chunks_mut(f).zip(u.data().par_chunks(f)).for_each(|(gr, ur)| {
        for c in 0..f {
            let a = gamma[c] * rstd[c];
            if batch == 2 {
                gr[c] = (gr[c] - a * s1[c] * 0.5) * (eps * rstd[c] * rstd[c]);
            } else {
                let xhat = (ur[c] - mean[c]) * rstd[c];
                gr[c] -= a * (s1[c] + xhat * s2[c]) / n;
            }
        }
    });
    // The ops before the BatchNorm, row by row from z; the Linear bias's gradient.
    let before = batch_norm::before(spec, params, k);
    let mut dz = Tensor::full(&[batch, f], 0.0f32)?;
    let zeros = || (vec![0.0f32; f], before.zero_grads());
    let (db, d_before) = dz
        .data_mut()
        .par_chunks_mut(ROWS_PER_TASK * f)
        .enumerate()
        .map(|(task, dz_rows)| {
            let (mut db, mut dp) = zeros();
            let mut scratch = before.scratch();
            for (j, dzr) in dz_rows.chunks_exact_mut(f).enumerate() {
                let r = task * ROWS_PER_TASK + j;
                let (zr, gr) = (&z.data()[r * f..(r + 1) * f], &g.data()[r * f..(r + 1) * f]);
                before.backward(zr, gr, dzr, &mut scratch, &mut dp);
                db.iter_mut().zip(dzr.iter()).for_each(|(s, v)| *s += v);
            }
            (db, dp)
        })
        .reduce(zeros, |a, b| {
            let mut db = a.0;
            db.iter_mut().zip(&b.0).for_each(|(s, v)| *s += v);
            (db, add(a.1, b.1))
        });
    // The statistics' two extra "parameters" of the BatchNorm have no gradient to give.
    let mut dchain = d_before;
    dchain.extend(d_after.into_iter().enumerate().filter(|(i, _)| *i != 2 && *i != 3).map(|(_, g)| g));
    Ok((dz, db, dchain))
}

/// Rows of the chain's backward per task: the parameter gradients are summed over a
/// task's rows in order, then over tasks tree-wise.
const ROWS_PER_TASK: usize = 16;

fn backward_impl(
    spec: &BlockSpec,
    x: &Tensor<f32>,
    params: &Params<f32>,
    dy: &Tensor<f32>,
    z: &Tensor<f32>,
    precision: Precision,
    progress: &mut Progress,
) -> Result<BlockGrads<f32>> {
    let batch = spec.check_input(x)?;
    check_params(spec, params)?;
    check_dy(spec, batch, dy)?;
    let out_f = spec.out_features;
    if z.shape() != [batch, out_f] {
        return Err(Error::tensor(
            "z",
            format!("expected the Linear output's shape [{batch}, {out_f}], got {:?}", z.shape()),
        ));
    }
    if let Some((k, eps)) = spec.chain.batch_norm() {
        let (dz, db, dchain) = dz_batch_norm(spec, params, dy, z, (k, eps))?;
        return finish_backward(spec, x, params, dz, db, dchain, precision, progress);
    }
    let chain = chain_rows(spec, params);
    let out_w = *chain.features.last().expect("features of the input at least");

    // dz, row by row through the chain; dbias and the chain's parameter gradients.
    let mut dz = Tensor::full(&[batch, out_f], 0.0f32)?;
    let zeros = || (vec![0.0f32; out_f], chain.zero_grads());
    let add = |mut a: (Vec<f32>, Vec<Vec<f32>>), b: (Vec<f32>, Vec<Vec<f32>>)| {
        a.0.iter_mut().zip(&b.0).for_each(|(s, v)| *s += v);
        for (sa, sb) in a.1.iter_mut().zip(&b.1) {
            sa.iter_mut().zip(sb).for_each(|(s, v)| *s += v);
        }
        a
    };
    let (db, dchain) = dz
        .data_mut()
        .par_chunks_mut(ROWS_PER_TASK * out_f)
        .enumerate()
        .map(|(task, dz_rows)| {
            let (mut db, mut dp) = zeros();
            let mut scratch = chain.scratch();
            for (j, dzr) in dz_rows.chunks_exact_mut(out_f).enumerate() {
                let r = task * ROWS_PER_TASK + j;
                let (zr, dyr) = (&z.data()[r * out_f..(r + 1) * out_f], &dy.data()[r * out_w..(r + 1) * out_w]);
                chain.backward(zr, dyr, dzr, &mut scratch, &mut dp);
                db.iter_mut().zip(dzr.iter()).for_each(|(s, v)| *s += v);
            }
            (db, dp)
        })
        .reduce(zeros, add);
    finish_backward(spec, x, params, dz, db, dchain, precision, progress)
}

/// The two GEMMs of the backward from `dz`, and every gradient in [`Params`]' layout
/// (`dchain`: the chain's parameters' gradients in order).
#[allow(clippy::too_many_arguments)]
fn finish_backward(
    spec: &BlockSpec,
    x: &Tensor<f32>,
    params: &Params<f32>,
    dz: Tensor<f32>,
    db: Vec<f32>,
    dchain: Vec<Vec<f32>>,
    precision: Precision,
    progress: &mut Progress,
) -> Result<BlockGrads<f32>> {
    let batch = x.rows();
    let (in_f, out_f) = (spec.in_features, spec.out_features);
    // dx = dz W (batch x in), dW = dz^T x (out x in). FP8 scales each operand along the
    // dimension its product keeps: dx takes the forward's W (per row, output channel)
    // with its inverse scales moved onto dz's columns (`fp8::moved_scales`), then dz per
    // row; dW takes dz per column (output feature) and x per column (input feature).
    let mut w_op = Operand::new(params.linear_weight.data(), (out_f, in_f), Axis::Rows, precision);
    let moved: Vec<f32>;
    let dz_rows = match &mut w_op.scales {
        Some(scales) => {
            let (mult, col) = fp8::moved_scales(scales);
            *scales = vec![col; in_f];
            moved = dz.data().chunks_exact(out_f).flat_map(|r| r.iter().zip(&mult).map(|(v, m)| v * m)).collect();
            Operand::new(&moved, (batch, out_f), Axis::Rows, precision)
        }
        None => Operand::new(dz.data(), (batch, out_f), Axis::Rows, precision),
    };
    let mut dx = Tensor::full(&[batch, in_f], 0.0f32)?;
    let (dz_mat, w_mat) =
        (MatRef::row_major(&dz_rows.values, batch, out_f), MatRef::row_major(&w_op.values, out_f, in_f));
    matmul_tiled(dx.data_mut(), dz_mat, w_mat, Tiles::new(batch, in_f, out_f), progress);
    unscale(dx.data_mut(), &dz_rows, 0, &w_op);
    drop(dz_rows);
    let dw_precision = if precision == Precision::Fp8GwBf16 { Precision::Bf16 } else { precision };
    let dz_cols = Operand::new(dz.data(), (batch, out_f), Axis::Cols, dw_precision);
    let x_op = Operand::new(x.data(), (batch, in_f), Axis::Cols, dw_precision);
    let mut dw = Tensor::full(&[out_f, in_f], 0.0f32)?;
    let (dz_mat, x_mat) =
        (MatRef::row_major(&dz_cols.values, batch, out_f), MatRef::row_major(&x_op.values, batch, in_f));
    matmul_tiled(dw.data_mut(), dz_mat.t(), x_mat, Tiles::new(out_f, in_f, batch), progress);
    unscale(dw.data_mut(), &dz_cols, 0, &x_op);

    let mut dchain = dchain.into_iter();
    let ops = params
        .ops
        .iter()
        .map(|p| p.iter().map(|t| Tensor::new(t.shape(), dchain.next().expect("one per parameter"))).collect())
        .collect::<Result<Vec<Vec<_>>>>()?;
    let grads = Params { linear_weight: dw, linear_bias: Tensor::new(&[out_f], db)?, ops };
    Ok(BlockGrads { x: dx, params: grads })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_matches_the_formats() {
        let v = 1.0 + 2f32.powi(-9) + 2f32.powi(-12); // needs 12 mantissa bits
        assert_eq!(Precision::Fp32.round(v), v);
        assert_eq!(Precision::Tf32.round(v), 1.0 + 2f32.powi(-9)); // truncated to 10 bits
        assert_eq!(Precision::Bf16.round(v), 1.0); // 7 bits, nearest
        assert_eq!(Precision::Bf16.round(1.0 + 3.0 * 2f32.powi(-8)), 1.0 + 2f32.powi(-6)); // ties to even
        assert_eq!(Precision::Bf16.round(1.0 + 2f32.powi(-8)), 1.0); // ties to even
        assert!(Precision::Tf32.round(f32::from_bits(0x7f80_0001)).is_nan());
        assert_eq!(Precision::Bf16.round(f32::MAX), f32::INFINITY);
        assert_eq!(Precision::Bf16.round(f32::NEG_INFINITY), f32::NEG_INFINITY);
        // fp16: 10 bits, nearest even; the narrow range saturates to infinity.
        assert_eq!(Precision::Fp16.round(1.0 + 2f32.powi(-11)), 1.0);
        assert_eq!(Precision::Fp16.round(1.0 + 3.0 * 2f32.powi(-11)), 1.0 + 2f32.powi(-9));
        assert_eq!(Precision::Fp16.round(1.0 + 1.5 * 2f32.powi(-11)), 1.0 + 2f32.powi(-10));
        assert_eq!(Precision::Fp16.round(65504.0), 65504.0);
        assert_eq!(Precision::Fp16.round(7e4), f32::INFINITY);
        assert_eq!(Precision::Fp16.round(2f32.powi(-26)), 0.0);
        assert!(Precision::Fp16.round(f32::NAN).is_nan());
    }
}

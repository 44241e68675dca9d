//! The CPU reference: every op of a block written plainly from its math, in f32 or
//! f64, forward and backward side by side. It is the oracle every GPU result is
//! checked against, so it prefers the obvious over the fast: one function per op,
//! loops in the order of the formula, the two GEMMs through `nalgebra`, no fast-math.
//!
//! Layout: activations are row-major `(batch, features)` tensors and the ops'
//! parameters are `(features,)` vectors. Inside a chain every value stays 2-D, so
//! `max` gives `(batch, 1)` there; the block reshapes its result to
//! [`BlockSpec::output_shape`] (`(batch,)` for chains with `max`) at the end.
//!
//! [`block_forward`] is inference and records nothing. [`block_backward`] runs the
//! same forward on a [`Tape`] through [`block_forward_taped`] (one node for the
//! Linear layer, one per chain op) and back-propagates the caller's `dy`.

pub mod activation;
pub mod batch_norm;
pub mod group_norm;
pub mod linear;
pub mod op;
pub mod reduce;
pub mod rows;

pub use op::{Saved, op_backward, op_forward};

use crate::block::{BlockSpec, Params};
use crate::chain::Op;
use crate::error::{Error, Result};
use crate::tape::{Tape, VarId};
use crate::tensor::Tensor;

/// The scalar types the reference computes in: f32 (to mirror strict-f32 kernels)
/// and f64 (the oracle). `nalgebra::RealField` supplies the elementary functions
/// (`exp`, `ln_1p`, `tanh`, `sqrt`); this adds what it lacks.
pub trait Real: nalgebra::RealField + Copy {
    const ZERO: Self;
    const ONE: Self;
    /// The representable value nearest to `v` (named apart from
    /// `FromPrimitive::from_f64`, which `RealField` brings in and returns an `Option`).
    fn from_f64_nearest(v: f64) -> Self;
    fn to_f64(self) -> f64;
    /// A count (a group size, a pooling kernel) as a divisor.
    fn from_count(n: usize) -> Self {
        Self::from_f64_nearest(n as f64)
    }
    /// A constant of the chain (stored as f32 in [`crate::Op`]). f32 keeps it as is;
    /// f64 takes the decimal it was written as (`0.01`, not `0.009999999776…`), so the
    /// f64 oracle computes the model with the constants its definition names.
    fn from_chain_constant(v: f32) -> Self;
    /// The complementary error function (through `libm`: `nalgebra` has none); the
    /// normal CDF through it keeps its relative accuracy in the negative tail, where
    /// `1 + erf` cancels.
    fn erfc(self) -> Self;
    fn is_nan(self) -> bool;
}

impl Real for f32 {
    const ZERO: f32 = 0.0;
    const ONE: f32 = 1.0;
    fn from_f64_nearest(v: f64) -> f32 {
        v as f32
    }
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    fn from_chain_constant(v: f32) -> f32 {
        v
    }
    fn erfc(self) -> f32 {
        libm::erfcf(self)
    }
    fn is_nan(self) -> bool {
        f32::is_nan(self)
    }
}

impl Real for f64 {
    const ZERO: f64 = 0.0;
    const ONE: f64 = 1.0;
    fn from_f64_nearest(v: f64) -> f64 {
        v
    }
    fn to_f64(self) -> f64 {
        self
    }
    fn from_chain_constant(v: f32) -> f64 {
        // `Display` prints the shortest decimal that reads back as the same f32.
        v.to_string().parse().expect("an f32's Display output parses as f64")
    }
    fn erfc(self) -> f64 {
        libm::erfc(self)
    }
    fn is_nan(self) -> bool {
        f64::is_nan(self)
    }
}

/// `(rows, cols)` of a 2-D tensor, or a shape error naming `name`.
pub(crate) fn matrix_dims<T: Copy>(name: &str, t: &Tensor<T>) -> Result<(usize, usize)> {
    match *t.shape() {
        [rows, cols] => Ok((rows, cols)),
        ref s => Err(Error::tensor(name, format!("expected a 2-D (rows, cols) tensor, got shape {s:?}"))),
    }
}

/// Checks that `t` is a vector of `len` elements.
pub(crate) fn check_vector<T: Copy>(name: &str, t: &Tensor<T>, len: usize) -> Result<()> {
    if t.shape() != [len] {
        return Err(Error::tensor(name, format!("expected shape [{len}], got {:?}", t.shape())));
    }
    Ok(())
}

/// Checks that `t` has exactly `shape`.
pub(crate) fn check_shape<T: Copy>(name: &str, t: &Tensor<T>, shape: &[usize]) -> Result<()> {
    if t.shape() != shape {
        return Err(Error::tensor(name, format!("expected shape {shape:?}, got {:?}", t.shape())));
    }
    Ok(())
}

/// Checks that `params` fit `spec`: one list per op, each op's count, every shape.
fn check_params<T: Copy>(spec: &BlockSpec, params: &Params<T>) -> Result<()> {
    if params.ops.len() != spec.chain.0.len() {
        return Err(Error::Shape(format!(
            "the chain `{}` has {} ops, the parameters have {} op entries",
            spec.chain,
            spec.chain.0.len(),
            params.ops.len()
        )));
    }
    for (i, (op, p)) in spec.chain.0.iter().zip(&params.ops).enumerate() {
        if p.len() != op.param_bases().len() {
            return Err(Error::Shape(format!(
                "op {i} (`{op}`) takes {} parameter(s), got {}",
                op.param_bases().len(),
                p.len()
            )));
        }
    }
    for (s, t) in spec.param_specs().iter().zip(params.flat()) {
        check_shape(&s.name, t, &s.shape)?;
    }
    Ok(())
}

/// The block's output for input `x`: Linear, then each op of the chain (inference).
pub fn block_forward<T: Real>(spec: &BlockSpec, x: &Tensor<T>, params: &Params<T>) -> Result<Tensor<T>> {
    Ok(block_forward_saving(spec, x, params)?.0)
}

/// [`block_forward`] and the Linear output `z` `(batch, out)` the chain started from:
/// what [`block_backward_at`] takes to give the gradients without the GEMM again.
pub fn block_forward_saving<T: Real>(
    spec: &BlockSpec,
    x: &Tensor<T>,
    params: &Params<T>,
) -> Result<(Tensor<T>, Tensor<T>)> {
    let batch = spec.check_input(x)?;
    check_params(spec, params)?;
    let z = linear::linear_forward(x, &params.linear_weight, &params.linear_bias)?;
    let mut h = z.clone();
    for (op, op_params) in spec.chain.0.iter().zip(&params.ops) {
        h = if *op == Op::Residual { residual(&h, &z)? } else { op_forward(op, &h, op_params)?.0 };
    }
    Ok((h.reshape(&spec.output_shape(batch))?, z))
}

/// The `residual` op: `h + z`, `z` the chain's input (the Linear's output), same shape.
/// Its backward hands `dy` to both.
fn residual<T: Real>(h: &Tensor<T>, z: &Tensor<T>) -> Result<Tensor<T>> {
    if h.shape() != z.shape() {
        return Err(Error::Shape(format!("residual: the value {:?} and the chain's input {:?}", h.shape(), z.shape())));
    }
    Tensor::new(h.shape(), h.data().iter().zip(z.data()).map(|(&a, &b)| a + b).collect())
}

/// The batch statistics of the chain's BatchNorm at the Linear output `z`: each
/// feature's mean and biased variance over the rows (`None` without a BatchNorm). The
/// running statistics are the caller's ([`batch_norm::running_stats_update`]).
pub fn batch_norm_stats<T: Real>(
    spec: &BlockSpec,
    params: &Params<T>,
    z: &Tensor<T>,
) -> Result<Option<batch_norm::BatchNormStats<T>>> {
    let Some((k, _)) = spec.chain.batch_norm() else { return Ok(None) };
    check_params(spec, params)?;
    let mut h = z.clone();
    for (op, op_params) in spec.chain.0[..=k].iter().zip(&params.ops) {
        match op_forward(op, &h, op_params)? {
            (_, Saved::BatchNorm { stats, .. }) => return Ok(Some(stats)),
            (y, _) => h = y,
        }
    }
    unreachable!("op {k} is the BatchNorm")
}

/// Gradients of a block's input and of each of its parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockGrads<T> {
    pub x: Tensor<T>,
    pub params: Params<T>,
}

/// The block's forward recorded on `tape`: a node for the Linear layer (inputs `x`,
/// W, b) and one per chain op (inputs its input and its parameters), plus a reshape
/// node when the output shape is not `(batch, F)`. `x_var` is `x`'s variable;
/// `param_vars` are the parameters' variables in [`Params::flat`] order. Returns the
/// output (shaped as [`BlockSpec::output_shape`]) and its variable, so another
/// block can consume it on the same tape.
pub fn block_forward_taped<T: Real>(
    tape: &mut Tape<Tensor<T>>,
    spec: &BlockSpec,
    x: &Tensor<T>,
    x_var: VarId,
    params: &Params<T>,
    param_vars: &[VarId],
) -> Result<(Tensor<T>, VarId)> {
    forward_taped_from(tape, spec, x, x_var, params, param_vars, None)
}

/// [`block_forward_taped`], with the Linear output `z` given instead of computed when
/// `z` is `Some` (its backward still uses `x` and `W`).
fn forward_taped_from<T: Real>(
    tape: &mut Tape<Tensor<T>>,
    spec: &BlockSpec,
    x: &Tensor<T>,
    x_var: VarId,
    params: &Params<T>,
    param_vars: &[VarId],
    z: Option<&Tensor<T>>,
) -> Result<(Tensor<T>, VarId)> {
    let batch = spec.check_input(x)?;
    check_params(spec, params)?;
    let n_params = params.flat().len();
    if param_vars.len() != n_params {
        return Err(Error::Argument(format!(
            "the block has {n_params} parameters, got {} tape variables for them",
            param_vars.len()
        )));
    }

    let mut h = match z {
        None => linear::linear_forward(x, &params.linear_weight, &params.linear_bias)?,
        Some(z) => {
            let want = [batch, spec.out_features];
            if z.shape() != want.as_slice() {
                return Err(Error::Shape(format!("z has shape {:?}, the Linear output has {want:?}", z.shape())));
            }
            z.clone()
        }
    };
    let (saved_x, saved_w) = (x.clone(), params.linear_weight.clone());
    let mut h_var = tape.record(&[x_var, param_vars[0], param_vars[1]], move |dy: Tensor<T>| {
        let (dx, dw, db) = linear::linear_backward(&saved_x, &saved_w, &dy)?;
        Ok(vec![Some(dx), Some(dw), Some(db)])
    });
    let (z, z_var) = (h.clone(), h_var);

    let mut next_param = 2;
    for (op, op_params) in spec.chain.0.iter().zip(&params.ops) {
        if *op == Op::Residual {
            h = residual(&h, &z)?;
            h_var = tape.record(&[h_var, z_var], |dy: Tensor<T>| Ok(vec![Some(dy.clone()), Some(dy)]));
            continue;
        }
        let vars = &param_vars[next_param..next_param + op_params.len()];
        next_param += op_params.len();
        let (y, saved) = op_forward(op, &h, op_params)?;
        let mut inputs = vec![h_var];
        inputs.extend_from_slice(vars);
        let (op, op_params) = (*op, op_params.clone());
        h_var = tape.record(&inputs, move |dy: Tensor<T>| {
            let (dx, dparams) = op_backward(&op, &saved, &op_params, &dy)?;
            Ok(std::iter::once(Some(dx)).chain(dparams.into_iter().map(Some)).collect())
        });
        h = y;
    }

    let out_shape = spec.output_shape(batch);
    if h.shape() != out_shape.as_slice() {
        let inner_shape = h.shape().to_vec();
        h = h.reshape(&out_shape)?;
        h_var = tape.record(&[h_var], move |dy: Tensor<T>| Ok(vec![Some(dy.reshape(&inner_shape)?)]));
    }
    Ok((h, h_var))
}

/// Output `y` and the gradients of `L = sum(y * dy)` with respect to `x` and every
/// parameter: the forward on a tape, then [`Tape::backward`] seeded with `dy`,
/// which must have the output's shape.
pub fn block_backward<T: Real>(
    spec: &BlockSpec,
    x: &Tensor<T>,
    params: &Params<T>,
    dy: &Tensor<T>,
) -> Result<(Tensor<T>, BlockGrads<T>)> {
    backward_from(spec, x, params, dy, None)
}

/// [`block_backward`] at a given Linear output `z` (`(batch, out)`) instead of
/// `x W^T + b`: the exact gradients of the function a device's forward evaluated when
/// `z` is the one it computed. Where `z` carries rounding error (TF32), piecewise
/// derivatives (LeakyReLU at 0, Hardtanh at its bounds) are taken on the same side as
/// the device took them, so this separates the backward's own error from the
/// forward's (`host check --backward`).
pub fn block_backward_at<T: Real>(
    spec: &BlockSpec,
    x: &Tensor<T>,
    params: &Params<T>,
    dy: &Tensor<T>,
    z: &Tensor<T>,
) -> Result<(Tensor<T>, BlockGrads<T>)> {
    backward_from(spec, x, params, dy, Some(z))
}

fn backward_from<T: Real>(
    spec: &BlockSpec,
    x: &Tensor<T>,
    params: &Params<T>,
    dy: &Tensor<T>,
    z: Option<&Tensor<T>>,
) -> Result<(Tensor<T>, BlockGrads<T>)> {
    let batch = spec.check_input(x)?;
    let out_shape = spec.output_shape(batch);
    if dy.shape() != out_shape.as_slice() {
        return Err(Error::Shape(format!("dy has shape {:?}, the block's output has {out_shape:?}", dy.shape())));
    }

    let mut tape = Tape::new();
    let x_var = tape.leaf();
    let param_vars: Vec<VarId> = params.flat().iter().map(|_| tape.leaf()).collect();
    let (y, y_var) = forward_taped_from(&mut tape, spec, x, x_var, params, &param_vars, z)?;
    let mut grads = tape.backward(y_var, dy.clone())?;

    // Every parameter feeds the output, so a missing gradient cannot happen; zeros
    // (the true gradient of an unused value) keep this total anyway.
    let mut take = |var: VarId, like: &Tensor<T>| match grads.take(var) {
        Some(grad) => Ok(grad),
        None => Tensor::full(like.shape(), T::ZERO),
    };
    let dx = take(x_var, x)?;
    let mut dparams = params.clone();
    for (slot, var) in dparams.flat_mut().into_iter().zip(&param_vars) {
        let grad = take(*var, slot)?;
        *slot = grad;
    }
    Ok((y, BlockGrads { x: dx, params: dparams }))
}

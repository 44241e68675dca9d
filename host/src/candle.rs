//! A candle adapter: [`FusedLinear`], one block (`Linear` + epilogue chain) as a
//! `candle_nn::Module` whose forward and backward run on the CPU backend ([`crate::cpu`]).
//!
//! The forward is a `CustomOp3` over `(x, lin.weight, packed)`, `packed` being every other
//! parameter concatenated into one 1-D tensor (candle's custom ops take at most three
//! tensors); its `bwd` returns the fused backward's gradients, and candle's autograd splits
//! the packed gradient back onto each parameter through the concatenation.
//!
//! CPU tensors only (see docs/RUST.md for why candle's CUDA feature cannot be enabled
//! beside this crate's cudarc). f32 runs as is; bf16 and f16 are converted to f32 and the
//! output back; other dtypes are an error.

use crate::block::Init as ParamInit;
use crate::{BlockSpec, Params, cpu};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Error, Layout, Result, Shape, Tensor};
use candle_nn::{Init, VarBuilder};

/// One fused block with candle parameters named as PyTorch names them (`lin.weight`,
/// `lin.bias`, `gn.weight`, ...), so `VarBuilder::from_varmap` (training) and
/// `VarBuilder::from_mmaped_safetensors` (a PyTorch block's weights) both fit.
#[derive(Clone, Debug)]
pub struct FusedLinear {
    spec: BlockSpec,
    weight: Tensor,
    /// The parameters after `lin.weight`, in [`BlockSpec::param_specs`] order.
    others: Vec<Tensor>,
}

fn host_err(what: &str, e: crate::Error) -> Error {
    Error::Msg(format!("FusedLinear: {what}: {e}"))
}

impl FusedLinear {
    /// The block `spec` with its parameters from `vb` (created with PyTorch's initialisation
    /// when `vb` is backed by a `VarMap` that lacks them).
    pub fn new(spec: BlockSpec, vb: VarBuilder) -> Result<Self> {
        let mut tensors = Vec::new();
        for p in spec.param_specs() {
            let init = match p.init {
                ParamInit::Uniform(b) => Init::Uniform { lo: -b, up: b },
                ParamInit::Ones => Init::Const(1.0),
                ParamInit::Zeros => Init::Const(0.0),
                ParamInit::Normal => Init::Randn { mean: 0.0, stdev: 1.0 },
            };
            tensors.push(vb.get_with_hints(p.shape.as_slice(), &p.name, init)?);
        }
        let mut it = tensors.into_iter();
        let weight = it.next().expect("a block has a Linear weight");
        Ok(FusedLinear { spec, weight, others: it.collect() })
    }

    /// `Linear(in_features, out_features)` followed by `chain` (the CLI's syntax, e.g.
    /// `"groupnorm(8),swish"`).
    pub fn from_chain(in_features: usize, out_features: usize, chain: &str, vb: VarBuilder) -> Result<Self> {
        let chain = chain.parse().map_err(|e| host_err("chain", e))?;
        let spec = BlockSpec::new(in_features, out_features, chain).map_err(|e| host_err("block", e))?;
        Self::new(spec, vb)
    }

    pub fn spec(&self) -> &BlockSpec {
        &self.spec
    }

    /// The Linear weight `(out, in)`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The other parameters in [`BlockSpec::param_specs`] order (`lin.bias` first).
    pub fn others(&self) -> &[Tensor] {
        &self.others
    }
}

fn check_cpu(name: &str, t: &Tensor) -> Result<()> {
    if !t.device().is_cpu() {
        return Err(Error::Msg(format!(
            "FusedLinear: {name} is on {:?}; only CPU tensors are supported (candle's CUDA path is not wired up)",
            t.device().location()
        )));
    }
    Ok(())
}

impl candle_nn::Module for FusedLinear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dtype = x.dtype();
        if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(Error::Msg(format!(
                "FusedLinear: x has dtype {dtype:?}; supported: f32 (bf16 and f16 through f32)"
            )));
        }
        check_cpu("x", x)?;
        let names = self.spec.param_specs();
        for (t, p) in std::iter::once(&self.weight).chain(&self.others).zip(&names) {
            check_cpu(&p.name, t)?;
            if t.dtype() != dtype {
                return Err(Error::Msg(format!(
                    "FusedLinear: {} has dtype {:?} but x has {dtype:?}",
                    p.name,
                    t.dtype()
                )));
            }
        }
        match x.dims() {
            [b, i] if *i == self.spec.in_features && *b > 0 => {}
            d => {
                return Err(Error::Msg(format!(
                    "FusedLinear: x must have shape (batch >= 1, {}) for Linear({}, {}), got {d:?}",
                    self.spec.in_features, self.spec.in_features, self.spec.out_features
                )));
            }
        }
        let f32 = |t: &Tensor| t.to_dtype(DType::F32)?.contiguous();
        let others = self.others.iter().map(f32).collect::<Result<Vec<_>>>()?;
        let packed = Tensor::cat(&others, 0)?;
        let op = BlockOp { spec: self.spec.clone() };
        let y = f32(x)?.apply_op3(&f32(&self.weight)?, &packed, op)?;
        y.to_dtype(dtype)
    }
}

/// The custom op: `(x, lin.weight, packed other parameters) -> y`.
struct BlockOp {
    spec: BlockSpec,
}

/// A contiguous f32 slice of `s` as laid out by `l`.
fn slice<'a>(name: &str, s: &'a CpuStorage, l: &Layout) -> Result<&'a [f32]> {
    let data = match s {
        CpuStorage::F32(v) => v.as_slice(),
        other => {
            return Err(Error::Msg(format!("FusedLinear: {name} has dtype {:?}, expected f32", other.dtype())));
        }
    };
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => Err(Error::Msg(format!("FusedLinear: {name} is not contiguous"))),
    }
}

impl BlockOp {
    /// The host tensors of `x` and the parameters, shapes checked.
    fn unpack(
        &self,
        x: &[f32],
        x_dims: &[usize],
        w: &[f32],
        packed: &[f32],
    ) -> Result<(crate::Tensor<f32>, Params<f32>)> {
        let x = crate::Tensor::new(x_dims, x.to_vec()).map_err(|e| host_err("x", e))?;
        let specs = self.spec.param_specs();
        let want: usize = specs[1..].iter().map(|p| p.shape.iter().product::<usize>()).sum();
        if packed.len() != want {
            return Err(Error::Msg(format!(
                "FusedLinear: the packed parameters have {} values, the block needs {want}",
                packed.len()
            )));
        }
        let mut flat = vec![crate::Tensor::new(&specs[0].shape, w.to_vec()).map_err(|e| host_err("lin.weight", e))?];
        let mut at = 0;
        for p in &specs[1..] {
            let n: usize = p.shape.iter().product();
            flat.push(crate::Tensor::new(&p.shape, packed[at..at + n].to_vec()).map_err(|e| host_err(&p.name, e))?);
            at += n;
        }
        let params = Params::from_flat(&self.spec, flat).map_err(|e| host_err("parameters", e))?;
        Ok((x, params))
    }
}

impl CustomOp3 for BlockOp {
    fn name(&self) -> &'static str {
        "fused-linear"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, params) = self.unpack(
            slice("x", s1, l1)?,
            l1.dims(),
            slice("lin.weight", s2, l2)?,
            slice("packed parameters", s3, l3)?,
        )?;
        let y = cpu::forward(&self.spec, &x, &params, &Default::default()).map_err(|e| host_err("forward", e))?;
        let shape = Shape::from(y.shape().to_vec());
        Ok((CpuStorage::F32(y.into_data()), shape))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        packed: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let vec = |t: &Tensor| t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>();
        let (xh, params) = self.unpack(&vec(x)?, x.dims(), &vec(w)?, &vec(packed)?)?;
        let dyh = crate::Tensor::new(dy.dims(), vec(dy)?).map_err(|e| host_err("dy", e))?;
        // The backward recomputes the forward's Linear output rather than keeping it alive
        // between the two passes: one extra GEMM, no state in the op.
        let (_, g) =
            cpu::backward(&self.spec, &xh, &params, &dyh, &Default::default()).map_err(|e| host_err("backward", e))?;
        let dev = x.device();
        let dx = Tensor::from_vec(g.x.into_data(), x.dims(), dev)?;
        let flat = g.params.flat();
        let dw = Tensor::from_vec(flat[0].data().to_vec(), w.dims(), dev)?;
        let rest: Vec<f32> = flat[1..].iter().flat_map(|t| t.data().iter().copied()).collect();
        let dp = Tensor::from_vec(rest, packed.dims(), dev)?;
        Ok((Some(dx), Some(dw), Some(dp)))
    }
}

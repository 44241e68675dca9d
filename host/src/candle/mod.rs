//! A candle adapter: [`FusedLinear`], one block (`Linear` + epilogue chain) as a
//! `candle_nn::Module` whose forward and backward run on the CPU backend ([`crate::cpu`])
//! for CPU tensors, and with the feature `candle-cuda` on the GPU kernels for candle's
//! CUDA tensors (`cuda`: on candle's device, stream and buffers).
//!
//! The forward is a `CustomOp3` over `(x, lin.weight, packed)`, `packed` being every other
//! parameter concatenated into one 1-D tensor (candle's custom ops take at most three
//! tensors), each padded with zeros to a multiple of 4 values so that every one starts at
//! a 16-byte boundary (the GPU kernels' vector loads); its `bwd` returns the fused
//! backward's gradients, and candle's autograd splits the packed gradient back onto each
//! parameter through the concatenation.
//!
//! f32 runs as is; bf16 and f16 run in their type on CUDA (the bf16 blocks' kernels) and
//! through f32 copies on the CPU; other dtypes are an error. The GEMMs run in FP32 unless [`FusedLinear::with_precision`] picks another
//! arithmetic (3xTF32 keeps FP32's accuracy at tensor-core speed). docs/RUST.md says how
//! to build `candle-cuda` (candle links CUDA at build time).

#[cfg(feature = "candle-cuda")]
mod cuda;

use crate::block::Init as ParamInit;
use crate::precision::Precision;
use crate::{BlockSpec, Params, cpu};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Device, Error, Layout, Result, Shape, Tensor};
use candle_nn::{Init, VarBuilder};

/// One fused block with candle parameters named as PyTorch names them (`lin.weight`,
/// `lin.bias`, `gn.weight`, ...), so `VarBuilder::from_varmap` (training) and
/// `VarBuilder::from_mmaped_safetensors` (a PyTorch block's weights) both fit.
#[derive(Clone, Debug)]
pub struct FusedLinear {
    spec: BlockSpec,
    precision: Precision,
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
        Ok(FusedLinear { spec, precision: Precision::Fp32, weight, others: it.collect() })
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

    /// The same block with its GEMMs in `precision` on the GPU (FP32 by default). The CPU
    /// backend runs FP8 by emulation and the others in FP32.
    pub fn with_precision(mut self, precision: Precision) -> Self {
        self.precision = precision;
        self
    }

    pub fn precision(&self) -> Precision {
        self.precision
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

/// Whether the block runs on `device`: the CPU, and CUDA devices where the crate was built
/// with `candle-cuda`.
fn check_device(name: &str, t: &Tensor, device: &Device) -> Result<()> {
    if !t.device().same_device(device) {
        return Err(Error::Msg(format!(
            "FusedLinear: {name} is on {:?}, x on {:?}",
            t.device().location(),
            device.location()
        )));
    }
    if device.is_cuda() && cfg!(not(feature = "candle-cuda")) {
        return Err(Error::Msg(format!(
            "FusedLinear: {name} is on {:?}; this build takes CPU tensors (CUDA ones need the feature \
             `candle-cuda`, docs/RUST.md)",
            device.location()
        )));
    }
    if !(device.is_cpu() || device.is_cuda()) {
        return Err(Error::Msg(format!("FusedLinear: {name} is on {:?} (CPU or CUDA)", device.location())));
    }
    Ok(())
}

/// The packed layout: where each parameter after `lin.weight` starts in `packed`, and
/// `packed`'s length (each padded to a multiple of 4 values: 16-byte boundaries).
fn packed_offsets(spec: &BlockSpec) -> (Vec<usize>, usize) {
    let mut at = 0;
    let starts = spec.param_specs()[1..]
        .iter()
        .map(|p| {
            let start = at;
            at += p.shape.iter().product::<usize>().next_multiple_of(4);
            start
        })
        .collect();
    (starts, at)
}

impl candle_nn::Module for FusedLinear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dtype = x.dtype();
        if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(Error::Msg(format!("FusedLinear: x has dtype {dtype:?}; supported: f32, bf16 and f16")));
        }
        let device = x.device();
        check_device("x", x, device)?;
        let names = self.spec.param_specs();
        for (t, p) in std::iter::once(&self.weight).chain(&self.others).zip(&names) {
            check_device(&p.name, t, device)?;
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
        let mut parts = Vec::new();
        for t in &self.others {
            let t = f32(t)?.flatten_all()?;
            let pad = t.elem_count().next_multiple_of(4) - t.elem_count();
            parts.push(t);
            if pad > 0 {
                parts.push(Tensor::zeros(pad, DType::F32, device)?);
            }
        }
        let packed = Tensor::cat(&parts, 0)?;
        let op = BlockOp {
            spec: self.spec.clone(),
            precision: self.precision,
            #[cfg(feature = "candle-cuda")]
            train: x.track_op() || self.weight.track_op() || self.others.iter().any(Tensor::track_op),
            #[cfg(feature = "candle-cuda")]
            saved: Default::default(),
        };
        // On CUDA a 16-bit model's x and weight go in as stored (the kernels read them);
        // the CPU backend takes f32.
        let y = if device.is_cuda() {
            x.contiguous()?.apply_op3(&self.weight.contiguous()?, &packed, op)?
        } else {
            f32(x)?.apply_op3(&f32(&self.weight)?, &packed, op)?
        };
        y.to_dtype(dtype)
    }
}

/// The custom op: `(x, lin.weight, packed other parameters) -> y`, one per forward call.
struct BlockOp {
    spec: BlockSpec,
    precision: Precision,
    /// Whether a backward may follow (some input tracks gradients): the CUDA forward then
    /// keeps the Linear output `z` for it, which the backward would otherwise recompute.
    #[cfg(feature = "candle-cuda")]
    train: bool,
    #[cfg(feature = "candle-cuda")]
    saved: std::sync::Mutex<Option<crate::gpu::block::Saved>>,
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
    /// The CPU backend's options: FP8 emulated, the other precisions in FP32.
    fn cpu_options(&self) -> cpu::Options {
        cpu::Options { precision: cpu::Precision::emulating(self.precision).unwrap_or_default(), ..Default::default() }
    }

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
        let (starts, want) = packed_offsets(&self.spec);
        if packed.len() != want {
            return Err(Error::Msg(format!(
                "FusedLinear: the packed parameters have {} values, the block needs {want}",
                packed.len()
            )));
        }
        let mut flat = vec![crate::Tensor::new(&specs[0].shape, w.to_vec()).map_err(|e| host_err("lin.weight", e))?];
        for (p, &at) in specs[1..].iter().zip(&starts) {
            let n: usize = p.shape.iter().product();
            flat.push(crate::Tensor::new(&p.shape, packed[at..at + n].to_vec()).map_err(|e| host_err(&p.name, e))?);
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
        let y = cpu::forward(&self.spec, &x, &params, &self.cpu_options()).map_err(|e| host_err("forward", e))?;
        let shape = Shape::from(y.shape().to_vec());
        Ok((CpuStorage::F32(y.into_data()), shape))
    }

    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda::forward(self, (s1, l1), (s2, l2), (s3, l3))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        packed: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        #[cfg(feature = "candle-cuda")]
        if x.device().is_cuda() {
            let (dx, dw, dp) = cuda::backward(self, x, w, packed, &dy.contiguous()?)?;
            return Ok((dx, Some(dw), Some(dp)));
        }
        let vec = |t: &Tensor| t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>();
        let (xh, params) = self.unpack(&vec(x)?, x.dims(), &vec(w)?, &vec(packed)?)?;
        let dyh = crate::Tensor::new(dy.dims(), vec(dy)?).map_err(|e| host_err("dy", e))?;
        // The backward recomputes the forward's Linear output rather than keeping it alive
        // between the two passes: one extra GEMM, no state in the op.
        let (_, g) =
            cpu::backward(&self.spec, &xh, &params, &dyh, &self.cpu_options()).map_err(|e| host_err("backward", e))?;
        let dev = x.device();
        let dx = Tensor::from_vec(g.x.into_data(), x.dims(), dev)?;
        let flat = g.params.flat();
        let dw = Tensor::from_vec(flat[0].data().to_vec(), w.dims(), dev)?;
        let (starts, len) = packed_offsets(&self.spec);
        let mut rest = vec![0.0f32; len];
        for (t, &at) in flat[1..].iter().zip(&starts) {
            rest[at..at + t.data().len()].copy_from_slice(t.data());
        }
        let dp = Tensor::from_vec(rest, packed.dims(), dev)?;
        Ok((Some(dx), Some(dw), Some(dp)))
    }
}

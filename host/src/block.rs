//! A block: `Linear(in, out)` followed by an epilogue chain, its parameters and
//! their PyTorch-style initialisation.

use crate::chain::{Chain, Op};
use crate::error::{Error, Result};
use crate::tensor::{Tensor, numel};
use rand::Rng;
use rand_distr::{Distribution, StandardNormal, Uniform};

/// The shape of a block, validated: every op of the chain applies to its features.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockSpec {
    pub in_features: usize,
    pub out_features: usize,
    pub chain: Chain,
    /// Features entering op `i` (`features[i]`), and leaving the chain (`features[len]`).
    features: Vec<usize>,
}

/// How a parameter is drawn when no weights file is given (as PyTorch initialises it).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// `U(-bound, bound)`: Linear weight and bias, `bound = 1/sqrt(in)`.
    Uniform(f64),
    /// A norm's `weight` (GroupNorm, LayerNorm, RMSNorm).
    Ones,
    /// A norm's `bias`.
    Zeros,
    /// `randn`: the extra `bias` and `w` parameters of the models.
    Normal,
}

/// One parameter's name (as in the safetensors files), shape and initialiser.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub init: Init,
}

impl BlockSpec {
    pub fn new(in_features: usize, out_features: usize, chain: Chain) -> Result<Self> {
        if in_features == 0 || out_features == 0 {
            return Err(Error::Shape(format!(
                "Linear({in_features}, {out_features}): feature counts must be at least 1"
            )));
        }
        // The weight, as f64 for the reference, must be one addressable allocation.
        numel::<f64>(&[out_features, in_features]).map_err(|_| {
            Error::Shape(format!(
                "Linear({in_features}, {out_features}): its weight has more elements than memory can address"
            ))
        })?;
        let mut features = vec![out_features];
        let mut reduced: Option<&Op> = None;
        // The BatchNorm's statistics are per feature over the rows: only ops that keep
        // each feature apart (per-element ones) may come before it.
        let mut across: Option<&Op> = None;
        for (i, op) in chain.0.iter().enumerate() {
            if *op == Op::Residual {
                let f = *features.last().unwrap();
                if i + 1 != chain.0.len() || f != out_features || chain.batch_norm().is_some() {
                    return Err(Error::Chain(format!(
                        "`residual` adds the Linear's {out_features} outputs back: it must be the chain's last op, \
                         after ops that keep the {out_features} features (here {f}), in a chain without a BatchNorm"
                    )));
                }
            }
            if let (Op::BatchNorm { .. }, Some(before)) = (op, across) {
                return Err(Error::Chain(format!(
                    "`{op}` after `{before}`: a BatchNorm may follow per-element ops only, and appear once \
                     in a chain"
                )));
            }
            if !matches!(op, Op::Pointwise(..)) {
                across = across.or(Some(op));
            }
            if let (Some(r), Some(p)) = (reduced, op.param_bases().first()) {
                return Err(Error::Chain(format!(
                    "`{op}` after `{r}`: its per-channel parameter `{p}` has no channels to act on (the \
                     reduction leaves one value per row); put it before `{r}`, or use a scalar op (`scale(s)`)"
                )));
            }
            if op.reduces_row() {
                reduced = reduced.or(Some(op));
            }
            let f = op.out_features(*features.last().unwrap())?;
            features.push(f);
        }
        Ok(BlockSpec { in_features, out_features, chain, features })
    }

    /// Features entering op `i` of the chain (`i == chain.len()`: the block's output).
    pub fn features_at(&self, i: usize) -> usize {
        self.features[i]
    }

    /// Shape of the block's output for `batch` rows: `(batch, F)`, or `(batch,)` when
    /// the chain reduces each row to one value (`max`, `sum`, `mean`, `min`, `logsumexp`).
    pub fn output_shape(&self, batch: usize) -> Vec<usize> {
        if self.chain.0.iter().any(Op::reduces_row) { vec![batch] } else { vec![batch, *self.features.last().unwrap()] }
    }

    /// Floating-point operations of the forward GEMM (the epilogue is negligible).
    pub fn forward_flops(&self, batch: usize) -> f64 {
        2.0 * batch as f64 * self.in_features as f64 * self.out_features as f64
    }

    /// Every parameter in the fixed order used by [`Params::flat`].
    pub fn param_specs(&self) -> Vec<ParamSpec> {
        let bound = 1.0 / (self.in_features as f64).sqrt();
        let mut specs = vec![
            ParamSpec {
                name: "lin.weight".into(),
                shape: vec![self.out_features, self.in_features],
                init: Init::Uniform(bound),
            },
            ParamSpec { name: "lin.bias".into(), shape: vec![self.out_features], init: Init::Uniform(bound) },
        ];
        let mut seen = std::collections::HashMap::<&str, usize>::new();
        for (i, op) in self.chain.0.iter().enumerate() {
            for base in op.param_bases() {
                let n = seen.entry(base).or_insert(0);
                *n += 1;
                let name = match (*n, base.split_once('.')) {
                    (1, _) => base.to_string(),
                    (n, Some((module, field))) => format!("{module}{n}.{field}"),
                    (n, None) => format!("{base}{n}"),
                };
                let init = match *base {
                    "gn.weight" | "ln.weight" | "rms.weight" | "bn.weight" => Init::Ones,
                    "gn.bias" | "ln.bias" | "bn.bias" => Init::Zeros,
                    _ => Init::Normal,
                };
                specs.push(ParamSpec { name, shape: vec![self.features[i]], init });
            }
        }
        specs
    }

    /// Checks, before anything is allocated, that `batch` rows of input and of every
    /// activation of the chain have an addressable size (as f64, for the reference).
    pub fn check_batch(&self, batch: usize) -> Result<()> {
        if batch == 0 {
            return Err(Error::Shape("the batch is empty (0 rows)".into()));
        }
        self.check_batch_norm_rows(batch)?;
        let widest = self.features.iter().copied().max().unwrap_or(self.out_features).max(self.in_features);
        numel::<f64>(&[batch, widest]).map_err(|_| {
            Error::Shape(format!("{batch} rows of {widest} features have more elements than memory can address"))
        })?;
        Ok(())
    }

    /// Checks that `x` is a `(batch, in_features)` input and returns the batch.
    /// A BatchNorm's statistics need two rows at least (PyTorch refuses one as well).
    fn check_batch_norm_rows(&self, batch: usize) -> Result<()> {
        if batch == 1 && self.chain.batch_norm().is_some() {
            return Err(Error::Shape(
                "a BatchNorm in training mode needs more than 1 row (the variance of each feature over one \
                 value); PyTorch's: \"Expected more than 1 value per channel when training\""
                    .into(),
            ));
        }
        Ok(())
    }

    pub fn check_input<T: Copy>(&self, x: &Tensor<T>) -> Result<usize> {
        match x.shape() {
            [b, i] if *i == self.in_features && *b > 0 => self.check_batch_norm_rows(*b).map(|_| *b),
            [0, _] => Err(Error::tensor("x", "the batch is empty (0 rows)")),
            s => Err(Error::tensor(
                "x",
                format!(
                    "expected shape (batch, {}) for Linear({}, {}), got {s:?}",
                    self.in_features, self.in_features, self.out_features
                ),
            )),
        }
    }
}

/// The parameters of one block: the Linear layer's, then each op's own.
#[derive(Clone, Debug, PartialEq)]
pub struct Params<T> {
    /// `(out, in)`, row-major, as PyTorch stores it.
    pub linear_weight: Tensor<T>,
    /// `(out,)`
    pub linear_bias: Tensor<T>,
    /// `ops[i]`: the parameters of op `i`, in [`Op::param_bases`] order
    /// (`bias`: `[bias]`, `mul`: `[w]`, `groupnorm`: `[gamma, beta]`, others empty).
    pub ops: Vec<Vec<Tensor<T>>>,
}

impl<T: Copy> Params<T> {
    /// Builds the parameters from tensors in [`BlockSpec::param_specs`] order, checking shapes.
    pub fn from_flat(spec: &BlockSpec, tensors: Vec<Tensor<T>>) -> Result<Self> {
        let specs = spec.param_specs();
        if specs.len() != tensors.len() {
            return Err(Error::Shape(format!("the block has {} parameters, got {}", specs.len(), tensors.len())));
        }
        for (s, t) in specs.iter().zip(&tensors) {
            if t.shape() != s.shape.as_slice() {
                return Err(Error::tensor(&s.name, format!("expected shape {:?}, got {:?}", s.shape, t.shape())));
            }
        }
        let mut it = tensors.into_iter();
        let linear_weight = it.next().unwrap();
        let linear_bias = it.next().unwrap();
        let ops = spec.chain.0.iter().map(|op| op.param_bases().iter().map(|_| it.next().unwrap()).collect()).collect();
        Ok(Params { linear_weight, linear_bias, ops })
    }

    /// All parameters in [`BlockSpec::param_specs`] order.
    pub fn flat(&self) -> Vec<&Tensor<T>> {
        let mut v = vec![&self.linear_weight, &self.linear_bias];
        v.extend(self.ops.iter().flatten());
        v
    }

    pub fn flat_mut(&mut self) -> Vec<&mut Tensor<T>> {
        let mut v = vec![&mut self.linear_weight, &mut self.linear_bias];
        v.extend(self.ops.iter_mut().flatten());
        v
    }

    pub fn map<U: Copy>(&self, f: impl Fn(T) -> U + Copy) -> Params<U> {
        Params {
            linear_weight: self.linear_weight.map(f),
            linear_bias: self.linear_bias.map(f),
            ops: self.ops.iter().map(|p| p.iter().map(|t| t.map(f)).collect()).collect(),
        }
    }
}

impl Params<f32> {
    /// Draws parameters as PyTorch's modules initialise them (same distributions,
    /// not the same random stream).
    pub fn init(spec: &BlockSpec, rng: &mut impl Rng) -> Self {
        let tensors = spec
            .param_specs()
            .iter()
            .map(|s| {
                // Cannot overflow: `BlockSpec::new` checked the largest, the weight.
                let n = s.shape.iter().product();
                let data: Vec<f32> = match s.init {
                    Init::Uniform(b) => {
                        let u = Uniform::new_inclusive(-b as f32, b as f32).expect("finite bound");
                        (0..n).map(|_| u.sample(rng)).collect()
                    }
                    Init::Ones => vec![1.0; n],
                    Init::Zeros => vec![0.0; n],
                    Init::Normal => (0..n).map(|_| StandardNormal.sample(rng)).collect(),
                };
                Tensor::new(&s.shape, data).expect("length matches shape")
            })
            .collect();
        Params::from_flat(spec, tensors).expect("shapes come from the spec")
    }

    /// [`Params::init`], then every op parameter (GroupNorm's affine included) redrawn
    /// from a standard normal: for checks against the reference, where ones and zeros
    /// would let e.g. a swapped `gamma` and `beta` pass.
    pub fn random(spec: &BlockSpec, rng: &mut impl Rng) -> Self {
        let mut params = Self::init(spec, rng);
        for p in params.ops.iter_mut().flatten() {
            *p = Tensor::from_fn(p.shape(), |_| StandardNormal.sample(rng)).expect("an existing shape");
        }
        params
    }
}

/// A `(batch, in)` input drawn from a standard normal (as `torch.randn`).
pub fn random_input(batch: usize, in_features: usize, rng: &mut impl Rng) -> Result<Tensor<f32>> {
    Tensor::from_fn(&[batch, in_features], |_| StandardNormal.sample(rng))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chain::Preset;

    #[test]
    fn parameter_names_match_pytorch_modules() {
        let names = |p: Preset| -> Vec<String> {
            BlockSpec::new(64, 1024, p.chain()).unwrap().param_specs().into_iter().map(|s| s.name).collect()
        };
        assert_eq!(names(Preset::M1), ["lin.weight", "lin.bias", "gn.weight", "gn.bias", "w"]);
        assert_eq!(names(Preset::M2), ["lin.weight", "lin.bias", "bias", "gn.weight", "gn.bias"]);
        assert_eq!(names(Preset::M4), ["lin.weight", "lin.bias"]);
        let twice = BlockSpec::new(8, 16, "gn(4),bias,gn(2),bias".parse().unwrap()).unwrap();
        let names: Vec<_> = twice.param_specs().into_iter().map(|s| s.name).collect();
        assert_eq!(
            names,
            ["lin.weight", "lin.bias", "gn.weight", "gn.bias", "bias", "gn2.weight", "gn2.bias", "bias2"]
        );
    }

    #[test]
    fn shapes_follow_the_chain() {
        let spec = BlockSpec::new(32, 64, "avgpool(4),bias,max".parse().unwrap()).unwrap();
        assert_eq!(spec.param_specs()[2].shape, [16]);
        assert_eq!(spec.output_shape(5), [5]);
        assert!(BlockSpec::new(32, 96, Preset::M1.chain()).unwrap_err().to_string().contains("256"));
    }

    #[test]
    fn a_residual_comes_last_at_the_linear_width_without_a_batch_norm() {
        for ok in ["residual", "sigmoid,scale(2),residual", "softmax,groupnorm(4),residual"] {
            assert!(BlockSpec::new(8, 16, ok.parse().unwrap()).is_ok(), "{ok}");
        }
        for bad in ["residual,tanh", "avgpool(2),residual", "max,residual", "swish,batchnorm,residual"] {
            let e = BlockSpec::new(8, 16, bad.parse().unwrap()).unwrap_err().to_string();
            assert!(e.contains("`residual` adds the Linear's 16 outputs back"), "{bad}: {e}");
        }
    }
}

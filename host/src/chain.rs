//! The epilogue chain as data: the ops applied to a Linear layer's output, the five
//! reference models as presets, and the `--ops` syntax.
//!
//! Syntax: comma-separated ops, case-insensitive, spaces ignored. The per-element ops
//! and their arguments come from the registry (`kernel_abi::ops`; listed by
//! [`syntax_help`]); the others are `groupnorm(G[,eps])` (GroupNorm over `G` groups,
//! eps 1e-5 by default, parameters `gn.weight` and `gn.bias`), `avgpool(k)`
//! (AvgPool1d over features, `F -> F / k`), `maxpool(k)` (MaxPool1d, the same),
//! the row reductions `max`, `min`, `sum`, `mean`, `logsumexp` (over features,
//! `(N, F) -> (N,)`), `softmax`, `layernorm([eps])` (parameters `ln.weight`,
//! `ln.bias`) and `rmsnorm([eps])` (parameter `rms.weight`). After a reduction the
//! ops act on one value per row: per-channel parameters are refused there.
//!
//! Parameter names follow the PyTorch modules of the reference models (`lin.weight`,
//! `lin.bias`, `gn.weight`, `gn.bias`, `w`, `bias`). When a chain uses the same kind
//! twice, later ones get a number: `bias2`, `w2`, `gn2.weight`.

use crate::error::{Error, Result};
pub use kernel_abi::ops::Pointwise;
use kernel_abi::ops::SHORTHANDS;
use std::fmt;

/// One op of an epilogue chain.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Op {
    /// A per-element op with its arguments (`OpDesc::a`, `OpDesc::b`; 0 where it has fewer).
    Pointwise(Pointwise, [f32; 2]),
    GroupNorm {
        groups: usize,
        eps: f32,
    },
    AvgPool(usize),
    RowMax,
    /// A reduction of each row to one value (besides `max`).
    Reduce(Reduce),
    Softmax,
    /// MaxPool1d over features, kernel and stride `k`.
    MaxPool(usize),
    /// LayerNorm over the features with a per-feature weight and bias.
    LayerNorm {
        eps: f32,
    },
    /// RMSNorm over the features with a per-feature weight.
    RmsNorm {
        eps: f32,
    },
    /// BatchNorm1d in training mode: each feature normalised by its mean and (biased)
    /// variance over the batch's rows, then a per-feature weight and bias. The one op
    /// that mixes rows: at most once per chain, after per-element ops only.
    BatchNorm {
        eps: f32,
    },
    /// The chain's input added back, `y = v + z` (`z` the Linear's output): a residual
    /// of the Linear around the ops before it (KernelBench 70's `x + original_x`). The
    /// chain's last op, after ops that keep the features (`BlockSpec::new` checks).
    Residual,
}

/// The row reductions besides the max: `(N, F) -> (N,)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reduce {
    Sum,
    Mean,
    /// Ties and NaN as the row max: the first minimum, the first NaN.
    Min,
    LogSumExp,
}

impl Reduce {
    pub const ALL: [Reduce; 4] = [Reduce::Sum, Reduce::Mean, Reduce::Min, Reduce::LogSumExp];

    pub fn name(self) -> &'static str {
        match self {
            Reduce::Sum => "sum",
            Reduce::Mean => "mean",
            Reduce::Min => "min",
            Reduce::LogSumExp => "logsumexp",
        }
    }
}

/// RMSNorm's eps when none is written: FP32's machine epsilon (`torch.finfo(float32).eps`,
/// what `nn.RMSNorm(eps=None)` uses for float32 input).
pub const RMS_NORM_EPS: f32 = f32::EPSILON;

impl Op {
    /// `kind` with its default arguments (0 for an argument without one).
    pub fn of(kind: Pointwise) -> Op {
        let mut args = [0.0; 2];
        for (a, spec) in args.iter_mut().zip(kind.info().args) {
            *a = spec.default.unwrap_or(0.0);
        }
        Op::Pointwise(kind, args)
    }

    /// A per-element op drawn at random, its arguments from the registry's sample
    /// ranges (the random chains of `host check` and the tests).
    pub fn random_pointwise(rng: &mut impl rand::Rng) -> Op {
        let kind = Pointwise::ALL[rng.random_range(0..Pointwise::ALL.len())];
        let mut args = [0.0; 2];
        for (a, spec) in args.iter_mut().zip(kind.info().args) {
            *a = rng.random_range(spec.sample.0..spec.sample.1);
        }
        Op::Pointwise(kind, args)
    }

    /// A per-element op without a per-channel parameter drawn at random (what may
    /// follow a row reduction).
    pub fn random_scalar_pointwise(rng: &mut impl rand::Rng) -> Op {
        loop {
            let op = Op::random_pointwise(rng);
            if op.param_bases().is_empty() {
                return op;
            }
        }
    }

    /// Features after this op, given `f` before it, or why it cannot apply.
    pub fn out_features(&self, f: usize) -> Result<usize> {
        match *self {
            Op::GroupNorm { groups, eps } => {
                if groups == 0 {
                    return Err(Error::Chain("groupnorm(0): a GroupNorm needs at least 1 group".into()));
                }
                if !f.is_multiple_of(groups) {
                    return Err(Error::Chain(format!(
                        "groupnorm({groups}): the number of groups must divide the {f} channels; {}",
                        divisors_hint(f)
                    )));
                }
                if !(eps > 0.0 && eps.is_finite()) {
                    return Err(Error::Chain(format!("groupnorm({groups},{eps}): eps must be positive and finite")));
                }
                Ok(f)
            }
            Op::AvgPool(k) | Op::MaxPool(k) => {
                if k == 0 || k > f {
                    return Err(Error::Chain(format!("{self}: kernel must be between 1 and the {f} features")));
                }
                Ok(f / k)
            }
            Op::RowMax | Op::Reduce(_) => Ok(1),
            Op::Softmax | Op::Residual => Ok(f),
            Op::LayerNorm { eps } | Op::RmsNorm { eps } | Op::BatchNorm { eps } => {
                if !(eps > 0.0 && eps.is_finite()) {
                    return Err(Error::Chain(format!("{self}: eps must be positive and finite")));
                }
                Ok(f)
            }
            Op::Pointwise(kind, args) => {
                let info = kind.info();
                for (spec, &a) in info.args.iter().zip(&args) {
                    if a.is_nan() || (a.is_infinite() && !spec.infinite_ok) {
                        return Err(Error::Chain(format!("{self}: `{}` must be finite", spec.name)));
                    }
                }
                if info.ordered && args[..info.args.len()].windows(2).any(|w| w[0] > w[1]) {
                    let names: Vec<&str> = info.args.iter().map(|a| a.name).collect();
                    return Err(Error::Chain(format!("{self}: {} must not decrease", names.join(" <= "))));
                }
                Ok(f)
            }
        }
    }

    /// Base names of this op's parameters, in order.
    pub fn param_bases(&self) -> &'static [&'static str] {
        match self {
            Op::Pointwise(kind, _) => kind.info().params,
            Op::GroupNorm { .. } => &["gn.weight", "gn.bias"],
            Op::LayerNorm { .. } => &["ln.weight", "ln.bias"],
            Op::RmsNorm { .. } => &["rms.weight"],
            Op::BatchNorm { .. } => &["bn.weight", "bn.bias"],
            _ => &[],
        }
    }

    /// Whether this op reduces each row to one value (`max`, `sum`, `mean`, `min`,
    /// `logsumexp`): the ops after it see one value per row.
    pub fn reduces_row(&self) -> bool {
        matches!(self, Op::RowMax | Op::Reduce(_))
    }

    /// Whether the backward takes one side of a tie or kink here (the refinement of
    /// `z` looks for inputs within their rounding error of one): LeakyReLU, Hardtanh,
    /// the row max and min, MaxPool.
    pub fn has_kink(&self) -> bool {
        match self {
            Op::Pointwise(kind, _) => kind.info().error.has_kink(),
            Op::RowMax | Op::Reduce(Reduce::Min) | Op::MaxPool(_) => true,
            _ => false,
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Op::Pointwise(kind, args) => {
                write!(f, "{}", kind.name())?;
                let n = kind.info().args.len();
                if n > 0 {
                    let list: Vec<String> = args[..n].iter().map(f32::to_string).collect();
                    write!(f, "({})", list.join(","))?;
                }
                Ok(())
            }
            Op::GroupNorm { groups, eps } => write!(f, "groupnorm({groups},{eps:e})"),
            Op::AvgPool(k) => write!(f, "avgpool({k})"),
            Op::RowMax => write!(f, "max"),
            Op::Reduce(r) => write!(f, "{}", r.name()),
            Op::Softmax => write!(f, "softmax"),
            Op::MaxPool(k) => write!(f, "maxpool({k})"),
            Op::LayerNorm { eps } => write!(f, "layernorm({eps:e})"),
            Op::RmsNorm { eps } => write!(f, "rmsnorm({eps:e})"),
            Op::BatchNorm { eps } => write!(f, "batchnorm({eps:e})"),
            Op::Residual => write!(f, "residual"),
        }
    }
}

/// One op of the chain syntax as the registry describes it: the per-element ops' rows
/// (`kernel_abi::ops`) and the three that work across features.
#[derive(Clone, Debug, PartialEq)]
pub struct OpEntry {
    pub name: &'static str,
    pub aliases: &'static [&'static str],
    /// `(name, default)`; `None`: required.
    pub args: Vec<(&'static str, Option<f32>)>,
    /// Parameter base names (`bias`, `w`, `gn.weight`, ...).
    pub params: &'static [&'static str],
    /// Whether its derivative jumps somewhere (the backward refines `z` near it).
    pub kink: bool,
    /// Whether a row's largest values can tie in FP32 after it (no row max to check there).
    pub saturates: bool,
    pub per_element: bool,
    pub meaning: &'static str,
}

/// Every op of the chain syntax, per-element ops first (in the registry's order).
pub fn registry() -> Vec<OpEntry> {
    let mut ops: Vec<OpEntry> = Pointwise::ALL
        .iter()
        .map(|&kind| {
            let info = kind.info();
            OpEntry {
                name: info.names[0],
                aliases: &info.names[1..],
                args: info.args.iter().map(|a| (a.name, a.default)).collect(),
                params: info.params,
                kink: info.error.has_kink(),
                saturates: info.saturates,
                per_element: true,
                meaning: info.meaning,
            }
        })
        .collect();
    let across = |name, aliases, args, params, kink, meaning| OpEntry {
        name,
        aliases,
        args,
        params,
        kink,
        saturates: false,
        per_element: false,
        meaning,
    };
    ops.push(across(
        "groupnorm",
        &["gn"],
        vec![("G", None), ("eps", Some(1e-5))],
        &["gn.weight", "gn.bias"],
        false,
        "GroupNorm over `G` groups of consecutive channels",
    ));
    ops.push(across("avgpool", &[], vec![("k", None)], &[], false, "AvgPool1d over features: `F -> F / k`"));
    ops.push(across("max", &["rowmax"], vec![], &[], true, "max over features: `(N, F) -> (N,)`"));
    ops.push(across("min", &["rowmin", "amin"], vec![], &[], true, "min over features: `(N, F) -> (N,)`"));
    ops.push(across("sum", &[], vec![], &[], false, "sum over features: `(N, F) -> (N,)`"));
    ops.push(across("mean", &[], vec![], &[], false, "mean over features: `(N, F) -> (N,)`"));
    ops.push(across("logsumexp", &["lse"], vec![], &[], false, "`log(sum(exp(x)))` over features: `(N, F) -> (N,)`"));
    ops.push(across("softmax", &[], vec![], &[], false, "softmax over features"));
    ops.push(across("maxpool", &[], vec![("k", None)], &[], true, "MaxPool1d over features: `F -> F / k`"));
    ops.push(across(
        "layernorm",
        &["ln"],
        vec![("eps", Some(1e-5))],
        &["ln.weight", "ln.bias"],
        false,
        "LayerNorm over the features",
    ));
    ops.push(across(
        "rmsnorm",
        &["rms"],
        vec![("eps", Some(RMS_NORM_EPS))],
        &["rms.weight"],
        false,
        "RMSNorm over the features (eps: FP32's machine epsilon by default)",
    ));
    ops.push(across(
        "batchnorm",
        &["bn"],
        vec![("eps", Some(1e-5))],
        &["bn.weight", "bn.bias"],
        false,
        "BatchNorm1d in training mode: each feature over the batch's rows (once, after per-element ops only)",
    ));
    ops.push(across(
        "residual",
        &[],
        vec![],
        &[],
        false,
        "the Linear's output added back, `y + z` (last, after ops that keep the features; no BatchNorm)",
    ));
    ops
}

/// The `--ops` syntax, one line per op (from the registry), for help and errors.
pub fn syntax_help() -> String {
    let mut lines = Vec::new();
    for &kind in Pointwise::ALL {
        let info = kind.info();
        let args: Vec<String> = info
            .args
            .iter()
            .map(|a| match a.default {
                Some(d) => format!("{}={d}", a.name),
                None => a.name.to_string(),
            })
            .collect();
        let call =
            if args.is_empty() { info.names.join(" | ") } else { format!("{}({})", info.names[0], args.join(",")) };
        let param = info.params.iter().map(|p| format!(" [parameter `{p}`]")).collect::<String>();
        lines.push(format!("  {call:<28} {}{param}", info.meaning.replace('`', "")));
    }
    for (name, kind, args) in SHORTHANDS {
        lines.push(format!("  {name:<28} {}", Op::Pointwise(*kind, *args)));
    }
    for op in registry().into_iter().filter(|op| !op.per_element) {
        let args: Vec<String> = op
            .args
            .iter()
            .map(|&(name, default)| match default {
                Some(d) if d != 0.0 && d.abs() < 1e-3 => format!("{name}={d:e}"),
                Some(d) => format!("{name}={d}"),
                None => name.to_string(),
            })
            .collect();
        let call = if args.is_empty() { op.name.to_string() } else { format!("{}({})", op.name, args.join(",")) };
        let params: Vec<String> = op.params.iter().map(|p| format!("`{p}`")).collect();
        let params = if params.is_empty() { String::new() } else { format!(" [parameters {}]", params.join(", ")) };
        lines.push(format!("  {call:<28} {}{params}", op.meaning.replace('`', "")));
    }
    lines.join("\n")
}

/// "group counts that divide N: 1, 2, ...", for errors about a GroupNorm's groups.
pub fn divisors_hint(n: usize) -> String {
    // Trial division up to sqrt(n): instant below 2^40, too slow to be worth it above.
    if n > 1 << 40 {
        return format!("choose a divisor of {n}");
    }
    let mut small: Vec<usize> = Vec::new();
    let mut large: Vec<usize> = Vec::new();
    let mut d = 1;
    while d <= n / d {
        if n.is_multiple_of(d) {
            small.push(d);
            if d != n / d {
                large.push(n / d);
            }
        }
        d += 1;
    }
    small.extend(large.into_iter().rev());
    let list: Vec<String> = small.iter().map(usize::to_string).collect();
    format!("group counts that divide {n}: {}", list.join(", "))
}

/// A sequence of ops applied after the Linear layer.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Chain(pub Vec<Op>);

impl fmt::Display for Chain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return write!(f, "(none)");
        }
        let parts: Vec<String> = self.0.iter().map(Op::to_string).collect();
        write!(f, "{}", parts.join(","))
    }
}

impl std::str::FromStr for Chain {
    type Err = Error;

    fn from_str(s: &str) -> Result<Chain> {
        let s: String = s.chars().filter(|c| !c.is_whitespace()).collect::<String>().to_lowercase();
        if s.is_empty() || s == "none" {
            return Ok(Chain::default());
        }
        split_top_level(&s)?.into_iter().map(parse_op).collect::<Result<Vec<_>>>().map(Chain)
    }
}

/// Splits at commas outside parentheses.
fn split_top_level(s: &str) -> Result<Vec<&str>> {
    let (mut depth, mut start, mut parts) = (0i32, 0, Vec::new());
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
        if !(0..=1).contains(&depth) {
            return Err(Error::Chain(format!("unbalanced parentheses in `{s}`")));
        }
    }
    if depth != 0 {
        return Err(Error::Chain(format!("unbalanced parentheses in `{s}`")));
    }
    parts.push(&s[start..]);
    Ok(parts)
}

fn parse_op(token: &str) -> Result<Op> {
    let (name, args) = match token.split_once('(') {
        Some((name, rest)) => {
            let inner =
                rest.strip_suffix(')').ok_or_else(|| Error::Chain(format!("`{token}`: expected `)` at the end")))?;
            let args: Vec<&str> = if inner.is_empty() { vec![] } else { inner.split(',').collect() };
            (name, args)
        }
        None => (token, vec![]),
    };
    let num = |i: usize| -> Result<f32> {
        args[i].parse::<f32>().map_err(|_| Error::Chain(format!("`{token}`: `{}` is not a number", args[i])))
    };
    let count = |i: usize| -> Result<usize> {
        args[i].parse::<usize>().map_err(|_| Error::Chain(format!("`{token}`: `{}` is not a whole number", args[i])))
    };
    let arity = |lo: usize, hi: usize| -> Result<()> {
        if args.len() < lo || args.len() > hi {
            let want = if lo == hi { format!("{lo}") } else { format!("{lo} to {hi}") };
            return Err(Error::Chain(format!("`{token}`: `{name}` takes {want} argument(s), got {}", args.len())));
        }
        Ok(())
    };
    if name.is_empty() {
        return Err(Error::Chain("empty op (two commas in a row?)".into()));
    }
    if let Some((_, kind, fixed)) = SHORTHANDS.iter().find(|(n, ..)| *n == name) {
        arity(0, 0)?;
        return Ok(Op::Pointwise(*kind, *fixed));
    }
    if let Some(&kind) = Pointwise::ALL.iter().find(|k| k.info().names.contains(&name)) {
        let specs = kind.info().args;
        let required = specs.iter().filter(|a| a.default.is_none()).count();
        // All arguments or (when each has a default) none: one bound of two is ambiguous.
        if !args.is_empty() || required > 0 {
            arity(specs.len(), specs.len())?;
        }
        let mut values = [0.0; 2];
        for (i, (v, spec)) in values.iter_mut().zip(specs).enumerate() {
            *v = if args.is_empty() { spec.default.unwrap_or(0.0) } else { num(i)? };
        }
        return Ok(Op::Pointwise(kind, values));
    }
    let op = match name {
        "groupnorm" | "gn" => {
            arity(1, 2)?;
            Op::GroupNorm { groups: count(0)?, eps: if args.len() == 2 { num(1)? } else { 1e-5 } }
        }
        "avgpool" => arity(1, 1).and_then(|_| count(0)).map(Op::AvgPool)?,
        "max" | "rowmax" => arity(0, 0).map(|_| Op::RowMax)?,
        "min" | "rowmin" | "amin" => arity(0, 0).map(|_| Op::Reduce(Reduce::Min))?,
        "sum" => arity(0, 0).map(|_| Op::Reduce(Reduce::Sum))?,
        "mean" => arity(0, 0).map(|_| Op::Reduce(Reduce::Mean))?,
        "logsumexp" | "lse" => arity(0, 0).map(|_| Op::Reduce(Reduce::LogSumExp))?,
        "softmax" => arity(0, 0).map(|_| Op::Softmax)?,
        "maxpool" => arity(1, 1).and_then(|_| count(0)).map(Op::MaxPool)?,
        "layernorm" | "ln" => {
            arity(0, 1)?;
            Op::LayerNorm { eps: if args.len() == 1 { num(0)? } else { 1e-5 } }
        }
        "rmsnorm" | "rms" => {
            arity(0, 1)?;
            Op::RmsNorm { eps: if args.len() == 1 { num(0)? } else { RMS_NORM_EPS } }
        }
        "batchnorm" | "bn" => {
            arity(0, 1)?;
            Op::BatchNorm { eps: if args.len() == 1 { num(0)? } else { 1e-5 } }
        }
        "residual" => arity(0, 0).map(|_| Op::Residual)?,
        other => {
            return Err(Error::Chain(format!("unknown op `{other}`; known:\n{}", syntax_help())));
        }
    };
    Ok(op)
}

/// The five reference models (docs/MODELS.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    M1,
    M2,
    M3,
    M4,
    M5,
}

impl Preset {
    pub const ALL: [Preset; 5] = [Preset::M1, Preset::M2, Preset::M3, Preset::M4, Preset::M5];

    pub fn chain(self) -> Chain {
        use Pointwise::*;
        let gn = |groups| Op::GroupNorm { groups, eps: 1e-5 };
        let (scale, leaky) = (Op::Pointwise(Scale, [2.0, 0.0]), Op::Pointwise(LeakyRelu, [0.01, 0.0]));
        Chain(match self {
            Preset::M1 => vec![gn(256), Op::of(Swish), Op::of(Mul), Op::of(Swish)],
            Preset::M2 => vec![Op::of(Swish), Op::of(Bias), gn(64)],
            Preset::M3 => vec![gn(512), leaky, scale],
            Preset::M4 => vec![Op::AvgPool(16), Op::of(Gelu), scale, Op::RowMax],
            Preset::M5 => vec![Op::of(Bias), Op::Pointwise(Hardtanh, [-1.0, 1.0]), Op::of(Mish), gn(256)],
        })
    }

    /// Seed size `(batch, in, out)`.
    pub fn seed_shape(self) -> (usize, usize, usize) {
        match self {
            Preset::M2 => (32768, 1024, 4096),
            _ => (1024, 8192, 8192),
        }
    }
}

impl fmt::Display for Preset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self:?}")
    }
}

impl std::str::FromStr for Preset {
    type Err = Error;
    fn from_str(s: &str) -> Result<Preset> {
        match s.to_ascii_uppercase().as_str() {
            "M1" => Ok(Preset::M1),
            "M2" => Ok(Preset::M2),
            "M3" => Ok(Preset::M3),
            "M4" => Ok(Preset::M4),
            "M5" => Ok(Preset::M5),
            _ => Err(Error::Argument(format!("unknown model `{s}`; expected M1, M2, M3, M4 or M5"))),
        }
    }
}

impl Chain {
    /// Replaces the group count of every GroupNorm (the `--groups` flag).
    pub fn with_groups(mut self, groups: usize) -> Chain {
        for op in &mut self.0 {
            if let Op::GroupNorm { groups: g, .. } = op {
                *g = groups;
            }
        }
        self
    }

    pub fn has_group_norm(&self) -> bool {
        self.0.iter().any(|op| matches!(op, Op::GroupNorm { .. }))
    }

    /// The index of the chain's BatchNorm, if it has one (at most one: [`BlockSpec::new`]).
    ///
    /// [`BlockSpec::new`]: crate::block::BlockSpec::new
    pub fn batch_norm(&self) -> Option<(usize, f32)> {
        self.0.iter().enumerate().find_map(|(i, op)| match *op {
            Op::BatchNorm { eps } => Some((i, eps)),
            _ => None,
        })
    }
}

#[cfg(test)]
mod registry_tests {
    use super::*;

    /// Every name and alias the registry lists parses (with its required arguments), to
    /// an op of that name: the registry and the parser cannot drift apart.
    #[test]
    fn every_registry_name_parses() {
        for op in registry() {
            let args: Vec<String> = op.args.iter().map(|(_, d)| d.map_or("2".into(), |d| d.to_string())).collect();
            for name in std::iter::once(op.name).chain(op.aliases.iter().copied()) {
                let text = if args.is_empty() { name.to_string() } else { format!("{name}({})", args.join(",")) };
                let chain: Chain = text.parse().unwrap_or_else(|e| panic!("{text}: {e}"));
                assert!(chain.to_string().starts_with(op.name), "{text} -> {chain}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_a_chain() {
        let c: Chain = "GroupNorm(256), swish, mul, swish".parse().unwrap();
        assert_eq!(c, Preset::M1.chain());
        let again: Chain = c.to_string().parse().unwrap();
        assert_eq!(again, c);
        let c: Chain = "hardtanh(-2,3),leakyrelu,avgpool(4),max,double".parse().unwrap();
        use Pointwise::*;
        let want = [
            Op::Pointwise(Hardtanh, [-2.0, 3.0]),
            Op::Pointwise(LeakyRelu, [0.01, 0.0]),
            Op::AvgPool(4),
            Op::RowMax,
            Op::Pointwise(Scale, [2.0, 0.0]),
        ];
        assert_eq!(c.0, want);
    }

    #[test]
    fn refuses_bad_chains_with_reasons() {
        for (text, needle) in [
            ("swish,,mish", "empty op"),
            ("relu6", "unknown op `relu6`"),
            ("groupnorm", "takes 1 to 2"),
            ("groupnorm(x)", "not a whole number"),
            ("scale(1", "unbalanced"),
            ("hardtanh(1)", "takes 2 argument(s), got 1"),
            ("batchnorm(1,2)", "takes 0 to 1"),
        ] {
            let err = text.parse::<Chain>().unwrap_err().to_string();
            assert!(err.contains(needle), "`{text}` gave `{err}`");
        }
    }

    #[test]
    fn feature_flow_is_checked() {
        assert_eq!(Op::AvgPool(16).out_features(8192).unwrap(), 512);
        assert_eq!(Op::AvgPool(3).out_features(10).unwrap(), 3);
        assert!(Op::AvgPool(11).out_features(10).unwrap_err().to_string().contains("avgpool(11)"));
        let err = Op::GroupNorm { groups: 7, eps: 1e-5 }.out_features(96).unwrap_err().to_string();
        assert!(
            err.contains("must divide the 96 channels") && err.contains("1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96")
        );
        let err = Op::GroupNorm { groups: 0, eps: 1e-5 }.out_features(96).unwrap_err().to_string();
        assert!(err.contains("groupnorm(0): a GroupNorm needs at least 1 group"), "{err}");
    }
}

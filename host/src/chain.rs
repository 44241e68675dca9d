//! The epilogue chain as data: the ops applied to a Linear layer's output, the five
//! reference models as presets, and the `--ops` syntax.
//!
//! Syntax (comma-separated, case-insensitive, spaces ignored):
//!
//! | op                      | meaning                                   | parameters        |
//! |-------------------------|-------------------------------------------|-------------------|
//! | `bias`                  | `x + bias[c]`                             | `bias` `(F,)`     |
//! | `mul`                   | `x * w[c]`                                | `w` `(F,)`        |
//! | `scale(s)`              | `s * x`                                   |                   |
//! | `double`                | `x + x` (same as `scale(2)`)              |                   |
//! | `swish`, `mish`, `gelu` | activations (GELU: exact erf form)        |                   |
//! | `leakyrelu(slope)`      | default slope 0.01                        |                   |
//! | `hardtanh(min,max)`     | default -1, 1                             |                   |
//! | `groupnorm(G[,eps])`    | GroupNorm over `G` groups, default eps 1e-5 | `gn.weight`, `gn.bias` |
//! | `avgpool(k)`            | AvgPool1d(k) over features: `F -> F / k`  |                   |
//! | `max`                   | max over features: `(N, F) -> (N,)`       |                   |
//!
//! Parameter names follow the PyTorch modules of `shared/baselines/pytorch_baselines.py`
//! (`lin.weight`, `lin.bias`, `gn.weight`, `gn.bias`, `w`, `bias`). When a chain uses
//! the same kind twice, later ones get a number: `bias2`, `w2`, `gn2.weight`.

use crate::error::{Error, Result};
use std::fmt;

/// One op of an epilogue chain.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Op {
    Bias,
    ChannelMul,
    Scale(f32),
    Swish,
    Mish,
    Gelu,
    LeakyRelu(f32),
    Hardtanh(f32, f32),
    GroupNorm { groups: usize, eps: f32 },
    AvgPool(usize),
    RowMax,
}

impl Op {
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
            Op::AvgPool(k) => {
                if k == 0 || k > f {
                    return Err(Error::Chain(format!("avgpool({k}): kernel must be between 1 and the {f} features")));
                }
                Ok(f / k)
            }
            Op::RowMax => Ok(1),
            Op::Hardtanh(lo, hi) if lo.is_nan() || hi.is_nan() || lo > hi => {
                Err(Error::Chain(format!("hardtanh({lo},{hi}): min must not exceed max")))
            }
            Op::Scale(s) | Op::LeakyRelu(s) if !s.is_finite() => {
                Err(Error::Chain(format!("{self}: the factor must be finite")))
            }
            _ => Ok(f),
        }
    }

    /// Base names of this op's parameters, in order.
    pub fn param_bases(&self) -> &'static [&'static str] {
        match self {
            Op::Bias => &["bias"],
            Op::ChannelMul => &["w"],
            Op::GroupNorm { .. } => &["gn.weight", "gn.bias"],
            _ => &[],
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Op::Bias => write!(f, "bias"),
            Op::ChannelMul => write!(f, "mul"),
            Op::Scale(s) => write!(f, "scale({s})"),
            Op::Swish => write!(f, "swish"),
            Op::Mish => write!(f, "mish"),
            Op::Gelu => write!(f, "gelu"),
            Op::LeakyRelu(s) => write!(f, "leakyrelu({s})"),
            Op::Hardtanh(lo, hi) => write!(f, "hardtanh({lo},{hi})"),
            Op::GroupNorm { groups, eps } => write!(f, "groupnorm({groups},{eps:e})"),
            Op::AvgPool(k) => write!(f, "avgpool({k})"),
            Op::RowMax => write!(f, "max"),
        }
    }
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
    let op = match name {
        "bias" => arity(0, 0).map(|_| Op::Bias)?,
        "mul" => arity(0, 0).map(|_| Op::ChannelMul)?,
        "scale" => arity(1, 1).and_then(|_| num(0)).map(Op::Scale)?,
        "double" => arity(0, 0).map(|_| Op::Scale(2.0))?,
        "swish" | "silu" => arity(0, 0).map(|_| Op::Swish)?,
        "mish" => arity(0, 0).map(|_| Op::Mish)?,
        "gelu" => arity(0, 0).map(|_| Op::Gelu)?,
        "leakyrelu" => {
            arity(0, 1)?;
            Op::LeakyRelu(if args.is_empty() { 0.01 } else { num(0)? })
        }
        "hardtanh" => {
            if args.len() == 1 {
                arity(0, 0)?; // a single bound is ambiguous
            }
            arity(0, 2)?;
            if args.is_empty() { Op::Hardtanh(-1.0, 1.0) } else { Op::Hardtanh(num(0)?, num(1)?) }
        }
        "groupnorm" | "gn" => {
            arity(1, 2)?;
            Op::GroupNorm { groups: count(0)?, eps: if args.len() == 2 { num(1)? } else { 1e-5 } }
        }
        "avgpool" => arity(1, 1).and_then(|_| count(0)).map(Op::AvgPool)?,
        "max" | "rowmax" => arity(0, 0).map(|_| Op::RowMax)?,
        "" => return Err(Error::Chain("empty op (two commas in a row?)".into())),
        other => {
            return Err(Error::Chain(format!(
                "unknown op `{other}`; known: bias, mul, scale(s), double, swish, mish, gelu, leakyrelu(slope), \
                 hardtanh(min,max), groupnorm(G[,eps]), avgpool(k), max"
            )));
        }
    };
    Ok(op)
}

/// The five reference models of `shared/spec/models.md`.
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
        use Op::*;
        let gn = |groups| GroupNorm { groups, eps: 1e-5 };
        Chain(match self {
            Preset::M1 => vec![gn(256), Swish, ChannelMul, Swish],
            Preset::M2 => vec![Swish, Bias, gn(64)],
            Preset::M3 => vec![gn(512), LeakyRelu(0.01), Scale(2.0)],
            Preset::M4 => vec![AvgPool(16), Gelu, Scale(2.0), RowMax],
            Preset::M5 => vec![Bias, Hardtanh(-1.0, 1.0), Mish, gn(256)],
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
        assert_eq!(c.0, vec![Op::Hardtanh(-2.0, 3.0), Op::LeakyRelu(0.01), Op::AvgPool(4), Op::RowMax, Op::Scale(2.0)]);
    }

    #[test]
    fn refuses_bad_chains_with_reasons() {
        for (text, needle) in [
            ("swish,,mish", "empty op"),
            ("relu6", "unknown op `relu6`"),
            ("groupnorm", "takes 1 to 2"),
            ("groupnorm(x)", "not a whole number"),
            ("scale(1", "unbalanced"),
            ("hardtanh(1)", "takes 0"),
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

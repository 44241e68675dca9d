//! The epilogue ops, each described once.
//!
//! The per-element ops ([`Pointwise`]) are table-driven end to end: their row in
//! [`Pointwise::info`] gives the `--ops` syntax, the arguments and their defaults, the
//! per-channel parameter, and how the op moves a rounding error (which tells whether
//! it has a kink, and the bound the kink scan carries through it). The kernels take
//! the list from [`for_each_pointwise!`](crate::for_each_pointwise), so each op's math (`kernels-gpu`'s
//! `epilogue::pointwise`) runs in every register layout and in both kink scans; a
//! missing math type, table row or reference formula fails to compile.
//!
//! GroupNorm, AvgPool and the row max are not per-element: each kernel handles them
//! by name ([`OP_GROUP_NORM`], [`OP_AVG_POOL`], [`OP_ROW_MAX`]); so do the other
//! whole-row ops ([`ROW_OPS`]: the row reductions, softmax, MaxPool, RMSNorm), which
//! only the row-wise epilogue runs (the GEMMs' fused epilogue sees a 128-column tile),
//! as it alone runs [`OP_RESIDUAL`] (the chain's input added back).
//! LayerNorm has no code of its own: over an `(N, F)` value it is a GroupNorm of one
//! group (the same statistics, a per-feature affine), and the host describes it so.
//!
//! Adding a per-element op: a line in [`for_each_pointwise!`](crate::for_each_pointwise), a row in
//! [`Pointwise::info`], its math in `kernels-gpu/src/epilogue/pointwise.rs` and its
//! f64 formula in `host/src/reference/activation.rs` (and a row in the README's
//! chain table).

/// The list of per-element ops and their codes: calls `$m! { $args [Name = code, ...] }`.
/// Everything that dispatches on a per-element op is generated from this one list.
#[macro_export]
macro_rules! for_each_pointwise {
    ($($m:ident)::+ ! $args:tt) => {
        $($m)::+! { $args [
            Bias = 1,
            Mul = 2,
            Scale = 3,
            Swish = 4,
            Mish = 5,
            Gelu = 6,
            LeakyRelu = 7,
            Hardtanh = 8,
            Tanh = 12,
            Sigmoid = 13,
            GeluTanh = 14,
        ] }
    };
}

macro_rules! declare_pointwise {
    (() [$($name:ident = $code:literal,)*]) => {
        /// A per-element op: its output at a column depends on the input there, the
        /// op's arguments and (for `Bias` and `Mul`) its parameter at that column.
        #[repr(u32)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum Pointwise {
            $($name = $code,)*
        }

        impl Pointwise {
            /// Every per-element op, in code order.
            pub const ALL: &'static [Pointwise] = &[$(Pointwise::$name,)*];

            /// The op whose [`OpDesc::code`](crate::epilogue::OpDesc) is `code`.
            pub const fn from_code(code: u32) -> Option<Pointwise> {
                match code {
                    $($code => Some(Pointwise::$name),)*
                    _ => None,
                }
            }
        }

        /// Each per-element op's code, as `match` patterns on `OpDesc::code`.
        #[allow(non_upper_case_globals)]
        pub mod code {
            $(pub const $name: u32 = $code;)*
        }
    };
}
for_each_pointwise!(declare_pointwise!());

/// GroupNorm over `count` groups of the features; `a` is eps, `param0`/`param1` gamma and beta.
pub const OP_GROUP_NORM: u32 = 9;
/// AvgPool1d of `count` features (`F -> F / count`).
pub const OP_AVG_POOL: u32 = 10;
/// Max over the features (`(N, F) -> (N,)`).
pub const OP_ROW_MAX: u32 = 11;

// The whole-row ops, coded from 32 up (the per-element ops keep the codes below).
/// Sum over the features (`(N, F) -> (N,)`).
pub const OP_ROW_SUM: u32 = 32;
/// Mean over the features (`(N, F) -> (N,)`).
pub const OP_ROW_MEAN: u32 = 33;
/// Min over the features (`(N, F) -> (N,)`; ties and NaN as the row max).
pub const OP_ROW_MIN: u32 = 34;
/// `log(sum(exp(x)))` over the features (`(N, F) -> (N,)`).
pub const OP_LOGSUMEXP: u32 = 35;
/// Softmax over the features (shape kept).
pub const OP_SOFTMAX: u32 = 36;
/// MaxPool1d of `count` features, stride `count` (`F -> F / count`).
pub const OP_MAX_POOL: u32 = 37;
/// RMSNorm over the features; `a` is eps, `param0` the weight.
pub const OP_RMS_NORM: u32 = 38;
/// The chain's input added back (`y = v + z`; the chain's last op): the row-wise kernels
/// re-read `z`, so only they run it.
pub const OP_RESIDUAL: u32 = 39;
/// Every whole-row op but GroupNorm, AvgPool and the row max.
pub const ROW_OPS: [u32; 7] = [OP_ROW_SUM, OP_ROW_MEAN, OP_ROW_MIN, OP_LOGSUMEXP, OP_SOFTMAX, OP_MAX_POOL, OP_RMS_NORM];

/// Whether op `code` reduces a row to one value (`max`, `sum`, `mean`, `min`, `logsumexp`).
pub const fn reduces_row(code: u32) -> bool {
    matches!(code, OP_ROW_MAX | OP_ROW_SUM | OP_ROW_MEAN | OP_ROW_MIN | OP_LOGSUMEXP)
}

const _: () = {
    let mut i = 0;
    while i < Pointwise::ALL.len() {
        let c = Pointwise::ALL[i] as u32;
        assert!(c != 0 && c < 32 && c != OP_GROUP_NORM && c != OP_AVG_POOL && c != OP_ROW_MAX, "op codes are unique");
        i += 1;
    }
};

/// A scalar argument of a per-element op (`scale(s)`, `leakyrelu(slope)`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Arg {
    pub name: &'static str,
    /// Used when the op is written without arguments (`leakyrelu`); `None`: required.
    pub default: Option<f32>,
    /// Infinite values are meaningful (Hardtanh's bounds); else the value must be finite.
    pub infinite_ok: bool,
    /// Where the random chains of the tests and `host check` draw it from.
    pub sample: (f32, f32),
}

/// How a per-element op moves its input's rounding error: the rule the kink scan
/// applies to each value's error radius `r` (and to `c`, a relative error common to
/// the whole row, seen by a value `x` as `c |x|`), and whether the op has a kink.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ErrorRule {
    /// `x + p`: the radius is kept and the common error joins it as `c |x|`.
    Shift,
    /// A linear map (`x * p`, `x * s`): the radius scales with the slope `|f'(x)|`;
    /// the common error scales with the value, so it is carried on.
    Linear,
    /// Smooth, with `|f'| <= lipschitz` everywhere: the radius, common error
    /// included, times that bound.
    Smooth { lipschitz: f32 },
    /// A kink at 0 with slopes 1 and `a` (LeakyReLU): an input within its radius of 0
    /// is doubtful; a sign does not see the common error.
    KinkAtZero,
    /// Clamped to `[a, b]` (Hardtanh): kinks at both bounds, which see the common error.
    Clamp,
}

impl ErrorRule {
    /// Whether the derivative jumps somewhere (the backward may read the wrong side).
    pub const fn has_kink(self) -> bool {
        matches!(self, ErrorRule::KinkAtZero | ErrorRule::Clamp)
    }

    /// Whether the common relative error is folded into the radius after this op.
    pub const fn clears_common(self) -> bool {
        matches!(self, ErrorRule::Shift | ErrorRule::Smooth { .. } | ErrorRule::Clamp)
    }
}

/// One per-element op's row of the registry.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PointwiseInfo {
    /// The name in the `--ops` syntax, then accepted aliases.
    pub names: &'static [&'static str],
    /// Its scalar arguments (`OpDesc::a`, then `OpDesc::b`). Written all or none.
    pub args: &'static [Arg],
    /// The arguments must not decrease (Hardtanh's `min <= max`).
    pub ordered: bool,
    /// The base name of its per-channel parameter, if it has one (`OpDesc::param0`;
    /// one gradient slot).
    pub params: &'static [&'static str],
    pub error: ErrorRule,
    /// Whether it saturates (tanh, Hardtanh): the largest values of a row can become
    /// equal in FP32, so a row max after it has no well-defined winner to check against
    /// f64 (the random chains of `host check` and the tests put none there).
    pub saturates: bool,
    /// What it computes, for the chain-syntax tables.
    pub meaning: &'static str,
}

const fn row(
    names: &'static [&'static str],
    args: &'static [Arg],
    params: &'static [&'static str],
    error: ErrorRule,
    meaning: &'static str,
) -> PointwiseInfo {
    PointwiseInfo { names, args, ordered: false, params, error, saturates: false, meaning }
}

const FACTOR: Arg = Arg { name: "s", default: None, infinite_ok: false, sample: (-3.0, 3.0) };
const SLOPE: Arg = Arg { name: "slope", default: Some(0.01), infinite_ok: false, sample: (0.0, 0.5) };

impl Pointwise {
    /// The op's row of the registry.
    pub const fn info(self) -> PointwiseInfo {
        use ErrorRule::*;
        use Pointwise::*;
        match self {
            Bias => row(&["bias"], &[], &["bias"], Shift, "`x + bias[c]`"),
            Mul => row(&["mul"], &[], &["w"], Linear, "`x * w[c]`"),
            Scale => row(&["scale"], &[FACTOR], &[], Linear, "`s * x`"),
            // Largest slopes: swish' 1.0998, mish' 1.0885, gelu' 1.1289, gelu_tanh' 1.1290
            // (at x = 1.4185), rounded up; sigmoid' 1/4 (at 0).
            Swish => row(&["swish", "silu"], &[], &[], Smooth { lipschitz: 1.1 }, "`x * sigmoid(x)`"),
            Mish => row(&["mish"], &[], &[], Smooth { lipschitz: 1.09 }, "`x * tanh(softplus(x))`"),
            Gelu => row(&["gelu"], &[], &[], Smooth { lipschitz: 1.13 }, "`x * Phi(x)` (exact erf form)"),
            LeakyRelu => row(&["leakyrelu"], &[SLOPE], &[], KinkAtZero, "`x` if `x > 0`, else `slope * x`"),
            Hardtanh => PointwiseInfo {
                names: &["hardtanh"],
                args: &[
                    Arg { name: "min", default: Some(-1.0), infinite_ok: true, sample: (-2.0, -0.5) },
                    Arg { name: "max", default: Some(1.0), infinite_ok: true, sample: (0.5, 3.0) },
                ],
                ordered: true,
                params: &[],
                error: Clamp,
                saturates: true,
                meaning: "`clamp(x, min, max)`",
            },
            Tanh => {
                PointwiseInfo { saturates: true, ..row(&["tanh"], &[], &[], Smooth { lipschitz: 1.0 }, "`tanh(x)`") }
            }
            Sigmoid => PointwiseInfo {
                saturates: true,
                ..row(&["sigmoid"], &[], &[], Smooth { lipschitz: 0.25 }, "`1 / (1 + exp(-x))`")
            },
            GeluTanh => row(
                &["gelu_tanh"],
                &[],
                &[],
                Smooth { lipschitz: 1.13 },
                "`x * (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) / 2` (GELU's tanh form)",
            ),
        }
    }

    /// The name in the `--ops` syntax.
    pub const fn name(self) -> &'static str {
        self.info().names[0]
    }
}

/// Names that stand for an op with fixed arguments: `double` is `scale(2)`.
pub const SHORTHANDS: &[(&str, Pointwise, [f32; 2])] = &[("double", Pointwise::Scale, [2.0, 0.0])];

const _: () = {
    let mut i = 0;
    while i < Pointwise::ALL.len() {
        let info = Pointwise::ALL[i].info();
        assert!(info.params.len() <= 1 && info.args.len() <= 2, "OpDesc holds one parameter and two arguments");
        i += 1;
    }
};

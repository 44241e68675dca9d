//! How an op moves a value's error radius: the rules both scans apply.

use super::*;

/// A GroupNorm group is recomputed whole when its normalised values' radius exceeds
/// this many times `z`'s own relative error (`rel_err`: for a GroupNorm first in the
/// chain, a group whose spread is below a quarter of the row's rms): its gradients
/// would carry the forward's error magnified as much.
pub(super) const ILL_CONDITIONED: f32 = 4.0;

/// The smallest aligned block of `z` columns holding both an aligned block of `a` and
/// one of `b` (each a multiple of the other), or the whole row.
#[inline(always)]
pub(super) fn nest(a: usize, b: usize) -> usize {
    if a == WHOLE_ROW || b == WHOLE_ROW {
        WHOLE_ROW
    } else if b.is_multiple_of(a) {
        b
    } else if a.is_multiple_of(b) {
        a
    } else {
        WHOLE_ROW
    }
}

/// One value through a per-element op: its output, its radius, and whether the op's
/// kink lies within that radius of the input (the one rule both scans apply: the op's
/// [`ErrorRule`] in the registry). `p` is the op's parameter at the value's column,
/// `rc = rx + c |x|` its radius with the common relative error `c` the input still
/// carries.
#[inline(always)]
pub(super) fn pointwise_radius<P: PointwiseMath>(op: &OpDesc, p: f32, x: f32, rx: f32, rc: f32) -> (f32, f32, bool) {
    let y = P::forward(x, p, op.a, op.b);
    match const { P::OP.info().error } {
        ErrorRule::Shift => (y, rc, false),
        ErrorRule::Linear => (y, rx * fabs(P::grad(x, p, op.a, op.b)), false),
        ErrorRule::Smooth { lipschitz } => (y, rc * lipschitz, false),
        ErrorRule::KinkAtZero => (y, rx * fabs(op.a).max(1.0), fabs(x) <= rx),
        ErrorRule::Clamp => (y, rc, fabs(x - op.a) <= rc || fabs(x - op.b) <= rc),
    }
}

/// Whether the common relative error is gone after op `code`: folded into the radius
/// (see [`ErrorRule::clears_common`]) or divided out (GroupNorm).
#[inline(always)]
pub(super) fn clears_common(code: u32) -> bool {
    matches!(code, OP_GROUP_NORM | OP_RMS_NORM | OP_SOFTMAX | OP_LOGSUMEXP)
        || match_pointwise!(code, P => const { P::OP.info().error.clears_common() }, _ => false)
}

/// A group's statistics for the radius rules: `size` values, `r2` the sum of their
/// squared radii, `rstd` their `1 / std`.
#[derive(Clone, Copy)]
pub(super) struct GroupRadius {
    pub(super) mean: f32,
    pub(super) rstd: f32,
    /// The statistics' own radius: the rms of the group's radii over sqrt(size)
    /// (independent roundings average out in the mean and the variance).
    r_stat: f32,
    /// The group's spread is small against its values' radius: the error is magnified
    /// into every normalised value and its gradients, so the group is recomputed whole.
    pub(super) ill_conditioned: bool,
}

impl GroupRadius {
    #[inline(always)]
    pub(super) fn new(mean: f32, rstd: f32, r2: f32, size: usize, rel_err: f32) -> Self {
        let inv = 1.0 / size as f32;
        let ill_conditioned = size > 1 && rstd * sqrt(r2 * inv) > ILL_CONDITIONED * rel_err;
        GroupRadius { mean, rstd, r_stat: sqrt(r2) * inv, ill_conditioned }
    }

    /// One value through the normalisation and the affine `gamma`, `beta`: its output
    /// and radius (its own radius plus the statistics', through the mean and `1 / std`).
    #[inline(always)]
    pub(super) fn apply(&self, x: f32, rx: f32, gamma: f32, beta: f32) -> (f32, f32) {
        let d = (x - self.mean) * self.rstd;
        (fma(d, gamma, beta), fabs(gamma) * self.rstd * (rx + self.r_stat * (1.0 + fabs(d))))
    }
}


//! Comparing results against the f64 reference, and the tolerances that are not a
//! GEMM precision's: those ([`FP32_REL`], [`TF32_REL`], [`BF16_REL`]) live beside the
//! arithmetic they bound, in [`crate::precision`] (explained there), and are re-exported
//! here so that every tolerance is reachable from this one module.
//!
//! Why the others:
//! * The tensor-core issue also names `allclose(atol = 1e-4, rtol = 1e-4)` against the
//!   reference for the FP32-accurate paths ([`ALLCLOSE_ATOL`], [`ALLCLOSE_RTOL`]).
//!   Every comparison measures it ([`Comparison::close`]) and `host check` reports it,
//!   but it is not a pass/fail bar: elementwise, it fails wherever a value is a sum
//!   that cancels (PyTorch's own FP32 M1 backward against f64, H100: `lin.weight` 3.5x
//!   over it at a norm-wise 1.5e-6) or a GroupNorm over a few channels magnifies a
//!   value's rounding, so it would mark right answers wrong; the norm-wise bound is
//!   the one every path is held to (docs/VERSIONS.md, series 7 of 2026-11-23).
//! * [`F64_REL`] bounds disagreement between two f64 computations of the same math
//!   (the reference against naive loops): rounding only, so 1e-10.
//! * Finite differences (central, step [`FD_STEP`]) have truncation error
//!   `O(h^2 * f''')` and cancellation error `O(ulp / h)`; with h = 1e-6 in f64 both
//!   sit near 1e-9 relative, so [`FD_REL`] = 1e-6 catches any wrong derivative term
//!   (those are off by O(1)) without flaking.

pub use crate::precision::{BF16_REL, FP8_REL, FP32_REL, TF32_REL};

/// `allclose`'s elementwise bound `|got - ref| <= atol + rtol |ref|` (PyTorch's), with
/// these two: measured and reported, see the module.
pub const ALLCLOSE_ATOL: f64 = 1e-4;
/// See [`ALLCLOSE_ATOL`].
pub const ALLCLOSE_RTOL: f64 = 1e-4;

/// Two f64 computations of the same function.
pub const F64_REL: f64 = 1e-10;
/// Step of the central finite differences in f64.
pub const FD_STEP: f64 = 1e-6;
/// Analytic gradient vs central finite differences, norm-wise relative error.
pub const FD_REL: f64 = 1e-6;

/// How far `got` is from `reference`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Comparison {
    /// `||got - ref|| / ||ref||` (2-norms); `abs` is used when `ref` is all zeros.
    pub rel: f64,
    /// `max |got - ref|`.
    pub max_abs: f64,
    /// Elements where `got` is NaN or infinite but `ref` is finite, or that differ
    /// where `ref` is not finite (always a failure).
    pub non_finite: usize,
    /// NaN or infinite values in `got`, whether or not the reference has them too (NaN
    /// or Inf in the input or the weights): an output that holds them is not usable.
    pub nan_or_inf: usize,
    /// Elements compared.
    pub len: usize,
    /// Index of the largest absolute difference.
    pub worst: usize,
    /// The largest `|got - ref| / (ALLCLOSE_ATOL + ALLCLOSE_RTOL |ref|)`: `allclose`
    /// holds while it is at most 1.
    pub close: f64,
}

impl Comparison {
    /// True when within `rel_tol` and free of unexpected NaN/Inf.
    pub fn passes(&self, rel_tol: f64) -> bool {
        self.non_finite == 0 && self.rel <= rel_tol
    }

    /// [`Comparison::passes`], and no NaN or Inf in `got` at all: what a check reports
    /// as ok. (`passes` alone holds where the reference has the same NaN and Inf.)
    pub fn ok(&self, rel_tol: f64) -> bool {
        self.passes(rel_tol) && self.nan_or_inf == 0
    }

    /// The check's verdict in words: `ok`, `FAILED`, or why an output that matches the
    /// reference is still not ok.
    pub fn verdict(&self, rel_tol: f64) -> String {
        match (self.passes(rel_tol), self.nan_or_inf) {
            (true, 0) => "ok".into(),
            (true, n) => format!(
                "not ok: {n} NaN/Inf in the output, as in the f64 reference (NaN/Inf in the input or the weights)"
            ),
            (false, _) => "FAILED".into(),
        }
    }

    /// Whether `allclose(ALLCLOSE_ATOL, ALLCLOSE_RTOL)` holds (and no unexpected NaN/Inf).
    pub fn allclose(&self) -> bool {
        self.non_finite == 0 && self.close <= 1.0
    }
}

/// Compares two equally long sequences of values as f64.
pub fn compare(got: &[f64], reference: &[f64]) -> Comparison {
    assert_eq!(got.len(), reference.len(), "compared sequences differ in length");
    let (mut diff2, mut ref2, mut max_abs, mut worst, mut non_finite, mut close) = (0.0, 0.0, 0.0, 0, 0, 0.0f64);
    let nan_or_inf = got.iter().filter(|g| !g.is_finite()).count();
    for (i, (&g, &r)) in got.iter().zip(reference).enumerate() {
        if r.is_finite() && !g.is_finite() {
            non_finite += 1;
            continue;
        }
        if !r.is_finite() {
            // Where the reference itself is NaN/Inf, the result must match it exactly.
            if !(g == r || (g.is_nan() && r.is_nan())) {
                non_finite += 1;
            }
            continue;
        }
        let d = (g - r).abs();
        diff2 += d * d;
        ref2 += r * r;
        close = close.max(d / (ALLCLOSE_ATOL + ALLCLOSE_RTOL * r.abs()));
        if d > max_abs {
            max_abs = d;
            worst = i;
        }
    }
    let rel = if ref2 > 0.0 { (diff2 / ref2).sqrt() } else { diff2.sqrt() };
    Comparison { rel, max_abs, non_finite, nan_or_inf, len: got.len(), worst, close }
}

/// [`compare`] for f32 results against an f64 reference.
pub fn compare_f32(got: &[f32], reference: &[f64]) -> Comparison {
    let got: Vec<f64> = got.iter().map(|&v| v as f64).collect();
    compare(&got, reference)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_error_is_norm_wise() {
        let c = compare(&[3.0, 4.04], &[3.0, 4.0]);
        assert!((c.rel - 0.008).abs() < 1e-12, "{c:?}");
        assert_eq!(c.worst, 1);
    }

    #[test]
    fn unexpected_nan_always_fails() {
        let c = compare(&[f64::NAN, 1.0], &[0.0, 1.0]);
        assert_eq!(c.non_finite, 1);
        assert!(!c.passes(1.0));
        let same = compare(&[f64::NAN, 1.0], &[f64::NAN, 1.0]);
        assert!(same.passes(0.0), "NaN where the reference has it matches");
        assert_eq!(same.nan_or_inf, 1);
        assert!(!same.ok(0.0) && same.verdict(0.0).starts_with("not ok: 1 NaN/Inf"), "{}", same.verdict(0.0));
        assert!(compare(&[1.0], &[1.0]).ok(0.0));
        assert_eq!(compare(&[f64::INFINITY], &[1.0]).verdict(1.0), "FAILED");
    }

    #[test]
    fn allclose_is_elementwise() {
        // Norm-wise 1e-5 over 10^4 elements, but one element 2e-3 off where allclose
        // allows 1e-4 + 1e-4 * 1.
        let want = vec![1.0; 10_000];
        let mut got = want.clone();
        got[7] += 2e-3;
        let c = compare(&got, &want);
        assert!(c.passes(FP32_REL) && !c.allclose(), "{c:?}");
        assert!((c.close - 2e-3 / 2e-4).abs() < 1e-6, "{c:?}");
        got[7] = 1.0 + 1.9e-4;
        assert!(compare(&got, &want).allclose());
    }
}

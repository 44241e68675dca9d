//! `row_partials_finish`: the second half of a chain that reduces each row once (a
//! sum, mean, max, min or logsumexp after per-element ops and GroupNorms). The TMA
//! GEMM's epilogue ran the ops before the reduction on its tiles and left two floats
//! per row and 128-column half tile (`kernel_abi::epilogue::row_partials`); here a
//! warp per row adds them up and runs the per-element ops after the reduction. The GEMM's output itself never goes through memory, where the row-wise
//! epilogue would write and re-read it whole (32 MB in FP32 at 1024 x 8192).

use super::logsumexp_shift;
use super::pointwise::{PointwiseMath, match_pointwise};
use crate::prelude::element::{Bf16, Element, F16};
use crate::prelude::math::{exp, ln, max_nan};
use crate::prelude::warp::{warp_max, warp_sum};
use crate::prelude::*;
use kernel_abi::epilogue::*;

macro_rules! finish_entries {
    ($($(#[$doc:meta])* $name:ident = $e:ty;)*) => {$(
        $(#[$doc])*
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "ptx-kernel" fn $name(
            partials: *const f32,
            parts: u32,
            m: u32,
            n: u32,
            reduction: u32,
            ops: *const OpDesc,
            n_ops: u32,
            y: *mut $e,
        ) {
            unsafe { finish::<$e>(partials, (parts, m, n), reduction, ops, n_ops, y) }
        }
    )*};
}

finish_entries! {
    /// `y[r] = ops(reduce_p partials[p, r])` for the `m` rows: `partials` as
    /// `kernel_abi::epilogue::row_partials` lays them out (`parts` of them per row, over
    /// `n` features), `reduction` the reduction's op code, then `n_ops` per-element ops
    /// (a parameter's first entry is the one column's).
    ///
    /// # Safety
    /// `partials` holds `parts * m * 2` floats, `y` `m`; `ops` `n_ops` per-element ops
    /// whose parameters hold at least one float. Launch: 1-D, whole warps, a warp per
    /// row of `m`.
    row_partials_finish = f32;
    /// [`row_partials_finish`] with `y` rounded to bf16.
    ///
    /// # Safety
    /// As [`row_partials_finish`], `y` holding `m` 16-bit words.
    row_partials_finish_bf16 = Bf16;
    /// [`row_partials_finish`] with `y` rounded to fp16.
    ///
    /// # Safety
    /// As [`row_partials_finish_bf16`].
    row_partials_finish_f16 = F16;
}

/// The body of the entry points: a warp per row, each lane over every 32nd part,
/// then the warp's shuffles (a fixed order: the same bits every call); lane 0 runs the
/// ops and stores.
///
/// # Safety
/// See [`row_partials_finish`].
#[inline(always)]
unsafe fn finish<E: Element>(
    partials: *const f32,
    (parts, m, n): (u32, u32, u32),
    reduction: u32,
    ops: *const OpDesc,
    n_ops: u32,
    y: *mut E,
) {
    let t = (block_idx_x() * block_dim_x() + thread_idx_x()) as usize;
    let (r, lane) = (t / 32, t % 32);
    let (parts, m) = (parts as usize, m as usize);
    // (The whole warp leaves together: one row per warp.)
    if r >= m {
        return;
    }
    // SAFETY: p < parts, r < m: inside the partials.
    let part = |p: usize| unsafe { [*partials.add((p * m + r) * 2), *partials.add((p * m + r) * 2 + 1)] };
    let mut v = match reduction {
        OP_ROW_SUM | OP_ROW_MEAN => {
            let mut s = 0.0;
            for p in (lane..parts).step_by(32) {
                s += part(p)[0];
            }
            let s = warp_sum(s);
            if reduction == OP_ROW_MEAN { s / n as f32 } else { s }
        }
        OP_LOGSUMEXP => {
            let mut top = f32::NEG_INFINITY;
            for p in (lane..parts).step_by(32) {
                top = max_nan(top, part(p)[0]);
            }
            let shift = logsumexp_shift(warp_max(top));
            let mut s = 0.0;
            for p in (lane..parts).step_by(32) {
                let [pm, ps] = part(p);
                // A part of `-inf` alone adds nothing (its `exp` of a difference could be
                // `inf` times its zero sum).
                if ps != 0.0 {
                    s += ps * exp(logsumexp_shift(pm) - shift);
                }
            }
            shift + ln(warp_sum(s))
        }
        OP_ROW_MAX | OP_ROW_MIN => {
            let sign = if reduction == OP_ROW_MIN { -1.0 } else { 1.0 };
            let mut top = f32::NEG_INFINITY;
            for p in (lane..parts).step_by(32) {
                top = max_nan(top, sign * part(p)[0]);
            }
            sign * warp_max(top)
        }
        // The host sends only these: poison rather than guess.
        _ => f32::NAN,
    };
    if lane != 0 {
        return;
    }
    for o in 0..n_ops as usize {
        // SAFETY: o < n_ops.
        let op = unsafe { &*ops.add(o) };
        v = match_pointwise!(op.code, P => {
            // SAFETY: a parameter holds the one column's value.
            let p = if P::HAS_PARAM { unsafe { Vector(op.param0).get(0) } } else { 0.0 };
            P::forward(v, p, op.a, op.b)
        }, _ => f32::NAN);
    }
    // SAFETY: r < m.
    unsafe { E::store1(y.add(r), v) };
}

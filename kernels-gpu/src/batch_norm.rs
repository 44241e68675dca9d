//! BatchNorm1d on batch statistics (the chain op `batchnorm`): the statistics of each
//! feature over the rows of the BatchNorm's input `u`, and the backward's correction for
//! the paths through them. Everything else of the op runs as per-element ops of the
//! row-wise epilogue (`bias(-mean), mul(rstd), mul(gamma), bias(beta)`, see the host's
//! `gpu/batch_norm.rs`).

use crate::elementwise::global_index;
use crate::prelude::math::sqrt;
use crate::prelude::*;
use kernel_abi::batch_norm::{COLUMNS, ROW_GROUPS};

/// Each feature's mean and biased variance over the `rows` rows of `u` `(rows, n)`:
/// `out[c]` the mean, `out[n + c]` the variance. Each thread runs Welford's update over
/// every `ROW_GROUPS`-th row of one column; the partial counts, means and sums of
/// squared deviations are merged pairwise (Chan et al.), so no `E[x^2] - E[x]^2`
/// cancels.
///
/// # Safety
/// `u` holds `rows * n` floats, `out` `2 n`. Launch: `ceil(n / COLUMNS)` blocks of
/// `COLUMNS * ROW_GROUPS` threads, `3 * COLUMNS * ROW_GROUPS` floats of shared memory.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn batch_norm_stats(u: *const f32, rows: u32, n: u32, out: *mut f32) {
    let t = thread_idx_x() as usize;
    let (lane, group) = (t % COLUMNS, t / COLUMNS);
    let (rows, n) = (rows as usize, n as usize);
    let c = block_idx_x() as usize * COLUMNS + lane;
    let (mut count, mut mean, mut m2) = (0.0f32, 0.0f32, 0.0f32);
    if c < n {
        let mut r = group;
        while r < rows {
            // SAFETY: r < rows, c < n.
            let v = unsafe { *u.add(r * n + c) };
            count += 1.0;
            let delta = v - mean;
            mean += delta / count;
            m2 += delta * (v - mean);
            r += ROW_GROUPS;
        }
    }
    let base = dynamic_shared::<f32>();
    let slots = COLUMNS * ROW_GROUPS;
    // SAFETY: the launch's 3 * slots floats; t < slots.
    unsafe {
        *base.add(t) = count;
        *base.add(slots + t) = mean;
        *base.add(2 * slots + t) = m2;
        sync_threads();
    }
    if group != 0 || c >= n {
        return;
    }
    for g in 1..ROW_GROUPS {
        let i = g * COLUMNS + lane;
        // SAFETY: i < slots, written before the barrier.
        let (nb, mb, m2b) = unsafe { (*base.add(i), *base.add(slots + i), *base.add(2 * slots + i)) };
        if nb == 0.0 {
            continue;
        }
        let total = count + nb;
        let delta = mb - mean;
        mean += delta * (nb / total);
        m2 += m2b + delta * delta * (count * nb / total);
        count = total;
    }
    // SAFETY: c < n; out holds 2 n.
    unsafe {
        *out.add(c) = mean;
        *out.add(n + c) = m2 / rows as f32;
    }
}

/// From `mean_var` (`[mean; var]`, `2 n`), the four rows the epilogue reads:
/// `out = [mean; var; -mean; 1 / sqrt(var + eps)]`.
///
/// # Safety
/// `mean_var` holds `2 n` floats, `out` `4 n`. Launch: 1-D over `n`.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn batch_norm_finish(mean_var: *const f32, n: u32, eps: f32, out: *mut f32) {
    let (c, n) = (global_index(), n as usize);
    if c < n {
        // SAFETY: c < n; the sizes above.
        unsafe {
            let (mean, var) = (*mean_var.add(c), *mean_var.add(n + c));
            *out.add(c) = mean;
            *out.add(n + c) = var;
            *out.add(2 * n + c) = -mean;
            *out.add(3 * n + c) = 1.0 / sqrt(var + eps);
        }
    }
}

/// The backward's paths through the statistics, in place on `g` (the gradient of the
/// BatchNorm's input at fixed statistics, `gamma rstd dv`):
/// `g -= gamma rstd (s1 + xhat s2) / rows`, `xhat = (u - mean) rstd`, with `s1 = sum dv`
/// and `s2 = sum dv xhat` per feature (the bias's and weight's gradients). Over two rows
/// `xhat = ±sqrt(1 - eps rstd^2)`: the formula's `1 - xhat^2` would cancel to noise where
/// the variance dwarfs `eps`, so there its exact value `eps rstd^2` is used:
/// `g = (g - gamma rstd s1 / 2) eps rstd^2`.
///
/// # Safety
/// `g` and `u` hold `rows * n` floats; `stats` the `4 n` of [`batch_norm_finish`];
/// `gamma`, `s1` and `s2` `n`. Launch: 1-D over `rows * n`.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "ptx-kernel" fn batch_norm_grad(
    g: *mut f32,
    u: *const f32,
    stats: *const f32,
    gamma: *const f32,
    s1: *const f32,
    s2: *const f32,
    rows: u32,
    n: u32,
    eps: f32,
) {
    let (i, n) = (global_index(), n as usize);
    if i >= rows as usize * n {
        return;
    }
    let c = i % n;
    // SAFETY: i < rows n, c < n; the sizes above.
    unsafe {
        let (neg_mean, rstd) = (*stats.add(2 * n + c), *stats.add(3 * n + c));
        let xhat = (*u.add(i) + neg_mean) * rstd;
        let a = *gamma.add(c) * rstd;
        let gi = g.add(i);
        *gi = if rows == 2 {
            (*gi - a * *s1.add(c) * 0.5) * (eps * rstd * rstd)
        } else {
            *gi - a * (*s1.add(c) + xhat * *s2.add(c)) / rows as f32
        };
    }
}

//! BatchNorm1d on batch statistics (the chain op `batchnorm`): the statistics of each
//! feature over the rows of the BatchNorm's input `u`, and the backward's correction for
//! the paths through them. Everything else of the op runs as per-element ops of the
//! row-wise epilogue (`bias(-mean), mul(rstd), mul(gamma), bias(beta)`, see the host's
//! `gpu/batch_norm.rs`).

use crate::elementwise::global_index;
use crate::prelude::math::sqrt;
use crate::prelude::*;
use kernel_abi::batch_norm::{CHUNK_ROWS, COLUMNS, ROW_GROUPS};

/// Each feature's count, mean and sum of squared deviations over one chunk of
/// `CHUNK_ROWS` rows of `u` `(rows, n)` (chunk `blockIdx.y`), at
/// `partials[(3 chunk + j) n + c]` for `j` = count, mean, M2. Each thread runs Welford's update over every
/// `ROW_GROUPS`-th row of its chunk in one column; the block's partials are merged
/// pairwise (Chan et al.), so no `E[x^2] - E[x]^2` cancels. (One chunk per block: with the
/// whole batch per block, 16384 rows were 2048 dependent steps per thread, and the
/// statistics took four times the GEMM.)
///
/// # Safety
/// `u` holds `rows * n` floats, `partials` `3 n ceil(rows / CHUNK_ROWS)`. Launch: grid
/// `(ceil(n / COLUMNS), ceil(rows / CHUNK_ROWS))` of `COLUMNS * ROW_GROUPS` threads,
/// `3 * COLUMNS * ROW_GROUPS` floats of shared memory.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn batch_norm_stats(u: *const f32, rows: u32, n: u32, partials: *mut f32) {
    let t = thread_idx_x() as usize;
    let (lane, group) = (t % COLUMNS, t / COLUMNS);
    let (rows, n) = (rows as usize, n as usize);
    let c = block_idx_x() as usize * COLUMNS + lane;
    let chunk = block_idx_y() as usize;
    let end = if (chunk + 1) * CHUNK_ROWS < rows { (chunk + 1) * CHUNK_ROWS } else { rows };
    let (mut count, mut mean, mut m2) = (0.0f32, 0.0f32, 0.0f32);
    if c < n {
        let mut r = chunk * CHUNK_ROWS + group;
        while r < end {
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
        (count, mean, m2) = merge((count, mean, m2), (nb, mb, m2b));
    }
    // SAFETY: c < n, chunk < the grid's chunks; partials holds 3 n of them.
    unsafe {
        *partials.add(3 * chunk * n + c) = count;
        *partials.add((3 * chunk + 1) * n + c) = mean;
        *partials.add((3 * chunk + 2) * n + c) = m2;
    }
}

/// Chan et al.'s merge of two (count, mean, M2) partials.
#[inline(always)]
fn merge((count, mean, m2): (f32, f32, f32), (nb, mb, m2b): (f32, f32, f32)) -> (f32, f32, f32) {
    if nb == 0.0 {
        return (count, mean, m2);
    }
    let total = count + nb;
    let delta = mb - mean;
    (total, mean + delta * (nb / total), m2 + m2b + delta * delta * (count * nb / total))
}

/// From the `chunks` partials of [`batch_norm_stats`], the four rows the epilogue reads:
/// `out = [mean; var; -mean; 1 / sqrt(var + eps)]` (`var` biased: M2 over all rows).
///
/// # Safety
/// `partials` holds `3 n chunks` floats, `out` `4 n`. Launch: 1-D over `n`.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn batch_norm_finish(partials: *const f32, chunks: u32, n: u32, eps: f32, out: *mut f32) {
    let (c, n) = (global_index(), n as usize);
    if c >= n {
        return;
    }
    let mut acc = (0.0f32, 0.0f32, 0.0f32);
    for k in 0..chunks as usize {
        // SAFETY: k < chunks, c < n; the sizes above.
        let part = unsafe { (*partials.add(3 * k * n + c), *partials.add((3 * k + 1) * n + c), *partials.add((3 * k + 2) * n + c)) };
        acc = merge(acc, part);
    }
    let (count, mean, m2) = acc;
    let var = m2 / count;
    // SAFETY: c < n; out holds 4 n.
    unsafe {
        *out.add(c) = mean;
        *out.add(n + c) = var;
        *out.add(2 * n + c) = -mean;
        *out.add(3 * n + c) = 1.0 / sqrt(var + eps);
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

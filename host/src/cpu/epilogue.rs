//! The epilogue chain in f32, one row at a time (every op acts on each row alone).
//!
//! [`forward_row`] and [`backward_row`] are the only places that match on [`Op`]. A
//! per-element op evaluates its formula from `reference::activation` in f32: the one
//! CPU definition of each registry op, held to naive loops and finite differences by
//! the reference's own tests, so a new op needs no CPU code. The whole-row ops
//! (GroupNorm, LayerNorm, RMSNorm, pooling, the row reductions, softmax) are this
//! module's own f32 code (vectorised sums, no f64), checked against the f64 reference. Statistics and reductions inside a row (GroupNorm's
//! mean and variance, AvgPool's windows) are summed in f32 over eight interleaved
//! partial sums, which vectorises and keeps the rounding error near that of a tree.

use crate::chain::{Op, Reduce};
use crate::reference::activation::{pointwise, pointwise_grad};

/// `op`'s forward applied in place to one row `v` (the op's input); returns the row's
/// new length (`avgpool(k)` leaves `len / k` values at the front, `max` one).
/// `p` holds the op's parameters in [`Op::param_bases`] order, each `v.len()` long.
pub(crate) fn forward_row(op: &Op, p: &[&[f32]], v: &mut [f32]) -> usize {
    let n = v.len();
    match *op {
        Op::Pointwise(kind, [a, b]) => match p.first() {
            Some(param) => v.iter_mut().zip(*param).for_each(|(x, &q)| *x = pointwise(kind, *x, q, a, b)),
            None => v.iter_mut().for_each(|x| *x = pointwise(kind, *x, 0.0, a, b)),
        },
        Op::GroupNorm { groups, eps } => {
            let size = n / groups;
            for (g, xs) in v.chunks_exact_mut(size).enumerate() {
                let (mean, rstd) = group_stats(xs, eps);
                let (gamma, beta) = (&p[0][g * size..], &p[1][g * size..]);
                for ((x, &gm), &bt) in xs.iter_mut().zip(gamma).zip(beta) {
                    *x = (*x - mean) * rstd * gm + bt;
                }
            }
        }
        Op::AvgPool(k) => {
            // Window j reads v[j k..], at or after v[j]: overwriting the front in order is safe.
            for j in 0..n / k {
                v[j] = sum(&v[j * k..(j + 1) * k]) / k as f32;
            }
            return n / k;
        }
        Op::RowMax => {
            v[0] = v[argmax(v)];
            return 1;
        }
        Op::Reduce(r) => {
            v[0] = reduce(r, v);
            return 1;
        }
        Op::Softmax => softmax(v),
        // The chain's input is added by `ChainRows::forward` (one op sees its row's
        // current values only); here the identity.
        Op::Residual => {}
        Op::MaxPool(k) => {
            // As AvgPool: window j reads at or after v[j].
            for j in 0..n / k {
                v[j] = v[j * k + argmax(&v[j * k..(j + 1) * k])];
            }
            return n / k;
        }
        Op::LayerNorm { eps } => return forward_row(&Op::GroupNorm { groups: 1, eps }, p, v),
        // Per element once the batch statistics are known: `p` is gamma, beta, then
        // each feature's batch mean and rstd (`cpu::batch_norm` appends them).
        Op::BatchNorm { .. } => {
            let (gamma, beta, mean, rstd) = (p[0], p[1], p[2], p[3]);
            for (c, x) in v.iter_mut().enumerate() {
                *x = (*x - mean[c]) * rstd[c] * gamma[c] + beta[c];
            }
        }
        Op::RmsNorm { eps } => {
            let r = rms_rstd(v, eps);
            v.iter_mut().zip(p[0]).for_each(|(x, &w)| *x = *x * r * w);
        }
    }
    n
}

/// A row reduction of `v` (not empty).
fn reduce(r: Reduce, v: &[f32]) -> f32 {
    match r {
        Reduce::Sum => sum(v),
        Reduce::Mean => sum(v) / v.len() as f32,
        Reduce::Min => v[argmin(v)],
        Reduce::LogSumExp => {
            // Shifted by the row max (by 0 where it is infinite, as PyTorch).
            let m = v[argmax(v)];
            let shift = if m.is_infinite() { 0.0 } else { m };
            shift + v.iter().map(|&x| (x - shift).exp()).sum::<f32>().ln()
        }
    }
}

/// Softmax of `v` in place, shifted by its max.
fn softmax(v: &mut [f32]) {
    let m = v[argmax(v)];
    v.iter_mut().for_each(|x| *x = (*x - m).exp());
    let s = sum(v);
    v.iter_mut().for_each(|x| *x /= s);
}

/// RMSNorm's `1 / sqrt(mean(x^2) + eps)`.
fn rms_rstd(v: &[f32], eps: f32) -> f32 {
    let mut acc = [0.0f32; 8];
    let chunks = v.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().map(|&x| x * x).sum();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += x * x;
        }
    }
    1.0 / ((acc.iter().sum::<f32>() + tail) / v.len() as f32 + eps).sqrt()
}

/// `op`'s backward on one row: `x` is the op's forward input, `dy` the gradient of its
/// output; writes `dx` (as long as `x`) and adds this row's share of each parameter's
/// gradient to `dp` (in [`Op::param_bases`] order, each as long as `x`).
pub(crate) fn backward_row(op: &Op, p: &[&[f32]], x: &[f32], dy: &[f32], dx: &mut [f32], dp: &mut [Vec<f32>]) {
    match *op {
        Op::Pointwise(kind, [a, b]) => match (p.first(), dp.first_mut()) {
            (Some(param), Some(dp)) => {
                for (((d, a_p), (&g, &v)), &q) in dx.iter_mut().zip(dp.iter_mut()).zip(dy.iter().zip(x)).zip(*param) {
                    let (gx, gp) = pointwise_grad(kind, v, q, a, b);
                    *d = g * gx;
                    *a_p += g * gp;
                }
            }
            _ => {
                for ((d, &g), &v) in dx.iter_mut().zip(dy).zip(x) {
                    *d = g * pointwise_grad(kind, v, 0.0, a, b).0;
                }
            }
        },
        // With xhat = (x - mean) rstd and g = dy gamma, means over the group:
        // dx = rstd (g - mean(g) - xhat mean(g xhat)); dgamma += dy xhat; dbeta += dy.
        Op::GroupNorm { groups, eps } => {
            let size = x.len() / groups;
            let (dgamma, dbeta) = dp.split_at_mut(1);
            let (dgamma, dbeta) = (&mut dgamma[0], &mut dbeta[0]);
            for g in 0..groups {
                let c = g * size..(g + 1) * size;
                let (xs, dys, gamma) = (&x[c.clone()], &dy[c.clone()], &p[0][c.clone()]);
                let (mean, rstd) = group_stats(xs, eps);
                let (mut sum_g, mut sum_gx) = (0.0f32, 0.0f32);
                for (((&v, &d), &gm), (dg, db)) in
                    xs.iter().zip(dys).zip(gamma).zip(dgamma[c.clone()].iter_mut().zip(&mut dbeta[c.clone()]))
                {
                    let xhat = (v - mean) * rstd;
                    sum_g += d * gm;
                    sum_gx += d * gm * xhat;
                    *dg += d * xhat;
                    *db += d;
                }
                let (mean_g, mean_gx) = (sum_g / size as f32, sum_gx / size as f32);
                for (((d, &v), &dyv), &gm) in dx[c].iter_mut().zip(xs).zip(dys).zip(gamma) {
                    let xhat = (v - mean) * rstd;
                    *d = rstd * (dyv * gm - mean_g - xhat * mean_gx);
                }
            }
        }
        // Each input of window j gets dy[j] / k; the F mod k trailing inputs get 0.
        Op::AvgPool(k) => {
            dx.fill(0.0);
            for (window, &g) in dx.chunks_exact_mut(k).zip(dy) {
                window.fill(g / k as f32);
            }
        }
        Op::RowMax => {
            dx.fill(0.0);
            dx[argmax(x)] = dy[0];
        }
        Op::Reduce(Reduce::Min) => {
            dx.fill(0.0);
            dx[argmin(x)] = dy[0];
        }
        Op::Reduce(Reduce::Sum) => dx.fill(dy[0]),
        Op::Reduce(Reduce::Mean) => dx.fill(dy[0] / x.len() as f32),
        Op::Reduce(Reduce::LogSumExp) => {
            let y = reduce(Reduce::LogSumExp, x);
            dx.iter_mut().zip(x).for_each(|(d, &v)| *d = dy[0] * (v - y).exp());
        }
        // The value's path; `ChainRows::backward` adds `dy` to `dz` for the chain's input.
        Op::Residual => dx.copy_from_slice(dy),
        // dx = s (dy - sum(dy s)).
        Op::Softmax => {
            dx.copy_from_slice(x);
            softmax(dx);
            let dot: f32 = dx.iter().zip(dy).map(|(s, d)| s * d).sum();
            dx.iter_mut().zip(dy).for_each(|(s, &d)| *s *= d - dot);
        }
        // Each window's gradient to its first maximum; the F mod k trailing inputs get 0.
        Op::MaxPool(k) => {
            dx.fill(0.0);
            for (j, &g) in dy.iter().enumerate() {
                dx[j * k + argmax(&x[j * k..(j + 1) * k])] = g;
            }
        }
        Op::LayerNorm { eps } => backward_row(&Op::GroupNorm { groups: 1, eps }, p, x, dy, dx, dp),
        // With the batch statistics held fixed (`cpu::batch_norm` adds their paths):
        // dx = gamma rstd dy; dgamma += dy xhat; dbeta += dy.
        Op::BatchNorm { .. } => {
            let (gamma, mean, rstd) = (p[0], p[2], p[3]);
            let (dgamma, rest) = dp.split_at_mut(1);
            for (c, ((d, &g), &v)) in dx.iter_mut().zip(dy).zip(x).enumerate() {
                *d = gamma[c] * rstd[c] * g;
                dgamma[0][c] += g * (v - mean[c]) * rstd[c];
                rest[0][c] += g;
            }
        }
        // With xhat = x r: dx = r (dy w - xhat mean(dy w xhat)); dw += dy xhat.
        Op::RmsNorm { eps } => {
            let r = rms_rstd(x, eps);
            let w = p[0];
            let mut dot = 0.0f32;
            for ((&v, &d), (&wc, dw)) in x.iter().zip(dy).zip(w.iter().zip(dp[0].iter_mut())) {
                dot += d * wc * v * r;
                *dw += d * v * r;
            }
            let m = dot / x.len() as f32;
            for ((d, &v), (&g, &wc)) in dx.iter_mut().zip(x).zip(dy.iter().zip(w)) {
                *d = r * (g * wc - v * r * m);
            }
        }
    }
}

/// Sum over eight interleaved partial sums.
fn sum(xs: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let chunks = xs.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += v;
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// A group's mean and `1 / sqrt(var + eps)` (biased variance, two passes: the
/// squares are of the residuals, so no cancellation).
fn group_stats(xs: &[f32], eps: f32) -> (f32, f32) {
    let n = xs.len() as f32;
    let mean = sum(xs) / n;
    let mut acc = [0.0f32; 8];
    let chunks = xs.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().map(|&v| (v - mean) * (v - mean)).sum();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += (v - mean) * (v - mean);
        }
    }
    let var = (acc.iter().sum::<f32>() + tail) / n;
    (mean, 1.0 / (var + eps).sqrt())
}

/// Index of the row's maximum as `torch.max`: the first of equal maxima, and the
/// first NaN if there is one (NaN propagates).
fn argmax(v: &[f32]) -> usize {
    pick(v, |x, best| x > best)
}

/// Index of the row's minimum as `torch.min`: the first of equal minima, the first NaN.
fn argmin(v: &[f32]) -> usize {
    pick(v, |x, best| x < best)
}

/// Index of the first value that `beats` every earlier one, or of the first NaN.
fn pick(v: &[f32], beats: impl Fn(f32, f32) -> bool) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x.is_nan() {
            return i;
        }
        if beats(x, v[best]) {
            best = i;
        }
    }
    best
}

/// A chain ready to run on rows: its ops, each op's parameters as slices, and the
/// features entering each op (`features[len]`: the output's).
pub(crate) struct ChainRows<'a> {
    pub ops: &'a [Op],
    pub params: Vec<Vec<&'a [f32]>>,
    pub features: Vec<usize>,
}

/// Per-thread buffers of [`ChainRows::backward`].
pub(crate) struct Scratch {
    /// Every op's input for the current row, op `i` at `offsets[i]`.
    inputs: Vec<f32>,
    offsets: Vec<usize>,
    grad: Vec<f32>,
    grad_next: Vec<f32>,
}

impl<'a> ChainRows<'a> {
    /// Runs the chain in place on a row whose first `features[0]` values are the
    /// Linear output; returns the output's length (`features[len]`).
    pub(crate) fn forward(&self, row: &mut [f32]) -> usize {
        let mut len = self.features[0];
        // A `residual` (the last op: `BlockSpec::new`) adds the chain's input back.
        let input = self.residual().then(|| row[..len].to_vec());
        for (op, p) in self.ops.iter().zip(&self.params) {
            len = forward_row(op, p, &mut row[..len]);
        }
        if let Some(z) = input {
            row[..len].iter_mut().zip(&z).for_each(|(v, z)| *v += z);
        }
        len
    }

    /// Whether the chain ends with `residual`.
    fn residual(&self) -> bool {
        self.ops.last() == Some(&Op::Residual)
    }

    pub(crate) fn scratch(&self) -> Scratch {
        let mut offsets = vec![0];
        for &f in &self.features[..self.ops.len()] {
            offsets.push(offsets.last().unwrap() + f);
        }
        let widest = self.features.iter().copied().max().unwrap_or(0);
        Scratch {
            inputs: vec![0.0; *offsets.last().unwrap()],
            offsets,
            grad: vec![0.0; widest],
            grad_next: vec![0.0; widest],
        }
    }

    /// Gradient flat list of the chain's parameters: one zero vector per parameter.
    pub(crate) fn zero_grads(&self) -> Vec<Vec<f32>> {
        self.params.iter().flatten().map(|p| vec![0.0; p.len()]).collect()
    }

    /// One row's backward through the chain: `z` is the row's Linear output, `dy` the
    /// gradient of its chain output; writes `dz` and adds the row's share of the
    /// chain parameters' gradients to `dp` (as [`ChainRows::zero_grads`] lays them out).
    /// The forward is recomputed from `z`, keeping each op's input for this row only.
    pub(crate) fn backward(&self, z: &[f32], dy: &[f32], dz: &mut [f32], s: &mut Scratch, dp: &mut [Vec<f32>]) {
        let ops = self.ops.len();
        if ops == 0 {
            dz.copy_from_slice(dy);
            return;
        }
        s.inputs[..z.len()].copy_from_slice(z);
        for i in 0..ops - 1 {
            // Op i runs on a copy of its input (a row may shrink), its output becomes
            // op i + 1's saved input.
            let (f_in, f_out) = (self.features[i], self.features[i + 1]);
            let work = &mut s.grad[..f_in];
            work.copy_from_slice(&s.inputs[s.offsets[i]..s.offsets[i] + f_in]);
            forward_row(&self.ops[i], &self.params[i], work);
            s.inputs[s.offsets[i + 1]..s.offsets[i + 1] + f_out].copy_from_slice(&work[..f_out]);
        }
        let mut first_param = dp.len();
        let (mut g, mut g_next) = (&mut s.grad, &mut s.grad_next);
        g[..dy.len()].copy_from_slice(dy);
        for i in (0..ops).rev() {
            first_param -= self.params[i].len();
            let (f_in, f_out) = (self.features[i], self.features[i + 1]);
            let x = &s.inputs[s.offsets[i]..s.offsets[i] + f_in];
            let dp_op = &mut dp[first_param..first_param + self.params[i].len()];
            backward_row(&self.ops[i], &self.params[i], x, &g[..f_out], &mut g_next[..f_in], dp_op);
            std::mem::swap(&mut g, &mut g_next);
        }
        dz.copy_from_slice(&g[..self.features[0]]);
        if self.residual() {
            dz.iter_mut().zip(dy).for_each(|(d, g)| *d += g);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_takes_the_first_maximum_and_the_first_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[1.0, f32::NAN, 5.0, f32::NAN]), 1);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
    }

    #[test]
    fn avgpool_shrinks_the_row_in_place() {
        let mut v = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0];
        assert_eq!(forward_row(&Op::AvgPool(3), &[], &mut v), 2);
        assert_eq!(v[..2], [2.0, 5.0]);
    }

    #[test]
    fn sums_cover_every_element() {
        let xs: Vec<f32> = (1..=19).map(|i| i as f32).collect();
        assert_eq!(sum(&xs), 190.0);
        let (mean, rstd) = group_stats(&[2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0, 1.0, 9.0], 0.0);
        assert_eq!(mean, 5.0);
        assert!((1.0 / rstd - 6.4f32.sqrt()).abs() < 1e-6, "{rstd}"); // variance 64 / 10
    }
}

//! BatchNorm1d on batch statistics (the chain op `batchnorm`), column by column: a block
//! takes 128 features of a run of rows, each lane 4 consecutive features, its warp row
//! pairs (`kernel_abi::batch_norm`). A feature's sums over the rows stay in one thread
//! until the block's warps meet, and each pass over a `(rows, n)` tensor is one
//! coalesced read.
//!
//! With `P` the per-element ops before the BatchNorm (the block's GEMM chain, applied
//! to the saved `z` again where the kernels get `z`) and `Q` those after it:
//! * `batch_norm_stats`: each feature's count, mean and sum of squared deviations of
//!   `u = P(z)` over a block's rows (Welford per thread, Chan's merges across warps, so
//!   no `E[x^2] - E[x]^2` cancels); `batch_norm_finish` merges the blocks'.
//! * `batch_norm_apply`: `y = Q(gamma (u - mean) rstd + beta)`, `Q` per element.
//! * `batch_norm_backward_sums`: the gradient `dv` at the BatchNorm's output (from `dy`
//!   through `Q`) and, per block, `S2 = sum dv xhat` (gamma's gradient), `S1 = sum dv`
//!   (beta's) and `Q`'s parameter gradients.
//! * `batch_norm_backward_dz`: `du = gamma rstd (dv - (S1 + xhat S2) / N)`, the paths
//!   through the statistics included, then `dz` through `P`, with `P`'s parameter
//!   gradients and the Linear bias's (`sum dz`) per block.
//!
//! Chains whose ops after the BatchNorm need whole rows (a softmax) run those as the
//! row-wise epilogue's ops instead (the host's `gpu/batch_norm.rs`), with
//! `batch_norm_grad` for the paths through the statistics.

use crate::elementwise::global_index;
use crate::epilogue::lanes::{F4, LaneGroup, add_to_slot, lane_backward_rows, lane_forward_rows, store_row4};
use crate::epilogue::pointwise::param_count;
use crate::prelude::element::{Bf16, Element, F16};
use crate::prelude::math::sqrt;
use crate::prelude::*;
use crate::unroll;
use kernel_abi::batch_norm::{COLUMNS, MAX_OPS, THREADS, WARPS};
use kernel_abi::epilogue::OpDesc;

/// Two rows of a lane's 4 columns.
type Pair = [[f32; 4]; 2];

/// Where a thread works: its 4 columns from `c`, its block's rows `row0..row_end`.
#[derive(Clone, Copy)]
struct Place {
    n: usize,
    c: usize,
    row0: usize,
    row_end: usize,
    warp: usize,
    lane: usize,
}

impl Place {
    /// Block `(bx, by)` takes columns `128 bx..` of rows `by rows_per_block..`.
    #[inline(always)]
    fn here(rows: u32, n: u32, rows_per_block: u32) -> Place {
        let (rows, n, per_block) = (rows as usize, n as usize, rows_per_block as usize);
        let (warp, lane) = (warp_id() as usize, lane_id() as usize);
        let row0 = block_idx_y() as usize * per_block;
        let row_end = if row0 + per_block < rows { row0 + per_block } else { rows };
        Place { n, c: block_idx_x() as usize * COLUMNS + lane * 4, row0, row_end, warp, lane }
    }

    /// The warp's row pairs `(row, both)` (`both`: row + 1 is the block's too); none for
    /// a lane whose columns all lie past `n`. (An iterator, not a closure taking the
    /// body: the closure was compiled as a function of its own, its state on the stack.)
    #[inline(always)]
    fn pairs(&self) -> Pairs {
        let row = if self.c < self.n { self.row0 + 2 * self.warp } else { self.row_end };
        Pairs { row, end: self.row_end }
    }

    /// Per-column vector `v[c..c + 4]` (0 past `n`).
    ///
    /// # Safety
    /// `v` holds `n` floats.
    #[inline(always)]
    unsafe fn column(&self, v: *const f32) -> [f32; 4] {
        unsafe { AsStored::column4(Vector(v as u64), self.n, self.c) }
    }

    /// Per-column parameter `p[c..c + 4]` as stored (0 past `n`).
    ///
    /// # Safety
    /// `p` holds `n` values.
    #[inline(always)]
    unsafe fn param(&self, p: Vector) -> [f32; 4] {
        unsafe { AsStored::column4(p, self.n, self.c) }
    }

    /// Rows `row` and, when `both`, `row + 1` of the lane's columns (0 past `n`, and
    /// for an absent second row): one load per row where `n % 4 == 0` (the host then
    /// sends tensors aligned for it).
    ///
    /// # Safety
    /// `src` holds `row_end * n` values.
    #[inline(always)]
    unsafe fn load_pair<T: Element>(&self, src: *const T, row: usize, both: bool) -> Pair {
        let (n, c) = (self.n, self.c);
        let mut v = [[0.0f32; 4]; 2];
        unroll!(i in 0..2 => {
            if i == 0 || both {
                let at = (row + i) * n + c;
                // SAFETY: row + i < row_end; c + 4 <= n where n % 4 == 0 (c < n),
                // else each column checked.
                unsafe {
                    if n % 4 == 0 {
                        v[i] = T::load4_nc(src.add(at));
                    } else {
                        unroll!(e in 0..4 => { if c + e < n { v[i][e] = T::load1(src.add(at + e)); } });
                    }
                }
            }
        });
        v
    }

    /// Writes rows `row` and, when `both`, `row + 1` of the lane's columns.
    ///
    /// # Safety
    /// `dst` holds `row_end * n` values.
    #[inline(always)]
    unsafe fn store_pair<O: Element>(&self, dst: *mut O, v: &Pair, row: usize, both: bool) {
        unsafe {
            store_row4(dst, v[0], row, self.n, self.c);
            if both {
                store_row4(dst, v[1], row + 1, self.n, self.c);
            }
        }
    }
}

/// A warp's row pairs ([`Place::pairs`]).
struct Pairs {
    row: usize,
    end: usize,
}

impl Iterator for Pairs {
    type Item = (usize, bool);
    #[inline(always)]
    fn next(&mut self) -> Option<(usize, bool)> {
        let row = self.row;
        if row >= self.end {
            return None;
        }
        self.row += 2 * WARPS;
        Some((row, row + 1 < self.end))
    }
}

/// Copies the op descriptors `ops[..len]` into shared memory (by the block's first
/// threads; a barrier must follow before they are read).
///
/// # Safety
/// `ops` holds `len <= MAX_OPS` descriptors, `table` room for them.
#[inline(always)]
unsafe fn copy_ops(ops: *const OpDesc, len: usize, table: *mut OpDesc) {
    let t = thread_idx_x() as usize;
    if t < len {
        // SAFETY: t < len.
        unsafe { *table.add(t) = *ops.add(t) };
    }
}

/// Parameter-gradient slots of the per-element ops `ops[..len]`.
///
/// # Safety
/// `ops` holds `len` descriptors.
#[inline(always)]
unsafe fn params_of(ops: *const OpDesc, len: usize) -> usize {
    let mut count = 0;
    for i in 0..len {
        // SAFETY: i < len.
        count += param_count(unsafe { &*ops.add(i) });
    }
    count
}

/// The per-element ops `table[..len]` forward on two rows (never a GroupNorm: the
/// host sends per-element ops only).
///
/// # Safety
/// `table` holds `len` descriptors whose parameters hold `n` floats.
#[inline(always)]
unsafe fn chain_forward(table: *const OpDesc, len: usize, x: &mut Pair, p: &Place) {
    for i in 0..len {
        // SAFETY: i < len.
        lane_forward_rows(unsafe { &*table.add(i) }, LaneGroup::default, x, p.n, p.c);
    }
}

/// `g`, the gradient at the output of the ops `table[..len]` applied to `x0`, taken
/// back to their input; each op's parameter gradients are added to the warp's `sums`
/// from slot `first` on, in chain order (row 1's only when `both`). Each op's input is
/// recomputed from `x0`: the chains around a BatchNorm are a few ops long.
///
/// # Safety
/// As [`chain_forward`]; `sums` the warp's region of at least `first` + the ops'
/// parameter slots.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn chain_backward(table: *const OpDesc, len: usize, x0: &Pair, g: &mut Pair, p: &Place, sums: *mut F4, first: usize, both: bool) {
    // SAFETY (whole body): i < len; the slots as the caller promises.
    let mut slot = first + unsafe { params_of(table, len) };
    for i in (0..len).rev() {
        let op = unsafe { &*table.add(i) };
        let mut x = *x0;
        unsafe { chain_forward(table, i, &mut x, p) };
        slot -= param_count(op);
        unsafe { lane_backward_rows(op, LaneGroup::default(), &x, g, p.n, p.c, sums, slot, p.lane, both) };
    }
}

/// Zeroes the lane's `slots` sums in its warp's region of `all` (the block's
/// `[warp][slot][lane]` sums); returns that region.
///
/// # Safety
/// `all` holds `WARPS * slots * 32` sums.
#[inline(always)]
unsafe fn zeroed_sums(all: *mut F4, slots: usize, p: &Place) -> *mut F4 {
    // SAFETY: inside `all`; the lane's own slice.
    unsafe {
        let sums = all.add(p.warp * slots * 32);
        for k in 0..slots {
            *sums.add(k * 32 + p.lane) = F4([0.0; 4]);
        }
        sums
    }
}

/// The warps' sums meet; warp 0 writes the first `count` slots of the block's row of
/// `partials` `(blocks, count, n)`. Called by the whole block.
///
/// # Safety
/// As [`zeroed_sums`]; `partials` holds `(block_idx_y + 1) count n` floats.
#[inline(always)]
unsafe fn write_sums(all: *const F4, slots: usize, count: usize, partials: *mut f32, p: &Place) {
    // SAFETY: indices < WARPS * slots * 32; uniform barrier; columns past n are not stored.
    unsafe {
        sync_threads();
        if p.warp == 0 {
            let out = partials.add(block_idx_y() as usize * count * p.n);
            for k in 0..count {
                let mut v = [0.0f32; 4];
                for w in 0..WARPS {
                    let s = (*all.add((w * slots + k) * 32 + p.lane)).0;
                    unroll!(e in 0..4 => { v[e] += s[e]; });
                }
                store_row4(out, v, k, p.n, p.c);
            }
        }
    }
}

/// The BatchNorm's statistics as the kernels use them, `-mean` and
/// `rstd = 1 / sqrt(var + eps)` (as `batch_norm_finish` forms them, so every path
/// normalises alike), and its weight and bias, for the lane's columns.
#[derive(Clone, Copy)]
struct Affine {
    neg_mean: [f32; 4],
    rstd: [f32; 4],
    gamma: [f32; 4],
    beta: [f32; 4],
}

impl Affine {
    /// From the batch's mean and biased variance.
    ///
    /// # Safety
    /// `gamma` and `beta` hold `n` floats.
    #[inline(always)]
    unsafe fn of(mean: [f32; 4], var: [f32; 4], eps: f32, gamma: Vector, beta: Vector, p: &Place) -> Affine {
        // SAFETY: as the caller promises.
        let (gamma, beta) = unsafe { (p.param(gamma), p.param(beta)) };
        Affine { neg_mean: mean.map(|m| -m), rstd: var.map(|v| 1.0 / sqrt(v + eps)), gamma, beta }
    }

    /// From `stats`, `[mean; var]` (`2 n` floats: the forward's, or `batch_norm_finish`'s
    /// first rows).
    ///
    /// # Safety
    /// `stats` holds `2 n` floats, `gamma` and `beta` `n`.
    #[inline(always)]
    unsafe fn load(stats: *const f32, eps: f32, gamma: Vector, beta: Vector, p: &Place) -> Affine {
        // SAFETY: as the caller promises.
        unsafe { Affine::of(p.column(stats), p.column(stats.add(p.n)), eps, gamma, beta, p) }
    }

    /// `(xhat, v)`: `xhat = (u - mean) rstd` and the BatchNorm's output `gamma xhat + beta`.
    #[inline(always)]
    fn normalise(&self, u: &Pair) -> (Pair, Pair) {
        let (mut xhat, mut v) = ([[0.0f32; 4]; 2], [[0.0f32; 4]; 2]);
        unroll!(i in 0..2 => {
            unroll!(e in 0..4 => {
                xhat[i][e] = (u[i][e] + self.neg_mean[e]) * self.rstd[e];
                v[i][e] = xhat[i][e] * self.gamma[e] + self.beta[e];
            });
        });
        (xhat, v)
    }
}

/// Each feature's count, mean and sum of squared deviations of `u = P(src)` over block
/// `(bx, by)`'s rows, in FP64, at `partials[(3 by + j) n + c]` for `j` = count, mean, M2.
/// Each thread sums its rows' deviations from its first value, and their squares, in
/// FP64 (exact enough for FP32 inputs that no Welford update is needed); the warps' and
/// then the blocks' are merged pairwise (Chan et al.). FP64 throughout, so the mean and
/// variance are the FP32 data's to within their final rounding: a value next to a kink
/// after the BatchNorm (KernelBench 41's ReLU) sees the statistics' error only once.
///
/// # Safety
/// `src` holds `rows * n` floats (16-byte aligned where `n % 4 == 0`); `pre[..n_pre]`
/// per-element ops (`n_pre <= MAX_OPS`) with parameters of `n`; `partials`
/// `3 n ceil(rows / rows_per_block)` doubles. Launch: grid `(ceil(n / 128), ceil(rows /
/// rows_per_block))` of `THREADS`, `STATS_SMEM_BYTES` of shared memory; `rows_per_block` even.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn batch_norm_stats(
    src: *const f32,
    rows: u32,
    n: u32,
    rows_per_block: u32,
    pre: *const OpDesc,
    n_pre: u32,
    partials: *mut f64,
) {
    let p = Place::here(rows, n, rows_per_block);
    let n_pre = (n_pre as usize).min(MAX_OPS);
    let table = dynamic_shared::<OpDesc>();
    // SAFETY: the table's MAX_OPS descriptors, then THREADS * 9 doubles (STATS_SMEM_BYTES).
    let f = unsafe { table.add(MAX_OPS) } as *mut f64;
    unsafe {
        copy_ops(pre, n_pre, table);
        sync_threads();
    }
    let (mut count, mut shift, mut s1, mut s2) = (0.0f64, [0.0f64; 4], [0.0f64; 4], [0.0f64; 4]);
    for (row, both) in p.pairs() {
        // SAFETY: as the kernel's contract.
        let mut x = unsafe { p.load_pair(src, row, both) };
        unsafe { chain_forward(table, n_pre, &mut x, &p) };
        if count == 0.0 {
            shift = x[0].map(f64::from);
        }
        unroll!(i in 0..2 => {
            if i == 0 || both {
                count += 1.0;
                unroll!(e in 0..4 => {
                    let d = f64::from(x[i][e]) - shift[e];
                    s1[e] += d;
                    s2[e] += d * d;
                });
            }
        });
    }
    let mut acc = Moments { count, mean: [0.0; 4], m2: [0.0; 4] };
    if count > 0.0 {
        let inv = 1.0 / count;
        unroll!(e in 0..4 => {
            acc.mean[e] = shift[e] + s1[e] * inv;
            acc.m2[e] = s2[e] - s1[e] * s1[e] * inv;
        });
    }
    let t = thread_idx_x() as usize;
    // SAFETY: t < THREADS; 9 rows of THREADS doubles; uniform barrier.
    unsafe {
        *f.add(t) = acc.count;
        unroll!(e in 0..4 => {
            *f.add((1 + e) * THREADS + t) = acc.mean[e];
            *f.add((5 + e) * THREADS + t) = acc.m2[e];
        });
        sync_threads();
    }
    if p.warp != 0 || p.c >= p.n {
        return;
    }
    for w in 1..WARPS {
        let u = w * 32 + p.lane;
        // SAFETY: u < THREADS, written before the barrier.
        let other = unsafe {
            Moments {
                count: *f.add(u),
                mean: [0, 1, 2, 3].map(|e| *f.add((1 + e) * THREADS + u)),
                m2: [0, 1, 2, 3].map(|e| *f.add((5 + e) * THREADS + u)),
            }
        };
        acc.merge(&other);
    }
    let chunk = block_idx_y() as usize;
    // SAFETY: the block's three rows of partials; columns past n are not stored.
    unsafe {
        store_row4_f64(partials, [acc.count; 4], 3 * chunk, p.n, p.c);
        store_row4_f64(partials, acc.mean, 3 * chunk + 1, p.n, p.c);
        store_row4_f64(partials, acc.m2, 3 * chunk + 2, p.n, p.c);
    }
}

/// Writes the columns `c..c + 4` below `n` of `row` of `(.., n)` doubles.
///
/// # Safety
/// `row`'s columns below `n` are inside `dst`.
#[inline(always)]
unsafe fn store_row4_f64(dst: *mut f64, v: [f64; 4], row: usize, n: usize, c: usize) {
    unroll!(e in 0..4 => {
        if c + e < n {
            // SAFETY: as the caller promises.
            unsafe { *dst.add(row * n + c + e) = v[e] };
        }
    });
}

/// `N` columns' count (the same for all), means and sums of squared deviations, FP64.
#[derive(Clone, Copy)]
struct Moments<const N: usize> {
    count: f64,
    mean: [f64; N],
    m2: [f64; N],
}

impl<const N: usize> Moments<N> {
    /// Chan et al.'s pairwise merge of `other` into `self`.
    #[inline(always)]
    fn merge(&mut self, other: &Moments<N>) {
        if other.count == 0.0 {
            return;
        }
        let total = self.count + other.count;
        let (wb, wab) = (other.count / total, self.count * other.count / total);
        for e in 0..N {
            let d = other.mean[e] - self.mean[e];
            self.mean[e] += d * wb;
            self.m2[e] += other.m2[e] + d * d * wab;
        }
        self.count = total;
    }

    /// The merged partials `(blocks, 3, n)` of [`batch_norm_stats`] for columns `c..c + N`,
    /// in block order.
    ///
    /// # Safety
    /// `partials` holds `3 n blocks` doubles, `c < n` (columns past `n` read column
    /// `n - 1`; their values are never used).
    #[inline(always)]
    unsafe fn of_partials(partials: *const f64, blocks: usize, n: usize, c: usize) -> Moments<N> {
        let mut acc = Moments { count: 0.0, mean: [0.0; N], m2: [0.0; N] };
        let col = |e: usize| if c + e < n { c + e } else { n - 1 };
        for k in 0..blocks {
            // SAFETY: k < blocks; columns below n.
            let part = unsafe {
                Moments {
                    count: *partials.add(3 * k * n + col(0)),
                    mean: core::array::from_fn(|e| *partials.add((3 * k + 1) * n + col(e))),
                    m2: core::array::from_fn(|e| *partials.add((3 * k + 2) * n + col(e))),
                }
            };
            acc.merge(&part);
        }
        acc
    }

    /// The biased variances, rounded once to FP32 with the means.
    #[inline(always)]
    fn mean_var(&self) -> ([f32; N], [f32; N]) {
        (self.mean.map(|m| m as f32), core::array::from_fn(|e| (self.m2[e] / self.count) as f32))
    }
}

/// `y = Q(gamma (u - mean) rstd + beta)` over block `(bx, by)`'s rows, `Q` the
/// per-element ops `post[..n_post]` (the value formed as the row-wise path's ops
/// `bias(-mean), mul(rstd), mul(gamma), bias(beta)` form it).
///
/// # Safety
/// `u` holds `rows * n` floats, `y` `rows * n` values (aligned for 4-value accesses
/// where `n % 4 == 0`); `stats` `[mean; var]`, `2 n`; `gamma`, `beta` `n`; `post`
/// per-element ops, `n_post <= MAX_OPS`. Launch as [`batch_norm_stats`], with `MAX_OPS`
/// descriptors of shared memory.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn apply<O: Element>(
    u: *const f32,
    rows: u32,
    n: u32,
    rows_per_block: u32,
    (stats, gamma, beta, eps): (*const f32, Vector, Vector, f32),
    (post, n_post): (*const OpDesc, u32),
    y: *mut O,
) {
    let p = Place::here(rows, n, rows_per_block);
    let n_post = (n_post as usize).min(MAX_OPS);
    let table = dynamic_shared::<OpDesc>();
    // SAFETY: MAX_OPS descriptors of shared memory; uniform barrier.
    unsafe {
        copy_ops(post, n_post, table);
        sync_threads();
    }
    if p.c >= p.n {
        return;
    }
    // SAFETY: as the kernel's contract.
    let bn = unsafe { Affine::load(stats, eps, gamma, beta, &p) };
    for (row, both) in p.pairs() {
        // SAFETY (whole body): as the kernel's contract.
        let x = unsafe { p.load_pair(u, row, both) };
        let (_, mut v) = bn.normalise(&x);
        unsafe {
            chain_forward(table, n_post, &mut v, &p);
            p.store_pair(y, &v, row, both);
        }
    }
}

/// The op tables of `P` and `Q` in shared memory and the warp's `slots` sums, zeroed:
/// `(P's table, Q's table, the block's sums, the warp's)`. Called by the whole block
/// (it ends on a barrier).
///
/// # Safety
/// `pre`, `post` hold `n_pre`, `n_post <= MAX_OPS` descriptors; the launch's
/// `sums_smem_bytes(slots)` of shared memory.
#[inline(always)]
unsafe fn tables_and_sums(
    (pre, n_pre): (*const OpDesc, usize),
    (post, n_post): (*const OpDesc, usize),
    slots: usize,
    p: &Place,
) -> (*const OpDesc, *const OpDesc, *mut F4, *mut F4) {
    let pre_t = dynamic_shared::<OpDesc>();
    // SAFETY (whole body): two tables of MAX_OPS descriptors, then the sums; uniform barrier.
    unsafe {
        let post_t = pre_t.add(MAX_OPS);
        let all = pre_t.add(2 * MAX_OPS) as *mut F4;
        copy_ops(pre, n_pre, pre_t);
        copy_ops(post, n_post, post_t);
        let sums = zeroed_sums(all, slots, p);
        sync_threads();
        (pre_t, post_t, all, sums)
    }
}

/// A row pair's way back to the BatchNorm: `(z, xhat, dv)`, its `z`, `xhat` at
/// `u = P(z)`, and `dy` taken back through `Q` to the BatchNorm's output (`Q`'s
/// parameter gradients added to the sums from slot `first`).
///
/// # Safety
/// As [`backward_sums`]'s contract; the tables of [`tables_and_sums`].
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn pair_dv<G: Element>(
    (z, dy): (*const f32, *const G),
    (row, both): (usize, bool),
    (pre_t, n_pre): (*const OpDesc, usize),
    (post_t, n_post): (*const OpDesc, usize),
    bn: &Affine,
    sums: *mut F4,
    first: usize,
    p: &Place,
) -> (Pair, Pair, Pair) {
    // SAFETY (whole body): as the caller promises.
    unsafe {
        let x0 = p.load_pair(z, row, both);
        let mut u = x0;
        chain_forward(pre_t, n_pre, &mut u, p);
        let (xhat, v) = bn.normalise(&u);
        let mut g = p.load_pair(dy, row, both);
        chain_backward(post_t, n_post, &v, &mut g, p, sums, first, both);
        (x0, xhat, g)
    }
}

/// From `z` and `dy`, the gradient sums of block `(bx, by)`'s rows: `partials[by]`
/// `(2 + q, n)`, slot 0 `sum dv xhat` (gamma's), slot 1 `sum dv` (beta's), then the
/// parameters of `Q` in chain order; `dv` is `dy` taken back through `Q`, `u = P(z)`.
///
/// # Safety
/// `z` holds `rows * n` floats, `dy` `rows * n` values (16- or 8-byte aligned where
/// `n % 4 == 0`); `pre`, `post` per-element ops, at most `MAX_OPS` each, with together
/// at most `MAX_SLOTS - 2` parameters; `stats` `[mean; var]`, `2 n`; `gamma`, `beta` `n`.
/// Launch as
/// [`batch_norm_stats`], with `sums_smem_bytes(2 + q)` of shared memory.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn backward_sums<G: Element>(
    z: *const f32,
    dy: *const G,
    rows: u32,
    n: u32,
    rows_per_block: u32,
    (pre, n_pre): (*const OpDesc, u32),
    (stats, gamma, beta, eps): (*const f32, Vector, Vector, f32),
    (post, n_post): (*const OpDesc, u32),
    partials: *mut f32,
) {
    let p = Place::here(rows, n, rows_per_block);
    let (n_pre, n_post) = ((n_pre as usize).min(MAX_OPS), (n_post as usize).min(MAX_OPS));
    // SAFETY: post holds n_post descriptors.
    let slots = 2 + unsafe { params_of(post, n_post) };
    // SAFETY: as the kernel's contract.
    let (pre_t, post_t, all, sums) = unsafe { tables_and_sums((pre, n_pre), (post, n_post), slots, &p) };
    if p.c < p.n {
        // SAFETY: as the kernel's contract.
        let bn = unsafe { Affine::load(stats, eps, gamma, beta, &p) };
        for pair in p.pairs() {
            // SAFETY (whole body): as the kernel's contract; slots 0 and 1, then Q's.
            unsafe {
                let (_, xhat, g) = pair_dv((z, dy), pair, (pre_t, n_pre), (post_t, n_post), &bn, sums, 2, &p);
                let both = pair.1;
                let gx = [0, 1].map(|i| [0, 1, 2, 3].map(|e| g[i][e] * xhat[i][e]));
                add_to_slot(sums, 0, p.lane, &gx, both);
                add_to_slot(sums, 1, p.lane, &g, both);
            }
        }
    }
    // SAFETY: the block's row of partials (2 + q slots).
    unsafe { write_sums(all, slots, slots, partials, &p) };
}

/// `dz` and the gradient sums of block `(bx, by)`'s rows: `partials[by]` `(1 + p, n)`,
/// slot 0 `sum dz` (the Linear bias's), then the parameters of `P` in chain order.
/// `dv` as [`backward_sums`]; with `a = gamma rstd`, `du = a (dv - (S1 + xhat S2) / rows)`
/// (`S2 = sums[..n]`, `S1 = sums[n..2 n]`, the grid's sums of `backward_sums`); over two
/// rows `xhat = ±sqrt(1 - eps rstd^2)`, where `1 - xhat^2` would cancel to noise, so
/// there its exact value is used: `du = a (dv - S1 / 2) eps rstd^2`. Then `dz` is `du`
/// taken back through `P`.
///
/// # Safety
/// As [`backward_sums`]; `dz` as `dy`; `sums` holds `2 n` floats. Launch as
/// [`backward_sums`], with `sums_smem_bytes(1 + p + q)` of shared memory.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn backward_dz<G: Element>(
    (z, dy, dz): (*const f32, *const G, *mut G),
    rows: u32,
    n: u32,
    rows_per_block: u32,
    (pre, n_pre): (*const OpDesc, u32),
    (stats, gamma, beta, eps): (*const f32, Vector, Vector, f32),
    (post, n_post): (*const OpDesc, u32),
    sums_in: *const f32,
    partials: *mut f32,
) {
    let p = Place::here(rows, n, rows_per_block);
    let (n_pre, n_post) = ((n_pre as usize).min(MAX_OPS), (n_post as usize).min(MAX_OPS));
    // Slots: the Linear bias's, P's, then Q's (summed again here, never written).
    // SAFETY: pre and post hold n_pre and n_post descriptors.
    let (p_slots, q_slots) = unsafe { (params_of(pre, n_pre), params_of(post, n_post)) };
    let slots = 1 + p_slots + q_slots;
    // SAFETY: as the kernel's contract.
    let (pre_t, post_t, all, sums) = unsafe { tables_and_sums((pre, n_pre), (post, n_post), slots, &p) };
    if p.c < p.n {
        // SAFETY: as the kernel's contract.
        let (bn, s2, s1) = unsafe { (Affine::load(stats, eps, gamma, beta, &p), p.column(sums_in), p.column(sums_in.add(p.n))) };
        let two = rows == 2;
        // Divided, not multiplied by a rounded `1 / rows`: that reciprocal's error has
        // the same sign in every row, and the Linear bias's gradient, `sum dz`, cancels
        // the correction against `sum dv`, keeping it.
        let rows_f = rows as f32;
        for (row, both) in p.pairs() {
            // SAFETY (whole body): as the kernel's contract; slots below `slots`.
            unsafe {
                let tables = ((pre_t, n_pre), (post_t, n_post));
                let (x0, xhat, mut g) = pair_dv((z, dy), (row, both), tables.0, tables.1, &bn, sums, 1 + p_slots, &p);
                unroll!(i in 0..2 => {
                    unroll!(e in 0..4 => {
                        let (a, r) = (bn.gamma[e] * bn.rstd[e], bn.rstd[e]);
                        g[i][e] = if two {
                            a * (g[i][e] - s1[e] * 0.5) * (eps * r * r)
                        } else {
                            a * (g[i][e] - (s1[e] + xhat[i][e] * s2[e]) / rows_f)
                        };
                    });
                });
                chain_backward(pre_t, n_pre, &x0, &mut g, &p, sums, 1, both);
                add_to_slot(sums, 0, p.lane, &g, both);
                p.store_pair(dz, &g, row, both);
            }
        }
    }
    // SAFETY: the block's row of partials (1 + p slots).
    unsafe { write_sums(all, slots, 1 + p_slots, partials, &p) };
}

/// The column kernels' entry points, one per type of the 16-bit or FP32 tensors they
/// read or write beside the FP32 `z` or `u` (`y`; `dy` and `dz`).
macro_rules! batch_norm_entry_points {
    ($($apply:ident, $sums:ident, $dz:ident: $t:ty;)*) => {$(
        /// `apply` into `y` of this entry point's type.
        ///
        /// # Safety
        /// As `apply`.
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "ptx-kernel" fn $apply(
            u: *const f32,
            rows: u32,
            n: u32,
            rows_per_block: u32,
            stats: *const f32,
            gamma: Vector,
            beta: Vector,
            eps: f32,
            post: *const OpDesc,
            n_post: u32,
            y: *mut $t,
        ) {
            unsafe { apply(u, rows, n, rows_per_block, (stats, gamma, beta, eps), (post, n_post), y) }
        }

        /// `backward_sums` on `dy` of this entry point's type.
        ///
        /// # Safety
        /// As `backward_sums`.
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "ptx-kernel" fn $sums(
            z: *const f32,
            dy: *const $t,
            rows: u32,
            n: u32,
            rows_per_block: u32,
            pre: *const OpDesc,
            n_pre: u32,
            stats: *const f32,
            gamma: Vector,
            beta: Vector,
            eps: f32,
            post: *const OpDesc,
            n_post: u32,
            partials: *mut f32,
        ) {
            unsafe {
                backward_sums(z, dy, rows, n, rows_per_block, (pre, n_pre), (stats, gamma, beta, eps), (post, n_post), partials)
            }
        }

        /// `backward_dz` on `dy` and `dz` of this entry point's type.
        ///
        /// # Safety
        /// As `backward_dz`.
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "ptx-kernel" fn $dz(
            z: *const f32,
            dy: *const $t,
            dz: *mut $t,
            rows: u32,
            n: u32,
            rows_per_block: u32,
            pre: *const OpDesc,
            n_pre: u32,
            stats: *const f32,
            gamma: Vector,
            beta: Vector,
            eps: f32,
            post: *const OpDesc,
            n_post: u32,
            sums: *const f32,
            partials: *mut f32,
        ) {
            unsafe {
                backward_dz(
                    (z, dy, dz),
                    rows,
                    n,
                    rows_per_block,
                    (pre, n_pre),
                    (stats, gamma, beta, eps),
                    (post, n_post),
                    sums,
                    partials,
                )
            }
        }
    )*};
}
batch_norm_entry_points! {
    batch_norm_apply, batch_norm_backward_sums, batch_norm_backward_dz: f32;
    batch_norm_apply_bf16, batch_norm_backward_sums_bf16, batch_norm_backward_dz_bf16: Bf16;
    batch_norm_apply_f16, batch_norm_backward_sums_f16, batch_norm_backward_dz_f16: F16;
}

/// From the `chunks` partials of [`batch_norm_stats`], the four rows the row-wise path's
/// epilogue reads: `out = [mean; var; -mean; 1 / sqrt(var + eps)]` (`var` biased: M2
/// over all rows; merged in FP64, rounded once).
///
/// # Safety
/// `partials` holds `3 n chunks` doubles, `out` `4 n` floats. Launch: 1-D over `n`.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn batch_norm_finish(partials: *const f64, chunks: u32, n: u32, eps: f32, out: *mut f32) {
    let (c, n) = (global_index(), n as usize);
    if c >= n {
        return;
    }
    // SAFETY: the sizes above; c < n.
    let ([mean], [var]) = unsafe { Moments::<1>::of_partials(partials, chunks as usize, n, c) }.mean_var();
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
    gamma: Vector,
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
        let a = gamma.get(c) * rstd;
        let gi = g.add(i);
        *gi = if rows == 2 {
            (*gi - a * *s1.add(c) * 0.5) * (eps * rstd * rstd)
        } else {
            *gi - a * (*s1.add(c) + xhat * *s2.add(c)) / rows as f32
        };
    }
}

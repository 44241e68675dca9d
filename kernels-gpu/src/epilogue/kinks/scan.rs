//! `kink_scan`: the row-wise scan, a block per row of `z`, values and radii in shared memory.

use super::*;

use super::radius::*;

/// `(v[j], r[j]) = op(j, v[j], r[j])` for the block's values `j < f`.
///
/// # Safety
/// `v` and `r` hold `f` floats of shared memory; `op` reads only inside its contract.
#[inline(always)]
unsafe fn each(v: *mut f32, r: *mut f32, f: usize, mut op: impl FnMut(usize, f32, f32) -> (f32, f32)) {
    let mut j = thread_idx_x() as usize;
    while j < f {
        // SAFETY: j < f.
        unsafe {
            let (y, ry) = op(j, *v.add(j), *r.add(j));
            *v.add(j) = y;
            *r.add(j) = ry;
        }
        j += ROW_THREADS;
    }
}

/// Where [`kink_scan`] marks the chunks a doubtful decision depends on, for the op
/// being scanned: `pool` columns of `z` per feature of its input, decisions depending
/// on aligned blocks of `dep` columns (or the whole row).
#[derive(Clone, Copy)]
struct Marks {
    flags: *mut u8,
    row_flag: *mut u32,
    pool: usize,
    dep: usize,
    n: usize,
}

impl Marks {
    /// Marks the chunks of `z` columns that feature `j` of the op's input depends on.
    ///
    /// # Safety
    /// `flags` holds `n.div_ceil(CHUNK)` bytes; `j * pool < n`.
    #[inline(always)]
    unsafe fn flag(&self, j: usize) {
        unsafe {
            if self.dep == WHOLE_ROW {
                *self.row_flag = 1;
                return;
            }
            let start = j * self.pool / self.dep * self.dep;
            let end = (start + self.dep).min(self.n);
            let mut c = start / CHUNK;
            while c * CHUNK < end {
                *self.flags.add(c) = 1;
                c += 1;
            }
        }
    }
}

/// [`each`] through one per-element op `P`, marking the values whose kink is within
/// reach (the op a constant here, so the loop has no dispatch).
///
/// # Safety
/// As [`each`] and [`Marks::flag`]; the op's parameter holds `f` floats.
#[inline(always)]
unsafe fn pointwise_pass<P: PointwiseMath>(op: &OpDesc, v: *mut f32, r: *mut f32, f: usize, c: f32, marks: Marks) {
    let p0 = Vector(op.param0);
    unsafe {
        each(v, r, f, |j, x, rx| {
            let p = if P::HAS_PARAM { p0.get(j) } else { 0.0 };
            let (y, ry, doubtful) = pointwise_radius::<P>(op, p, x, rx, rx + c * fabs(x));
            if doubtful {
                marks.flag(j);
            }
            (y, ry)
        })
    }
}

/// Lists, for every row of `z`, the chunks of `z` whose rounding could move a kinked
/// op's input across its kink, or that feed an ill-conditioned GroupNorm group:
/// `lists[c * rows + i]`, `i < counts[c]`, are the rows whose chunk `c` needs its
/// exact values.
///
/// Each value of `z` starts with the radius `rel_err * rms(z row)` and a relative
/// error `abs_err` common to the row (the host's model of its precision's GEMM error,
/// already scaled to a bound), which each op carries forward: Lipschitz bounds for
/// the pointwise ops, and for GroupNorm the element's own radius plus its group
/// statistics' (`rms radius / sqrt(size)`, through the mean and through `1 / std`).
/// An input within its radius of a kink (LeakyReLU's 0, Hardtanh's bounds, a second
/// candidate for a row max) is doubtful.
///
/// # Safety
/// Device pointers; `ops[..n_ops]` well formed. `counts` zeroed, `n.div_ceil(CHUNK)`
/// entries; `lists` `n.div_ceil(CHUNK) * rows`. Launch: grid `(rows, 1, 1)`,
/// `ROW_THREADS` threads, `scan_smem_bytes(n)` dynamic shared memory.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
// NaN tests written `x == x` on purpose: `is_nan()` compiles to other PTX in this kernel
// (checked by diff), and the kernel as it stands is the one verified on the GPU.
#[allow(clippy::eq_op)]
pub unsafe extern "ptx-kernel" fn kink_scan(
    z: *const f32,
    n: u32,
    ops: *const OpDesc,
    n_ops: u32,
    rel_err: f32,
    abs_err: f32,
    counts: *mut u32,
    lists: *mut u32,
) {
    let row = block_idx_x() as usize;
    let rows = grid_dim_x() as usize;
    let t = thread_idx_x() as usize;
    let (warp, lane) = (warp_id() as usize, lane_id() as usize);
    let n = n as usize;
    let chunks = n.div_ceil(CHUNK);
    let base = dynamic_shared::<f32>();
    // SAFETY (whole body): scan_smem_bytes(n, pooled) covers [v: n][r: n] (and, when
    // the ops pool, [v_alt: n][r_alt: n]) [red: WARPS][row flag: 1][flags: chunks
    // bytes]; every index below is inside its array; barriers are reached by the whole block.
    unsafe {
        let mut pooled = false;
        for i in 0..n_ops as usize {
            pooled |= matches!((*ops.add(i)).code, OP_AVG_POOL | OP_MAX_POOL);
        }
        let (mut v, mut r) = (base, base.add(n));
        let (mut v_alt, mut r_alt) = if pooled { (base.add(2 * n), base.add(3 * n)) } else { (v, r) };
        let red = base.add(if pooled { 4 * n } else { 2 * n });
        let row_flag = red.add(WARPS) as *mut u32;
        let flags = row_flag.add(1) as *mut u8;
        let mut sq = 0.0;
        let mut j = t;
        while j < n {
            let x = *z.add(row * n + j);
            *v.add(j) = x;
            if x == x {
                sq += x * x;
            }
            j += ROW_THREADS;
        }
        let mut c = t;
        while c < chunks {
            *flags.add(c) = 0;
            c += ROW_THREADS;
        }
        if t == 0 {
            *row_flag = 0;
        }
        let rms = sqrt(block_sum(sq, red) / n as f32);
        let base = rel_err * rms;
        let mut j = t;
        while j < n {
            *r.add(j) = base;
            j += ROW_THREADS;
        }
        sync_threads();

        // `r` holds each value's radius; `c` a relative error common to all values
        // (TF32's truncation shrinks every product alike): a GroupNorm divides it out,
        // a sign or a row max's pick does not see it, and where it matters (an added
        // bias, a Hardtanh bound, a curved activation) it joins `r` as `c |v|`.
        let mut c = abs_err;
        let (mut f, mut pool, mut dep) = (n, 1usize, 1usize);
        for i in 0..n_ops as usize {
            let op = &*ops.add(i);
            let (p0, p1) = (Vector(op.param0), Vector(op.param1));
            let f_out = features_after(op, f);
            let marks = Marks { flags, row_flag, pool, dep, n };
            match op.code {
                OP_GROUP_NORM => {
                    let (groups, size) = (op.count as usize, f / op.count as usize);
                    // Lanes per group: a power-of-two group of up to 32 channels takes
                    // that many lanes (a warp does 32 / size groups at once), larger or
                    // odd ones the whole warp.
                    let seg = if size <= WARP && size.is_power_of_two() { size } else { WARP };
                    let per_warp = WARP >> seg.trailing_zeros();
                    let (sub, sl) = (lane >> seg.trailing_zeros(), lane & (seg - 1));
                    let inv = 1.0 / size as f32;
                    let mut g0 = warp * per_warp;
                    while g0 < groups {
                        let g = g0 + sub;
                        let live = g < groups;
                        let (vs, rs) = (v.add(g.min(groups - 1) * size), r.add(g.min(groups - 1) * size));
                        let (mut s1, mut s2) = (0.0, 0.0);
                        let mut j = sl;
                        while live && j < size {
                            s1 += *vs.add(j);
                            s2 += *rs.add(j) * *rs.add(j);
                            j += seg;
                        }
                        let mean = segment_sum(s1, seg as u32) * inv;
                        let r2 = segment_sum(s2, seg as u32);
                        let mut sq = 0.0;
                        let mut j = sl;
                        while live && j < size {
                            let d = *vs.add(j) - mean;
                            sq += d * d;
                            j += seg;
                        }
                        let rstd = rsqrt(fma(segment_sum(sq, seg as u32), inv, op.a));
                        let stats = GroupRadius::new(mean, rstd, r2, size, rel_err);
                        if live && sl == 0 && stats.ill_conditioned {
                            Marks { dep: nest(dep, size * pool), ..marks }.flag(g * size);
                        }
                        let mut j = sl;
                        while live && j < size {
                            let ch = g * size + j;
                            let (y, ry) = stats.apply(*vs.add(j), *rs.add(j), p0.get(ch), p1.get(ch));
                            *vs.add(j) = y;
                            *rs.add(j) = ry;
                            j += seg;
                        }
                        g0 += WARPS * per_warp;
                    }
                    dep = nest(dep, size * pool);
                }
                OP_AVG_POOL => {
                    let k = op.count as usize;
                    let mut j = t;
                    while j < f_out {
                        let (mut sv, mut sr) = (0.0, 0.0);
                        for e in 0..k {
                            sv += *v.add(j * k + e);
                            sr += *r.add(j * k + e);
                        }
                        *v_alt.add(j) = sv / k as f32;
                        *r_alt.add(j) = sr / k as f32;
                        j += ROW_THREADS;
                    }
                    core::mem::swap(&mut v, &mut v_alt);
                    core::mem::swap(&mut r, &mut r_alt);
                    pool *= k;
                    dep = nest(dep, pool);
                }
                OP_ROW_MAX | OP_ROW_MIN => {
                    // Doubtful when another element's upper bound reaches the largest
                    // lower bound: the arg-max could be either. (The min is the max of
                    // the negated values.)
                    let sign = if op.code == OP_ROW_MIN { -1.0 } else { 1.0 };
                    let mut lo = f32::NEG_INFINITY;
                    let mut j = t;
                    while j < f {
                        lo = max_nan(lo, sign * *v.add(j) - *r.add(j));
                        j += ROW_THREADS;
                    }
                    let top = block_max(lo, red);
                    let (mut near, mut m, mut rm) = (0.0, f32::NEG_INFINITY, 0.0f32);
                    let mut j = t;
                    while j < f {
                        let (x, rx) = (sign * *v.add(j), *r.add(j));
                        if x + rx >= top {
                            near += 1.0;
                        }
                        m = max_nan(m, x);
                        rm = rm.max(rx);
                        j += ROW_THREADS;
                    }
                    let near = block_sum(near, red);
                    let m = block_max(m, red);
                    // A bound on the max's own radius, for any op after it.
                    let rm = block_reduce(rm, red, warp_max, 0.0, f32::max);
                    if t == 0 {
                        *v = sign * m;
                        *r = rm;
                        if near >= 2.0 && top == top {
                            *row_flag = 1;
                        }
                    }
                    dep = WHOLE_ROW;
                }
                OP_MAX_POOL => {
                    // A window is doubtful as a row max is; its max carries the
                    // window's largest radius.
                    let k = op.count as usize;
                    let window = Marks { dep: nest(dep, pool * k), ..marks };
                    let mut j = t;
                    while j < f_out {
                        let (mut lo, mut m, mut rm) = (f32::NEG_INFINITY, f32::NEG_INFINITY, 0.0f32);
                        for e in 0..k {
                            let (x, rx) = (*v.add(j * k + e), *r.add(j * k + e));
                            lo = max_nan(lo, x - rx);
                            m = max_nan(m, x);
                            rm = rm.max(rx);
                        }
                        let mut near = 0;
                        for e in 0..k {
                            if *v.add(j * k + e) + *r.add(j * k + e) >= lo {
                                near += 1;
                            }
                        }
                        if near >= 2 && lo == lo {
                            window.flag(j * k);
                        }
                        *v_alt.add(j) = m;
                        *r_alt.add(j) = rm;
                        j += ROW_THREADS;
                    }
                    core::mem::swap(&mut v, &mut v_alt);
                    core::mem::swap(&mut r, &mut r_alt);
                    pool *= k;
                    dep = nest(dep, pool);
                }
                OP_ROW_SUM | OP_ROW_MEAN | OP_LOGSUMEXP => {
                    // Sum and mean: the radii add up, the common relative error stays
                    // (`c` carried on). logsumexp moves by at most its inputs' largest
                    // change, common error included.
                    let lse = op.code == OP_LOGSUMEXP;
                    let (mut s, mut m, mut rs) = (0.0, f32::NEG_INFINITY, 0.0f32);
                    let mut j = t;
                    while j < f {
                        let (x, rx) = (*v.add(j), *r.add(j));
                        s += x;
                        m = max_nan(m, x);
                        rs = if lse { rs.max(rx + c * fabs(x)) } else { rs + rx };
                        j += ROW_THREADS;
                    }
                    let m = block_max(m, red);
                    let shift = crate::epilogue::logsumexp_shift(m);
                    let mut e = 0.0;
                    let mut j = t;
                    while lse && j < f {
                        e += exp(*v.add(j) - shift);
                        j += ROW_THREADS;
                    }
                    let s = block_sum(if lse { e } else { s }, red);
                    let rs = if lse { block_reduce(rs, red, warp_max, 0.0, f32::max) } else { block_sum(rs, red) };
                    if t == 0 {
                        *v = if lse { shift + ln(s) } else if op.code == OP_ROW_MEAN { s / f as f32 } else { s };
                        *r = if op.code == OP_ROW_MEAN { rs / f as f32 } else { rs };
                    }
                    dep = WHOLE_ROW;
                }
                OP_SOFTMAX => {
                    // |ds_j| <= s_j (|d_j| + sum_k s_k |d_k|) for input changes d.
                    let mut m = f32::NEG_INFINITY;
                    let mut j = t;
                    while j < f {
                        m = max_nan(m, *v.add(j));
                        j += ROW_THREADS;
                    }
                    let m = block_max(m, red);
                    let mut e = 0.0;
                    let mut j = t;
                    while j < f {
                        let x = *v.add(j);
                        *r.add(j) += c * fabs(x);
                        *v.add(j) = exp(x - m);
                        e += *v.add(j);
                        j += ROW_THREADS;
                    }
                    let e = block_sum(e, red);
                    let mut sr = 0.0;
                    let mut j = t;
                    while j < f {
                        *v.add(j) /= e;
                        sr += *v.add(j) * *r.add(j);
                        j += ROW_THREADS;
                    }
                    let sr = block_sum(sr, red);
                    each(v, r, f, |_, s, rx| (s, s * (rx + sr)));
                    dep = WHOLE_ROW;
                }
                OP_RMS_NORM => {
                    // As a GroupNorm of one group around 0.
                    let (mut sq, mut r2) = (0.0, 0.0);
                    let mut j = t;
                    while j < f {
                        sq += *v.add(j) * *v.add(j);
                        r2 += *r.add(j) * *r.add(j);
                        j += ROW_THREADS;
                    }
                    let rstd = rsqrt(block_sum(sq, red) / f as f32 + op.a);
                    let stats = GroupRadius::new(0.0, rstd, block_sum(r2, red), f, rel_err);
                    if t == 0 && stats.ill_conditioned {
                        *row_flag = 1;
                    }
                    each(v, r, f, |j, x, rx| stats.apply(x, rx, p0.get(j), 0.0));
                    dep = WHOLE_ROW;
                }
                // One loop per op, its code a constant there (a `match` per value would
                // dispatch in the loop).
                code => match_pointwise!(code, P => pointwise_pass::<P>(op, v, r, f, c, marks),
                    _ => each(v, r, f, |_, _, _| (f32::NAN, f32::NAN))), // unknown code: poison
            }
            if clears_common(op.code) {
                c = 0.0;
            }
            f = f_out;
            sync_threads();
        }

        let whole = *row_flag != 0;
        let mut c = t;
        while c < chunks {
            if whole || *flags.add(c) != 0 {
                let i = atomic_add_global(counts.add(c), 1);
                *lists.add(c * rows + i as usize) = row as u32;
            }
            c += ROW_THREADS;
        }
    }
}


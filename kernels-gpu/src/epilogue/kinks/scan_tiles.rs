//! `kink_scan_tiles`: the scan of the chains the tile-wise backward takes, values and radii
//! in registers.

use super::*;

use super::radius::*;

/// Bits of the chunks (of the 8 in a 128-column segment starting at `seg0`) that the
/// decision at column `col` depends on: its aligned block of `dep` columns (a power
/// of two up to 128), cut at `n`.
#[inline(always)]
fn chunk_bits(col: usize, dep: usize, seg0: usize, n: usize) -> u32 {
    let start = col & !(dep - 1);
    let end = (start + dep).min(n);
    let (first, last) = ((start - seg0) / CHUNK, (end - 1 - seg0) / CHUNK);
    ((2u32 << last) - 1) & !((1u32 << first) - 1)
}

/// [`kink_scan`] for the chains the tile-wise path takes (pointwise ops and GroupNorm
/// over groups of a power of two from 4 to 128 channels, so a group never crosses a
/// 128-column segment): one warp per row, a lane holding 4 consecutive columns of
/// each segment, values and radii in registers, a group's statistics by shuffles
/// among its lanes. The same radii and tests as the row-wise scan.
///
/// The block's warps take every 8th segment of one row. A row whose decisions depend
/// on at most `cap` values of `z` (M5's under TF32: its Hardtanh's doubtful values
/// alone, now and then a whole group of its GroupNorm) appends them to `values` as
/// (row, column) pairs, `value_count` of them, for [`refine_values`]: `refine_z` would
/// read a 16-column chunk of weights and `x`'s row for each. A row with more (M3's:
/// every kink after its GroupNorm takes a group) lists the chunks for `refine_z`, each
/// (row, chunk) once.
///
/// # Safety
/// As [`kink_scan`], and the chain as said; `values` has room for `2 * cap` u32 per
/// row. Launch: grid `(rows, 1, 1)`, `ROW_THREADS` threads, `tiles_scan_layout(n,
/// cap)[5]` bytes of shared memory.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
// NaN tests written `x == x` on purpose: `is_nan()` compiles to other PTX in this kernel
// (checked by diff), and the kernel as it stands is the one verified on the GPU.
#[allow(clippy::eq_op)]
pub unsafe extern "ptx-kernel" fn kink_scan_tiles(
    z: *const f32,
    n: u32,
    ops: *const OpDesc,
    n_ops: u32,
    rel_err: f32,
    abs_err: f32,
    counts: *mut u32,
    lists: *mut u32,
    cap: u32,
    values: *mut u32,
    value_count: *mut u32,
) {
    let (rows, n, cap) = (grid_dim_x() as usize, n as usize, cap as usize);
    let row = block_idx_x() as usize;
    let t = thread_idx_x() as usize;
    let (warp, lane) = (warp_id() as usize, lane_id() as usize);
    let vec = n.is_multiple_of(4);
    let [first, red, count, list, marks, _] = tiles_scan_layout(n, cap);
    // SAFETY (whole body): columns are read below n only; ops[..n_ops] as the contract
    // says; the shared memory is laid out as tiles_scan_layout says, `list` written
    // below `cap`, `marks` once per segment by its warp; the barriers are reached by
    // the whole block (`found` is read by every thread after the last atomic).
    unsafe {
        let smem = dynamic_shared::<u8>();
        let (red, count) = (smem.add(red) as *mut f32, smem.add(count) as *mut u32);
        let (list, marks) = (smem.add(list) as *mut u32, smem.add(marks) as *mut u32);
        if t == 0 {
            *count = 0;
        }
        let zr = z.add(row * n);
        let mut sq = 0.0;
        let mut c = 4 * (warp * WARP + lane);
        while c < n {
            let v = load4(zr, c, n, vec);
            unroll!(e in 0..4 => {
                if v[e] == v[e] {
                    sq = fma(v[e], v[e], sq);
                }
            });
            c += 4 * ROW_THREADS;
        }
        // (Its barriers also order the count's reset before the atomics below.)
        let base = rel_err * sqrt(block_sum(sq, red) / n as f32);
        let mut seg0 = 4 * WARP * warp;
        while seg0 < n {
            let c = seg0 + 4 * lane;
            let mut v = load4(zr, c, n, vec);
            let mut r = [base; 4];
            let mut cc = abs_err;
            let mut dep = 1usize;
            // Chunks of decisions over whole groups; this lane's values doubtful alone.
            let mut bits = 0u32;
            let mut alone = 0u32;
            for i in 0..n_ops as usize {
                let op = &*ops.add(i);
                let (p0, p1) = (Vector(op.param0), Vector(op.param1));
                match op.code {
                    OP_GROUP_NORM => {
                        let size = n / op.count as usize;
                        let lanes = (size / 4) as u32;
                        let inv = 1.0 / size as f32;
                        let (mut s1, mut s2) = (0.0, 0.0);
                        unroll!(e in 0..4 => {
                            s1 += v[e];
                            s2 = fma(r[e], r[e], s2);
                        });
                        let mean = segment_sum(s1, lanes) * inv;
                        let r2 = segment_sum(s2, lanes);
                        let mut s3 = 0.0;
                        unroll!(e in 0..4 => {
                            let d = v[e] - mean;
                            s3 = fma(d, d, s3);
                        });
                        let rstd = rsqrt(fma(segment_sum(s3, lanes), inv, op.a));
                        let stats = GroupRadius::new(mean, rstd, r2, size, rel_err);
                        dep = dep.max(size);
                        if c < n && stats.ill_conditioned {
                            bits |= chunk_bits(c, dep, seg0, n);
                        }
                        // (Last, as in M5's chain, only its conditioning is asked.)
                        if i + 1 < n_ops as usize {
                            // (Inside the function's unsafe block: a GroupNorm's two parameters hold `n` floats each.)
                            let (gamma, beta) = (AsStored::column4(p0, n, c), AsStored::column4(p1, n, c));
                            unroll!(e in 0..4 => {
                                (v[e], r[e]) = stats.apply(v[e], r[e], gamma[e], beta[e]);
                            });
                        }
                    }
                    code => {
                        // (Inside the unsafe block: an op's parameter holds `n` floats.)
                        let p = if param_count(op) > 0 { AsStored::column4(p0, n, c) } else { [0.0; 4] };
                        unroll!(e in 0..4 => {
                            let rc = r[e] + cc * fabs(v[e]);
                            let (y, ry, doubtful) = match_pointwise!(code,
                                P => pointwise_radius::<P>(op, p[e], v[e], r[e], rc),
                                _ => (f32::NAN, f32::NAN, false)); // unknown code: poison
                            if doubtful && c + e < n {
                                if dep == 1 {
                                    alone |= 1 << e;
                                } else {
                                    bits |= chunk_bits(c + e, dep, seg0, n);
                                }
                            }
                            v[e] = y;
                            r[e] = ry;
                        });
                    }
                }
                if clears_common(op.code) {
                    cc = 0.0;
                }
            }
            let mut alone_bits = 0u32;
            unroll!(e in 0..4 => {
                if alone & (1 << e) != 0 {
                    alone_bits |= chunk_bits(c + e, 1, seg0, n);
                    if cap > 0 {
                        let i = atomic_add_shared(count, 1) as usize;
                        if i < cap {
                            *list.add(i) = (c + e) as u32;
                        }
                    }
                }
            });
            // The segment's chunks any lane flagged, kept for after the count is known.
            let mut m = 1;
            while m < WARP as u32 {
                bits |= shfl_xor(f32::from_bits(bits), m).to_bits();
                alone_bits |= shfl_xor(f32::from_bits(alone_bits), m).to_bits();
                m <<= 1;
            }
            if lane == 0 {
                *marks.add(seg0 / (4 * WARP)) = bits | alone_bits << 8;
            }
            seg0 += 4 * ROW_THREADS;
        }
        sync_threads();
        // The whole groups' values join the list (a chunk at a time), so that a row with
        // few doubtful values in all goes to refine_values whole.
        let segs = n.div_ceil(4 * WARP);
        if cap > 0 {
            let mut s = t;
            while s < segs {
                let mut todo = *marks.add(s) & 0xff;
                while todo != 0 {
                    let c0 = (s * 8 + todo.trailing_zeros() as usize) * CHUNK;
                    todo &= todo - 1;
                    for c in c0..(c0 + CHUNK).min(n) {
                        let i = atomic_add_shared(count, 1) as usize;
                        if i < cap {
                            *list.add(i) = c as u32;
                        }
                    }
                }
                s += ROW_THREADS;
            }
            sync_threads();
        }
        let found = if cap > 0 { *count as usize } else { 0 };
        if found > 0 && found <= cap {
            // The row's values appended to [`refine_values`]'s list as (row, column).
            let first = smem.add(first) as *mut u32;
            if t == 0 {
                *first = atomic_add_global(value_count, found as u32);
            }
            sync_threads();
            if t < found {
                let at = 2 * (*first as usize + t);
                *values.add(at) = row as u32;
                *values.add(at + 1) = *list.add(t);
            }
        } else {
            // Else every chunk a decision depends on, once per row (its list has room
            // for every row).
            let mut s = t;
            while s < segs {
                let m = *marks.add(s);
                let mut todo = (m | m >> 8) & 0xff;
                while todo != 0 {
                    let chunk = s * 8 + todo.trailing_zeros() as usize;
                    todo &= todo - 1;
                    let i = atomic_add_global(counts.add(chunk), 1);
                    *lists.add(chunk * rows + i as usize) = row as u32;
                }
                s += ROW_THREADS;
            }
        }
    }
}

/// `p[kk..kk + 4]` (zero past `k`): one 16-byte load when `vec` (rows 16-byte aligned).
///
/// # Safety
/// `p` points at a row of `k` floats of global memory that nothing writes meanwhile.
#[inline(always)]
unsafe fn load4(p: *const f32, kk: usize, k: usize, vec: bool) -> [f32; 4] {
    unsafe {
        if vec && kk + 4 <= k {
            load_v4_nc(p.add(kk))
        } else {
            let mut v = [0.0; 4];
            unroll!(e in 0..4 => {
                if kk + e < k {
                    v[e] = *p.add(kk + e);
                }
            });
            v
        }
    }
}


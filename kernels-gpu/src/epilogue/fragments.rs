//! The chain on `wgmma` accumulator fragments, in registers: the TMA GEMM's epilogue
//! (`gemm/tma/`), with no staging through shared memory and no barrier (but for a 16-bit
//! `y`, staged for the TMA store: [`stage_half`]).
//!
//! A thread of an `m64n256` warpgroup holds 128 values of a `256`-column tile: value
//! `4 j + e` is row `r + 8 (e / 2)` (two rows), column `col + 8 j + e % 2`
//! (`j` in 0..32), where `col` = the tile's first column + `2 (lane % 4)`. So a GroupNorm
//! group of `g` channels (a power of two, 4..=128, inside the tile since tiles start at
//! multiples of 256 and groups divide `n`) is `g / 8` of a thread's 8-column chunks on
//! the 4 lanes of a quad (`g` = 4: half a chunk, 2 lanes): its sums are the thread's
//! own, then one or two shuffles. Columns past `n` carry values that are never stored
//! and never reach a group's sums.
//!
//! The bias and the ops' parameters are FP32 here (the host widens a 16-bit model's for
//! these kernels, `kernel_abi::vector`): read as stored, a bf16 model's fused GroupNorm
//! took 9-15% longer at 1024 x 8192 x 8192 (a loop per storage type, or a branch per
//! load), more than the one widening launch it saves.

use super::pointwise::*;
use crate::prelude::element::{Element, Half};
use crate::prelude::math::{exp, fma, max_nan, rsqrt};
use crate::prelude::mma::st_shared_b32;
use crate::prelude::warp::shfl_xor;
use crate::unroll;
use kernel_abi::epilogue::*;

/// Half a thread's fragment: 16 chunks (of 2 columns x 2 rows), 128 columns. The
/// epilogue runs on one half at a time and stores it before the next, so at most 192
/// values are live (the other half's accumulators included): with all 128 values in
/// flight the op loop needed more registers than a consumer thread has.
pub type HalfFragment = [f32; 64];

/// `v = f(v, j, e)` for every value of a half fragment (chunk `j` of the half).
#[inline(always)]
pub fn each_half_value(v: &mut HalfFragment, f: impl Fn(f32, usize, usize) -> f32) {
    unroll!(j in 0..16 => {
        unroll!(e in 0..4 => { v[4 * j + e] = f(v[4 * j + e], j, e); });
    });
}

/// Columns a thread's half fragment spans from its first: chunk 15's pair ends here.
const HALF_SPAN: usize = 8 * 15 + 2;

/// Whether every column of the half fragment from `col` is below `n`: true in all but
/// the last column tile, where the per-chunk bounds checks are needed. (Checked once:
/// per chunk, each 64-bit bound and its branch cost more instructions than a bias add
/// or a store.)
#[inline(always)]
fn half_inside(n: usize, col: usize) -> bool {
    col + HALF_SPAN <= n
}

/// One op forward on a half fragment; `col` is the half's first column for this
/// thread (see the module). The per-column bias and multiply run in two versions:
/// with the whole half inside `n` (all tiles but the last column's), 8-byte read-only
/// loads and no checks; else a bounds check per chunk. (Nsight Compute, M2: the checked
/// loads of the extra bias, 6 branch and address instructions per chunk, cost more
/// than its Swish.) GroupNorm keeps the checks: unchecked, ptxas issues a block's
/// `gamma` and `beta` loads at once and spills.
#[inline(always)]
pub fn fragment_forward(op: &OpDesc, v: &mut HalfFragment, n: usize, col: usize) {
    let p0 = op.param0 as *const f32;
    let checked = |p: *const f32, j: usize| column_pair(p, n, col + 8 * j);
    match op.code {
        OP_GROUP_NORM => group_norm_sized(op, v, n, checked),
        code => match_pointwise!(code, P => {
            if P::HAS_PARAM {
                per_column(v, p0, n, col, |x, p| P::forward(x, p, op.a, op.b))
            } else {
                each_half_value(v, |x, _, _| P::forward(x, 0.0, op.a, op.b))
            }
        }, _ => unfusable()),
    }
}

/// GroupNorm on a half fragment, one instance per group size (the chunk indices stay
/// compile-time constants); `pair(p, j)` loads chunk `j`'s two parameters.
#[inline(always)]
fn group_norm_sized(op: &OpDesc, v: &mut HalfFragment, n: usize, pair: impl Fn(*const f32, usize) -> [f32; 2]) {
    let g = n / (op.count as usize).max(1);
    match g {
        4 => group_norm::<1, 1, 4>(op, v, g, pair),
        8 => group_norm::<1, 2, 4>(op, v, g, pair),
        16 => group_norm::<2, 2, 4>(op, v, g, pair),
        32 => group_norm::<4, 2, 4>(op, v, g, pair),
        64 => group_norm::<8, 2, 8>(op, v, g, pair),
        128 => group_norm::<16, 2, 16>(op, v, g, pair),
        // Not fusable: the host never sends it; stop rather than pass through.
        _ => unfusable(),
    }
}

/// `p[c]`, `p[c + 1]` (`c` even) in one 8-byte load through the read-only data path
/// (the parameters' pointers come from the op table, so a plain load would be generic).
///
/// # Safety
/// `c + 1` is below the length of `p`, a device allocation (8-byte aligned) that nothing
/// writes while the kernel runs.
#[inline(always)]
unsafe fn load_pair_nc(p: *const f32, c: usize) -> [f32; 2] {
    let (a, b): (u32, u32);
    // SAFETY: as the caller promises.
    unsafe {
        core::arch::asm!("{{ .reg .b64 g; cvta.to.global.u64 g, {p}; ld.global.nc.v2.b32 {{{a}, {b}}}, [g]; }}",
             p = in(reg64) p.add(c) as u64, a = out(reg32) a, b = out(reg32) b,
             options(pure, readonly, nostack));
    }
    [f32::from_bits(a), f32::from_bits(b)]
}

/// `v += bias[column]` over the half fragment from `col` (the Linear layer's bias).
#[inline(always)]
pub fn add_column_bias(v: &mut HalfFragment, bias: *const f32, n: usize, col: usize) {
    per_column(v, bias, n, col, |x, b| x + b);
}

/// `v = v * row_inv[row] * col_inv[column]` over the half fragment from `col`: an FP8
/// GEMM's sums with their operands' scales undone (`row_inv` holds the thread's two
/// rows', `row` and `row + 8`; `col_inv` `n` floats). Powers of two: exact, in the CPU
/// emulation's order.
#[inline(always)]
pub fn unscale_fragment(v: &mut HalfFragment, row_inv: [f32; 2], col_inv: *const f32, n: usize, col: usize) {
    each_half_value(v, |x, _, e| x * row_inv[e / 2]);
    per_column(v, col_inv, n, col, |x, c| x * c);
}

/// `v = f(v, p[column])` over the half fragment from `col`, for a per-column parameter
/// `p` of length `n`: with the whole half inside `n` (all tiles but the last column's),
/// 8-byte read-only loads and no checks; else a bounds check per chunk.
#[inline(always)]
fn per_column(v: &mut HalfFragment, p: *const f32, n: usize, col: usize, f: impl Fn(f32, f32) -> f32) {
    if half_inside(n, col) {
        // SAFETY: every chunk's pair is below `n`, the parameter's length; nothing
        // writes parameters while a kernel reads them.
        each_half_value(v, |x, j, e| f(x, unsafe { load_pair_nc(p, col + 8 * j) }[e % 2]));
    } else {
        each_half_value(v, |x, j, e| f(x, column_pair(p, n, col + 8 * j)[e % 2]));
    }
}

/// Starts bringing into L1 what the epilogue of the tile at columns `col0..col0 + 256`
/// reads per column — the Linear bias, each bias / multiply / GroupNorm op's
/// parameters — and the op table, so that its loads hit L1 instead of waiting on L2.
/// (Nsight Compute, M2: a fifth of the epilogue's stall samples were the first uses of
/// the Linear bias and GroupNorm's `gamma`/`beta`, whose slices change from tile to
/// tile; prefetched, M2 gained about 1%: docs/VERSIONS.md, "Kernel design history".) One thread, ahead
/// of the epilogue: the TMA producer, when it starts the tile.
///
/// # Safety
/// `bias` (if not null) and the ops' parameters hold `n` floats; `ops` holds `n_ops`.
#[inline(always)]
pub unsafe fn prefetch_tile_params(bias: *const f32, ops: *const OpDesc, n_ops: u32, col0: u32, n: u32) {
    use crate::prelude::global::prefetch_l1;
    // The tile's 256 columns of `p`: eight 128-byte lines.
    let lines = |p: *const f32| {
        let mut c = col0;
        while c < n && c < col0 + 256 {
            // SAFETY: c < n, inside the parameter.
            unsafe { prefetch_l1(p.add(c as usize)) };
            c += 32;
        }
    };
    if !bias.is_null() {
        lines(bias);
    }
    for o in 0..n_ops as usize {
        // SAFETY: o < n_ops.
        let op = unsafe { &*ops.add(o) };
        match op.code {
            OP_GROUP_NORM => {
                lines(op.param0 as *const f32);
                lines(op.param1 as *const f32);
            }
            code => {
                if match_pointwise!(code, P => P::HAS_PARAM, _ => false) {
                    lines(op.param0 as *const f32);
                }
            }
        }
    }
}

/// Per-column parameters `p[c]`, `p[c + 1]` (`c` even), 0 past `n`: one 8-byte load.
#[inline(always)]
fn column_pair(p: *const f32, n: usize, c: usize) -> [f32; 2] {
    if c + 2 <= n {
        // SAFETY: c + 1 < n, the parameter's length; nothing writes parameters while
        // a kernel reads them.
        unsafe { load_pair_nc(p, c) }
    } else {
        // SAFETY: the parameter holds `n` floats.
        [0, 1].map(|e| if c + e < n { unsafe { *p.add(c + e) } } else { 0.0 })
    }
}

/// `bar.warp.sync`: the warp is converged here anyway; ptxas keeps loads on their side
/// of it, so a block's parameter loads are not all issued at once.
#[inline(always)]
fn schedule_fence() {
    // SAFETY: every lane of the warp runs the epilogue (no divergence around it).
    unsafe { core::arch::asm!("bar.warp.sync -1;", options(nostack, preserves_flags)) }
}

/// An op this epilogue cannot run reached it (the host checks fusability first): the
/// kernel traps, so the launch fails instead of returning a wrong answer. (Poisoning the
/// values instead costs registers at every op's dispatch.)
#[inline(always)]
fn unfusable() {
    // SAFETY: aborts the kernel.
    unsafe { core::arch::nvptx::trap() }
}

/// Sums over groups of `CPG` chunks (`j` in a block of `BJ` <= 16) and `2 SHUFFLES`
/// lanes (xor 1, then xor 2): the first chunk of each group ends with the group's sum.
#[inline(always)]
fn group_sums<const CPG: usize, const SHUFFLES: u32, const BJ: usize>(s: &mut [[f32; 16]; 2]) {
    unroll!(i in 0..2 => {
        // The group's chunks into its first (compile-time indices).
        unroll!(j in 0..16 => {
            if j < BJ && j % CPG != 0 {
                s[i][j - j % CPG] += s[i][j];
            }
        });
        // The quad (or pair) of lanes, once per group.
        unroll!(j in 0..16 => {
            if j < BJ && j % CPG == 0 {
                s[i][j] += shfl_xor(s[i][j], 1);
                if SHUFFLES > 1 {
                    s[i][j] += shfl_xor(s[i][j], 2);
                }
            }
        });
    });
}

/// GroupNorm forward (two-pass statistics, as the reference) for groups of `CPG`
/// chunks on `2 SHUFFLES` lanes (`CPG` = 1 with 1 shuffle: groups of 4 columns), `BJ`
/// chunks at a time so only a block's sums are live beside the fragment's 128 values.
#[inline(always)]
fn group_norm<const CPG: usize, const SHUFFLES: u32, const BJ: usize>(
    op: &OpDesc,
    v: &mut HalfFragment,
    g: usize,
    pair: impl Fn(*const f32, usize) -> [f32; 2],
) {
    let (gamma, beta) = (op.param0 as *const f32, op.param1 as *const f32);
    let inv = 1.0 / g as f32;
    unroll!(blk in 0..4 => {
        if blk * BJ < 16 {
            // Keeps the block's parameter loads from being hoisted above the blocks
            // before it (all of them at once need more registers than a thread has).
            schedule_fence();
            // Per row `i` and chunk: the sum, then the group's mean, of the values; then
            // the same for the squared deviations and `1 / std`.
            let mut mean = [[0.0f32; 16]; 2];
            unroll!(jj in 0..16 => {
                if jj < BJ {
                    let j = blk * BJ + jj;
                    unroll!(i in 0..2 => { mean[i][jj] = v[4 * j + 2 * i] + v[4 * j + 2 * i + 1]; });
                }
            });
            group_sums::<CPG, SHUFFLES, BJ>(&mut mean);
            let mut q = [[0.0f32; 16]; 2];
            unroll!(jj in 0..16 => {
                if jj < BJ {
                    let j = blk * BJ + jj;
                    unroll!(i in 0..2 => {
                        let mu = mean[i][jj - jj % CPG] * inv;
                        let (a, b) = (v[4 * j + 2 * i] - mu, v[4 * j + 2 * i + 1] - mu);
                        q[i][jj] = fma(a, a, b * b);
                    });
                }
            });
            group_sums::<CPG, SHUFFLES, BJ>(&mut q);
            unroll!(jj in 0..16 => {
                if jj < BJ {
                    let j = blk * BJ + jj;
                    let (g2, b2) = (pair(gamma, j), pair(beta, j));
                    unroll!(i in 0..2 => {
                        let lead = jj - jj % CPG;
                        let (mu, rstd) = (mean[i][lead] * inv, rsqrt(q[i][lead] * inv + op.a));
                        unroll!(e in 0..2 => {
                            let x = v[4 * j + 2 * i + e];
                            v[4 * j + 2 * i + e] = fma((x - mu) * rstd, g2[e], b2[e]);
                        });
                    });
                }
            });
        }
    });
}

/// The chain's reduction if its last op reduces each row (the host's row-partials plan):
/// that op's code, else 0.
///
/// # Safety
/// `ops` holds `n_ops` descriptors.
#[inline(always)]
pub unsafe fn row_reduction(ops: *const OpDesc, n_ops: u32) -> u32 {
    if n_ops == 0 {
        return 0;
    }
    // SAFETY: the last of the `n_ops`.
    let code = unsafe { (*ops.add(n_ops as usize - 1)).code };
    if reduces_row(code) { code } else { 0 }
}

/// Reduces each of a half fragment's two rows over its 128 columns (those below `n`)
/// by `code` and stores the two floats of each (`kernel_abi::epilogue::row_partials`:
/// the sum; the max or min; logsumexp's max and sum of `exp(v - shift)`) as part
/// `part` of `out (parts, m, 2)`. Each row's columns are on the 4 lanes of a quad:
/// the thread's 32 values, then two shuffles; lane `tig` 0 stores.
///
/// # Safety
/// `out` holds `(part + 1) m 2` floats; every lane of the warp calls it (the shuffles).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn store_row_partials(
    v: &HalfFragment,
    code: u32,
    out: *mut f32,
    (m, n): (usize, usize),
    row: usize,
    col: usize,
    part: usize,
    tig: usize,
) {
    let inside = half_inside(n, col);
    let live = |j: usize, e: usize| inside || col + 8 * j + e % 2 < n;
    let quad_sum = |s: f32| {
        let s = s + shfl_xor(s, 1);
        s + shfl_xor(s, 2)
    };
    // Max and min (and logsumexp's shift) as a max of `sign v`; NaN propagates.
    let sign = if code == OP_ROW_MIN { -1.0 } else { 1.0 };
    unroll!(i in 0..2 => {
        let mut pair = [0.0f32; 2];
        if code == OP_ROW_SUM || code == OP_ROW_MEAN {
            let mut s = 0.0;
            unroll!(j in 0..16 => { unroll!(e in 0..2 => { if live(j, e) { s += v[4 * j + 2 * i + e]; } }); });
            pair[0] = quad_sum(s);
        } else {
            let mut top = f32::NEG_INFINITY;
            unroll!(j in 0..16 => { unroll!(e in 0..2 => {
                if live(j, e) { top = max_nan(top, sign * v[4 * j + 2 * i + e]); }
            }); });
            top = max_nan(top, shfl_xor(top, 1));
            top = max_nan(top, shfl_xor(top, 2));
            if code == OP_LOGSUMEXP {
                let shift = super::logsumexp_shift(top);
                let mut s = 0.0;
                unroll!(j in 0..16 => { unroll!(e in 0..2 => {
                    if live(j, e) { s += exp(v[4 * j + 2 * i + e] - shift); }
                }); });
                pair = [top, quad_sum(s)];
            } else {
                pair[0] = sign * top;
            }
        }
        let r = row + 8 * i;
        if tig == 0 && r < m {
            // SAFETY: r < m, part < parts.
            unsafe {
                let at = out.add((part * m + r) * 2);
                *at = pair[0];
                *at.add(1) = pair[1];
            }
        }
    });
}

/// One warpgroup's share of a staged half tile: 64 rows x 128 16-bit columns, as two
/// `64 x 64` boxes of 128-byte rows in the 128-byte swizzle (the TMA store's layout).
pub const STAGED_HALF_BYTES: u32 = 64 * 128 * 2;

/// Writes a half fragment, rounded to `H` (nearest even), into the warpgroup's
/// staging boxes at `buf` (1024-byte aligned): row `16 warp + gid (+ 8)` of 64, column
/// `2 tig + 8 j` of 128, in box `j / 8`, its 16-byte chunk `j % 8` moved to
/// `(j % 8) ^ (row % 8)` as the swizzle places it. So the 8 rows x 4 lanes of one store
/// meet 32 different banks (unswizzled, the rows' 128-byte stride is an 8-way conflict).
///
/// # Safety
/// `buf` is a 1024-byte aligned shared address with [`STAGED_HALF_BYTES`] bytes that no
/// store still reads; `gid`, `tig`, `warp` as the fragment's thread.
#[inline(always)]
pub unsafe fn stage_half<H: Half>(buf: u32, v: &HalfFragment, warp: u32, gid: u32, tig: u32) {
    unroll!(i in 0..2 => {
        let base = buf + (warp * 16 + gid + 8 * i as u32) * 128 + 4 * tig;
        unroll!(j in 0..16 => {
            let at = base + (j as u32 / 8) * 8192 + (((j as u32 % 8) ^ gid) << 4);
            let pair = H::pack2(v[4 * j + 2 * i].to_bits(), v[4 * j + 2 * i + 1].to_bits());
            // SAFETY: inside the caller's boxes, 4-byte aligned.
            unsafe { st_shared_b32(at, pair) };
        });
    });
}

/// Stores a half fragment's values (rows `row`, `row + 8`; columns from `col` as in the
/// module) into the `(m, n)` row-major `dst` (FP32, or bf16 rounded to nearest), a pair
/// at a time when aligned, skipping rows past `m` and columns past `n`.
///
/// # Safety
/// `dst` holds `m * n` elements.
#[inline(always)]
pub unsafe fn store_half<O: Element>(dst: *mut O, v: &HalfFragment, (m, n): (usize, usize), row: usize, col: usize) {
    // Even `n` keeps every pair aligned to two elements (`col` is even).
    let inside = n % 2 == 0 && half_inside(n, col);
    unroll!(i in 0..2 => {
        let r = row + 8 * i;
        if r < m {
            // SAFETY: r < m and every written column < n.
            unsafe {
                let at = dst.add(r * n + col);
                if inside {
                    unroll!(j in 0..16 => {
                        O::store2(at.add(8 * j), v[4 * j + 2 * i], v[4 * j + 2 * i + 1]);
                    });
                } else {
                    unroll!(j in 0..16 => {
                        let (a, b) = (v[4 * j + 2 * i], v[4 * j + 2 * i + 1]);
                        let c = col + 8 * j;
                        if n % 2 == 0 && c + 2 <= n {
                            O::store2(at.add(8 * j), a, b);
                        } else if c < n {
                            O::store1(at.add(8 * j), a);
                            if c + 1 < n {
                                O::store1(at.add(8 * j + 1), b);
                            }
                        }
                    });
                }
            }
        }
    });
}

//! Register-blocked FP32 GEMM on the FMA units with the epilogue chain fused into its
//! store: `y = chain(x W^T + b)` in one kernel.

use crate::epilogue::pointwise::*;
use crate::prelude::math::{fma, rsqrt};
use crate::prelude::warp::segment_sum;
use crate::prelude::*;
use crate::unroll;
use kernel_abi::epilogue::*;
use kernel_abi::gemm_simt::*;

const TM: usize = 8; // rows per thread: two runs of 4, 64 apart
const TN: usize = 8; // columns per thread: two runs of 4, 64 apart
const HALF: usize = BLOCK_M / 2;

#[derive(Clone, Copy)]
#[repr(C, align(16))]
struct F4([f32; 4]);

/// Row (or column) of the tile owned by index `i < 8` of thread coordinate `t < 16`.
#[inline(always)]
fn owned(t: usize, i: usize) -> usize {
    (i / 4) * HALF + t * 4 + i % 4
}

/// `y = chain(x W^T + bias)`, or, when launched with `gridDim.z = S > 1`, split-K
/// partial products `y[s] = x[:, ks] W[:, ks]^T` with no bias and no chain.
///
/// # Safety
/// Device pointers of the sizes below; `ops[..n_ops]` holds only ops this kernel
/// fuses (pointwise ops and GroupNorm with groups of 4..=128 channels, a power of
/// two; the host checks). Launch: `THREADS` threads, grid
/// `(ceil(n / BLOCK_N), ceil(m / BLOCK_M), S)`, `SMEM_BYTES` of dynamic shared memory;
/// `k_split` a multiple of `BLOCK_K` with `S * k_split >= k`.
///
/// # Parameters
/// * `x`: `(m, k)` row-major; `w`: `(n, k)` row-major (PyTorch's Linear weight); `bias`: `(n,)`.
/// * `y`: `(m, n)`, or `(S, m, n)` for split-K.
///
/// # Tiling
/// A block computes a `128 x 128` tile of `y`, stepping `k` by 8. Each step's `x` and
/// `w` slices are loaded into registers one step ahead (16-byte loads when `VEC`, which
/// needs `k % 4 == 0`), then stored transposed (`k` outermost) into the other of two
/// shared-memory stages, so one barrier per step suffices.
///
/// # Thread mapping
/// Warp `w`, lane `l`: `ty = 2w + l / 16`, `tx = l % 16`. The thread owns rows
/// `ty*4 + {0..3}` and `64 + ty*4 + {0..3}`, columns likewise with `tx`: 64
/// accumulators. Its fragments come from shared memory as 16-byte loads (a warp reads
/// 2 distinct `x` vectors and 16 distinct `w` vectors per `k`). In the epilogue, the 16
/// lanes of a half-warp cover 64 consecutive columns of one row, so a GroupNorm group
/// of `g` channels is `g / 4` neighbouring lanes: its statistics are shuffle sums.
#[inline(always)]
unsafe fn gemm_f32<const VEC: bool>(
    x: *const f32,
    w: *const f32,
    bias: *const f32,
    y: *mut f32,
    m: u32,
    n: u32,
    k: u32,
    k_split: u32,
    ops: *const OpDesc,
    n_ops: u32,
) {
    let (m, n, k) = (m as usize, n as usize, k as usize);
    let t = thread_idx_x() as usize;
    let lane = t % 32;
    let ty = (t / 32) * 2 + lane / 16;
    let tx = lane % 16;
    let row0 = block_idx_y() as usize * BLOCK_M;
    let col0 = block_idx_x() as usize * BLOCK_N;
    let split = block_idx_z() as usize;
    let k_begin = split * k_split as usize;
    let k_end = if k_begin + (k_split as usize) < k { k_begin + k_split as usize } else { k };

    let smem = dynamic_shared::<f32>(); // [stage][x tile | w tile][BLOCK_K][SMEM_STRIDE]
    let tile = BLOCK_K * SMEM_STRIDE;

    // Global loads: thread t moves 4 consecutive k of tile row t / 2 (of x and of w).
    let ld_row = t / 2;
    let ld_k = (t % 2) * 4;
    let load = |src: *const f32, rows: usize, r: usize, k0: usize| -> [f32; 4] {
        let mut v = [0.0f32; 4];
        let gk = k0 + ld_k;
        if r < rows {
            if VEC {
                if gk < k_end {
                    // SAFETY: k % 4 == 0 makes the 16-byte load aligned and in row r.
                    v = unsafe { (*(src.add(r * k + gk) as *const F4)).0 };
                }
            } else {
                for e in 0..4 {
                    if gk + e < k_end {
                        // SAFETY: r < rows, gk + e < k.
                        v[e] = unsafe { *src.add(r * k + gk + e) };
                    }
                }
            }
        }
        v
    };
    let store = |stage: usize, xv: [f32; 4], wv: [f32; 4]| {
        // SAFETY: (ld_k + e) * SMEM_STRIDE + ld_row < tile for both tiles of a stage.
        unsafe {
            let sx = smem.add(stage * 2 * tile);
            let sw = sx.add(tile);
            for e in 0..4 {
                *sx.add((ld_k + e) * SMEM_STRIDE + ld_row) = xv[e];
                *sw.add((ld_k + e) * SMEM_STRIDE + ld_row) = wv[e];
            }
        }
    };

    let mut acc = [[0.0f32; TN]; TM];
    let mut k0 = k_begin;
    let (mut xv, mut wv) = (load(x, m, row0 + ld_row, k0), load(w, n, col0 + ld_row, k0));
    store(0, xv, wv);
    // SAFETY: uniform control flow throughout the main loop.
    unsafe { sync_threads() };
    let mut stage = 0;
    while k0 < k_end {
        let next = k0 + BLOCK_K;
        if next < k_end {
            xv = load(x, m, row0 + ld_row, next);
            wv = load(w, n, col0 + ld_row, next);
        }
        // SAFETY: all indices stay inside this stage's two tiles.
        unsafe {
            let sx = smem.add(stage * 2 * tile) as *const F4;
            let sw = smem.add(stage * 2 * tile + tile) as *const F4;
            unroll!(kk in 0..8 => {
                let q = kk * SMEM_STRIDE / 4;
                let a0 = (*sx.add(q + ty)).0;
                let a1 = (*sx.add(q + HALF / 4 + ty)).0;
                let b0 = (*sw.add(q + tx)).0;
                let b1 = (*sw.add(q + HALF / 4 + tx)).0;
                let a = [a0[0], a0[1], a0[2], a0[3], a1[0], a1[1], a1[2], a1[3]];
                let b = [b0[0], b0[1], b0[2], b0[3], b1[0], b1[1], b1[2], b1[3]];
                unroll!(i in 0..8 => { unroll!(j in 0..8 => { acc[i][j] = fma(a[i], b[j], acc[i][j]); }); });
            });
        }
        if next < k_end {
            store(stage ^ 1, xv, wv);
        }
        // SAFETY: uniform; orders this step's reads before the next step's overwrite.
        unsafe { sync_threads() };
        stage ^= 1;
        k0 = next;
    }

    // Stage the accumulator tile in shared memory (the pipeline's stages are done:
    // the loop ended on a barrier), so the epilogue can walk whole rows with a small
    // register footprint and store them coalesced.
    // SAFETY: rows and columns < 128, inside the STAGE_STRIDE-strided staging tile.
    unsafe {
        unroll!(i in 0..8 => {
            unroll!(h in 0..2 => {
                let j = h * 4;
                let v = F4([acc[i][j], acc[i][j + 1], acc[i][j + 2], acc[i][j + 3]]);
                *(smem.add(owned(ty, i) * STAGE_STRIDE + owned(tx, j)) as *mut F4) = v;
            });
        });
        sync_threads();
    }
    let split_k = grid_dim_z() > 1;
    // Split-K: this split's partial product goes to its own slice; the row-wise
    // epilogue adds the slices, the bias and the chain.
    let out = if split_k { unsafe { y.add(split * m * n) } } else { y };
    let (warp, c) = (t / 32, col0 + lane * 4);
    let mut r = warp;
    while r < BLOCK_M && row0 + r < m {
        // SAFETY: r < 128 and lane * 4 + 3 < 128.
        let mut v = unsafe { (*(smem.add(r * STAGE_STRIDE + lane * 4) as *const F4)).0 };
        if !split_k {
            epilogue_row(&mut v, bias, ops, n_ops, n, c);
        }
        let row = row0 + r;
        // SAFETY: row < m; every written column < n.
        unsafe {
            if VEC && n % 4 == 0 && c + 4 <= n {
                *(out.add(row * n + c) as *mut F4) = F4(v);
            } else {
                unroll!(e in 0..4 => {
                    if c + e < n {
                        *out.add(row * n + c + e) = v[e];
                    }
                });
            }
        }
        r += THREADS / 32;
    }
}

/// Floats per row of the staged `128 x 128` output tile (16-byte aligned rows).
const STAGE_STRIDE: usize = BLOCK_N + 4;

/// Bias, then the chain, on one lane's 4 consecutive columns `c..c+4` of one row; the
/// warp holds the whole 128-column row of the tile. Columns past `n` carry values that
/// are never stored and must not reach a GroupNorm sum (they cannot: groups divide `n`
/// and the tile starts at a multiple of 128).
#[inline(always)]
fn epilogue_row(v: &mut [f32; 4], bias: *const f32, ops: *const OpDesc, n_ops: u32, n: usize, c: usize) {
    // Per-column parameter `p[c + e]`, 0 past the end.
    let param = |p: *const f32, e: usize| if c + e < n { unsafe { *p.add(c + e) } } else { 0.0 };
    unroll!(e in 0..4 => { v[e] += param(bias, e); });
    for o in 0..n_ops as usize {
        // SAFETY: o < n_ops.
        let op = unsafe { *ops.add(o) };
        let p0 = op.param0 as *const f32;
        match op.code {
            OP_GROUP_NORM => {
                // Groups of g = n / groups channels, g a power of two in 4..=128, are
                // g / 4 neighbouring lanes: two-pass mean and variance by shuffle sums.
                let g = n / (op.count as usize).max(1);
                let lanes = (g / 4) as u32;
                let inv = 1.0 / g as f32;
                let mean = segment_sum(v[0] + v[1] + v[2] + v[3], lanes) * inv;
                let mut q = 0.0;
                unroll!(e in 0..4 => { let d = v[e] - mean; q += d * d; });
                let rstd = rsqrt(segment_sum(q, lanes) * inv + op.a);
                let p1 = op.param1 as *const f32;
                unroll!(e in 0..4 => { v[e] = (v[e] - mean) * rstd * param(p0, e) + param(p1, e); });
            }
            code => {
                unroll!(e in 0..4 => {
                    let x = v[e];
                    v[e] = match code {
                        OP_BIAS => x + param(p0, e),
                        OP_MUL => x * param(p0, e),
                        OP_SCALE => x * op.a,
                        OP_SWISH => swish(x),
                        OP_MISH => mish(x),
                        OP_GELU => gelu(x),
                        OP_LEAKY_RELU => leaky_relu(x, op.a),
                        OP_HARDTANH => hardtanh(x, op.a, op.b),
                        _ => f32::NAN, // not fusable: the host never sends it; poison, never pass through
                    };
                });
            }
        }
    }
}

/// [`gemm_f32`] with 16-byte loads: needs `k % 4 == 0`.
///
/// # Safety
/// See [`gemm_f32`].
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn gemm_f32_fused_vec4(
    x: *const f32,
    w: *const f32,
    bias: *const f32,
    y: *mut f32,
    m: u32,
    n: u32,
    k: u32,
    k_split: u32,
    ops: *const OpDesc,
    n_ops: u32,
) {
    unsafe { gemm_f32::<true>(x, w, bias, y, m, n, k, k_split, ops, n_ops) }
}

/// [`gemm_f32`] with scalar loads: any `k`.
///
/// # Safety
/// See [`gemm_f32`].
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn gemm_f32_fused_scalar(
    x: *const f32,
    w: *const f32,
    bias: *const f32,
    y: *mut f32,
    m: u32,
    n: u32,
    k: u32,
    k_split: u32,
    ops: *const OpDesc,
    n_ops: u32,
) {
    unsafe { gemm_f32::<false>(x, w, bias, y, m, n, k, k_split, ops, n_ops) }
}

//! Shared-memory tiled FP32 GEMM with bias: the first, plain member of the GEMM family.
//!
//! Correct for any shape; not yet tuned (see docs/PERFORMANCE.md).

use crate::prelude::math::fma;
use crate::prelude::*;
use kernel_abi::gemm_tiled::*;

const ROW_THREADS: usize = BLOCK_M / THREAD_M; // 16 threads along M
const COL_THREADS: usize = BLOCK_N / THREAD_N; // 16 threads along N
const A_STRIDE: usize = BLOCK_M + SMEM_PAD;
const B_STRIDE: usize = BLOCK_N + SMEM_PAD;

/// `y[m, n] = sum_k x[m, k] * w[n, k] + bias[n]`.
///
/// # Safety
/// Pointers are device pointers to at least the sizes below; `y` does not alias inputs.
/// Launch with [`kernel_abi::gemm_tiled`]'s configuration: `THREADS` threads (1-D),
/// grid `(ceil(n / BLOCK_N), ceil(m / BLOCK_M))`, `SMEM_BYTES` dynamic shared memory.
///
/// # Parameters
/// * `x`: `(m, k)` row-major (the batch of inputs).
/// * `w`: `(n, k)` row-major (PyTorch's Linear weight).
/// * `bias`: `(n,)`.
/// * `y`: `(m, n)` row-major, written in full.
///
/// # Tiling
/// Each block computes a `BLOCK_M x BLOCK_N` tile of `y`, stepping through `k` in
/// slices of `BLOCK_K`. A slice of `x` and one of `w` are staged in shared memory
/// transposed (`k` outermost), so the inner product reads both along `m` / `n`.
/// Out-of-range rows, columns and `k` are loaded as zero and never stored.
///
/// # Thread mapping
/// Thread `t` owns rows `ty + 16 i` and columns `tx + 16 j` (`i, j < 4`) of the tile,
/// with `ty = t / 16`, `tx = t % 16`: neighbouring threads write neighbouring columns,
/// so the stores coalesce and the shared-memory reads of a warp hit distinct banks.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn gemm_bias_tiled(
    x: *const f32,
    w: *const f32,
    bias: *const f32,
    y: *mut f32,
    m: u32,
    n: u32,
    k: u32,
) {
    let (m, n, k) = (m as usize, n as usize, k as usize);
    let t = thread_idx_x() as usize;
    let ty = t / COL_THREADS;
    let tx = t % COL_THREADS;
    let row0 = block_idx_y() as usize * BLOCK_M;
    let col0 = block_idx_x() as usize * BLOCK_N;

    let s_x = dynamic_shared::<f32>(); // [BLOCK_K][A_STRIDE]: x tile, transposed
    // SAFETY: SMEM_BYTES covers both arrays.
    let s_w = unsafe { s_x.add(BLOCK_K * A_STRIDE) }; // [BLOCK_K][B_STRIDE]: w tile, transposed

    let mut acc = [[0.0f32; THREAD_N]; THREAD_M];
    let mut k0 = 0;
    while k0 < k {
        // Stage x[row0.., k0..] and w[col0.., k0..]: each thread moves
        // BLOCK_M * BLOCK_K / THREADS elements of each, reading along k.
        let mut e = t;
        while e < BLOCK_M * BLOCK_K {
            let (r, kk) = (e / BLOCK_K, e % BLOCK_K);
            let (gr, gk) = (row0 + r, k0 + kk);
            // SAFETY: the global read is bounds-checked; the shared index is < BLOCK_K * A_STRIDE.
            unsafe { *s_x.add(kk * A_STRIDE + r) = if gr < m && gk < k { *x.add(gr * k + gk) } else { 0.0 } };
            e += THREADS;
        }
        let mut e = t;
        while e < BLOCK_N * BLOCK_K {
            let (c, kk) = (e / BLOCK_K, e % BLOCK_K);
            let (gc, gk) = (col0 + c, k0 + kk);
            // SAFETY: as above, for w.
            unsafe { *s_w.add(kk * B_STRIDE + c) = if gc < n && gk < k { *w.add(gc * k + gk) } else { 0.0 } };
            e += THREADS;
        }
        // SAFETY: uniform control flow: every thread runs the same number of k steps.
        unsafe { sync_threads() };

        for kk in 0..BLOCK_K {
            let mut a = [0.0f32; THREAD_M];
            let mut b = [0.0f32; THREAD_N];
            for i in 0..THREAD_M {
                // SAFETY: index < BLOCK_K * A_STRIDE.
                a[i] = unsafe { *s_x.add(kk * A_STRIDE + ty + ROW_THREADS * i) };
            }
            for j in 0..THREAD_N {
                // SAFETY: index < BLOCK_K * B_STRIDE.
                b[j] = unsafe { *s_w.add(kk * B_STRIDE + tx + COL_THREADS * j) };
            }
            for i in 0..THREAD_M {
                for j in 0..THREAD_N {
                    acc[i][j] = fma(a[i], b[j], acc[i][j]);
                }
            }
        }
        // SAFETY: uniform, as above; keeps the next staging from overwriting tiles in use.
        unsafe { sync_threads() };
        k0 += BLOCK_K;
    }

    for i in 0..THREAD_M {
        let r = row0 + ty + ROW_THREADS * i;
        for j in 0..THREAD_N {
            let c = col0 + tx + COL_THREADS * j;
            if r < m && c < n {
                // SAFETY: bounds-checked against (m, n).
                unsafe { *y.add(r * n + c) = acc[i][j] + *bias.add(c) };
            }
        }
    }
}

//! The row-wise epilogue: runs any chain over the rows of a finished GEMM output.
//!
//! This is the general path, used when the chain cannot be fused into the GEMM's
//! store (see docs/PERFORMANCE.md for what it costs: one extra read and write of
//! the GEMM output).

use super::pointwise::*;
use crate::prelude::math::{max_nan, rsqrt};
use crate::prelude::warp::{warp_max, warp_sum};
use crate::prelude::*;
use kernel_abi::epilogue::*;

const WARPS: usize = ROW_THREADS / WARP_SIZE as usize;

/// `y[row] = chain(sum_s z[s, row] + bias)` for every row: `splits` partial GEMM
/// products (split-K) are added first, then the bias (if not null), then the chain.
///
/// # Safety
/// Device pointers; `ops[..n_ops]` well formed (see [`OpDesc`]), its parameter vectors
/// as long as the features at their op. Launch: grid `(rows, 1, 1)`, `ROW_THREADS`
/// threads, `row_smem_bytes(n)` dynamic shared memory.
///
/// # Parameters
/// * `z`: `(splits, rows, n)` row-major: the GEMM output (`splits == 1`, Linear bias
///   included or passed as `bias`) or its split-K parts.
/// * `bias`: `(n,)` or null.
/// * `y`: `(rows, f_out)` row-major, `f_out` the features left after the chain.
///
/// # Thread mapping
/// One block per row; the row sits in shared memory. Elementwise ops stride the
/// block's threads over it; GroupNorm gives each warp whole groups (two-pass mean
/// and variance with shuffle reductions); pooling writes into the second buffer;
/// the row max reduces over warps, then across them.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn epilogue_rows(
    z: *const f32,
    splits: u32,
    bias: *const f32,
    y: *mut f32,
    n: u32,
    ops: *const OpDesc,
    n_ops: u32,
) {
    let row = block_idx_x() as usize;
    let t = thread_idx_x() as usize;
    let (warp, lane) = (warp_id() as usize, lane_id() as usize);
    let mut f = n as usize;

    let base = dynamic_shared::<f32>();
    let (mut cur, mut alt) = (base, unsafe { base.add(f) });
    let rows = grid_dim_x() as usize;
    let mut c = t;
    while c < f {
        // SAFETY: c < n and s < splits: inside z's (splits, rows, n) and the first buffer.
        unsafe {
            let mut v = if bias.is_null() { 0.0 } else { *bias.add(c) };
            for s in 0..splits as usize {
                v += *z.add((s * rows + row) * f + c);
            }
            *cur.add(c) = v;
        }
        c += ROW_THREADS;
    }
    // SAFETY: uniform control flow (every branch below is taken by the whole block).
    unsafe { sync_threads() };

    for i in 0..n_ops as usize {
        // SAFETY: i < n_ops.
        let op = unsafe { *ops.add(i) };
        let (p0, p1) = (op.param0 as *const f32, op.param1 as *const f32);
        match op.code {
            OP_GROUP_NORM => {
                let groups = op.count as usize;
                let size = f / groups;
                let mut g = warp;
                while g < groups {
                    // SAFETY (all accesses): g * size + j < f.
                    let s = unsafe { cur.add(g * size) };
                    let mut sum = 0.0;
                    let mut j = lane;
                    while j < size {
                        sum += unsafe { *s.add(j) };
                        j += WARP_SIZE as usize;
                    }
                    let mean = warp_sum(sum) / size as f32;
                    let mut sq = 0.0;
                    let mut j = lane;
                    while j < size {
                        let d = unsafe { *s.add(j) } - mean;
                        sq += d * d;
                        j += WARP_SIZE as usize;
                    }
                    let rstd = rsqrt(warp_sum(sq) / size as f32 + op.a);
                    let mut j = lane;
                    while j < size {
                        let ch = g * size + j;
                        unsafe { *s.add(j) = (*s.add(j) - mean) * rstd * *p0.add(ch) + *p1.add(ch) };
                        j += WARP_SIZE as usize;
                    }
                    g += WARPS;
                }
            }
            OP_AVG_POOL => {
                let k = op.count as usize;
                let f_out = f / k;
                let mut j = t;
                while j < f_out {
                    let mut sum = 0.0;
                    for e in 0..k {
                        // SAFETY: j * k + e < f_out * k <= f.
                        sum += unsafe { *cur.add(j * k + e) };
                    }
                    // SAFETY: j < f_out <= f, inside the second buffer.
                    unsafe { *alt.add(j) = sum / k as f32 };
                    j += ROW_THREADS;
                }
                core::mem::swap(&mut cur, &mut alt);
                f = f_out;
            }
            OP_ROW_MAX => {
                let mut m = f32::NEG_INFINITY;
                let mut j = t;
                while j < f {
                    // SAFETY: j < f.
                    m = max_nan(m, unsafe { *cur.add(j) });
                    j += ROW_THREADS;
                }
                let m = warp_max(m);
                // Partial maxima go to the second buffer; every thread has read `cur` by the barrier.
                if lane == 0 {
                    unsafe { *alt.add(warp) = m };
                }
                unsafe { sync_threads() };
                if t == 0 {
                    let mut m = unsafe { *alt };
                    for w in 1..WARPS {
                        m = max_nan(m, unsafe { *alt.add(w) });
                    }
                    unsafe { *cur = m };
                }
                f = 1;
            }
            code => {
                let mut j = t;
                while j < f {
                    // SAFETY: j < f; parameter vectors have f entries.
                    unsafe {
                        let v = *cur.add(j);
                        *cur.add(j) = match code {
                            OP_BIAS => v + *p0.add(j),
                            OP_MUL => v * *p0.add(j),
                            OP_SCALE => v * op.a,
                            OP_SWISH => swish(v),
                            OP_MISH => mish(v),
                            OP_GELU => gelu(v),
                            OP_LEAKY_RELU => leaky_relu(v, op.a),
                            OP_HARDTANH => hardtanh(v, op.a, op.b),
                            _ => f32::NAN, // unknown code: poison rather than pass through
                        };
                    }
                    j += ROW_THREADS;
                }
            }
        }
        // SAFETY: uniform; makes each op's writes visible to the next op's readers.
        unsafe { sync_threads() };
    }

    let mut j = t;
    while j < f {
        // SAFETY: j < f, the row's output width.
        unsafe { *y.add(row * f + j) = *cur.add(j) };
        j += ROW_THREADS;
    }
}

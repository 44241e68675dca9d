//! A Linear layer of one output column (one output feature, or folded to one by a whole
//! row's sum or mean straight after it: `dispatch::fold` on the host): its forward is a
//! dot product per row of `x`, its `dX` an outer product, its weight gradient a weighted
//! sum of `x`'s rows (spread back over the weight's rows by `unfold_rows_mean_grad` where
//! folded), and the fold itself the mean of the weight's rows. Each is one pass over its matrix at the memory's rate; a tile GEMM
//! one column wide keeps one block per 128 rows busy and reads 256-wide tiles of which
//! it uses one column.
//!
//! Sums run in FP32 in a fixed order (the same bits every call); 16-bit values are read
//! as stored and widened exactly.

use crate::prelude::element::{Bf16, Element, F16};
use crate::prelude::global::load_v4_nc;
use crate::prelude::warp::warp_sum;
use crate::prelude::*;
use crate::unroll;
use crate::prelude::math::fma;
use kernel_abi::dot::{
    COLUMN_DOT_ROWS_IN_FLIGHT as ROWS_IN_FLIGHT, COLUMN_DOTS_BLOCK_COLS, COLUMN_DOTS_MAX_RANGE_ROWS, OUTER_BLOCK_COLS,
    OUTER_MAX_BLOCK_ROWS, OUTER_MAX_RANK, THREADS,
};

const WARPS: usize = THREADS / 32;

// `outer_body` unrolls its sums over eight factors.
const _: () = assert!(OUTER_MAX_RANK == 8);

/// Declares the entry points of one kernel: each an instance of its body for the
/// element type named (FP32, bf16, fp16), its signature the kernel's with that type.
macro_rules! dot_entries {
    (column_dot: $($(#[$doc:meta])* $name:ident = $e:ty;)*) => {$(
        $(#[$doc])*
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "ptx-kernel" fn $name(
            a: *const $e,
            weights: *const $e,
            rows: u32,
            cols: u32,
            rows_per_block: u32,
            scale: f32,
            vector: u32,
            out: *mut f32,
        ) {
            unsafe { column_dot_body(a, weights, rows, cols, rows_per_block, scale, vector, out) }
        }
    )*};
    (column_dots: $($(#[$doc:meta])* $name:ident = $e:ty;)*) => {$(
        $(#[$doc])*
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "ptx-kernel" fn $name(
            a: *const $e,
            u: *const $e,
            ldu: u32,
            rank: u32,
            rows: u32,
            cols: u32,
            rows_per_block: u32,
            vector: u32,
            out: *mut f32,
        ) {
            unsafe { column_dots_body(a, (u, ldu, rank), (rows, cols), rows_per_block, vector, out) }
        }
    )*};
    (row_dot: $($(#[$doc:meta])* $name:ident = $e:ty;)*) => {$(
        $(#[$doc])*
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(x: *const $e, w: *const f32, rows: u32, k: u32, vector: u32, out: *mut f32) {
            unsafe { row_dot_body(x, w, rows, k, vector, out) }
        }
    )*};
    (outer: $($(#[$doc:meta])* $name:ident = ($u:ty, $v:ty);)*) => {$(
        $(#[$doc])*
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "ptx-kernel" fn $name(
            u: *const $u,
            ldu: u32,
            v: *const $v,
            ldv: u32,
            rows: u32,
            cols: u32,
            rank: u32,
            block_rows: u32,
            vector: u32,
            out: *mut $u,
        ) {
            unsafe { outer_body(u, ldu, v, ldv, (rows, cols, rank), block_rows, vector, out) }
        }
    )*};
}

dot_entries! {
    column_dot:
    /// `out[y, c] = scale * sum_r weights[r] a[r, c]` over block row `y`'s rows `r` of
    /// `a (rows, cols)` (`y rows_per_block ..`, at most `rows_per_block` of them): with
    /// `gridDim.y` 1 the weighted column sums, else that many partial sums for a second
    /// launch over them (`weights` null, `scale` 1) to add. `weights` null: all 1. Each
    /// block covers 32 chunks of 16 bytes (`kernel_abi::dot::column_dot_cols`), a chunk per
    /// lane, its warps taking every `WARPS`-th row with `ROWS_IN_FLIGHT` rows' loads in
    /// flight (4 KB a warp: with 4 values and 4 rows a lane, and the weights' null test
    /// inside the loop, ptxas issued two loads at a time); the warps' sums are added in
    /// shared memory in warp order.
    ///
    /// # Safety
    /// `a` holds `rows * cols` elements (16-byte aligned where `vector` is non-zero, which
    /// needs `cols` a multiple of a chunk's values), `weights` (if not null) `rows`, `out`
    /// `gridDim.y * cols` floats. Launch: `THREADS` threads, grid `(ceil(cols /
    /// column_dot_cols), ceil(rows / rows_per_block))`, `COLUMN_DOT_SMEM_BYTES` of dynamic
    /// shared memory.
    column_dot = f32;
    /// [`column_dot`] of bf16 values.
    ///
    /// # Safety
    /// As [`column_dot`].
    column_dot_bf16 = Bf16;
    /// [`column_dot`] of fp16 values.
    ///
    /// # Safety
    /// As [`column_dot`].
    column_dot_f16 = F16;
}

dot_entries! {
    column_dots:
    /// `out[y, r, c] = sum_j u[r, j] a[j, c]` over block row `y`'s rows `j` of `a (rows,
    /// cols)` (`y rows_per_block ..`), for the `rank` weight vectors `u[r, :]` (pitch
    /// `ldu`): `dX = dZ W` of a batch of 2 to `OUTER_MAX_RANK` rows as one pass over `W`,
    /// its ranges' FP32 sums added by `split_sums*`. [`column_dot`] for several
    /// weight vectors at once: a quad of columns per lane (eight vectors' sums of 16
    /// columns would not fit beside the loads in flight), the range's weights in shared
    /// memory, `ROWS_IN_FLIGHT` rows' loads in flight per warp, the warps' sums added in
    /// warp order.
    ///
    /// # Safety
    /// `a` holds `rows * cols` elements (aligned to a quad of them where `vector` is
    /// non-zero, which needs `cols` a multiple of 4), `u` `(rank - 1) * ldu + rows`, `out`
    /// `gridDim.y * rank * cols` floats; `1 <= rank <= OUTER_MAX_RANK`, `rows_per_block <=
    /// COLUMN_DOTS_MAX_RANGE_ROWS`. Launch: `THREADS` threads, grid `(ceil(cols /
    /// COLUMN_DOTS_BLOCK_COLS), ceil(rows / rows_per_block))`, `COLUMN_DOTS_SMEM_BYTES` of
    /// dynamic shared memory.
    column_dots = f32;
    /// [`column_dots`] of bf16 values.
    ///
    /// # Safety
    /// As [`column_dots`].
    column_dots_bf16 = Bf16;
    /// [`column_dots`] of fp16 values.
    ///
    /// # Safety
    /// As [`column_dots`].
    column_dots_f16 = F16;
}

dot_entries! {
    row_dot:
    /// `out[r] = sum_c x[r, c] w[c]` for the `rows` rows of `x (rows, k)`: a block per row
    /// (with a warp per row, eight rows a block, KB14's 16 MB `x` took 0.03 ms: too few
    /// loads in flight), a 16-byte chunk per thread and `CHUNKS_IN_FLIGHT` in flight, the
    /// lanes' sums added by shuffles and the warps' in warp order.
    ///
    /// # Safety
    /// `x` holds `rows * k` elements (16-byte aligned where `vector` is non-zero, which
    /// needs `k` a multiple of a chunk's values, and `w` 16-byte aligned), `w` `k` floats,
    /// `out` `rows` floats. Launch: `THREADS` threads, grid `rows`, `ROW_DOT_SMEM_BYTES` of
    /// dynamic shared memory.
    row_dot = f32;
    /// [`row_dot`] of bf16 values.
    ///
    /// # Safety
    /// As [`row_dot`].
    row_dot_bf16 = Bf16;
    /// [`row_dot`] of fp16 values.
    ///
    /// # Safety
    /// As [`row_dot`].
    row_dot_f16 = F16;
}

dot_entries! {
    outer:
    /// `out[i, c] = sum_{r < rank} u[r, i] v[r, c]` (`u (rank, rows)` at pitch `ldu`, `v
    /// (rank, cols)` at pitch `ldv`, `out (rows, cols)` dense), summed in FP32 in `r`'s
    /// order and rounded once into `out`'s type: a folded layer's `dX = dZ w` (rank 1,
    /// `v` the FP32 weight means), and the weight gradient `dW = dZ^T X` of a batch of at
    /// most `OUTER_MAX_RANK` rows, which is nothing but this sum (a tile GEMM as deep as
    /// the batch spends a whole tile's pipeline on it). Each block writes `block_rows`
    /// rows (`blockIdx.x`'s) of `OUTER_BLOCK_COLS` columns (`blockIdx.y`'s), a quad per
    /// thread, its quads of `v` in registers across the rows.
    ///
    /// # Safety
    /// `u` holds `(rank - 1) * ldu + rows` elements, `v` `(rank - 1) * ldv + cols`, `out`
    /// `rows * cols`; `1 <= rank <= OUTER_MAX_RANK`, `1 <= block_rows <=
    /// OUTER_MAX_BLOCK_ROWS`; `vector` non-zero only where `cols` and `ldv` are
    /// multiples of 4 and `v` and `out` aligned to a quad of their elements. Launch:
    /// `THREADS` threads, grid `(ceil(rows / block_rows), ceil(cols /
    /// OUTER_BLOCK_COLS))`, `OUTER_SMEM_BYTES` of dynamic shared memory.
    outer = (f32, f32);
    /// [`outer`] of bf16 `u` and `out`, FP32 `v` (a bf16 model's folded layer).
    ///
    /// # Safety
    /// As [`outer`].
    outer_bf16 = (Bf16, f32);
    /// [`outer`] of fp16 `u` and `out`, FP32 `v`.
    ///
    /// # Safety
    /// As [`outer`].
    outer_f16 = (F16, f32);
    /// [`outer`] of bf16 values throughout (a bf16 model's `dW` at a few rows; each
    /// product of two bf16 values is exact in FP32).
    ///
    /// # Safety
    /// As [`outer`].
    outer_sum_bf16 = (Bf16, Bf16);
    /// [`outer`] of fp16 values throughout.
    ///
    /// # Safety
    /// As [`outer`].
    outer_sum_f16 = (F16, F16);
}

/// Values of `I` in one 16-byte load: four FP32 or eight 16-bit ones.
#[inline(always)]
const fn chunk<I>() -> usize {
    16 / core::mem::size_of::<I>()
}

/// The 16 bytes at `at` as four words (a chunk of `I`'s values).
///
/// # Safety
/// `at` is 16-byte aligned, valid for 16 bytes that nothing writes during the kernel.
#[inline(always)]
unsafe fn load_words<I>(at: *const I) -> [u32; 4] {
    // SAFETY: as the caller's.
    unsafe { load_v4_nc(at as *const f32) }.map(f32::to_bits)
}

/// The [`chunk`] values of `I` in `w` (the rest of the eight 0).
#[inline(always)]
fn chunk_values<I: Element>(w: [u32; 4]) -> [f32; 8] {
    if chunk::<I>() == 4 {
        let v = w.map(f32::from_bits);
        return [v[0], v[1], v[2], v[3], 0.0, 0.0, 0.0, 0.0];
    }
    let (a, b) = (I::unpack4([w[0], w[1]]), I::unpack4([w[2], w[3]]));
    [a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]]
}

/// The [`chunk`] values of `I` at `at`, columns `c ..` of `cols` (the rest of the eight
/// 0): one 16-byte load where `vector`, else one by one inside `cols`.
#[inline(always)]
unsafe fn load_chunk<I: Element>(at: *const I, c: usize, cols: usize, vector: bool) -> [f32; 8] {
    if vector {
        // SAFETY: the caller's 16-byte aligned chunk inside the row.
        return chunk_values::<I>(unsafe { load_words(at) });
    }
    // SAFETY: each column checked.
    core::array::from_fn(|q| if q < chunk::<I>() && c + q < cols { unsafe { I::load1(at.add(q)) } } else { 0.0 })
}

/// The body of [`column_dot`].
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn column_dot_body<I: Element>(
    a: *const I,
    weights: *const I,
    rows: u32,
    cols: u32,
    rows_per_block: u32,
    scale: f32,
    vector: u32,
    out: *mut f32,
) {
    let (t, cols, vector) = (thread_idx_x() as usize, cols as usize, vector != 0);
    let (warp, lane, n) = (t / 32, t % 32, chunk::<I>());
    let block_cols = 32 * n;
    let c = block_idx_x() as usize * block_cols + n * lane;
    let first = block_idx_y() as usize * rows_per_block as usize;
    let end = (first + rows_per_block as usize).min(rows as usize);
    // (The weights' null test outside the loop: inside, its branches kept ptxas from
    // issuing the rows' loads together.)
    let r = first + warp;
    let s = if weights.is_null() {
        // SAFETY: the caller's.
        unsafe { rows_sum::<I, false>(a, weights, (r, end), (c, cols), vector) }
    } else {
        // SAFETY: the caller's.
        unsafe { rows_sum::<I, true>(a, weights, (r, end), (c, cols), vector) }
    };
    // The warps' sums, added in warp order by the block's first `block_cols` threads.
    let sums = dynamic_shared::<f32>();
    // SAFETY: slot (warp, n lane + q) of WARPS * block_cols; a uniform barrier.
    unsafe {
        unroll!(q in 0..8 => {
            if q < n {
                *sums.add(warp * block_cols + n * lane + q) = s[q];
            }
        });
        sync_threads();
    }
    let col = block_idx_x() as usize * block_cols + t;
    if t < block_cols && col < cols {
        let mut total = 0.0;
        for w in 0..WARPS {
            // SAFETY: inside the shared sums.
            total += unsafe { *sums.add(w * block_cols + t) };
        }
        // SAFETY: row blockIdx.y of out, column col < cols.
        unsafe { *out.add(block_idx_y() as usize * cols + col) = scale * total };
    }
}

/// A `column_dot` lane's sums of its chunk of columns `c ..` over rows `r, r + WARPS, ..`
/// below `end`, each row weighted by `weights[row]` where `WEIGHTED`.
///
/// # Safety
/// As [`column_dot`]'s.
#[inline(always)]
unsafe fn rows_sum<I: Element, const WEIGHTED: bool>(
    a: *const I,
    weights: *const I,
    (mut r, end): (usize, usize),
    (c, cols): (usize, usize),
    vector: bool,
) -> [f32; 8] {
    // SAFETY (each call): a row below `end <= rows`.
    let weight = |r: usize| if WEIGHTED { unsafe { I::load1(weights.add(r)) } } else { 1.0 };
    let mut s = [0.0f32; 8];
    if c >= cols {
        return s;
    }
    if vector {
        // `ROWS_IN_FLIGHT` rows at a time: their loads issued before any is added (held
        // as loaded: widened 16-bit values took the array through local memory).
        while r + (ROWS_IN_FLIGHT - 1) * WARPS < end {
            // SAFETY: rows below `end`, a 16-byte aligned chunk inside each.
            let v: [[u32; 4]; ROWS_IN_FLIGHT] =
                core::array::from_fn(|i| unsafe { load_words(a.add((r + i * WARPS) * cols + c)) });
            let w: [f32; ROWS_IN_FLIGHT] = core::array::from_fn(|i| weight(r + i * WARPS));
            unroll!(i in 0..8 => {
                let x = chunk_values::<I>(v[i]);
                unroll!(q in 0..8 => { s[q] += w[i] * x[q]; });
            });
            r += ROWS_IN_FLIGHT * WARPS;
        }
    }
    while r < end {
        // SAFETY: row r < end, the chunk inside the row (checked where not `vector`).
        let v = unsafe { load_chunk(a.add(r * cols + c), c, cols, vector) };
        let w = weight(r);
        unroll!(q in 0..8 => { s[q] += w * v[q]; });
        r += WARPS;
    }
    s
}

/// The body of [`column_dots`].
#[inline(always)]
unsafe fn column_dots_body<I: Element>(
    a: *const I,
    (u, ldu, rank): (*const I, u32, u32),
    (rows, cols): (u32, u32),
    rows_per_block: u32,
    vector: u32,
    out: *mut f32,
) {
    let (t, rows, cols, ldu) = (thread_idx_x() as usize, rows as usize, cols as usize, ldu as usize);
    let rank = (rank as usize).clamp(1, OUTER_MAX_RANK);
    let (warp, lane) = (t / 32, t % 32);
    let first = block_idx_y() as usize * rows_per_block as usize;
    let end = (first + (rows_per_block as usize).min(COLUMN_DOTS_MAX_RANGE_ROWS)).min(rows);
    let count = end.saturating_sub(first);
    // `us[i][r] = u[r, first + i]`: the range's weights, read once.
    let us = dynamic_shared::<f32>();
    let mut e = t;
    while e < rank * count {
        let (i, r) = (e / rank, e % rank);
        // SAFETY: r < rank and first + i < rows: inside `u`; i < COLUMN_DOTS_MAX_RANGE_ROWS
        // and r < OUTER_MAX_RANK: inside the shared memory.
        unsafe { *us.add(i * OUTER_MAX_RANK + r) = I::load1(u.add(r * ldu + first + i)) };
        e += THREADS;
    }
    // SAFETY: every thread of the block reaches it.
    unsafe { sync_threads() };
    let c = block_idx_x() as usize * COLUMN_DOTS_BLOCK_COLS + 4 * lane;
    let mut s = [[0.0f32; 4]; OUTER_MAX_RANK];
    // Row `j`'s four values `v` into the sums, weighted by its `rank` weights.
    let add = |s: &mut [[f32; 4]; OUTER_MAX_RANK], j: usize, v: [f32; 4]| {
        // SAFETY: first <= j < end: inside the staged weights.
        let w = unsafe { us.add((j - first) * OUTER_MAX_RANK) };
        unroll!(r in 0..8 => {
            if r < rank {
                // SAFETY: as above.
                let f = unsafe { *w.add(r) };
                unroll!(q in 0..4 => { s[r][q] = fma(f, v[q], s[r][q]); });
            }
        });
    };
    if c < cols {
        let mut j = first + warp;
        if vector != 0 {
            while j + (ROWS_IN_FLIGHT - 1) * WARPS < end {
                // SAFETY: rows below `end`, an aligned quad inside each (`vector`).
                let v: [[f32; 4]; ROWS_IN_FLIGHT] =
                    core::array::from_fn(|i| unsafe { I::load4_nc(a.add((j + i * WARPS) * cols + c)) });
                unroll!(i in 0..8 => { add(&mut s, j + i * WARPS, v[i]); });
                j += ROWS_IN_FLIGHT * WARPS;
            }
        }
        while j < end {
            let v = if vector != 0 {
                // SAFETY: as above.
                unsafe { I::load4_nc(a.add(j * cols + c)) }
            } else {
                // SAFETY: each column checked against `cols`.
                core::array::from_fn(|q| if c + q < cols { unsafe { I::load1(a.add(j * cols + c + q)) } } else { 0.0 })
            };
            add(&mut s, j, v);
            j += WARPS;
        }
    }
    // The warps' sums, over the weights (which no thread reads any more): slot
    // `(warp, r, 4 lane + q)`, then added in warp order by the block's first
    // `COLUMN_DOTS_BLOCK_COLS` threads.
    // SAFETY: uniform barriers; the slots lie inside COLUMN_DOTS_SMEM_BYTES.
    unsafe {
        sync_threads();
        unroll!(r in 0..8 => {
            if r < rank {
                unroll!(q in 0..4 => {
                    *us.add((warp * OUTER_MAX_RANK + r) * COLUMN_DOTS_BLOCK_COLS + 4 * lane + q) = s[r][q];
                });
            }
        });
        sync_threads();
    }
    let col = block_idx_x() as usize * COLUMN_DOTS_BLOCK_COLS + t;
    if t < COLUMN_DOTS_BLOCK_COLS && col < cols {
        for r in 0..rank {
            let mut total = 0.0;
            for w in 0..WARPS {
                // SAFETY: inside the shared sums.
                total += unsafe { *us.add((w * OUTER_MAX_RANK + r) * COLUMN_DOTS_BLOCK_COLS + t) };
            }
            // SAFETY: row (blockIdx.y, r) of out, column col < cols.
            unsafe { *out.add((block_idx_y() as usize * rank + r) * cols + col) = total };
        }
    }
}

/// Chunks of `x` a `row_dot` thread has in flight at once.
const CHUNKS_IN_FLIGHT: usize = 2;

/// The body of [`row_dot`].
#[inline(always)]
unsafe fn row_dot_body<I: Element>(x: *const I, w: *const f32, rows: u32, k: u32, vector: u32, out: *mut f32) {
    let (t, row) = (thread_idx_x() as usize, block_idx_x() as usize);
    if row >= rows as usize {
        return;
    }
    // SAFETY: row < rows.
    let x = unsafe { x.add(row * k as usize) };
    // (The `vector` test outside the loops, as `column_dot`'s weights test.)
    let s = if vector != 0 {
        // SAFETY: the caller's.
        unsafe { row_sum::<I, true>(x, w, k as usize, t) }
    } else {
        // SAFETY: the caller's.
        unsafe { row_sum::<I, false>(x, w, k as usize, t) }
    };
    // The lanes' sums by shuffles, the warps' in warp order by thread 0.
    let total = warp_sum(((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])));
    let sums = dynamic_shared::<f32>();
    // SAFETY: slot `warp` of WARPS; a uniform barrier.
    unsafe {
        if t % 32 == 0 {
            *sums.add(t / 32) = total;
        }
        sync_threads();
    }
    if t == 0 {
        let mut sum = 0.0;
        for i in 0..WARPS {
            // SAFETY: inside the shared sums.
            sum += unsafe { *sums.add(i) };
        }
        // SAFETY: row < rows.
        unsafe { *out.add(row) = sum };
    }
}

/// A `row_dot` thread's sums of its chunks `n t, n t + n THREADS, ..` of the row `x`
/// (`k` values) times `w`: 16-byte loads where `VECTOR`, else one value at a time.
///
/// # Safety
/// As [`row_dot`]'s, for one row.
#[inline(always)]
unsafe fn row_sum<I: Element, const VECTOR: bool>(x: *const I, w: *const f32, k: usize, t: usize) -> [f32; 8] {
    let n = chunk::<I>();
    // The weights of a chunk: one or two 16-byte loads of floats.
    // SAFETY (each call): the caller's chunk inside `k` (checked where not `VECTOR`).
    let weights = |c: usize| -> [f32; 8] {
        if !VECTOR {
            return core::array::from_fn(|q| if q < n && c + q < k { unsafe { *w.add(c + q) } } else { 0.0 });
        }
        let lo = unsafe { load_v4_nc(w.add(c)) };
        let hi = if n == 8 { unsafe { load_v4_nc(w.add(c + 4)) } } else { [0.0; 4] };
        [lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]]
    };
    let stride = n * THREADS;
    let mut s = [0.0f32; 8];
    let mut c = n * t;
    if VECTOR {
        while c + (CHUNKS_IN_FLIGHT - 1) * stride < k {
            // SAFETY: 16-byte aligned chunks inside the row.
            let v: [[u32; 4]; CHUNKS_IN_FLIGHT] =
                core::array::from_fn(|i| unsafe { load_words(x.add(c + i * stride)) });
            let wv: [[f32; 8]; CHUNKS_IN_FLIGHT] = core::array::from_fn(|i| weights(c + i * stride));
            unroll!(i in 0..2 => {
                let xv = chunk_values::<I>(v[i]);
                unroll!(q in 0..8 => { s[q] += xv[q] * wv[i][q]; });
            });
            c += CHUNKS_IN_FLIGHT * stride;
        }
    }
    while c < k {
        // SAFETY: one chunk inside the row (checked where not `VECTOR`).
        let (v, wv) = (unsafe { load_chunk(x.add(c), c, k, VECTOR) }, weights(c));
        unroll!(q in 0..8 => { s[q] += v[q] * wv[q]; });
        c += stride;
    }
    s
}

/// The body of [`outer`].
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn outer_body<O: Element, V: Element>(
    u: *const O,
    ldu: u32,
    v: *const V,
    ldv: u32,
    (rows, cols, rank): (u32, u32, u32),
    block_rows: u32,
    vector: u32,
    out: *mut O,
) {
    let (ldu, ldv, rows, cols) = (ldu as usize, ldv as usize, rows as usize, cols as usize);
    let rank = (rank as usize).clamp(1, OUTER_MAX_RANK);
    let first = block_idx_x() as usize * block_rows as usize;
    if first >= rows {
        return;
    }
    let count = (block_rows as usize).min(OUTER_MAX_BLOCK_ROWS).min(rows - first);
    // `us[i][r] = u[r, first + i]`: the block's rows' factors, read once.
    let us = dynamic_shared::<f32>();
    let t = thread_idx_x() as usize;
    let mut e = t;
    while e < rank * count {
        let (r, i) = (e / count, e % count);
        // SAFETY: r < rank and first + i < rows: inside `u`; i < OUTER_MAX_BLOCK_ROWS and
        // r < OUTER_MAX_RANK: inside the shared memory.
        unsafe { *us.add(i * OUTER_MAX_RANK + r) = O::load1(u.add(r * ldu + first + i)) };
        e += THREADS;
    }
    // SAFETY: every thread of the block reaches it.
    unsafe { sync_threads() };
    let start = block_idx_y() as usize * OUTER_BLOCK_COLS;
    // One quad of `out`'s row `i` from the thread's quads `vs` of `v`.
    let sum = |i: usize, vs: &[[f32; 4]; OUTER_MAX_RANK]| {
        // SAFETY: i < count (each caller's loop).
        let a = |r: usize| unsafe { *us.add(i * OUTER_MAX_RANK + r) };
        let mut s = vs[0].map(|b| a(0) * b);
        unroll!(r in 0..8 => {
            if r >= 1 && r < rank {
                let f = a(r);
                unroll!(q in 0..4 => { s[q] = fma(f, vs[r][q], s[q]); });
            }
        });
        s
    };
    if vector != 0 {
        let c = start + 4 * t;
        if c >= cols {
            return;
        }
        let mut vs = [[0.0; 4]; OUTER_MAX_RANK];
        unroll!(r in 0..8 => {
            // SAFETY: a quad inside row r of `v`, aligned (`vector`).
            if r < rank { vs[r] = unsafe { V::load4_nc(v.add(r * ldv + c)) }; }
        });
        for i in 0..count {
            // SAFETY: a quad inside row first + i of `out`, aligned (`vector`).
            unsafe { O::store4(out.add((first + i) * cols + c), sum(i, &vs)) };
        }
    } else {
        // The thread's four columns, `THREADS` apart (coalesced).
        let mut vs = [[0.0; 4]; OUTER_MAX_RANK];
        unroll!(r in 0..8 => {
            if r < rank {
                unroll!(q in 0..4 => {
                    let c = start + t + q * THREADS;
                    // SAFETY: c < cols: inside row r of `v`.
                    if c < cols { vs[r][q] = unsafe { V::load1(v.add(r * ldv + c)) }; }
                });
            }
        });
        for i in 0..count {
            let s = sum(i, &vs);
            unroll!(q in 0..4 => {
                let c = start + t + q * THREADS;
                // SAFETY: c < cols: inside row first + i of `out`.
                if c < cols { unsafe { O::store1(out.add((first + i) * cols + c), s[q]) }; }
            });
        }
    }
}

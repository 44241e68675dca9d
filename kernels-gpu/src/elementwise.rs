//! Small memory-bound kernels the backward and the tape need: gradient accumulation
//! and the AvgPool fold of a Linear layer's weights (forward) and its transpose (backward).
//!
//! The elementwise ones are 1-D (one thread per output element, any grid that covers
//! `len`); the fold, unfold and transposes take a block per row or tile, as each says.

use crate::prelude::element::{Bf16, Element, F16, Half};
use crate::prelude::global::{load_v4_nc, store_v2, store_v4};
use crate::prelude::*;
use crate::unroll;

/// This thread's index in a 1-D launch.
#[inline(always)]
pub(crate) fn global_index() -> usize {
    (block_idx_x() as usize) * (block_dim_x() as usize) + thread_idx_x() as usize
}

/// `a += b` over `len` elements (the tape's gradient accumulation).
///
/// # Safety
/// `a` and `b` hold `len` floats.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn add_assign(a: *mut f32, b: *const f32, len: u32) {
    let i = global_index();
    if i < len as usize {
        // SAFETY: i < len.
        unsafe { *a.add(i) += *b.add(i) };
    }
}

/// `out[offset + i] = words[i]` for `i < count`: a small table (TMA tensor maps, op
/// descriptors) written from the launch's own arguments, so a CUDA graph captures it
/// with the launch and no host memory is read. One warp; lane `i` writes word `i`
/// (unrolled over constant indices: the argument array stays in parameter space).
///
/// # Safety
/// `out` holds `offset + count` words, `count <= STORE_WORDS`. Launch: one block of 32 threads.
#[unsafe(no_mangle)]
// The array is a by-value kernel parameter (in PTX's parameter space, as the launcher
// pushes it), not a C value: the FFI-safety lint does not apply.
#[allow(improper_ctypes_definitions)]
pub unsafe extern "ptx-kernel" fn store_words(
    out: *mut u64,
    offset: u32,
    count: u32,
    words: [u64; kernel_abi::STORE_WORDS],
) {
    let lane = thread_idx_x() as usize;
    unroll!(i in 0..16 => {
        if lane == i && i < count as usize {
            // SAFETY: i < count, inside `out` by the contract.
            unsafe { *out.add(offset as usize + i) = words[i] };
        }
        if lane == i && i + 16 < count as usize {
            // SAFETY: as above.
            unsafe { *out.add(offset as usize + i + 16) = words[i + 16] };
        }
    });
}

/// AvgPool1d(k) after a Linear layer is a Linear layer with averaged rows:
/// `out[j, c] = mean_e in[j k + e, c]` for `j < rows / k` (`in` is `(rows, cols)`).
/// One block per output row `j` (no per-element division: with 64-bit index
/// arithmetic per element the unfold below took 0.29 ms for M4's 256 MB), columns in
/// 16-byte steps when `cols` is a multiple of 4.
///
/// # Safety
/// `input` holds `rows * cols` floats, `out` `(rows / k) * cols`, both 16-byte aligned.
/// Launch: grid `rows / k` blocks, any block size.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn fold_rows_mean(input: *const f32, rows: u32, cols: u32, k: u32, out: *mut f32) {
    unsafe { fold_rows::<f32>(input, rows, cols, k, out) }
}

/// [`fold_rows_mean`] of a bf16 weight (a bf16 model's): the means in FP32.
///
/// # Safety
/// As [`fold_rows_mean`], `input` holding 16-bit words, 8-byte aligned.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn fold_rows_mean_bf16(input: *const Bf16, rows: u32, cols: u32, k: u32, out: *mut f32) {
    unsafe { fold_rows::<Bf16>(input, rows, cols, k, out) }
}

/// [`fold_rows_mean`] of an fp16 weight: the means in FP32.
///
/// # Safety
/// As [`fold_rows_mean_bf16`].
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn fold_rows_mean_f16(input: *const F16, rows: u32, cols: u32, k: u32, out: *mut f32) {
    unsafe { fold_rows::<F16>(input, rows, cols, k, out) }
}

/// [`fold_rows_mean`] of a bf16 weight as two bf16 matrices whose sum is the FP32
/// means to about 2^-17 of each: `hi` the means rounded (what `fold_rows_mean_bf16`
/// then a rounding would give), `lo` the rest rounded. `x hi^T + x lo^T` on a bf16 `x`
/// is then two bf16 GEMMs as accurate as 3xTF32 on the FP32 means, on bf16's tensor
/// cores and without widening `x`.
///
/// # Safety
/// As [`fold_rows_mean_bf16`]; `hi` and `lo` each hold `(rows / k) * cols` 16-bit words,
/// 8-byte aligned.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn fold_rows_mean_halves_bf16(
    input: *const Bf16,
    rows: u32,
    cols: u32,
    k: u32,
    hi: *mut Bf16,
    lo: *mut Bf16,
) {
    unsafe { fold_rows_halves::<Bf16, Bf16>(input, rows, cols, k, hi, lo) }
}

/// [`fold_rows_mean_halves_bf16`] of an fp16 weight (`hi + lo` within about 2^-22 of
/// each mean, or fp16's subnormal step 2^-24 where `lo` is that small).
///
/// # Safety
/// As [`fold_rows_mean_halves_bf16`].
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn fold_rows_mean_halves_f16(
    input: *const F16,
    rows: u32,
    cols: u32,
    k: u32,
    hi: *mut F16,
    lo: *mut F16,
) {
    unsafe { fold_rows_halves::<F16, F16>(input, rows, cols, k, hi, lo) }
}

/// [`fold_rows_mean_halves_bf16`] of FP32 rows (a first pass's means, where a window
/// is too long for one block: `host/src/gpu/elementwise.rs`).
///
/// # Safety
/// As [`fold_rows_mean_halves_bf16`], `input` holding floats, 16-byte aligned.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn fold_rows_mean_f32_halves_bf16(
    input: *const f32,
    rows: u32,
    cols: u32,
    k: u32,
    hi: *mut Bf16,
    lo: *mut Bf16,
) {
    unsafe { fold_rows_halves::<f32, Bf16>(input, rows, cols, k, hi, lo) }
}

/// [`fold_rows_mean_f32_halves_bf16`] into fp16 halves.
///
/// # Safety
/// As [`fold_rows_mean_f32_halves_bf16`].
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn fold_rows_mean_f32_halves_f16(
    input: *const f32,
    rows: u32,
    cols: u32,
    k: u32,
    hi: *mut F16,
    lo: *mut F16,
) {
    unsafe { fold_rows_halves::<f32, F16>(input, rows, cols, k, hi, lo) }
}

/// The FP32 mean of rows `first / cols ..` (`k` of them) at column `c`, four columns
/// at once: the rows' loads issued four at a time (a block's 16 rows are 16 independent
/// reads), then added in row order.
#[inline(always)]
unsafe fn mean4<I: Element>(input: *const I, first: usize, cols: usize, k: usize, c: usize) -> [f32; 4] {
    let mut s = [0.0f32; 4];
    let mut e = 0;
    while e + 4 <= k {
        // SAFETY: the caller's rows e .. e + 4 < k.
        let v: [[f32; 4]; 4] = core::array::from_fn(|i| unsafe { I::load4_nc(input.add(first + (e + i) * cols + c)) });
        unroll!(i in 0..4 => { unroll!(q in 0..4 => { s[q] += v[i][q]; }); });
        e += 4;
    }
    while e < k {
        // SAFETY: as above.
        let v = unsafe { I::load4_nc(input.add(first + e * cols + c)) };
        unroll!(q in 0..4 => { s[q] += v[q]; });
        e += 1;
    }
    let inv = 1.0 / k as f32;
    s.map(|x| x * inv)
}

/// The FP32 mean of one column `c`, as [`mean4`] by one value.
#[inline(always)]
unsafe fn mean1<I: Element>(input: *const I, first: usize, cols: usize, k: usize, c: usize) -> f32 {
    let mut s = 0.0;
    for e in 0..k {
        // SAFETY: the caller's rows.
        s += unsafe { I::load1(input.add(first + e * cols + c)) };
    }
    s * (1.0 / k as f32)
}

/// The body of the folds.
#[inline(always)]
unsafe fn fold_rows<I: Element>(input: *const I, rows: u32, cols: u32, k: u32, out: *mut f32) {
    let (cols, k, j) = (cols as usize, k as usize, block_idx_x() as usize);
    if j >= rows as usize / k {
        return;
    }
    let first = j * k * cols;
    // SAFETY (each access): rows j k .. j k + k < rows, columns below cols.
    each_column(cols, |c| unsafe { store_v4(out.add(j * cols + c), mean4(input, first, cols, k, c)) }, |c| unsafe {
        *out.add(j * cols + c) = mean1(input, first, cols, k, c)
    });
}

/// The body of the 16-bit folds into two halves.
#[inline(always)]
unsafe fn fold_rows_halves<I: Element, H: Half>(input: *const I, rows: u32, cols: u32, k: u32, hi: *mut H, lo: *mut H) {
    let (cols, k, j) = (cols as usize, k as usize, block_idx_x() as usize);
    if j >= rows as usize / k {
        return;
    }
    let first = j * k * cols;
    // SAFETY (each access): rows j k .. j k + k < rows, columns below cols.
    each_column(cols, |c| unsafe {
        let m = mean4(input, first, cols, k, c);
        let b = m.map(f32::to_bits);
        let words = [H::pack2(b[0], b[1]), H::pack2(b[2], b[3])];
        let h = H::unpack4(words);
        H::store4(hi.add(j * cols + c), m);
        H::store4(lo.add(j * cols + c), core::array::from_fn(|q| m[q] - h[q]));
    }, |c| unsafe {
        let m = mean1(input, first, cols, k, c);
        let h = H::unpack2(H::pack2(m.to_bits(), 0))[0];
        H::store1(hi.add(j * cols + c), m);
        H::store1(lo.add(j * cols + c), m - h);
    });
}

/// The backward of [`fold_rows_mean`]: `out[r, c] = g[r / k, c] / k` for rows inside a
/// pooling window, 0 for the trailing rows AvgPool drops (`out` is `(rows, cols)`).
/// One block per output row, as [`fold_rows_mean`].
///
/// # Safety
/// `g` holds `(rows / k) * cols` floats, `out` `rows * cols`, both 16-byte aligned.
/// Launch: grid `rows` blocks, any block size.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn unfold_rows_mean_grad(g: *const f32, rows: u32, cols: u32, k: u32, out: *mut f32) {
    unsafe { unfold_rows::<f32>(g, rows, cols, k, out) }
}

/// [`unfold_rows_mean_grad`] into a bf16 weight gradient (rounded to nearest).
///
/// # Safety
/// As [`unfold_rows_mean_grad`], `out` holding 16-bit words, 8-byte aligned.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn unfold_rows_mean_grad_to_bf16(g: *const f32, rows: u32, cols: u32, k: u32, out: *mut Bf16) {
    unsafe { unfold_rows::<Bf16>(g, rows, cols, k, out) }
}

/// [`unfold_rows_mean_grad`] into an fp16 weight gradient (rounded to nearest).
///
/// # Safety
/// As [`unfold_rows_mean_grad_to_bf16`].
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn unfold_rows_mean_grad_to_f16(g: *const f32, rows: u32, cols: u32, k: u32, out: *mut F16) {
    unsafe { unfold_rows::<F16>(g, rows, cols, k, out) }
}

/// The body of the unfolds.
#[inline(always)]
unsafe fn unfold_rows<O: Element>(g: *const f32, rows: u32, cols: u32, k: u32, out: *mut O) {
    let (rows, cols, k, r) = (rows as usize, cols as usize, k as usize, block_idx_x() as usize);
    if r >= rows {
        return;
    }
    // Rows past the last whole window get 0 (scale 0, reading window 0).
    let (src, scale) = if r < (rows / k) * k { (r / k, 1.0 / k as f32) } else { (0, 0.0) };
    // SAFETY (each access): row src < rows / k of g, row r of out, columns below cols.
    each_column(cols, |c| unsafe {
        let v = load_v4_nc(g.add(src * cols + c));
        O::store4(out.add(r * cols + c), v.map(|x| x * scale));
    }, |c| unsafe { O::store1(out.add(r * cols + c), *g.add(src * cols + c) * scale) });
}

/// Runs `quad(c)` for `c` = 0, 4, 8, .. when `cols` is a multiple of 4, else `one(c)` for
/// every column, the block's threads striding over them.
#[inline(always)]
fn each_column(cols: usize, quad: impl Fn(usize), one: impl Fn(usize)) {
    let (t, step) = (thread_idx_x() as usize, block_dim_x() as usize);
    if cols % 4 == 0 {
        let mut c = 4 * t;
        while c < cols {
            quad(c);
            c += 4 * step;
        }
    } else {
        let mut c = t;
        while c < cols {
            one(c);
            c += step;
        }
    }
}

/// `out (cols, rows) = input (rows, cols)^T` through a `32 x 33` shared tile (the pad
/// keeps the column reads conflict-free), so reads and writes are both coalesced. The
/// tensor-core `dW` needs `X^T` as its `k`-contiguous operand.
///
/// # Safety
/// `input` holds `rows * cols` floats, `out` as many. Launch: block `(32, 8)`, grid
/// `(ceil(cols / 32), ceil(rows / 32))`, `32 * 33 * 4` bytes of dynamic shared memory.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn transpose(input: *const f32, rows: u32, cols: u32, out: *mut f32) {
    let tile = dynamic_shared::<f32>();
    let (tx, ty) = (thread_idx_x() as usize, thread_idx_y() as usize);
    let (rows, cols) = (rows as usize, cols as usize);
    let (c0, r0) = (block_idx_x() as usize * 32, block_idx_y() as usize * 32);
    for j in (0..32).step_by(8) {
        let (r, c) = (r0 + ty + j, c0 + tx);
        if r < rows && c < cols {
            // SAFETY: inside input and inside the 32 x 33 tile.
            unsafe { *tile.add((ty + j) * 33 + tx) = *input.add(r * cols + c) };
        }
    }
    // SAFETY: uniform barrier.
    unsafe { sync_threads() };
    for j in (0..32).step_by(8) {
        // Output row = input column c0 + ty + j, output column = input row r0 + tx.
        let (c, r) = (c0 + ty + j, r0 + tx);
        if r < rows && c < cols {
            // SAFETY: inside out and inside the tile.
            unsafe { *out.add(c * rows + r) = *tile.add(tx * 33 + ty + j) };
        }
    }
}

/// [`transpose`] for `rows` and `cols` multiples of 4 (every row 16-byte aligned, both
/// ways): `64 x 64` tiles, each thread 4 independent 16-byte loads and 4 16-byte stores
/// (the 32 x 32 kernel issues 4-byte ones and reached 83% of the DRAM peak on M2's
/// 512 MB `dZ`), the tile turned through shared memory with a pitch of 65 (two-way
/// bank conflicts at most).
///
/// # Safety
/// `input` holds `rows * cols` floats, `out` as many, both 16-byte aligned; `rows % 4 ==
/// cols % 4 == 0`. Launch: block 256, grid `(ceil(cols / 64), ceil(rows / 64))`,
/// `64 * 65 * 4` bytes of dynamic shared memory.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn transpose_vec4(input: *const f32, rows: u32, cols: u32, out: *mut f32) {
    // SAFETY: as the caller promises; row c, columns r..r + 4 inside out, aligned.
    unsafe { transpose_tiles(input, rows, cols, |at, w| store_v4(out.add(at), w)) }
}

/// [`transpose_vec4`] rounding to bf16 (to nearest even) on the way out, 8 bytes per
/// store: the bf16 backward's transposed operands in one pass instead of a transpose
/// and a rounding pass (M1's `W^T`: 384 MB of traffic instead of 896).
///
/// # Safety
/// As [`transpose_vec4`], `out` holding `rows * cols` 16-bit words (8-byte aligned).
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn transpose_vec4_to_bf16(input: *const f32, rows: u32, cols: u32, out: *mut Bf16) {
    unsafe { transpose_to_half(input, rows, cols, out) }
}

/// [`transpose_vec4_to_bf16`] rounding to fp16.
///
/// # Safety
/// As [`transpose_vec4_to_bf16`].
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn transpose_vec4_to_f16(input: *const f32, rows: u32, cols: u32, out: *mut F16) {
    unsafe { transpose_to_half(input, rows, cols, out) }
}

/// The body of the rounding transposes.
///
/// # Safety
/// As [`transpose_vec4_to_bf16`].
#[inline(always)]
unsafe fn transpose_to_half<H: Half>(input: *const f32, rows: u32, cols: u32, out: *mut H) {
    let pack = |w: [f32; 4]| [H::pack2(w[0].to_bits(), w[1].to_bits()), H::pack2(w[2].to_bits(), w[3].to_bits())].map(f32::from_bits);
    // SAFETY: as the caller promises; four words at `at` (a multiple of 4) inside out.
    unsafe { transpose_tiles(input, rows, cols, |at, w| store_v2(out.add(at) as *mut f32, pack(w))) }
}

/// The body of [`transpose_vec4`] and [`transpose_vec4_to_bf16`]: `store(at, w)` writes
/// the four values `w` at element `at` of the output (`at` a multiple of 4).
///
/// # Safety
/// As [`transpose_vec4`]; `store` writes inside the output.
#[inline(always)]
unsafe fn transpose_tiles(input: *const f32, rows: u32, cols: u32, store: impl Fn(usize, [f32; 4])) {
    const PITCH: usize = 65;
    let tile = dynamic_shared::<f32>();
    let t = thread_idx_x() as usize;
    let (rows, cols) = (rows as usize, cols as usize);
    let (c0, r0) = (block_idx_x() as usize * 64, block_idx_y() as usize * 64);
    // The thread's 16-byte column `q` of the tile and its first row `sub` (then + 16 j).
    let (q, sub) = (t % 16, t / 16);
    let mut v = [[0.0f32; 4]; 4];
    unroll!(j in 0..4 => {
        let (r, c) = (r0 + sub + 16 * j, c0 + 4 * q);
        if r < rows && c < cols {
            // SAFETY: row r, columns c..c + 4 inside input (cols % 4 == 0), aligned.
            v[j] = unsafe { load_v4_nc(input.add(r * cols + c)) };
        }
    });
    unroll!(j in 0..4 => {
        // SAFETY: inside the 64 x PITCH tile.
        unroll!(e in 0..4 => { unsafe { *tile.add((4 * q + e) * PITCH + sub + 16 * j) = v[j][e] }; });
    });
    // SAFETY: uniform barrier.
    unsafe { sync_threads() };
    // Output row c (input column c0 + sub + 16 j), columns r..r + 4 (input rows).
    unroll!(j in 0..4 => {
        let (c, r) = (c0 + sub + 16 * j, r0 + 4 * q);
        if c < cols && r < rows {
            // SAFETY: inside the tile.
            let w = [0, 1, 2, 3].map(|e| unsafe { *tile.add((sub + 16 * j) * PITCH + 4 * q + e) });
            store(c * rows + r, w);
        }
    });
}

/// `out[i] = bf16(input[i])` (round to nearest even), the bf16 operands of cuBLAS's
/// bf16 GEMM that `host bench --precision bf16` compares against.
///
/// # Safety
/// `input` holds `len` floats, `out` `len` 16-bit words.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn f32_to_bf16(input: *const f32, len: u32, out: *mut Bf16) {
    unsafe { narrow(input, len, out) }
}

/// `out[i] = fp16(input[i])` (round to nearest even; beyond 65504, infinity).
///
/// # Safety
/// As [`f32_to_bf16`].
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn f32_to_f16(input: *const f32, len: u32, out: *mut F16) {
    unsafe { narrow(input, len, out) }
}

/// `out[i] = input[i]` widened from bf16 to FP32 (exact): a bf16 caller's tensors on
/// the paths that compute from FP32 ones.
///
/// # Safety
/// `input` holds `len` 16-bit words, `out` `len` floats.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn bf16_to_f32(input: *const Bf16, len: u32, out: *mut f32) {
    unsafe { widen(input, len, out) }
}

/// [`bf16_to_f32`] from fp16 (exact).
///
/// # Safety
/// As [`bf16_to_f32`].
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn f16_to_f32(input: *const F16, len: u32, out: *mut f32) {
    unsafe { widen(input, len, out) }
}

/// The body of the roundings to 16 bits.
///
/// # Safety
/// As [`f32_to_bf16`].
#[inline(always)]
unsafe fn narrow<H: Half>(input: *const f32, len: u32, out: *mut H) {
    let i = global_index();
    if i < len as usize {
        // SAFETY: i < len.
        unsafe { H::store1(out.add(i), *input.add(i)) };
    }
}

/// The body of the widenings from 16 bits.
///
/// # Safety
/// As [`bf16_to_f32`].
#[inline(always)]
unsafe fn widen<H: Half>(input: *const H, len: u32, out: *mut f32) {
    let i = global_index();
    if i < len as usize {
        // SAFETY: i < len.
        unsafe { *out.add(i) = H::load1(input.add(i)) };
    }
}

// The unrolled pick below covers exactly `VECTORS` vectors.
const _: () = assert!(kernel_abi::VECTORS == 8);

/// Up to [`kernel_abi::VECTORS`] short vectors copied or converted in one launch, each
/// from its own source to its own destination: a block's small parameters widened from
/// a 16-bit type and its small gradients copied out or rounded, in one launch per call instead
/// of one per vector. Vector `v` is `words[3v]` (source address), `words[3v + 1]`
/// (destination address) and `words[3v + 2]` (length, and in the high word a
/// `kernel_abi::CONVERT_*` mode); `count` vectors are given. The words stay in parameter
/// space: each block picks its vector by constant indices.
///
/// # Safety
/// Each source holds `len` values of its mode's input type and each destination `len`
/// of its output type. Launch: grid (any, `count`), 1-D blocks; block row `y` takes
/// vector `y`.
#[unsafe(no_mangle)]
// The array is a by-value kernel parameter (in PTX's parameter space, as the launcher
// pushes it), not a C value: the FFI-safety lint does not apply.
#[allow(improper_ctypes_definitions)]
pub unsafe extern "ptx-kernel" fn convert_vectors(count: u32, words: [u64; 3 * kernel_abi::VECTORS]) {
    let v = block_idx_y() as usize;
    if v >= count as usize {
        return;
    }
    let (mut src, mut dst, mut meta) = (0u64, 0u64, 0u64);
    unroll!(i in 0..8 => {
        if v == i {
            (src, dst, meta) = (words[3 * i], words[3 * i + 1], words[3 * i + 2]);
        }
    });
    let (len, mode) = (meta as u32 as usize, (meta >> 32) as u32);
    let step = (grid_dim_x() * block_dim_x()) as usize;
    let mut i = global_index();
    while i < len {
        // SAFETY: i < len, inside both vectors by the contract.
        unsafe {
            match mode {
                kernel_abi::CONVERT_BF16_TO_F32 => *(dst as *mut f32).add(i) = Bf16::load1((src as *const Bf16).add(i)),
                kernel_abi::CONVERT_F32_TO_BF16 => Bf16::store1((dst as *mut Bf16).add(i), *(src as *const f32).add(i)),
                kernel_abi::CONVERT_F16_TO_F32 => *(dst as *mut f32).add(i) = F16::load1((src as *const F16).add(i)),
                kernel_abi::CONVERT_F32_TO_F16 => F16::store1((dst as *mut F16).add(i), *(src as *const f32).add(i)),
                _ => *(dst as *mut f32).add(i) = *(src as *const f32).add(i),
            }
        }
        i += step;
    }
}

//! FP8 operands for the e4m3 GEMMs (`gemm_tma_e4m3_*`): a matrix scaled by a power of
//! two per row (or per column, written transposed so that the scaled dimension becomes
//! rows again) and rounded to e4m3, with the inverse scales the GEMM's epilogue
//! multiplies its sums by.
//!
//! The recipe is the CPU backend's (`host/src/fp8.rs`): the scale `s` is the largest
//! power of two with `amax * s <= 448`, so the largest magnitude lands in `(224, 448]`;
//! a NaN or infinite `amax` gives a NaN scale, a zero one `1`; the exponent is clamped to
//! FP32's normal range. Values are `cvt.rn.satfinite` conversions (nearest, ties to
//! even, saturating at `±448`, NaN kept), the same rounding as the emulation. Scaling by
//! a power of two is exact, so GPU and CPU quantise every operand to the same bytes.
//!
//! The amaxes are taken over bit patterns: `|v|`'s bits order as its magnitude, and a
//! NaN's (`0x7fc0_0000` and up) above infinity's, so an unsigned maximum propagates NaN
//! as `max` would.

use crate::prelude::element::{Bf16, Element, F16};
use crate::prelude::warp::shfl_xor;
use crate::prelude::*;
use crate::unroll;
use crate::prelude::global::{load_v4_nc, store_v4};
use kernel_abi::fp8::{COLUMN_AMAX_COLS, COLUMN_AMAX_SMEM_BYTES, COLUMN_BLOCK_ROWS, ROW_THREADS, TILE, TILE_PITCH};

/// The scale's exponent for a slice of largest magnitude `amax_bits` (`|v|`'s bits),
/// or `None` where the scale is NaN (a NaN or infinite `amax`).
#[inline(always)]
fn scale_exponent(amax_bits: u32) -> Option<i32> {
    if amax_bits >= 0x7f80_0000 {
        return None;
    }
    if amax_bits == 0 {
        return Some(0);
    }
    let (field, mantissa) = ((amax_bits >> 23) as i32, amax_bits & 0x7f_ffff);
    // amax = 1.m * 2^(field - 127) and 448 = 1.75 * 2^8: the largest `e` with
    // `amax * 2^e <= 448` is `8 - (field - 127)` where 1.m <= 1.75, else one less. A
    // subnormal `amax` (field 0) lands above 127, and is clamped as on the CPU.
    let e = if mantissa <= 0x60_0000 { 8 + 127 - field } else { 7 + 127 - field };
    Some(e.clamp(-126, 127))
}

/// `2^e` for `-127 <= e <= 127` (`2^-127` is subnormal).
#[inline(always)]
fn pow2(e: i32) -> f32 {
    if e >= -126 { f32::from_bits(((e + 127) as u32) << 23) } else { f32::from_bits(1 << 22) }
}

/// The scale and its inverse (both NaN where the exponent is `None`).
#[inline(always)]
fn scales(amax_bits: u32) -> (f32, f32) {
    match scale_exponent(amax_bits) {
        Some(e) => (pow2(e), pow2(-e)),
        None => (f32::NAN, f32::NAN),
    }
}

/// Two values rounded to e4m3 (nearest, ties to even, saturating), `lo` in the low byte.
#[inline(always)]
fn e4m3x2(lo: f32, hi: f32) -> u16 {
    let d: u16;
    // SAFETY: a register conversion (sm_89+).
    unsafe {
        core::arch::asm!("cvt.rn.satfinite.e4m3x2.f32 {d}, {hi}, {lo};", d = out(reg16) d, hi = in(reg32) hi, lo = in(reg32) lo, options(pure, nomem, nostack))
    };
    d
}

/// Four values rounded to e4m3, the first in the low byte.
#[inline(always)]
fn e4m3x4(v: [f32; 4]) -> u32 {
    e4m3x2(v[0], v[1]) as u32 | (e4m3x2(v[2], v[3]) as u32) << 16
}

/// The unsigned maximum of `v` over the block's `ROW_THREADS` threads, returned to all;
/// `shared` holds a word per warp.
///
/// # Safety
/// Every thread of the block calls it; `shared` is the block's.
#[inline(always)]
unsafe fn block_max_bits(v: u32, shared: *mut u32) -> u32 {
    let warp_max = |mut v: u32| {
        let mut m = 1;
        while m < 32 {
            let o = shfl_xor(f32::from_bits(v), m).to_bits();
            v = if o > v { o } else { v };
            m <<= 1;
        }
        v
    };
    let v = warp_max(v);
    let (warp, lane) = (thread_idx_x() / 32, thread_idx_x() % 32);
    // SAFETY: one word per warp; the barriers order the writes before the reads.
    unsafe {
        if lane == 0 {
            *shared.add(warp as usize) = v;
        }
        sync_threads();
        let w = if lane < (ROW_THREADS / 32) as u32 { *shared.add(lane as usize) } else { 0 };
        warp_max(w)
    }
}

/// Declares entry points, each an instance of a generic body for one source element
/// type: `body(arguments after src); entries`.
macro_rules! fp8_entries {
    ($body:ident $args:tt; $($(#[$doc:meta])* $name:ident = <$t:ty>;)*) => {$(
        fp8_entries!(@one $body $args; $(#[$doc])* $name = <$t>);
    )*};
    (@one $body:ident ($($arg:ident: $ty:ty),*); $(#[$doc:meta])* $name:ident = <$t:ty>) => {
        $(#[$doc])*
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(src: *const $t, $($arg: $ty),*) {
            unsafe { $body::<$t>(src, $($arg),*) }
        }
    };
}

fp8_entries! {
    quantise_rows(rows: u32, cols: u32, col_mult: *const f32, inv_max_bits: *mut u32, dst: *mut u8, inv_scales: *mut f32);
    /// Quantises the row-major `(rows, cols)` FP32 matrix `src` to e4m3 with one scale
    /// per row: `dst[r][c] = e4m3(v * s_r)`, `inv_scales[r] = 1 / s_r`, where `v` is
    /// `src[r][c]`, times `col_mult[c]` unless `col_mult` is null (`dZ` for `dX`: the
    /// weight's scales moved onto its columns, [`fp8_transpose_weight`]). Unless
    /// `inv_max_bits` is null, raises it to the largest `1 / s_r`'s bits (a weight's
    /// normaliser for [`fp8_transpose_weight`]; it starts at zero).
    ///
    /// # Safety
    /// `src` holds `rows * cols` values, 16-byte aligned; `col_mult` null or `cols`
    /// floats, 16-byte aligned; `dst` `rows * cols` bytes and `inv_scales` `rows` floats,
    /// 4-byte aligned; `cols` a multiple of 4. Launch: one block of `ROW_THREADS` threads
    /// per row, `ROW_THREADS / 8` bytes of shared memory.
    fp8_quantise_rows_f32 = <f32>;
    /// [`fp8_quantise_rows_f32`] of a bf16 matrix.
    ///
    /// # Safety
    /// As [`fp8_quantise_rows_f32`], `src` 8-byte aligned.
    fp8_quantise_rows_bf16 = <Bf16>;
    /// [`fp8_quantise_rows_f32`] of an fp16 matrix.
    ///
    /// # Safety
    /// As [`fp8_quantise_rows_bf16`].
    fp8_quantise_rows_f16 = <F16>;
}

/// Chunks of four values each thread of a row-wise block holds in registers: rows of up
/// to `4 ROW_THREADS HELD_CHUNKS` (8192) values are read once, all of a thread's loads in
/// flight together.
const HELD_CHUNKS: usize = 8;
const _: () = assert!(HELD_CHUNKS == 8, "the loops below unroll 8");

/// The body of the `fp8_quantise_rows_*` kernels: the row's amax, then its values
/// scaled and rounded, four per thread and chunk. A row of up to 8192 values stays in
/// registers between the two (one read, eight loads in flight per thread: read in two
/// passes of one load at a time, 1024 rows of 8192 bf16 values took 17-22 us on the
/// H100); a longer one is read twice (the second pass hits L1/L2).
#[inline(always)]
unsafe fn quantise_rows<T: Element>(
    src: *const T,
    _rows: u32,
    cols: u32,
    col_mult: *const f32,
    inv_max_bits: *mut u32,
    dst: *mut u8,
    inv_scales: *mut f32,
) {
    let (row, t) = (block_idx_x() as usize, thread_idx_x() as usize);
    let cols = cols as usize;
    // SAFETY: the row's `cols` values, 4 at a time (`cols % 4 == 0`, aligned), and as
    // many multipliers.
    let load = |c: usize| unsafe {
        let v = T::load4_nc(src.add(row * cols + c));
        if col_mult.is_null() {
            v
        } else {
            let m = f32::load4_nc(col_mult.add(c));
            [v[0] * m[0], v[1] * m[1], v[2] * m[2], v[3] * m[3]]
        }
    };
    let bits_max = |amax: u32, v: [f32; 4]| {
        let mut amax = amax;
        for x in v {
            let b = x.to_bits() & 0x7fff_ffff;
            amax = if b > amax { b } else { amax };
        }
        amax
    };
    // SAFETY: 4 bytes of the row, 4-byte aligned.
    let store = |c: usize, q: u32| unsafe { *(dst.add(row * cols + c) as *mut u32) = q };
    let inv = if cols <= 4 * ROW_THREADS * HELD_CHUNKS {
        // Chunk j of this thread: columns 4 (t + ROW_THREADS j) onwards.
        let mut held = [[0.0f32; 4]; HELD_CHUNKS];
        unroll!(j in 0..8 => {
            let c = 4 * (t + ROW_THREADS * j);
            if c < cols {
                held[j] = load(c);
            }
        });
        let mut amax = 0u32;
        unroll!(j in 0..8 => { amax = bits_max(amax, held[j]); });
        // SAFETY: every thread; the block's shared words.
        let (s, inv) = scales(unsafe { block_max_bits(amax, dynamic_shared::<u32>()) });
        unroll!(j in 0..8 => {
            let c = 4 * (t + ROW_THREADS * j);
            if c < cols {
                store(c, e4m3x4(held[j].map(|v| v * s)));
            }
        });
        inv
    } else {
        let mut amax = 0u32;
        let mut c = 4 * t;
        while c < cols {
            amax = bits_max(amax, load(c));
            c += 4 * ROW_THREADS;
        }
        // SAFETY: every thread; the block's shared words.
        let (s, inv) = scales(unsafe { block_max_bits(amax, dynamic_shared::<u32>()) });
        let mut c = 4 * t;
        while c < cols {
            store(c, e4m3x4(load(c).map(|v| v * s)));
            c += 4 * ROW_THREADS;
        }
        inv
    };
    if t == 0 {
        // SAFETY: `row < rows`; `inv_max_bits` a global word where not null.
        unsafe {
            *inv_scales.add(row) = inv;
            if !inv_max_bits.is_null() {
                atomic_max_u32(inv_max_bits, inv.to_bits());
            }
        }
    }
}

fp8_entries! {
    column_amax(rows: u32, cols: u32, amax_bits: *mut u32);
    /// Raises `amax_bits[c]` to the largest `|src[r][c]|`'s bits over the rows of this
    /// block's panel (`COLUMN_BLOCK_ROWS` rows): the first pass of a per-column
    /// quantisation. `amax_bits` starts at zero. A block takes `COLUMN_AMAX_COLS`
    /// columns: each thread four adjacent ones (one 8- or 16-byte load) in every fourth
    /// row of the panel, four loads in flight; the four row lanes meet in shared memory,
    /// then one atomic per column. (A column per thread and a row per load took 11.3 us
    /// for 1024 x 8192 bf16 values on the H100, 1.4 TB/s.)
    ///
    /// # Safety
    /// `src` holds `rows * cols` values, aligned to four of them; `cols` a multiple of 4;
    /// `amax_bits` `cols` words. Launch: grid `(ceil(cols / COLUMN_AMAX_COLS), ceil(rows /
    /// COLUMN_BLOCK_ROWS))` of 256 threads, `COLUMN_AMAX_SMEM_BYTES` of shared memory.
    fp8_column_amax_f32 = <f32>;
    /// [`fp8_column_amax_f32`] of a bf16 matrix.
    ///
    /// # Safety
    /// As [`fp8_column_amax_f32`].
    fp8_column_amax_bf16 = <Bf16>;
    /// [`fp8_column_amax_f32`] of an fp16 matrix.
    ///
    /// # Safety
    /// As [`fp8_column_amax_f32`].
    fp8_column_amax_f16 = <F16>;
}

#[inline(always)]
unsafe fn column_amax<T: Element>(src: *const T, rows: u32, cols: u32, amax_bits: *mut u32) {
    const { assert!(COLUMN_AMAX_COLS == 256 && COLUMN_AMAX_SMEM_BYTES == 4 * 256 * 4) };
    let t = thread_idx_x() as usize;
    // Four adjacent columns of lane `quad`, rows `lane_r` apart by four.
    let (quad, lane_r) = (t % 64, t / 64);
    let (rows, cols) = (rows as usize, cols as usize);
    let c = block_idx_x() as usize * COLUMN_AMAX_COLS + 4 * quad;
    let r0 = block_idx_y() as usize * COLUMN_BLOCK_ROWS;
    let end = if r0 + COLUMN_BLOCK_ROWS < rows { r0 + COLUMN_BLOCK_ROWS } else { rows };
    // (Element by element and unrolled: an array indexed in a loop would live in local memory.)
    let (mut a0, mut a1, mut a2, mut a3) = (0u32, 0u32, 0u32, 0u32);
    let mut take = |v: [f32; 4]| {
        let b = v.map(|x| x.to_bits() & 0x7fff_ffff);
        a0 = if b[0] > a0 { b[0] } else { a0 };
        a1 = if b[1] > a1 { b[1] } else { a1 };
        a2 = if b[2] > a2 { b[2] } else { a2 };
        a3 = if b[3] > a3 { b[3] } else { a3 };
    };
    if c < cols {
        let mut r = r0 + lane_r;
        while r + 12 < end {
            let mut v = [[0.0f32; 4]; 4];
            // SAFETY: rows r..=r + 12 < rows, columns c..c + 4 <= cols, aligned to four values.
            unroll!(i in 0..4 => { v[i] = unsafe { T::load4_nc(src.add((r + 4 * i) * cols + c)) }; });
            unroll!(i in 0..4 => { take(v[i]); });
            r += 16;
        }
        while r < end {
            // SAFETY: as above, one row.
            take(unsafe { T::load4_nc(src.add(r * cols + c)) });
            r += 4;
        }
    }
    let lanes = dynamic_shared::<u32>();
    // SAFETY: the block's `4 x 256` words, lane `lane_r`'s row; then every column's four.
    unsafe {
        let at = lanes.add(lane_r * COLUMN_AMAX_COLS + 4 * quad);
        (*at, *at.add(1), *at.add(2), *at.add(3)) = (a0, a1, a2, a3);
        sync_threads();
        let col = block_idx_x() as usize * COLUMN_AMAX_COLS + t;
        if col < cols {
            let m = [0, 1, 2, 3].map(|l| *lanes.add(l * COLUMN_AMAX_COLS + t));
            let m = if m[0] > m[1] { m[0] } else { m[1] };
            let n = [*lanes.add(2 * COLUMN_AMAX_COLS + t), *lanes.add(3 * COLUMN_AMAX_COLS + t)];
            let n = if n[0] > n[1] { n[0] } else { n[1] };
            atomic_max_u32(amax_bits.add(col), if m > n { m } else { n });
        }
    }
}

/// `*at = max(*at, v)`, unsigned, atomically.
///
/// # Safety
/// `at` is a valid global word.
#[inline(always)]
unsafe fn atomic_max_u32(at: *mut u32, v: u32) {
    // SAFETY: as the caller promises.
    unsafe {
        core::arch::asm!("red.global.max.u32 [{at}], {v};", at = in(reg64) at, v = in(reg32) v, options(nostack))
    };
}

fp8_entries! {
    quantise_columns_t(rows: u32, cols: u32, amax_bits: *const u32, dst_t: *mut u8, pitch: u32, inv_scales: *mut f32);
    /// Quantises the row-major `(rows, cols)` FP32 matrix `src` to e4m3 with one scale
    /// per column (from `amax_bits`, [`fp8_column_amax_f32`]'s), written transposed:
    /// `dst_t[c][r] = e4m3(src[r][c] * s_c)` (row pitch `pitch` bytes, zeros from
    /// `rows` to `pitch`: a GEMM may run its depth to `pitch`), `inv_scales[c] = 1 / s_c`.
    /// Tiles of `TILE x TILE` pass through shared memory, so both the reads and the
    /// writes are row-contiguous.
    ///
    /// # Safety
    /// `src` holds `rows * cols` values; `amax_bits` and `inv_scales` `cols` words;
    /// `dst_t` `cols * pitch` bytes, 16-byte aligned; `pitch` a multiple of 16, at least
    /// `rows`; `cols` a multiple of 4 and `src` aligned to four values. Launch: grid
    /// `(ceil(cols / TILE), ceil(pitch / TILE))` of 256 threads, `TILE * TILE_PITCH` bytes
    /// of shared memory.
    fp8_quantise_columns_t_f32 = <f32>;
    /// [`fp8_quantise_columns_t_f32`] of a bf16 matrix.
    ///
    /// # Safety
    /// As [`fp8_quantise_columns_t_f32`].
    fp8_quantise_columns_t_bf16 = <Bf16>;
    /// [`fp8_quantise_columns_t_f32`] of an fp16 matrix.
    ///
    /// # Safety
    /// As [`fp8_quantise_columns_t_f32`].
    fp8_quantise_columns_t_f16 = <F16>;
}

#[inline(always)]
unsafe fn quantise_columns_t<T: Element>(
    src: *const T,
    rows: u32,
    cols: u32,
    amax_bits: *const u32,
    dst_t: *mut u8,
    pitch: u32,
    inv_scales: *mut f32,
) {
    // The tile transposed, one row of `TILE_PITCH` bytes per column of `src`.
    const PITCH: usize = TILE_PITCH;
    let tile_t = dynamic_shared::<u8>();
    let t = thread_idx_x() as usize;
    let (rows, cols, pitch) = (rows as usize, cols as usize, pitch as usize);
    let (c0, r0) = (block_idx_x() as usize * TILE, block_idx_y() as usize * TILE);
    // Reads: thread `t` takes columns `c0 + 4 (t % 16)` onwards (four adjacent, one load:
    // `cols % 4 == 0`), rows `t / 16` apart by 16. (A column per thread and a 2-byte load
    // per value took 12.3 us for 1024 x 8192 bf16 values on the H100.)
    const { assert!(TILE == 64) };
    let (quad, first) = (t % 16, t / 16);
    let c = c0 + 4 * quad;
    if c < cols {
        // SAFETY: c + 4 <= cols.
        let s = [0, 1, 2, 3].map(|i| scales(unsafe { *amax_bits.add(c + i) }));
        if r0 == 0 && first == 0 {
            // SAFETY: c + 4 <= cols.
            unroll!(i in 0..4 => { unsafe { *inv_scales.add(c + i) = s[i].1 }; });
        }
        let mut v = [[0.0f32; 4]; 4];
        // Rows past the end: zeros (stored up to `pitch`), whatever the scale.
        unroll!(j in 0..4 => {
            let r = r0 + first + 16 * j;
            if r < rows {
                // SAFETY: r < rows, columns c..c + 4 <= cols, aligned to four values.
                v[j] = unsafe { T::load4_nc(src.add(r * cols + c)) };
            }
        });
        unroll!(j in 0..4 => {
            let rr = first + 16 * j;
            let q = e4m3x4([v[j][0] * s[0].0, v[j][1] * s[1].0, v[j][2] * s[2].0, v[j][3] * s[3].0]);
            let q = if r0 + rr < rows { q } else { 0 };
            // SAFETY: inside the tile: column `4 quad + i`'s row, byte `rr`.
            unroll!(i in 0..4 => { unsafe { *tile_t.add((4 * quad + i) * PITCH + rr) = (q >> (8 * i)) as u8 }; });
        });
    }
    // SAFETY: uniform.
    unsafe { sync_threads() };
    // Writes: 16 bytes per thread, `TILE / 16` threads per output row (a column of `src`).
    let per_row = TILE / 16;
    let mut i = t;
    while i < TILE * per_row {
        let (oc, chunk) = (i / per_row, i % per_row);
        let (c, r) = (c0 + oc, r0 + 16 * chunk);
        if c < cols && r < pitch {
            let at = tile_t.wrapping_add(oc * PITCH + 16 * chunk) as *const u32;
            // SAFETY: inside the tile (4-byte aligned: PITCH and 16 chunk are multiples
            // of 4); `dst_t`'s row `c` holds `pitch` bytes, `r + 16 <= pitch`, 16-byte aligned.
            unsafe {
                let w = [*at, *at.add(1), *at.add(2), *at.add(3)].map(f32::from_bits);
                store_v4(dst_t.add(c * pitch + r) as *mut f32, w);
            }
        }
        i += 256;
    }
}

/// Transposes a weight `(rows, cols)` quantised by [`fp8_quantise_rows_f32`] (one scale per
/// row, an output channel) into `dst_t (cols, rows)`, the `k`-major operand of
/// `dX = dZ W`: the same bytes, so `dX` sees the forward's quantised weight. Its scales
/// move to `dZ`'s columns: `dz_scales[r] = inv_scales[r] / m` (at most 1), and the GEMM
/// multiplies every column of `dX` by `inv_t[c] = m`, where `m` is the largest inverse
/// scale (`inv_max_bits`), so that `dZ`'s multiplied values cannot overflow. Powers of
/// two throughout: exact. `64 x 64`-byte tiles pass through shared memory.
///
/// # Safety
/// `src` holds `rows * cols` bytes and `dst_t` as many, both 16-byte aligned, `rows`
/// and `cols` multiples of 16; `inv_scales` and `dz_scales` `rows` floats, `inv_t`
/// `cols`; `inv_max_bits` the finished maximum. Launch: grid `(ceil(cols / TILE),
/// ceil(rows / TILE))` of 256 threads, `TILE * TILE_PITCH` bytes of shared memory.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn fp8_transpose_weight(
    src: *const u8,
    rows: u32,
    cols: u32,
    inv_scales: *const f32,
    inv_max_bits: *const u32,
    dst_t: *mut u8,
    inv_t: *mut f32,
    dz_scales: *mut f32,
) {
    const PITCH: usize = TILE_PITCH;
    let tile = dynamic_shared::<u8>();
    let t = thread_idx_x() as usize;
    let (rows, cols) = (rows as usize, cols as usize);
    let (c0, r0) = (block_idx_x() as usize * TILE, block_idx_y() as usize * TILE);
    // SAFETY: the finished maximum (a kernel before this one wrote it).
    let m = f32::from_bits(unsafe { *inv_max_bits });
    if block_idx_y() == 0 && t < TILE && c0 + t < cols {
        // SAFETY: c0 + t < cols.
        unsafe { *inv_t.add(c0 + t) = m };
    }
    if block_idx_x() == 0 && t < TILE && r0 + t < rows {
        // SAFETY: r0 + t < rows.
        unsafe { *dz_scales.add(r0 + t) = *inv_scales.add(r0 + t) / m };
    }
    // Reads: 16 bytes per thread, `TILE / 16` threads per row of `src`.
    let per_row = TILE / 16;
    let (r, chunk) = (t / per_row, t % per_row);
    if r0 + r < rows && c0 + 16 * chunk < cols {
        // SAFETY: 16 bytes of row `r0 + r` (`cols` a multiple of 16; aligned), into the
        // tile's row `r` (4-byte aligned: PITCH and 16 * chunk are multiples of 4).
        unsafe {
            let w = load_v4_nc(src.add((r0 + r) * cols + c0 + 16 * chunk) as *const f32);
            let at = tile.add(r * PITCH + 16 * chunk) as *mut u32;
            for (i, v) in w.iter().enumerate() {
                *at.add(i) = v.to_bits();
            }
        }
    }
    // SAFETY: uniform.
    unsafe { sync_threads() };
    // Writes: thread `t` gathers 16 rows of column `c0 + t / per_row` into 16 bytes.
    let (oc, chunk) = (t / per_row, t % per_row);
    if c0 + oc < cols && r0 + 16 * chunk < rows {
        let mut w = [0u32; 4];
        for (i, word) in w.iter_mut().enumerate() {
            for j in 0..4 {
                // SAFETY: inside the tile.
                let b = unsafe { *tile.add((16 * chunk + 4 * i + j) * PITCH + oc) };
                *word |= (b as u32) << (8 * j);
            }
        }
        // SAFETY: `dst_t`'s row `c0 + oc` holds `rows` bytes, `r0 + 16 * chunk + 16 <= rows`, 16-byte aligned.
        unsafe { store_v4(dst_t.add((c0 + oc) * rows + r0 + 16 * chunk) as *mut f32, w.map(f32::from_bits)) };
    }
}

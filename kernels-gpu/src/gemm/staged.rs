//! The end of every fused GEMM: the block's `128 x 128` output tile, staged in shared
//! memory by the main loop's arithmetic (whatever its register layout), is walked row
//! by row — bias, the saved `z`, the epilogue chain, coalesced stores.

use crate::epilogue::lanes::{F4, LaneGroup, lane_forward_rows, store_row4};
use crate::prelude::element::{Bf16, Element, F16};
use crate::prelude::global::load_v4_nc;
use crate::prelude::warp::shfl_xor;
use crate::prelude::*;
use crate::unroll;
use kernel_abi::epilogue::OpDesc;

/// Floats per row of the staged `128 x 128` output tile (16-byte aligned rows; the 4
/// floats of padding spread a warp's row-strided staging stores over banks).
pub const STAGE_STRIDE: usize = 128 + 4;
const TILE: usize = 128;
const WARPS: usize = 256 / 32;

/// Writes the staged tile of block `(row0, col0)`: each warp walks whole 128-column
/// rows, a lane holding 4 consecutive columns, so a GroupNorm group of `g` channels is
/// `g / 4` neighbouring lanes and its statistics are shuffle sums.
///
/// With `gridDim.z = S > 1` (split-K) it writes this split's raw partial product to its
/// own `(m, n)` slice of `y`; the row-wise epilogue adds the slices, bias and chain.
///
/// # Safety
/// `smem` holds the staged tile (rows of [`STAGE_STRIDE`] floats) and a barrier
/// separates its writes from this; `y` (and `save_z` if not null) as in the GEMM
/// kernels; 256 threads (`t` = 0..256, the caller's numbering) run it.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn write_staged_tile(
    t: usize,
    smem: *const f32,
    y: *mut f32,
    bias: Vector,
    save_z: *mut f32,
    (m, n): (usize, usize),
    (row0, col0): (usize, usize),
    ops: *const OpDesc,
    n_ops: u32,
) {
    let split_k = grid_dim_z() > 1;
    let out = if split_k { unsafe { y.add(block_idx_z() as usize * m * n) } } else { y };
    let (warp, lane) = (t / 32, t % 32);
    let c = col0 + lane * 4;
    let load = |r: usize| unsafe { (*(smem.add(r * STAGE_STRIDE + lane * 4) as *const F4)).0 };
    // Two rows per pass (`r` and `r + 8`, the same for the whole warp): the row's
    // chain is a string of dependent latencies (shuffles, `exp`, parameter loads) and a
    // block has only 8 warps, so two independent rows in one basic block roughly
    // halve the epilogue's time.
    let mut r = warp;
    while r < TILE && row0 + r < m {
        let r2 = r + WARPS;
        let two = r2 < TILE && row0 + r2 < m;
        // SAFETY: r, r2 < 128 and lane * 4 + 3 < 128, inside the staged tile.
        let mut rows = [load(r), if two { load(r2) } else { [0.0; 4] }];
        if !split_k {
            epilogue_rows(&mut rows, two, bias, save_z, row0 + r, ops, n_ops, n, c);
        }
        // SAFETY: rows < m; every written column < n.
        unsafe {
            store_row4(out, rows[0], row0 + r, n, c);
            if two {
                store_row4(out, rows[1], row0 + r2, n, c);
            }
        }
        r += 2 * WARPS;
    }
}

/// Bias, then the chain, on one lane's 4 consecutive columns `c..c+4` of `R` (1 or 2)
/// rows at once: rows `row` and, when `two`, `row + 8` (the warp holds the tile's whole
/// 128-column rows; see `lane_forward_rows` for why two). `save_z` receives the chain's
/// input. Without `two` a second row is a dummy, computed (warp-uniformly) but never
/// stored.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn epilogue_rows<const R: usize>(
    rows: &mut [[f32; 4]; R],
    two: bool,
    bias: Vector,
    save_z: *mut f32,
    row: usize,
    ops: *const OpDesc,
    n_ops: u32,
    n: usize,
    c: usize,
) {
    if !bias.is_null() {
        // SAFETY: the bias holds `n` floats (the caller's contract).
        let b = unsafe { AsStored::column4(bias, n, c) };
        unroll!(i in 0..2 => {
            if i < R {
                unroll!(e in 0..4 => { rows[i][e] += b[e]; });
            }
        });
    }
    if !save_z.is_null() {
        // SAFETY: rows < m and columns < n, inside save_z's (m, n).
        unsafe {
            store_row4(save_z, rows[0], row, n, c);
            if R > 1 && two {
                store_row4(save_z, rows[R - 1], row + WARPS, n, c);
            }
        }
    }
    for o in 0..n_ops as usize {
        // SAFETY: o < n_ops.
        let op = unsafe { &*ops.add(o) };
        lane_forward_rows(op, || LaneGroup::of(op, n), rows, n, c);
    }
}

/// `epilogue_rows` on one row (the FMA kernels' walk).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub fn epilogue_row(
    v: &mut [f32; 4],
    bias: Vector,
    save_z: *mut f32,
    row: usize,
    ops: *const OpDesc,
    n_ops: u32,
    n: usize,
    c: usize,
) {
    let mut rows = [*v];
    epilogue_rows(&mut rows, false, bias, save_z, row, ops, n_ops, n, c);
    *v = rows[0];
}

/// Declares the split-K ends of the tile epilogue, one per output type (`CHAIN`: whether
/// it runs the bias, saved `z` and chain; else they are ignored).
macro_rules! split_tiles_entries {
    ($($(#[$doc:meta])* $name:ident: $o:ty, $chain:literal;)*) => {$(
        $(#[$doc])*
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "ptx-kernel" fn $name(
            partials: *const f32,
            splits: u32,
            bias: Vector,
            y: *mut $o,
            save_z: *mut f32,
            m: u32,
            n: u32,
            ops: *const OpDesc,
            n_ops: u32,
        ) {
            unsafe { split_tiles::<$o, $chain>(partials, splits, bias, y, save_z, (m as usize, n as usize), ops, n_ops) }
        }
    )*};
}

split_tiles_entries! {
    /// The forward's end after split-K, for a chain the GEMM's tile epilogue runs
    /// (per-column ops, GroupNorms of 4..128 channels): `y = chain(z)` with `z = sum_s
    /// partials[s] + bias`, the slices added in order, `z` into `save_z` if not null. A
    /// block takes 16 rows of 128 columns, a warp two rows (`r`, `r + 8`), a lane 4
    /// columns, as the tile epilogue does: at few rows the row-wise epilogue's block per
    /// row left most SMs to a few long rows (128 x 4096 in 8 slices: 0.025 ms).
    ///
    /// # Safety
    /// `partials` holds `splits m n` floats; bias, `save_z`, `y` and `ops` as in the GEMM
    /// kernels, the ops fusable. Launch: grid `(ceil(n / 128), ceil(m / 16))`, 256 threads.
    epilogue_split_tiles: f32, true;
    /// [`epilogue_split_tiles`] into a bf16 `y` (each value rounded once).
    ///
    /// # Safety
    /// As [`epilogue_split_tiles`]; `y` holds `m n` 16-bit words.
    epilogue_split_tiles_bf16: Bf16, true;
    /// [`epilogue_split_tiles`] into an fp16 `y`.
    ///
    /// # Safety
    /// As [`epilogue_split_tiles_bf16`].
    epilogue_split_tiles_f16: F16, true;
    /// [`epilogue_split_tiles`] without bias, saved `z` or chain (null and 0): the slices
    /// added, rounded once into `y`, with `SLICES_IN_FLIGHT` slices' loads issued before
    /// any is added (still in slice order). One at a time, a few rows' many ranges were a
    /// latency each (64 ranges of one row of `dX`: 4.3 us, now 2.5); with the chain's
    /// code beside them the deeper loads took 87 registers instead of 48 and the
    /// chained split-K ends of 128-256 rows up to 11% longer. One row runs
    /// its own mapping: the eight warps split the slices (the 64 ranges of one row of
    /// 1024 columns: 2.5 -> 1.5 us).
    ///
    /// # Safety
    /// As [`epilogue_split_tiles`].
    split_sums: f32, false;
    /// [`split_sums`] into a bf16 `y`.
    ///
    /// # Safety
    /// As [`epilogue_split_tiles_bf16`].
    split_sums_bf16: Bf16, false;
    /// [`split_sums`] into an fp16 `y`.
    ///
    /// # Safety
    /// As [`epilogue_split_tiles_f16`].
    split_sums_f16: F16, false;
}

/// Columns `c..c+4` of `row` of an `(.., n)` matrix, 0 past `n`: one 16-byte load when
/// inside and aligned.
///
/// # Safety
/// `row` and the columns below `n` are inside `src`.
#[inline(always)]
unsafe fn load_row4(src: *const f32, row: usize, n: usize, c: usize) -> [f32; 4] {
    unsafe {
        if n % 4 == 0 && c + 4 <= n {
            load_v4_nc(src.add(row * n + c))
        } else {
            [0, 1, 2, 3].map(|e| if c + e < n { *src.add(row * n + c + e) } else { 0.0 })
        }
    }
}

/// Slices of split-K's partial sums whose loads [`split_tiles`] issues together.
const SLICES_IN_FLIGHT: usize = 4;
// (`split_tiles` unrolls its adds over four.)
const _: () = assert!(SLICES_IN_FLIGHT == 4);

/// Slice groups of [`one_row_sums`]: the lanes of a warp that take the same columns.
const ROW_SLICE_GROUPS: usize = 8;

/// [`split_sums`] of one row: the rows' mapping would leave seven of the block's eight
/// warps idle and each lane adding every slice in turn (64 slices of one row of `dX`: 16
/// rounds of 4 dependent loads). Here a warp takes 16 columns, lane `l` the 4 columns
/// `4 (l % 4)` on and every 8th slice from `l / 4`, with `SLICES_IN_FLIGHT` slices'
/// loads issued together; three butterfly shuffles add the 8 groups' sums (in one fixed
/// order: the same bits every call) and lanes 0..4 store.
///
/// # Safety
/// As [`split_tiles`] with `m` = 1; the grid's `x` covers `n` in `TILE` columns.
#[inline(always)]
unsafe fn one_row_sums<O: Element>(partials: *const f32, splits: usize, y: *mut O, n: usize, warp: usize, lane: usize) {
    const WARP_COLS: usize = TILE / WARPS;
    const _: () = assert!(WARP_COLS == 4 * (32 / ROW_SLICE_GROUPS));
    let (group, quad) = (lane / 4, lane % 4);
    let c = block_idx_x() as usize * TILE + warp * WARP_COLS + quad * 4;
    let mut sum = [0.0f32; 4];
    // SAFETY (each call): slice `s` < splits of `partials`, row 0, columns below `n`.
    let load = |s: usize| unsafe { load_row4(partials.add(s * n), 0, n, c) };
    let mut s = group;
    while s + ROW_SLICE_GROUPS * (SLICES_IN_FLIGHT - 1) < splits {
        let parts: [[f32; 4]; SLICES_IN_FLIGHT] = core::array::from_fn(|i| load(s + i * ROW_SLICE_GROUPS));
        unroll!(i in 0..4 => {
            unroll!(e in 0..4 => { sum[e] += parts[i][e]; });
        });
        s += ROW_SLICE_GROUPS * SLICES_IN_FLIGHT;
    }
    while s < splits {
        let part = load(s);
        unroll!(e in 0..4 => { sum[e] += part[e]; });
        s += ROW_SLICE_GROUPS;
    }
    // The groups are lane bits 2..5.
    unroll!(e in 0..4 => {
        sum[e] += shfl_xor(sum[e], 4);
        sum[e] += shfl_xor(sum[e], 8);
        sum[e] += shfl_xor(sum[e], 16);
    });
    if group == 0 {
        // SAFETY: row 0, columns below `n`, inside `y`.
        unsafe { store_row4(y, sum, 0, n, c) };
    }
}

/// The body of [`epilogue_split_tiles`].
///
/// # Safety
/// See [`epilogue_split_tiles`].
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn split_tiles<O: Element, const CHAIN: bool>(
    partials: *const f32,
    splits: u32,
    bias: Vector,
    y: *mut O,
    save_z: *mut f32,
    (m, n): (usize, usize),
    ops: *const OpDesc,
    n_ops: u32,
) {
    let t = thread_idx_x() as usize;
    let (warp, lane) = (t / 32, t % 32);
    if !CHAIN && m == 1 {
        // SAFETY: as this function's.
        unsafe { one_row_sums(partials, splits as usize, y, n, warp, lane) };
        return;
    }
    let c = block_idx_x() as usize * TILE + lane * 4;
    let row = block_idx_y() as usize * 2 * WARPS + warp;
    if row >= m {
        return;
    }
    let two = row + WARPS < m;
    let mut rows = [[0.0f32; 4]; 2];
    // SAFETY (each call): slice `s` of `partials`, rows below `m`, columns below `n`.
    let load = |s: usize| unsafe {
        let slice = partials.add(s * m * n);
        (load_row4(slice, row, n, c), if two { load_row4(slice, row + WARPS, n, c) } else { [0.0; 4] })
    };
    let (mut s, splits) = (0, splits as usize);
    // Without the chain, `SLICES_IN_FLIGHT` slices' loads at a time ([`split_sums`]).
    while !CHAIN && s + SLICES_IN_FLIGHT <= splits {
        let parts: [([f32; 4], [f32; 4]); SLICES_IN_FLIGHT] = core::array::from_fn(|i| load(s + i));
        unroll!(i in 0..4 => {
            unroll!(e in 0..4 => {
                rows[0][e] += parts[i].0[e];
                rows[1][e] += parts[i].1[e];
            });
        });
        s += SLICES_IN_FLIGHT;
    }
    while s < splits {
        let (a, b) = load(s);
        unroll!(e in 0..4 => {
            rows[0][e] += a[e];
            rows[1][e] += b[e];
        });
        s += 1;
    }
    if CHAIN {
        epilogue_rows(&mut rows, two, bias, save_z, row, ops, n_ops, n, c);
    }
    // SAFETY: rows below `m`, columns below `n`, inside `y`.
    unsafe {
        store_row4(y, rows[0], row, n, c);
        if two {
            store_row4(y, rows[1], row + WARPS, n, c);
        }
    }
}

//! 3xTF32's runs of `k`: the accumulators added into `y` in IEEE FP32 between runs
//! (and taken back before the epilogue), for the forward and the transposed kernels.

use super::opaque;
use crate::prelude::element::F2;
use crate::unroll;
use kernel_abi::gemm_tma::*;

/// 3xTF32 adds three MMAs' products into the accumulators per `k`-step, and the tensor
/// cores add into FP32 with a truncation that shrinks the sums: on the H100, a TF32
/// GEMM of TF32-exact operands at `k` = 8192 came out 1.7e-5 small (relative; SGEMM:
/// 1e-9), a quarter of that when summed as four GEMMs of 2048 (H100, measured for 83e00b1).
/// At `k` = 8192 that put 3xTF32's forward at 3e-5 of the f64 reference, and single
/// values 2-3x outside `allclose(1e-4, 1e-4)`, and M2's weight gradient (`k` = 32768)
/// at 2.3e-4. So the 3xTF32 forward, `dW` and `dX` add their accumulators into `y` (in
/// IEEE FP32) and restart them from zero every `FLUSH_K` of `k` (about 3% of the
/// forward's time, t71). A split-K range runs its own flushes from its start.
const FLUSH_K: u32 = 2048;
/// `FLUSH_K` in 3xTF32's k-tiles.
const FLUSH_TILES: u32 = FLUSH_K / SPLIT_BLOCK_K as u32;

/// The runs a tile's `k_tiles` are taken in: `FLUSH_TILES` each for 3xTF32 (`SPLIT`),
/// one otherwise.
#[inline(always)]
pub(super) fn k_runs<const SPLIT: bool>(k_tiles: u32) -> u32 {
    if SPLIT { k_tiles.div_ceil(FLUSH_TILES) } else { 1 }
}

/// The k-tiles of run `run` (of [`k_runs`]) of a unit's range `k_tiles` (empty past
/// its end).
#[inline(always)]
pub(super) fn run_k_tiles<const SPLIT: bool>(run: u32, k_tiles: core::ops::Range<u32>) -> core::ops::Range<u32> {
    if SPLIT { k_tiles.start + run * FLUSH_TILES..k_tiles.end.min(k_tiles.start + (run + 1) * FLUSH_TILES) } else { k_tiles }
}

/// What [`flush_quarter`] does with a quarter of the accumulators and their places in `y`.
#[derive(Clone, Copy, PartialEq)]
enum Flush {
    /// `y = acc`
    Store,
    /// `y += acc`
    Add,
    /// `acc += y`
    Take,
}

/// Where a thread's accumulators sit in `y`, as pairs of neighbouring places: pair
/// `(i, jj)` (`i < 2`, `jj < 32`) holds accumulators `4 jj + a` and `4 jj + b` at
/// `y[at]` and `y[at + 1]`. A flush uses the places the tile's own output takes, so
/// that no other tile reads or writes them meanwhile.
#[derive(Clone, Copy)]
pub(super) enum Layout {
    /// The forward's and `tk`'s `y (m, n)`: `4 jj + 2 i` and `+ 1` at row `row + i
    /// step`, columns `col + 8 jj`, `+ 1` (`step`: 8 for the forward's fragments, 1 for
    /// `tk`'s neighbouring rows).
    Rows { row: usize, col: usize, step: usize },
    /// `tk_t`'s `y^T (n, m)`: `4 jj + i` and `4 jj + 2 + i` at row `col + 8 jj + i`,
    /// columns `row`, `row + 1`.
    Transposed { row: usize, col: usize },
}

impl Layout {
    /// Pair `(i, jj)`: its accumulators, the offset of its first place, and whether each
    /// place is inside `y (m, n)` (or `(n, m)`).
    #[inline(always)]
    fn pair(self, i: usize, jj: usize, (m, n): (usize, usize)) -> (usize, usize, usize, bool, bool) {
        match self {
            Layout::Rows { row, col, step } => {
                let (r, c) = (row + step * i, col + 8 * jj);
                (4 * jj + 2 * i, 4 * jj + 2 * i + 1, r * n + c, r < m && c < n, r < m && c + 1 < n)
            }
            Layout::Transposed { row, col } => {
                let c = col + 8 * jj + i;
                (4 * jj + i, 4 * jj + 2 + i, c * m + row, c < n && row < m, c < n && row + 1 < m)
            }
        }
    }

    /// Whether every place of quarter `q` is inside and each pair 8-byte aligned.
    #[inline(always)]
    fn quarter_inside(self, q: usize, (m, n): (usize, usize)) -> bool {
        let last = 8 * (8 * q + 7);
        match self {
            Layout::Rows { row, col, step } => n % 2 == 0 && row + step < m && col + last + 2 <= n,
            Layout::Transposed { row, col } => m % 2 == 0 && row + 1 < m && col + last + 1 < n,
        }
    }
}

/// [`Flush`] on accumulators `32 q..32 q + 32` (pairs `(i, 8 q..8 q + 8)` of the
/// layout), skipping places outside `y`. A quarter at a time: the loads of a whole half
/// beside the other accumulators spill.
///
/// Where all 16 places are inside, the loads come first, with no branch between them,
/// so they are in flight together: under a bounds check each, one went out after
/// another, each waiting out L2's latency, and a flush cost ~17 us per tile (M1's
/// forward 1.19 ms against 1.01 without flushes, 1.08 with one per tile).
///
/// # Safety
/// `y` holds `m * n` floats; nothing else reads or writes these places meanwhile.
#[inline(always)]
unsafe fn flush_quarter(acc: &mut [u32; 128], y: *mut f32, q: usize, how: Flush, layout: Layout, sizes: (usize, usize)) {
    if layout.quarter_inside(q, sizes) {
        let mut u = [F2([0.0; 2]); 16];
        // SAFETY (both loops): every place is inside, as just checked, and each pair
        // 8-byte aligned.
        if how != Flush::Store {
            unroll!(i in 0..2 => {
                unroll!(j in 0..8 => {
                    let (_, _, at, _, _) = layout.pair(i, 8 * q + j, sizes);
                    u[8 * i + j] = unsafe { *(y.add(at) as *const F2) };
                });
            });
        }
        unroll!(i in 0..2 => {
            unroll!(j in 0..8 => {
                let (ia, ib, at, _, _) = layout.pair(i, 8 * q + j, sizes);
                let (a, b) = (f32::from_bits(acc[ia]), f32::from_bits(acc[ib]));
                let F2([v, w]) = u[8 * i + j];
                let p = unsafe { y.add(at) } as *mut F2;
                match how {
                    Flush::Store => unsafe { *p = F2([a, b]) },
                    Flush::Add => unsafe { *p = F2([v + a, w + b]) },
                    Flush::Take => {
                        acc[ia] = (a + v).to_bits();
                        acc[ib] = (b + w).to_bits();
                    }
                }
            });
        });
        return;
    }
    unroll!(i in 0..2 => {
        unroll!(j in 0..8 => {
            let (ia, ib, at, a_in, b_in) = layout.pair(i, 8 * q + j, sizes);
            unroll!(e in 0..2 => {
                let (slot, inside) = if e == 0 { (ia, a_in) } else { (ib, b_in) };
                if inside {
                    // SAFETY: the place is inside `y`.
                    unsafe {
                        let p = y.add(at + e);
                        let x = f32::from_bits(acc[slot]);
                        match how {
                            Flush::Store => *p = x,
                            Flush::Add => *p += x,
                            Flush::Take => acc[slot] = (x + *p).to_bits(),
                        }
                    }
                }
            });
        });
    });
}

/// Adds the accumulators into their places in `y` (stores them, the first time) and
/// zeroes them.
///
/// # Safety
/// The warpgroup's MMAs are finished; `y` holds `m * n` floats.
#[inline(always)]
pub(super) unsafe fn flush_accumulators(acc: &mut [u32; 128], y: *mut f32, first: bool, layout: Layout, (m, n): (u32, u32)) {
    // Each way its own code, so that nothing decides between a load and the next.
    // SAFETY: as the caller promises.
    unsafe {
        if first {
            flush_quarters(acc, y, Flush::Store, layout, (m, n));
        } else {
            flush_quarters(acc, y, Flush::Add, layout, (m, n));
        }
    }
    *acc = [0; 128];
}

/// [`flush_quarter`] on all four quarters (a function, not a closure: LLVM took a
/// closure out of line once three kernels used it, and ptxas then serialised the
/// `wgmma`s around the call, C7514).
///
/// # Safety
/// As [`flush_quarter`].
#[inline(always)]
unsafe fn flush_quarters(acc: &mut [u32; 128], y: *mut f32, how: Flush, layout: Layout, (m, n): (u32, u32)) {
    unroll!(q in 0..4 => {
        let sizes = (opaque(m) as usize, opaque(n) as usize);
        // SAFETY: as the caller promises.
        unsafe { flush_quarter(acc, y, q, how, layout, sizes) };
    });
}

/// Adds the flushed sums in `y` back into the accumulators before the epilogue.
///
/// # Safety
/// As [`flush_accumulators`], after at least one.
#[inline(always)]
pub(super) unsafe fn add_flushed(acc: &mut [u32; 128], y: *mut f32, layout: Layout, sizes: (u32, u32)) {
    // SAFETY: as the caller promises.
    unsafe { flush_quarters(acc, y, Flush::Take, layout, sizes) };
}


//! The CPU backend's GEMMs: a safe, bounds-checked front to the `gemm` crate (its
//! kernels pick AVX2/AVX-512/NEON at run time and spread over rayon's global thread
//! pool), tiled so that the caller can fuse work after each row panel and report
//! progress after each tile.

use super::progress::Progress;

/// A strided view of an `rows x cols` f32 matrix: element `(r, c)` is
/// `data[r * rs + c * cs]`.
#[derive(Clone, Copy)]
pub(crate) struct MatRef<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

impl<'a> MatRef<'a> {
    /// The row-major `rows x cols` matrix held in `data`.
    pub(crate) fn row_major(data: &'a [f32], rows: usize, cols: usize) -> Self {
        MatRef { data, rows, cols, rs: cols, cs: 1 }
    }

    /// The transpose (no copy: the strides swap).
    pub(crate) fn t(self) -> Self {
        MatRef { data: self.data, rows: self.cols, cols: self.rows, rs: self.cs, cs: self.rs }
    }

    /// Rows `r0..r1` of this matrix.
    fn rows(self, r0: usize, r1: usize) -> Self {
        let data = if r1 > r0 { &self.data[r0 * self.rs..] } else { &self.data[..0] };
        MatRef { data, rows: r1 - r0, ..self }
    }

    /// Columns `c0..c1` of this matrix.
    fn cols(self, c0: usize, c1: usize) -> Self {
        let data = if c1 > c0 { &self.data[c0 * self.cs..] } else { &self.data[..0] };
        MatRef { data, cols: c1 - c0, ..self }
    }

    /// Whether every element lies inside `data` (what makes the raw call sound).
    fn in_bounds(&self) -> bool {
        self.rows == 0
            || self.cols == 0
            || (self.rows - 1)
                .checked_mul(self.rs)
                .and_then(|r| (self.cols - 1).checked_mul(self.cs).and_then(|c| r.checked_add(c)))
                .is_some_and(|last| last < self.data.len())
    }
}

/// How a product is cut: row panels of `rows` rows, each computed in column blocks of
/// `cols` columns.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Tiles {
    pub rows: usize,
    pub cols: usize,
}

/// Products up to this many floating-point operations (about a second on two cores)
/// run whole: cutting M1's seed forward (137 GFLOP) into tiles cost 3.5%.
const WHOLE_FLOPS: f64 = 160e9;
/// Work per tile of a larger product: about a quarter of a second on two cores, so
/// progress moves visibly.
const TILE_FLOPS: f64 = 32e9;
/// Fewest rows in a row panel (and columns in a block): each tile repacks the other
/// operand, which costs ~3% of the tile's time at 512 and ~10% at 256 (2 cores, k = 8192).
const MIN_TILE: usize = 512;

impl Tiles {
    /// Tiles for an `m x n` result of a product over `k`.
    pub(crate) fn new(m: usize, n: usize, k: usize) -> Tiles {
        if 2.0 * m as f64 * n as f64 * k as f64 <= WHOLE_FLOPS {
            return Tiles { rows: m.max(1), cols: n.max(1) };
        }
        // `extent` items of `per_item` flops each, cut into even pieces of at least
        // MIN_TILE items and, above that, at most about TILE_FLOPS each.
        let cut = |extent: usize, per_item: f64| -> usize {
            if extent as f64 * per_item <= TILE_FLOPS || extent <= MIN_TILE {
                return extent.max(1);
            }
            let size = ((TILE_FLOPS / per_item) as usize).clamp(MIN_TILE, extent);
            let pieces = extent.div_ceil(size);
            extent.div_ceil(pieces)
        };
        let rows = cut(m, 2.0 * n as f64 * k as f64);
        let cols = cut(n, 2.0 * rows as f64 * k as f64);
        Tiles { rows, cols }
    }
}

/// `dst = a b` for `dst` the row-major `a.rows x b.cols` matrix (`a.cols == b.rows`),
/// in column blocks of `cols`, advancing `progress` by each block's flops.
///
/// The shapes come from validated tensors; a mismatch is a bug of this module, so it
/// panics (before any unsafe call) rather than returning an error.
pub(crate) fn matmul(dst: &mut [f32], a: MatRef<'_>, b: MatRef<'_>, cols: usize, progress: &mut Progress) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert!(
        b.rows == k && dst.len() == m * n && a.in_bounds() && b.in_bounds(),
        "cpu matmul: inconsistent operands ({m}x{k}) x ({}x{n}) into {} values",
        b.rows,
        dst.len()
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        dst.fill(0.0);
        return;
    }
    let cols = cols.clamp(1, n);
    let threads = rayon::current_num_threads();
    let parallelism = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    for c0 in (0..n).step_by(cols) {
        let c1 = (c0 + cols).min(n);
        let b = b.cols(c0, c1);
        // The block's last element, (m - 1, c1 - 1), is inside `dst`: m * n <= dst.len().
        let dst_block = &mut dst[c0..];
        // SAFETY: every element `gemm` reads is inside `a.data` / `b.data` (checked by
        // `in_bounds`, which the sub-views keep), and every element it writes,
        // `dst_block[r * n + c]` for r < m, c < c1 - c0, is inside `dst_block`. The
        // strides are below isize::MAX: they index allocations. `read_dst = false`: the
        // destination is only written (alpha is ignored), so its old values, even NaN,
        // do not leak in.
        unsafe {
            gemm::gemm(
                m,
                c1 - c0,
                k,
                dst_block.as_mut_ptr(),
                1,
                n as isize,
                false,
                a.data.as_ptr(),
                a.cs as isize,
                a.rs as isize,
                b.data.as_ptr(),
                b.cs as isize,
                b.rs as isize,
                0.0f32,
                1.0f32,
                false,
                false,
                false,
                parallelism,
            );
        }
        progress.advance(2.0 * m as f64 * (c1 - c0) as f64 * k as f64);
    }
}

/// [`matmul`] over row panels of `tiles.rows`: `dst` (`a.rows x b.cols`, row-major)
/// gets every panel in turn.
pub(crate) fn matmul_tiled(dst: &mut [f32], a: MatRef<'_>, b: MatRef<'_>, tiles: Tiles, progress: &mut Progress) {
    let n = b.cols;
    let rows = tiles.rows.max(1);
    for r0 in (0..a.rows).step_by(rows) {
        let r1 = (r0 + rows).min(a.rows);
        matmul(&mut dst[r0 * n..r1 * n], a.rows(r0, r1), b, tiles.cols, progress);
    }
}

/// [`matmul`] of rows `r0..r1` of `a` into `dst` (`(r1 - r0) x b.cols`).
pub(crate) fn matmul_rows(
    dst: &mut [f32],
    a: MatRef<'_>,
    (r0, r1): (usize, usize),
    b: MatRef<'_>,
    cols: usize,
    progress: &mut Progress,
) {
    matmul(dst, a.rows(r0, r1), b, cols, progress);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Naive `a b` for row-major `a` (m x k) and `b` (k x n), in f64.
    fn naive(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f64> {
        (0..m * n).map(|e| (0..k).map(|i| a[e / n * k + i] as f64 * b[i * n + e % n] as f64).sum()).collect()
    }

    #[test]
    fn strided_products_match_naive_loops() {
        let (m, k, n) = (37, 19, 41);
        let a: Vec<f32> = (0..m * k).map(|i| ((i * 7 % 13) as f32 - 6.0) / 4.0).collect();
        let b: Vec<f32> = (0..k * n).map(|i| ((i * 5 % 11) as f32 - 5.0) / 8.0).collect();
        let want = naive(&a, &b, m, k, n);
        let mut p = Progress::new(None, 0.0);
        // Plain, in small column blocks, in row panels, and through transposed views.
        let mut got = vec![f32::NAN; m * n];
        matmul(&mut got, MatRef::row_major(&a, m, k), MatRef::row_major(&b, k, n), n, &mut p);
        assert!(got.iter().zip(&want).all(|(&g, &w)| (g as f64 - w).abs() < 1e-5), "plain");
        let mut got = vec![f32::NAN; m * n];
        let tiles = Tiles { rows: 8, cols: 5 };
        matmul_tiled(&mut got, MatRef::row_major(&a, m, k), MatRef::row_major(&b, k, n), tiles, &mut p);
        assert!(got.iter().zip(&want).all(|(&g, &w)| (g as f64 - w).abs() < 1e-5), "tiled");
        let at: Vec<f32> = (0..k * m).map(|e| a[e % m * k + e / m]).collect(); // (k x m)
        let bt: Vec<f32> = (0..n * k).map(|e| b[e % k * n + e / k]).collect(); // (n x k)
        let mut got = vec![f32::NAN; m * n];
        matmul(&mut got, MatRef::row_major(&at, k, m).t(), MatRef::row_major(&bt, n, k).t(), 7, &mut p);
        assert!(got.iter().zip(&want).all(|(&g, &w)| (g as f64 - w).abs() < 1e-5), "transposed");
    }

    #[test]
    fn tiles_cut_only_large_products() {
        assert_eq!(Tiles::new(33, 96, 77), Tiles { rows: 33, cols: 96 });
        assert_eq!(Tiles::new(1024, 8192, 8192), Tiles { rows: 1024, cols: 8192 }); // M1, 137 GFLOP
        // 275 GFLOP: four row panels, each in three column blocks.
        let t = Tiles::new(2048, 8192, 8192);
        assert_eq!(t.rows, 512);
        assert!(t.cols >= MIN_TILE && 8192usize.div_ceil(t.cols) == 3, "{t:?}");
        // A huge layer: row panels of at least MIN_TILE even when one row is a tile's work.
        let t = Tiles::new(4096, 65536, 65536);
        assert_eq!((t.rows, t.cols), (512, 512));
    }
}

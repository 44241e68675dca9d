//! Small memory-bound kernels the backward and the tape need: gradient accumulation
//! and the AvgPool fold of a Linear layer's weights (forward) and its transpose (backward).
//!
//! All are 1-D: one thread per output element, any grid that covers `len`.

use crate::prelude::*;

#[inline(always)]
fn global_index() -> usize {
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

/// AvgPool1d(k) after a Linear layer is a Linear layer with averaged rows:
/// `out[j, c] = mean_e in[j k + e, c]` for `j < rows / k` (`in` is `(rows, cols)`).
///
/// # Safety
/// `input` holds `rows * cols` floats, `out` `(rows / k) * cols`.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn fold_rows_mean(input: *const f32, rows: u32, cols: u32, k: u32, out: *mut f32) {
    let (cols, k) = (cols as usize, k as usize);
    let i = global_index();
    if i < (rows as usize / k) * cols {
        let (j, c) = (i / cols, i % cols);
        let mut s = 0.0;
        for e in 0..k {
            // SAFETY: j * k + e < rows.
            s += unsafe { *input.add((j * k + e) * cols + c) };
        }
        // SAFETY: i inside out.
        unsafe { *out.add(i) = s / k as f32 };
    }
}

/// The backward of [`fold_rows_mean`]: `out[r, c] = g[r / k, c] / k` for rows inside a
/// pooling window, 0 for the trailing rows AvgPool drops (`out` is `(rows, cols)`).
///
/// # Safety
/// `g` holds `(rows / k) * cols` floats, `out` `rows * cols`.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn unfold_rows_mean_grad(g: *const f32, rows: u32, cols: u32, k: u32, out: *mut f32) {
    let (rows, cols, k) = (rows as usize, cols as usize, k as usize);
    let i = global_index();
    if i < rows * cols {
        let (r, c) = (i / cols, i % cols);
        // SAFETY: r / k < rows / k when r < (rows / k) * k; i inside out.
        unsafe { *out.add(i) = if r < (rows / k) * k { *g.add((r / k) * cols + c) / k as f32 } else { 0.0 } };
    }
}

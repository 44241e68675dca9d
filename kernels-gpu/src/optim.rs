//! Training: the mean-squared-error loss and the optimiser steps, elementwise.

use crate::prelude::math::sqrt;
use crate::prelude::warp::warp_sum;
use crate::prelude::*;

/// `dy = 2 (y - target) / len` and each block's sum of `(y - target)^2` in
/// `loss_parts[block]` (summed on the host: a handful of values).
///
/// # Safety
/// `y`, `target`, `dy` hold `len` floats, `loss_parts` one per block. Launch: 1-D,
/// 256 threads per block.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mse_loss_grad(y: *const f32, target: *const f32, dy: *mut f32, loss_parts: *mut f32, len: u32) {
    let i = (block_idx_x() * block_dim_x() + thread_idx_x()) as usize;
    let mut sq = 0.0;
    if i < len as usize {
        // SAFETY: i < len.
        unsafe {
            let d = *y.add(i) - *target.add(i);
            *dy.add(i) = 2.0 * d / len as f32;
            sq = d * d;
        }
    }
    let s = dynamic_shared::<f32>(); // one float per warp
    let sum = warp_sum(sq);
    // SAFETY: warp < 8 for 256 threads; uniform barrier.
    unsafe {
        if lane_id() == 0 {
            *s.add(warp_id() as usize) = sum;
        }
        sync_threads();
        if thread_idx_x() == 0 {
            let mut total = 0.0;
            for w in 0..(block_dim_x() / WARP_SIZE) as usize {
                total += *s.add(w);
            }
            *loss_parts.add(block_idx_x() as usize) = total;
        }
    }
}

/// Plain SGD: `p -= lr * g`.
///
/// # Safety
/// `p` and `g` hold `len` floats. Launch: 1-D covering `len`.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn sgd_step(p: *mut f32, g: *const f32, lr: f32, len: u32) {
    let i = (block_idx_x() * block_dim_x() + thread_idx_x()) as usize;
    if i < len as usize {
        // SAFETY: i < len.
        unsafe { *p.add(i) -= lr * *g.add(i) };
    }
}

/// Adam (Kingma & Ba, as `torch.optim.Adam` without weight decay): moments `m`, `v`
/// updated in place; `c1 = 1 / (1 - b1^t)`, `c2 = 1 / (1 - b2^t)` bias corrections.
///
/// # Safety
/// `p`, `g`, `m`, `v` hold `len` floats. Launch: 1-D covering `len`.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "ptx-kernel" fn adam_step(
    p: *mut f32,
    g: *const f32,
    m: *mut f32,
    v: *mut f32,
    lr: f32,
    b1: f32,
    b2: f32,
    eps: f32,
    c1: f32,
    c2: f32,
    len: u32,
) {
    let i = (block_idx_x() * block_dim_x() + thread_idx_x()) as usize;
    if i < len as usize {
        // SAFETY: i < len.
        unsafe {
            let gi = *g.add(i);
            let mi = b1 * *m.add(i) + (1.0 - b1) * gi;
            let vi = b2 * *v.add(i) + (1.0 - b2) * gi * gi;
            *m.add(i) = mi;
            *v.add(i) = vi;
            *p.add(i) -= lr * (mi * c1) / (sqrt(vi * c2) + eps);
        }
    }
}

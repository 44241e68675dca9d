//! The small-batch forward on tensor cores: `y = chain(x W^T + bias)` for at most
//! [`ROWS`] rows, as `mma.sync` products of the transpose, `z^T = W x^T`: `W` is the
//! `A` operand (16 output columns per `m16` fragment) and `x^T` the `B` operand, its
//! rows padded only to the `n8` fragment (1-64 rows are 1-8 fragments).
//!
//! The work is a stream of `W`. Each block owns a slab of [`SLAB`] columns (two `m16`
//! fragments) over the whole depth; its warps split `k` by units of 64 bytes per row
//! (32 bf16 or 16 FP32 values), unit `u` to warp `u % 8`. Within a unit, lane
//! `(g, q) = (l / 4, l % 4)` copies the 16-byte chunk `q` of `W` rows `g + 8 j` and of
//! `x` rows `8 f + g` into its own slots of its warp's `cp.async` ring, [`STAGES`]
//! units deep, and reads back exactly what it copied: no barrier in the loop, and each
//! unit's bytes stay in flight without holding registers. The order of `k` inside an
//! MMA is free as long as `A` and `B` agree: the chunk's words `2s`, `2s + 1` are the
//! `k` halves of step `s` for both, so a chunk of a row feeds two MMAs (`m16n8k16`
//! bf16 or fp16, or `m16n8k8` TF32) as loaded. (No 3xTF32 form: `host::gpu::dispatch::gemv_tc_serves`
//! says why.)
//!
//! The warps' partial sums meet in shared memory (added in warp order: deterministic),
//! then bias, `save_z`, and the chain on the slab as in `gemv`: per-element ops and
//! GroupNorms whose groups lie in the slab (the host checks), over all rows at once.
//! Other chains run with `n_ops = 0` (the slab stores `z`) and the row-wise epilogue.

use crate::epilogue::rows::op_forward_rows_stored;
use crate::prelude::async_copy::{cp_async_16, cp_async_commit, cp_async_wait, cp_async_wait_all, shared_address};
use crate::prelude::element::{Bf16, Element, F16, Half};
use crate::prelude::mma::{ld_shared_v4, mma_tf32};
use crate::prelude::*;
use crate::unroll;
use kernel_abi::epilogue::{OP_GROUP_NORM, OpDesc, ROW_THREADS};
use kernel_abi::gemv_tc::{CHUNK, RED_PITCH, ROWS, SLAB, STAGES, THREADS, W_SLOTS, WARPS};

const WARP: usize = WARP_SIZE as usize;
/// `n8` fragments of `x^T`, at most.
const FRAGS: usize = ROWS / 8;
const _: () = assert!(FRAGS == 8 && W_SLOTS == 4 && SLAB == 32 && THREADS == ROW_THREADS && STAGES == 4);
/// Bytes of one slot: a 16-byte chunk per lane.
const SLOT_BYTES: usize = WARP * CHUNK;

/// The main loop and its partial sums: each warp's products over its units of `k` for the
/// `F = ceil(m / 8)` fragments of `x^T`, stored as `[warp][row][RED_PITCH]` from `base`,
/// the start of the dynamic shared memory (over the ring, after a barrier).
///
/// # Safety
/// As `gemv_tc`, with `F == m.div_ceil(8)`; called by the whole block.
#[inline(always)]
unsafe fn products<E: Element, H: Half, const TF32: bool, const F: usize>(
    (x, w, (m, n, k), col0, base): (*const E, *const E, (u32, u32, u32), u32, *mut f32),
) {
    // Index arithmetic in 32 bits (the host checks `m k` and `n k` fit): 64-bit
    // offsets held across the loop cost the registers the accumulators need.
    let (warp, lane) = (warp_id(), lane_id());
    let (g, q) = (lane / 4, lane % 4);
    // Values per chunk and per unit (four chunks of a row).
    let per_chunk = (CHUNK / core::mem::size_of::<E>()) as u32;
    let per_unit = 4 * per_chunk;
    let units = k.div_ceil(per_unit);
    let warps = WARPS as u32;
    let mine = if units > warp { (units - warp).div_ceil(warps) } else { 0 };

    // This lane's slots: unit ring of its warp, `W_SLOTS + F` slots per stage.
    let stage_bytes = ((W_SLOTS + F) * SLOT_BYTES) as u32;
    let ring = shared_address(base) + warp * STAGES as u32 * stage_bytes + lane * CHUNK as u32;
    let stage_at = |s: u32| ring + s * stage_bytes;
    // Copies this lane's chunks of unit `i` (of this warp) into stage `s`: `W` rows
    // `col0 + 8 j + g` (one past `n` reads the last row and is never stored) and `x`
    // rows `8 f + g`; a chunk past `k`, or of a row past `m`, is zero-filled (nothing
    // read). Offsets are recomputed per unit rather than held in registers.
    let issue = |i: u32, s: u32| {
        let k0 = (warp + warps * i) * per_unit + q * per_chunk;
        let (at, bytes) = if k0 < k { (k0, CHUNK as u32) } else { (0, 0) };
        let dst = stage_at(s);
        unroll!(j in 0..4 => {
            let col = col0 + 8 * j as u32 + g;
            let row = if col < n { col } else { n - 1 };
            // SAFETY: `at + per_chunk <= k` inside a 16-byte aligned row of `w` (n >= 1),
            // or nothing read; the slot is this lane's, inside the ring.
            unsafe {
                let src = w.add((row * k + at) as usize) as *const f32;
                cp_async_16(dst + (j * SLOT_BYTES) as u32, src, bytes)
            };
        });
        unroll!(f in 0..8 => {
            if f < F {
                let r = 8 * f as u32 + g;
                let (src, bytes) = if r < m { (r * k + at, bytes) } else { (0, 0) };
                // SAFETY: as above, row r < m of `x`.
                unsafe {
                    let src = x.add(src as usize) as *const f32;
                    cp_async_16(dst + ((W_SLOTS + f) * SLOT_BYTES) as u32, src, bytes)
                };
            }
        });
    };
    let (warp, g, q) = (warp as usize, g as usize, q as usize);

    let mut acc = [[[0.0f32; 4]; F]; 2];
    unroll!(s in 0..3 => {
        if (s as u32) < mine {
            issue(s as u32, s as u32);
        }
        cp_async_commit();
    });
    let mut i = 0;
    while i < mine {
        // Unit i has landed (one group per unit, `STAGES - 2` younger ones may fly).
        cp_async_wait::<{ STAGES as u32 - 2 }>();
        let st = stage_at(i % STAGES as u32);
        let mut wv = [[0u32; 4]; W_SLOTS];
        // SAFETY: this lane's own landed slots.
        unroll!(j in 0..4 => { wv[j] = unsafe { ld_shared_v4(st + (j * SLOT_BYTES) as u32) }; });
        // Refill the stage unit i - 1 used: its reads fed the MMAs already issued.
        let ahead = i + STAGES as u32 - 1;
        if ahead < mine {
            issue(ahead, ahead % STAGES as u32);
        }
        cp_async_commit();
        // `A` of fragment `mf` at step `s`: rows g, g + 8 of the fragment, words 2s, 2s + 1.
        let mut a = [[[0u32; 4]; 2]; 2];
        unroll!(mf in 0..2 => {
            unroll!(s in 0..2 => {
                a[mf][s] = [wv[2 * mf][2 * s], wv[2 * mf + 1][2 * s], wv[2 * mf][2 * s + 1], wv[2 * mf + 1][2 * s + 1]];
            });
        });
        unroll!(f in 0..8 => {
            if f < F {
                // SAFETY: this lane's own landed slot.
                let xv = unsafe { ld_shared_v4(st + ((W_SLOTS + f) * SLOT_BYTES) as u32) };
                unroll!(s in 0..2 => {
                    let b = [xv[2 * s], xv[2 * s + 1]];
                    unroll!(mf in 0..2 => {
                        if TF32 {
                            mma_tf32(&mut acc[mf][f], a[mf][s], b);
                        } else {
                            H::mma(&mut acc[mf][f], a[mf][s], b);
                        }
                    });
                });
            }
        });
        i += 1;
    }
    cp_async_wait_all();
    // SAFETY: uniform control flow; every warp is done with its ring.
    unsafe { sync_threads() };

    // The warps' partial sums over the ring.
    let rows8 = F * 8;
    unroll!(mf in 0..2 => {
        unroll!(f in 0..8 => {
            if f < F {
                unroll!(e in 0..4 => {
                    let (col, row) = (16 * mf + g + 8 * (e / 2), 8 * f + 2 * q + e % 2);
                    // SAFETY: row < rows8, col < SLAB.
                    unsafe { *base.add((warp * rows8 + row) * RED_PITCH + col) = acc[mf][f][e] };
                });
            }
        });
    });
}

/// # Safety
/// Device pointers: `x (m, k)` and `w (n, k)` row-major in `E` with 16-byte rows
/// (`k * size_of::<E>() % 16 == 0`) and 16-byte aligned, `bias (n,)` or null,
/// `y (m, n)`, `save_z (m, n)` FP32 or null; `1 <= m <= ROWS`, `n >= 1`. `E` is `f32`
/// with `TF32` (the operands truncated by the tensor cores), else the 16-bit `H` (a
/// 16-bit model's values as stored); FP32 accumulation in both. With `n_ops > 0`: `ops[..n_ops]` per-element
/// ops or GroupNorms whose group size divides `SLAB`, which divides `n`. Launch: grid
/// `(n.div_ceil(SLAB), 1, 1)`, `THREADS` threads, `smem_bytes(m)` of dynamic shared memory.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn gemv_tc<E: Element, O: Element, H: Half, const TF32: bool>(
    x: *const E,
    w: *const E,
    bias: Vector,
    y: *mut O,
    save_z: *mut f32,
    (m, n, k): (u32, u32, u32),
    ops: *const OpDesc,
    n_ops: u32,
) {
    let t = thread_idx_x() as usize;
    let col0 = block_idx_x() * SLAB as u32;
    // The slab's bias and op parameters (a line each) into L1 while `W` streams: read
    // once, after the products, each had waited on L2 in turn.
    let prefetch = |v: u64| {
        let v = Vector(v);
        if !v.is_null() && (col0 as usize) < n as usize {
            // SAFETY: a vector of `n` values; col0 < n.
            unsafe { crate::prelude::global::prefetch_l1(v.skip(col0 as usize).ptr::<u8>()) };
        }
    };
    if t == 0 {
        prefetch(bias.0);
    } else if t <= 2 * n_ops as usize {
        // SAFETY: (t - 1) / 2 < n_ops.
        let op = unsafe { &*ops.add((t - 1) / 2) };
        prefetch(if t % 2 == 1 { op.param0 } else { op.param1 });
    }
    let frags = m.div_ceil(8) as usize;
    let base = dynamic_shared::<f32>();
    // The main loop for the rows' fragment count: with a count known at run time, the
    // loop issued all FRAGS fragments' MMAs and copies predicated off (a warp's unit
    // took ~265 instructions, the SMs 56% busy issuing them at 63% of the DRAM
    // bandwidth).
    let args = (x, w, (m, n, k), col0, base);
    // SAFETY (each arm): the caller's contract; `F` is `m`'s fragment count.
    unsafe {
        match frags {
            1 => products::<E, H, TF32, 1>(args),
            2 => products::<E, H, TF32, 2>(args),
            3 => products::<E, H, TF32, 3>(args),
            4 => products::<E, H, TF32, 4>(args),
            5 => products::<E, H, TF32, 5>(args),
            6 => products::<E, H, TF32, 6>(args),
            7 => products::<E, H, TF32, 7>(args),
            _ => products::<E, H, TF32, 8>(args),
        }
    }
    let (m, n, col0) = (m as usize, n as usize, col0 as usize);
    let rows8 = frags * 8;
    // SAFETY: smem_bytes(m) covers the partial sums, then the slab's `z`.
    let (red, zs) = (base, unsafe { base.add(WARPS * rows8 * RED_PITCH) });
    // SAFETY: uniform control flow.
    unsafe { sync_threads() };
    let mut i = t;
    while i < m * SLAB {
        let (r, j) = (i / SLAB, i % SLAB);
        let col = col0 + j;
        let mut v = 0.0;
        for wi in 0..WARPS {
            // SAFETY: inside the partial sums.
            v += unsafe { *red.add((wi * rows8 + r) * RED_PITCH + j) };
        }
        if col < n {
            // SAFETY: col < n, r < m.
            unsafe {
                if !bias.is_null() {
                    v += bias.get(col);
                }
                if !save_z.is_null() {
                    *save_z.add(r * n + col) = v;
                }
            }
        }
        // SAFETY: r < m, j < SLAB.
        unsafe { *zs.add(i) = v };
        i += THREADS;
    }
    // SAFETY: uniform control flow.
    unsafe { sync_threads() };
    for o in 0..n_ops as usize {
        // SAFETY: o < n_ops.
        let mut d = unsafe { *ops.add(o) };
        // The op on this slab: its parameters from the slab's first column, and a
        // GroupNorm's groups those inside the slab.
        if d.param0 != 0 {
            d.param0 = Vector(d.param0).skip(col0).0;
        }
        if d.param1 != 0 {
            d.param1 = Vector(d.param1).skip(col0).0;
        }
        if d.code == OP_GROUP_NORM {
            d.count = (d.count as usize * SLAB / n) as u32;
        }
        // SAFETY: the host's contract; every thread runs every op.
        unsafe { op_forward_rows_stored::<THREADS>(&d, zs, m, SLAB) };
    }
    let mut i = t;
    while i < m * SLAB {
        let (r, j) = (i / SLAB, i % SLAB);
        let c = col0 + j;
        if c < n {
            // SAFETY: c < n, r < m.
            unsafe { O::store1(y.add(r * n + c), *zs.add(i)) };
        }
        i += THREADS;
    }
}

/// Declares the entry points, one per (operand, output, arithmetic).
macro_rules! gemv_tc_entries {
    ($($(#[$doc:meta])* $name:ident = <$e:ty, $o:ty, $h:ty, $tf32:literal>;)*) => {$(
        $(#[$doc])*
        ///
        /// # Safety
        /// See `gemv_tc` in this module.
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "ptx-kernel" fn $name(
            x: *const $e, w: *const $e, bias: Vector, y: *mut $o, save_z: *mut f32,
            m: u32, n: u32, k: u32, ops: *const OpDesc, n_ops: u32,
        ) {
            unsafe { gemv_tc::<$e, $o, $h, $tf32>(x, w, bias, y, save_z, (m, n, k), ops, n_ops) }
        }
    )*};
}

gemv_tc_entries! {
    /// A bf16 model's `x` and `W` as stored, FP32 `y` (or `z` before the row-wise epilogue).
    gemv_tc_bf16 = <Bf16, f32, Bf16, false>;
    /// A bf16 model's `x`, `W` and `y` as stored.
    gemv_tc_bf16_to_bf16 = <Bf16, Bf16, Bf16, false>;
    /// An fp16 model's `x` and `W` as stored, FP32 `y` (or `z`).
    gemv_tc_f16 = <F16, f32, F16, false>;
    /// An fp16 model's `x`, `W` and `y` as stored.
    gemv_tc_f16_to_f16 = <F16, F16, F16, false>;
    /// FP32 `x`, `W` and `y`, TF32 products (`H` unused).
    gemv_tc_tf32 = <f32, f32, Bf16, true>;
}

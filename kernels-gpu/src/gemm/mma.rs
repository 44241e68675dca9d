//! Tensor-core GEMM with the epilogue chain fused into its store: `mma.sync.m16n8k8`
//! TF32 (or 3xTF32, FP32-accurate) fed by a 3-stage `cp.async` pipeline.
//!
//! # Shared-memory layouts
//! A stage holds a `128 x 32` tile of each operand, copied global -> shared with no
//! register staging, in the operand's own memory order:
//! * `k`-contiguous operands as `[row][32 k]` (128-byte rows, 8 chunks of 4 floats);
//!   chunk `c` of row `r` sits at chunk `c ^ (r % 8)`. `ldmatrix` then reads 8 rows of
//!   one chunk in one conflict-free phase, and lane `l` receives the word at row `l / 4`,
//!   `k = l % 4` — exactly the TF32 `m16n8k8` fragment layout.
//! * row-contiguous operands as `[32 k][row]` (512-byte rows). A fragment wants 4
//!   different `k` of one row, which no 16-byte load gives; instead the tile's rows (or
//!   columns) are *permuted*: a thread's 4 `mi` x 2 halves (A) or 4 `ni` (B) of one `k`
//!   become consecutive floats, one 16-byte `ld.shared` each. The accumulator mapping
//!   undoes the permutation when the tile is staged. Chunks are XOR-swizzled with a
//!   function of `k % 4` chosen per operand so that each 8-lane phase hits 8 distinct
//!   bank groups.
//!
//! # Warps
//! 8 warps as 2 (rows) x 4 (columns), each owning a `64 x 32` piece: 4 x 4 fragments of
//! `16 x 8`, 64 accumulators per thread. Per `k` of 8: A fragments are 4 `ldmatrix.x4`
//! (or 4 `ld.shared.v4`), B fragments 2 of either, then 16 MMAs (48 with the split).

use super::BlockTile;
use super::staged::{STAGE_STRIDE, write_staged_tile};
use crate::prelude::async_copy::*;
use crate::prelude::element::{self, Bf16, Half};
use crate::prelude::mma::*;
use crate::prelude::*;
use crate::unroll;
use kernel_abi::epilogue::OpDesc;
use kernel_abi::gemm_mma::*;

/// Bytes of one operand's tile in a stage.
const TILE_BYTES: u32 = (BLOCK_M * BLOCK_K * 4) as u32;
/// Bytes between consecutive rows of a `k`-contiguous tile, and of a row-contiguous one.
const K_ROW_BYTES: u32 = (BLOCK_K * 4) as u32;
const R_ROW_BYTES: u32 = (BLOCK_M * 4) as u32;

type Acc = [[[f32; 4]; 4]; 4];

/// The arithmetic of a `gemm_mma` kernel: TF32 (operands truncated to TF32), 3xTF32
/// (FP32-accurate split), bf16 or fp16 (operands rounded to the 16-bit type,
/// `m16n8k16`); FP32 accumulation in all.
const TF32: u8 = 0;
const TF32X3: u8 = 1;
const BF16: u8 = 2;
const F16: u8 = 3;

/// `y = chain(A B^T + bias)` on tensor cores; the contract (operand orders, split-K via
/// `gridDim.z`, `save_z`, bias) is that of [`super::fma`]'s `gemm_fma` with the sizes
/// of `kernel_abi::gemm_mma` (`k_split` a multiple of its `BLOCK_K` = 32).
///
/// # Safety
/// As `gemm_fma`; `THREADS` threads, `SMEM_BYTES` of dynamic shared memory; `VEC`
/// needs `lda`, `ldb` multiples of 4 and 16-byte aligned operands.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_mma<const MATH: u8, const VEC: bool, const A_K: bool, const B_K: bool>(
    a: *const f32,
    b: *const f32,
    bias: Vector,
    y: *mut f32,
    save_z: *mut f32,
    m: u32,
    n: u32,
    k: u32,
    lda: u32,
    ldb: u32,
    k_split: u32,
    ops: *const OpDesc,
    n_ops: u32,
) {
    let t = thread_idx_x();
    let BlockTile { row0, col0, k_begin, k_end, tiles } = BlockTile::new(k, k_split, BLOCK_K as u32);

    let smem = dynamic_shared::<f32>();
    let base = shared_address(smem);
    let stage_a = |s: u32| base + s * 2 * TILE_BYTES;

    // The copies' positions are recomputed from the thread index for every k-tile:
    // kept in registers across the MMAs instead, they pushed the 3xTF32 forward
    // kernel past 128 registers.
    // SAFETY (copies): every chunk lands inside its stage's tile; reads follow the
    // kernel's contract (out-of-range elements are zero-filled, not read).
    let issue = |tile: u32, stage: u32| unsafe {
        let k0 = k_begin + tile * BLOCK_K as u32;
        TileCopy::new::<A_K, true>(lda, m, row0, k0, t).issue::<VEC, A_K>(a, lda, stage_a(stage), k_end);
        TileCopy::new::<B_K, false>(ldb, n, col0, k0, t).issue::<VEC, B_K>(b, ldb, stage_a(stage) + TILE_BYTES, k_end);
    };
    for s in 0..STAGES as u32 - 1 {
        if s < tiles {
            issue(s, s);
        }
        cp_async_commit();
    }
    let frag = Fragments::new::<A_K, B_K>(t);
    let mut acc: Acc = [[[0.0; 4]; 4]; 4];
    let (mut read, mut write) = (0u32, STAGES as u32 - 1);
    for kt in 0..tiles {
        cp_async_wait::<{ STAGES as u32 - 2 }>();
        // SAFETY: uniform; makes stage `read` visible and frees stage `write` (read in
        // the previous iteration).
        unsafe { sync_threads() };
        if kt + (STAGES as u32 - 1) < tiles {
            issue(kt + STAGES as u32 - 1, write);
        }
        cp_async_commit();
        // SAFETY: the stage's two tiles are complete (wait + barrier above).
        unsafe { frag.multiply::<MATH, A_K, B_K>(&mut acc, stage_a(read), stage_a(read) + TILE_BYTES) };
        read = if read + 1 == STAGES as u32 { 0 } else { read + 1 };
        write = if write + 1 == STAGES as u32 { 0 } else { write + 1 };
    }
    cp_async_wait::<0>();
    // SAFETY: uniform; every warp is done reading the pipeline before it is reused.
    unsafe { sync_threads() };
    // SAFETY: the staging tile fits the dynamic shared memory; uniform barrier.
    unsafe {
        frag.stage::<A_K, B_K>(&acc, smem);
        sync_threads();
        write_staged_tile(
            thread_idx_x() as usize,
            smem,
            y,
            bias,
            save_z,
            (m as usize, n as usize),
            (row0 as usize, col0 as usize),
            ops,
            n_ops,
        );
    }
}

/// One thread's share of filling an operand's tile in a stage: 4 chunks of 4 floats,
/// the same 4 (relative) positions every k-tile.
///
/// `k`-contiguous (`[row][k]` tile): the thread copies chunk `t % 8` (4 `k`) of rows
/// `t / 8 + 32 i`. Row-contiguous (`[k][row]`): chunk `t % 32` (4 rows) of `k`-rows
/// `t / 32 + 8 i`. Either way the 4 chunks are 4096 bytes apart in the tile.
pub(super) struct TileCopy {
    /// Element offset of chunk 0 in the operand.
    off: u32,
    /// Byte offset of chunk 0 in the tile.
    pub(super) dst: u32,
    /// First `k` of chunk 0.
    kk: u32,
    /// Rows of the operand from this thread's (first) row on, saturating at 0: the rows
    /// still inside the matrix.
    rows_left: u32,
}

impl TileCopy {
    /// `A_ROLE`: the tile feeds the `A` fragments (selects the row-contiguous swizzle).
    #[inline(always)]
    pub(super) fn new<const K_MAJOR: bool, const A_ROLE: bool>(ld: u32, rows: u32, r0: u32, k0: u32, t: u32) -> TileCopy {
        if K_MAJOR {
            let (r, c) = (t / 8, t % 8);
            TileCopy {
                off: (r0 + r) * ld + k0 + 4 * c,
                dst: r * K_ROW_BYTES + ((c ^ (r % 8)) * 16),
                kk: k0 + 4 * c,
                rows_left: rows.saturating_sub(r0 + r),
            }
        } else {
            let (kr, c) = (t / 32, t % 32);
            TileCopy {
                off: (k0 + kr) * ld + r0 + 4 * c,
                dst: kr * R_ROW_BYTES + ((c ^ row_swizzle::<A_ROLE>(kr)) * 16),
                kk: k0 + kr,
                rows_left: rows.saturating_sub(r0 + 4 * c),
            }
        }
    }

    /// Starts the copies into the tile at shared address `tile`.
    ///
    /// # Safety
    /// `tile` is a tile of a stage; `src` the operand of the kernel's contract.
    #[inline(always)]
    pub(super) unsafe fn issue<const VEC: bool, const K_MAJOR: bool>(&self, src: *const f32, ld: u32, tile: u32, k_end: u32) {
        let chunk = if K_MAJOR { 32 * ld } else { 8 * ld };
        unroll!(i in 0..4 => {
            let i = i as u32;
            let off = self.off.wrapping_add(i * chunk);
            let dst = tile + self.dst + i * 4096;
            // Which of the chunk's 4 floats are inside the matrix (a prefix of them).
            let inside = if K_MAJOR {
                if self.rows_left > 32 * i { k_end.saturating_sub(self.kk).min(4) } else { 0 }
            } else if self.kk + 8 * i < k_end {
                self.rows_left.min(4)
            } else {
                0
            };
            if VEC {
                let p = if inside == 0 { src } else { src.wrapping_add(off as usize) };
                // SAFETY: 16-byte aligned (VEC); `inside` floats from `p` are in the matrix.
                unsafe { cp_async_16(dst, p, inside * 4) };
            } else {
                unroll!(e in 0..4 => {
                    let e = e as u32;
                    let p = if e < inside { src.wrapping_add((off + e) as usize) } else { src };
                    // SAFETY: element `e` is read only when inside the matrix.
                    unsafe { cp_async_4(dst + 4 * e, p, if e < inside { 4 } else { 0 }) };
                });
            }
        });
    }
}

/// Chunk swizzle of a row-contiguous tile, by `k % 4`. A thread reads chunks `2 gid + j`
/// (A) or `gid` (B) of `k`-rows `.. + tig`: an 8-lane phase is 2 `gid` x 4 `tig`, so
/// the A swizzle must map `tig` into {0, 1, 4, 5} and the B swizzle into {0, 2, 4, 6}
/// for the phase to cover 8 distinct bank groups.
#[inline(always)]
fn row_swizzle<const A_ROLE: bool>(k: u32) -> u32 {
    let k = k % 4;
    if A_ROLE { (k & 1) | ((k & 2) << 1) } else { k << 1 }
}

/// A thread's fixed shared-memory offsets for its fragments (bytes within a tile),
/// computed once.
#[derive(Clone, Copy)]
struct Fragments {
    /// `k`-contiguous: this lane's `ldmatrix` row address for the first fragment at
    /// `k`-step 0; step `s` flips bits 5-6 (chunk `2 s` of the swizzled row, which is
    /// `XOR 2 s`). Row-contiguous: its 16-byte word of `k`-row `tig`.
    a_off: u32,
    b_off: u32,
    /// Warp's rows and columns in the tile, and the lane's `(gid, tig)`.
    wm: u32,
    wn: u32,
    gid: u32,
    tig: u32,
}

impl Fragments {
    #[inline(always)]
    fn new<const A_K: bool, const B_K: bool>(t: u32) -> Fragments {
        let (w, l) = (t / 32, t % 32);
        let (wm, wn) = ((w % 2) * 64, (w / 2) * 32);
        let (gid, tig, q) = (l / 4, l % 4, l / 8);
        // Swizzled chunk `c` of a `k`-contiguous row `r` (with `r % 8 == l % 8` here).
        let chunk = |c: u32| (c ^ (l % 8)) * 16;
        let a_off = if A_K {
            // Matrix q: rows (q % 2) * 8 of the fragment, chunk 2 s + q / 2.
            (wm + (q % 2) * 8 + l % 8) * K_ROW_BYTES + chunk(q / 2)
        } else {
            // Chunk 2 gid (+1) of the warp's 16: rows wm + 8 gid .. + 8.
            tig * R_ROW_BYTES + (wm / 4 + ((2 * gid) ^ row_swizzle::<true>(tig))) * 16
        };
        let b_off = if B_K {
            // Matrix q: fragment columns of `ni = 2 p + q / 2`, chunk 2 s + q % 2.
            (wn + (q / 2) * 8 + l % 8) * K_ROW_BYTES + chunk(q % 2)
        } else {
            tig * R_ROW_BYTES + (wn / 4 + (gid ^ row_swizzle::<false>(tig))) * 16
        };
        Fragments { a_off, b_off, wm, wn, gid, tig }
    }

    /// The 4 `k`-steps of 8 of one stage: fragments, conversion, MMAs.
    ///
    /// # Safety
    /// `sa`, `sb`: shared addresses of the stage's complete tiles; warp-uniform call.
    #[inline(always)]
    unsafe fn multiply<const MATH: u8, const A_K: bool, const B_K: bool>(&self, acc: &mut Acc, sa: u32, sb: u32) {
        if MATH == BF16 {
            // SAFETY: as the caller's.
            return unsafe { self.multiply_half::<Bf16, A_K, B_K>(acc, sa, sb) };
        }
        if MATH == F16 {
            // SAFETY: as the caller's.
            return unsafe { self.multiply_half::<element::F16, A_K, B_K>(acc, sa, sb) };
        }
        unroll!(s in 0..4 => {
            let (af, bf) = unsafe { self.fragments::<A_K, B_K>(sa, sb, s as u32) };
            if MATH == TF32X3 {
                // High parts are the raw operands (see `tf32_residual`); one row of
                // fragments at a time keeps few residuals live. Small terms first, so
                // the large one lands last on each accumulator.
                let b_lo = bf.map(|f| f.map(tf32_residual));
                unroll!(mi in 0..4 => {
                    let a_lo = af[mi].map(tf32_residual);
                    unroll!(ni in 0..4 => { mma_tf32(&mut acc[mi][ni], a_lo, bf[ni]); });
                    unroll!(ni in 0..4 => { mma_tf32(&mut acc[mi][ni], af[mi], b_lo[ni]); });
                    unroll!(ni in 0..4 => { mma_tf32(&mut acc[mi][ni], af[mi], bf[ni]); });
                });
            } else {
                // Raw FP32 bits: the tensor core uses the TF32 part and ignores the low
                // 13 bits (truncation, as `wgmma` reading FP32 shared memory does).
                // Rounding here costs ~4 instructions per element, 384 per thread per
                // k-tile beside 64 MMAs: the loop would be bound by instruction issue.
                unroll!(mi in 0..4 => { unroll!(ni in 0..4 => { mma_tf32(&mut acc[mi][ni], af[mi], bf[ni]); }); });
            }
        });
    }

    /// [`Fragments::multiply`] with the operands rounded to the 16-bit `H`.
    ///
    /// # Safety
    /// As [`Fragments::multiply`].
    #[inline(always)]
    unsafe fn multiply_half<H: Half, const A_K: bool, const B_K: bool>(&self, acc: &mut Acc, sa: u32, sb: u32) {
        // A 16-bit `k`-step of 16 is two TF32 steps of 8: the thread's TF32 words for
        // `k` = tig, tig + 4 (step 2 j) and 8 + tig, 12 + tig (step 2 j + 1) become the
        // 16-bit pairs of logical `k` = 2 tig, 2 tig + 1, 2 tig + 8, 2 tig + 9 — the same
        // renaming of `k` for `A` and `B`, so the products still pair up.
        unroll!(j in 0..2 => {
            // Pack each step's words as soon as they are loaded: half the registers.
            let mut a = [[0u32; 4]; 4];
            let mut b = [[0u32; 2]; 4];
            unroll!(h in 0..2 => {
                let (af, bf) = unsafe { self.fragments::<A_K, B_K>(sa, sb, 2 * j as u32 + h as u32) };
                unroll!(mi in 0..4 => {
                    a[mi][2 * h] = H::pack2(af[mi][0], af[mi][2]);
                    a[mi][2 * h + 1] = H::pack2(af[mi][1], af[mi][3]);
                });
                unroll!(ni in 0..4 => { b[ni][h] = H::pack2(bf[ni][0], bf[ni][1]); });
            });
            unroll!(mi in 0..4 => { unroll!(ni in 0..4 => { H::mma(&mut acc[mi][ni], a[mi], b[ni]); }); });
        });
    }

    /// The thread's TF32 fragments of `k`-step `s` (of 8) of a stage: `A` for its 4 `mi`,
    /// `B` for its 4 `ni`, as FP32 bits.
    ///
    /// # Safety
    /// As [`Fragments::multiply`]; `s < 4`.
    #[inline(always)]
    unsafe fn fragments<const A_K: bool, const B_K: bool>(&self, sa: u32, sb: u32, s: u32) -> ([[u32; 4]; 4], [[u32; 2]; 4]) {
        // SAFETY (loads): every offset stays inside its 16 KiB tile.
        let mut bf = [[0u32; 2]; 4];
        if B_K {
            unroll!(p in 0..2 => {
                let r = unsafe { ldmatrix_x4(sb + (self.b_off ^ (32 * s)) + p as u32 * 16 * K_ROW_BYTES) };
                bf[2 * p] = [r[0], r[1]];
                bf[2 * p + 1] = [r[2], r[3]];
            });
        } else {
            let lo = unsafe { ld_shared_v4(sb + self.b_off + 8 * s * R_ROW_BYTES) };
            let hi = unsafe { ld_shared_v4(sb + self.b_off + (8 * s + 4) * R_ROW_BYTES) };
            unroll!(ni in 0..4 => { bf[ni] = [lo[ni], hi[ni]]; });
        }
        let mut af = [[0u32; 4]; 4];
        if A_K {
            unroll!(mi in 0..4 => {
                af[mi] = unsafe { ldmatrix_x4(sa + (self.a_off ^ (32 * s)) + mi as u32 * 16 * K_ROW_BYTES) };
            });
        } else {
            // Word e of chunk j holds rows (mi, half) with 4 j + e = 2 mi + half.
            // (The XOR flips chunk 2 gid to 2 gid + 1 in the swizzled order.)
            let (k0, k0_next) = (sa + 8 * s * R_ROW_BYTES + self.a_off, sa + 8 * s * R_ROW_BYTES + (self.a_off ^ 16));
            let (k4, k4_next) = (k0 + 4 * R_ROW_BYTES, k0_next + 4 * R_ROW_BYTES);
            let v = unsafe { [ld_shared_v4(k0), ld_shared_v4(k0_next), ld_shared_v4(k4), ld_shared_v4(k4_next)] };
            unroll!(mi in 0..4 => {
                let (j, e) = (mi / 2, (mi % 2) * 2);
                af[mi] = [v[j][e], v[j][e + 1], v[2 + j][e], v[2 + j][e + 1]];
            });
        }
        (af, bf)
    }

    /// Writes the accumulators to the `[128][STAGE_STRIDE]` staging tile, undoing the
    /// row (A row-contiguous) and column (B row-contiguous) permutations.
    ///
    /// # Safety
    /// `smem` holds the staging tile; no thread still reads the pipeline.
    #[inline(always)]
    unsafe fn stage<const A_K: bool, const B_K: bool>(&self, acc: &Acc, smem: *mut f32) {
        let (wm, wn, gid, tig) = (self.wm as usize, self.wn as usize, self.gid as usize, self.tig as usize);
        unroll!(mi in 0..4 => {
            unroll!(ni in 0..4 => {
                unroll!(e in 0..4 => {
                    let (half, col) = (e / 2, 2 * tig + e % 2);
                    let r = if A_K { wm + mi * 16 + gid + 8 * half } else { wm + gid * 8 + mi * 2 + half };
                    let c = if B_K { wn + ni * 8 + col } else { wn + col * 4 + ni };
                    // SAFETY: r, c < 128, inside the staging tile.
                    unsafe { *smem.add(r * STAGE_STRIDE + c) = acc[mi][ni][e] };
                });
            });
        });
    }
}

gemm_entries! {
    gemm_mma;
    /// Forward `x W^T`, 3xTF32 (FP32-accurate), 16-byte copies.
    gemm_mma_tf32x3_nt_vec4 = <TF32X3, true, true, true>;
    /// Forward `x W^T`, 3xTF32, 4-byte copies (any `k`).
    gemm_mma_tf32x3_nt_scalar = <TF32X3, false, true, true>;
    /// `dX = dZ W`, 3xTF32, 16-byte copies.
    gemm_mma_tf32x3_nn_vec4 = <TF32X3, true, true, false>;
    /// `dX = dZ W`, 3xTF32, 4-byte copies.
    gemm_mma_tf32x3_nn_scalar = <TF32X3, false, true, false>;
    /// `dW = dZ^T X`, 3xTF32, 16-byte copies.
    gemm_mma_tf32x3_tn_vec4 = <TF32X3, true, false, false>;
    /// `dW = dZ^T X`, 3xTF32, 4-byte copies.
    gemm_mma_tf32x3_tn_scalar = <TF32X3, false, false, false>;
    /// Forward `x W^T`, TF32, 16-byte copies.
    gemm_mma_tf32_nt_vec4 = <TF32, true, true, true>;
    /// Forward `x W^T`, TF32, 4-byte copies.
    gemm_mma_tf32_nt_scalar = <TF32, false, true, true>;
    /// `dX = dZ W`, TF32, 16-byte copies.
    gemm_mma_tf32_nn_vec4 = <TF32, true, true, false>;
    /// `dX = dZ W`, TF32, 4-byte copies.
    gemm_mma_tf32_nn_scalar = <TF32, false, true, false>;
    /// `dW = dZ^T X`, TF32, 16-byte copies.
    gemm_mma_tf32_tn_vec4 = <TF32, true, false, false>;
    /// `dW = dZ^T X`, TF32, 4-byte copies.
    gemm_mma_tf32_tn_scalar = <TF32, false, false, false>;
    /// Forward `x W^T`, bf16 operands, FP32 accumulation, 16-byte copies.
    gemm_mma_bf16_nt_vec4 = <BF16, true, true, true>;
    /// Forward `x W^T`, bf16, 4-byte copies.
    gemm_mma_bf16_nt_scalar = <BF16, false, true, true>;
    /// `dX = dZ W`, bf16, 16-byte copies.
    gemm_mma_bf16_nn_vec4 = <BF16, true, true, false>;
    /// `dX = dZ W`, bf16, 4-byte copies.
    gemm_mma_bf16_nn_scalar = <BF16, false, true, false>;
    /// `dW = dZ^T X`, bf16, 16-byte copies.
    gemm_mma_bf16_tn_vec4 = <BF16, true, false, false>;
    /// `dW = dZ^T X`, bf16, 4-byte copies.
    gemm_mma_bf16_tn_scalar = <BF16, false, false, false>;
    /// Forward `x W^T`, fp16 operands, FP32 accumulation, 16-byte copies.
    gemm_mma_f16_nt_vec4 = <F16, true, true, true>;
    /// Forward `x W^T`, fp16, 4-byte copies.
    gemm_mma_f16_nt_scalar = <F16, false, true, true>;
    /// `dX = dZ W`, fp16, 16-byte copies.
    gemm_mma_f16_nn_vec4 = <F16, true, true, false>;
    /// `dX = dZ W`, fp16, 4-byte copies.
    gemm_mma_f16_nn_scalar = <F16, false, true, false>;
    /// `dW = dZ^T X`, fp16, 16-byte copies.
    gemm_mma_f16_tn_vec4 = <F16, true, false, false>;
    /// `dW = dZ^T X`, fp16, 4-byte copies.
    gemm_mma_f16_tn_scalar = <F16, false, false, false>;
}

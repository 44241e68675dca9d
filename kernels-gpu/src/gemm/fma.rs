//! Register-blocked FP32 GEMM on the FMA units with the epilogue chain fused into its
//! store: `y = chain(x W^T + b)` in one kernel.

use super::staged::{STAGE_STRIDE, epilogue_row};
use crate::epilogue::lanes::{F4, store_row4};
use crate::prelude::async_copy::{cp_async_16, cp_async_wait_all, shared_address};
use crate::prelude::math::fma;
use crate::prelude::*;
use crate::unroll;
use kernel_abi::epilogue::*;
use kernel_abi::gemm_fma::*;

const TM: usize = 8; // rows per thread: two runs of 4, 64 apart
const TN: usize = 8; // columns per thread: two runs of 4, 64 apart
const HALF: usize = BLOCK_M / 2;
/// Each thread loads `CHUNKS` 16-byte pieces of each operand per k-step.
const CHUNKS: usize = BLOCK_K / 8;

/// Row (or column) of the tile owned by index `i < 8` of thread coordinate `t < 16`.
#[inline(always)]
fn owned(t: usize, i: usize) -> usize {
    (i / 4) * HALF + t * 4 + i % 4
}

/// `y = chain(A B^T + bias)` with `A` `(m, k)` and `B` `(n, k)` in either memory
/// order, or, when launched with `gridDim.z = S > 1`, split-K partial products
/// `y[s] = A[:, ks] B[:, ks]^T` with no bias and no chain.
///
/// The forward pass is `A = x`, `B = W` (both `k`-contiguous). The backward's GEMMs use
/// the other orders: `dX = dZ W` has `B(j, n) = W[n, j]` (`B` row-contiguous), and
/// `dW = dZ^T X` has both operands row-contiguous.
///
/// # Safety
/// Device pointers of the sizes below; `ops[..n_ops]` holds only ops this kernel
/// fuses (pointwise ops and GroupNorm with groups of 4..=128 channels, a power of
/// two; the host checks). Launch: `THREADS` threads, grid
/// `(ceil(n / BLOCK_N), ceil(m / BLOCK_M), S)`, `SMEM_BYTES` of dynamic shared memory;
/// `k_split` a multiple of `BLOCK_K` with `S * k_split >= k`. `VEC` needs `lda` and
/// `ldb` multiples of 4 (16-byte aligned rows).
///
/// # Parameters
/// * `a`: element `(i, kk)` at `a[i * lda + kk]` if `A_K` (k-contiguous), else at `a[kk * lda + i]`.
/// * `b`: element `(j, kk)` likewise with `ldb` and `B_K`.
/// * `bias`: `(n,)`, or null for none. `y`: `(m, n)` row-major, or `(S, m, n)` for split-K.
/// * `save_z`: `(m, n)`, or null: receives `A B^T + bias` before the chain, what the
///   backward needs; the inference path passes null and pays nothing but a branch.
///
/// # Tiling
/// A block computes a `128 x 128` tile of `y`, stepping `k` by 8. Each step's `A` and
/// `B` slices are loaded into registers one step ahead (16-byte loads when `VEC`), then
/// stored `k`-outermost into the other of two shared-memory stages (transposing the
/// `k`-contiguous operands), so one barrier per step suffices. With `VEC`, a
/// row-contiguous operand (already `k`-outermost in memory) is copied by `cp.async`
/// straight into that stage instead, waited for before the barrier.
///
/// # Thread mapping
/// Warp `w`, lane `l`: `ty = 2w + l / 16`, `tx = l % 16`. The thread owns rows
/// `ty*4 + {0..3}` and `64 + ty*4 + {0..3}`, columns likewise with `tx`: 64
/// accumulators. Its fragments come from shared memory as 16-byte loads (a warp reads
/// 2 distinct `A` vectors and 16 distinct `B` vectors per `k`). The finished tile is
/// staged in shared memory; then each warp walks whole 128-column rows, a lane holding
/// 4 consecutive columns, so a GroupNorm group of `g` channels is `g / 4` neighbouring
/// lanes and its statistics are shuffle sums.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_fma<M: TileMath, const VEC: bool, const A_K: bool, const B_K: bool>(
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
    let (m, n, k) = (m as usize, n as usize, k as usize);
    let (lda, ldb) = (lda as usize, ldb as usize);
    let t = thread_idx_x() as usize;
    let lane = t % 32;
    let row0 = block_idx_y() as usize * BLOCK_M;
    let col0 = block_idx_x() as usize * BLOCK_N;
    let split = block_idx_z() as usize;
    let k_begin = split * k_split as usize;
    let k_end = if k_begin + (k_split as usize) < k { k_begin + k_split as usize } else { k };

    let smem = dynamic_shared::<f32>(); // [stage][A tile | B tile][BLOCK_K][M::STRIDE]

    // Blocks whose tile lies inside `m x n` (all but the last row and column of
    // blocks) take a main loop without row bounds checks.
    let interior = row0 + BLOCK_M <= m && col0 + BLOCK_N <= n;
    let th = Thread::new(t);
    let dims = Dims { lda, ldb, m, n, row0, col0, k_begin, k_end, th };
    // SAFETY: forwards this kernel's contract.
    let acc = unsafe {
        if interior {
            main_loop::<M, VEC, A_K, B_K, false>(a, b, smem, &dims)
        } else {
            main_loop::<M, VEC, A_K, B_K, true>(a, b, smem, &dims)
        }
    };

    // Stage the accumulator tile in shared memory (the pipeline's stages are done:
    // the loop ended on a barrier), so the epilogue can walk whole rows with a small
    // register footprint and store them coalesced. (The walk is `staged::
    // write_staged_tile` inlined by hand: calling it moves ptxas's allocation at the
    // 128-register cap into a 4-byte spill in `nn_vec4`.)
    // SAFETY: the staging tile fits the dynamic shared memory; uniform barrier.
    unsafe {
        M::stage(&acc, smem, th);
        sync_threads();
    }
    let split_k = grid_dim_z() > 1;
    // Split-K: this split's partial product goes to its own slice; the row-wise
    // epilogue adds the slices, the bias and the chain.
    let out = if split_k { unsafe { y.add(split * m * n) } } else { y };
    let (warp, c) = (t / 32, col0 + lane * 4);
    let mut r = warp;
    while r < BLOCK_M && row0 + r < m {
        // SAFETY: r < 128 and lane * 4 + 3 < 128.
        let mut v = unsafe { (*(smem.add(r * STAGE_STRIDE + lane * 4) as *const F4)).0 };
        let row = row0 + r;
        if !split_k {
            epilogue_row(&mut v, bias, save_z, row, ops, n_ops, n, c);
        }
        // SAFETY: row < m; every written column < n.
        unsafe { store_row4(out, v, row, n, c) };
        r += THREADS / 32;
    }
}

/// Sizes and the thread's place, shared by the kernel and its main loop.
#[derive(Clone, Copy)]
struct Dims {
    lda: usize,
    ldb: usize,
    m: usize,
    n: usize,
    row0: usize,
    col0: usize,
    k_begin: usize,
    k_end: usize,
    th: Thread,
}

/// The k-loop of [`gemm_fma`]: the thread's 8 x 8 accumulators of `A[tile] B[tile]^T`
/// over `k_begin..k_end`. `EDGE` checks rows against `m` and `n` (the tile crosses an
/// edge); without it the loads carry only the check for the end of `k`.
///
/// # Safety
/// As [`gemm_fma`]; `smem` is the kernel's dynamic shared memory.
#[inline(always)]
unsafe fn main_loop<M: TileMath, const VEC: bool, const A_K: bool, const B_K: bool, const EDGE: bool>(
    a: *const f32,
    b: *const f32,
    smem: *mut f32,
    d: &Dims,
) -> M::Acc {
    let Dims { lda, ldb, m, n, row0, col0, k_begin, k_end, th } = *d;
    let t = th.t;
    let stride = M::STRIDE;
    let tile = BLOCK_K * stride;
    // Each thread moves 4 elements of each operand per k-step: for a k-contiguous
    // operand, 4 consecutive k of tile row t / 2; for a row-contiguous one, 4
    // consecutive rows of k-row t / 32. The same 4 land in shared memory at
    // `slot(e)`, k-outermost.
    let mut a_src = Loader::new::<A_K>(lda, m, row0, k_begin, t);
    let mut b_src = Loader::new::<B_K>(ldb, n, col0, k_begin, t);
    // With 16-byte loads, a row-contiguous operand's global order is its shared
    // order: it goes straight to shared memory by `cp.async`, no registers between.
    let (a_async, b_async) = (VEC && !A_K, VEC && !B_K);
    let store = |dst: *mut f32, k_major: bool, v: [[f32; 4]; CHUNKS]| {
        // SAFETY: indices < BLOCK_K * stride, inside one tile.
        unsafe {
            unroll!(c in 0..2 => {
                if k_major {
                    let (r, kk) = (t / 2, (t % 2) * 4 + 8 * c);
                    unroll!(e in 0..4 => { *dst.add((kk + e) * stride + r) = v[c][e]; });
                } else {
                    let (r, kk) = ((t % 32) * 4, t / 32 + 8 * c);
                    *(dst.add(kk * stride + r) as *mut F4) = F4(v[c]);
                }
            });
        }
    };
    let stage_ptr = |s: usize| unsafe { smem.add(s * 2 * tile) };
    // The shared address of this thread's `cp.async` slot in stage 0's `A` tile (the
    // row-contiguous layout's `(t / 32, (t % 32) * 4)`).
    let slot = shared_address(smem) + (4 * ((t / 32) * stride + (t % 32) * 4)) as u32;
    let tile_bytes = (4 * tile) as u32;

    let mut acc = M::zero();
    let (k_end, mut k0) = (k_end as u32, k_begin as u32);
    let (mut av, mut bv) = ([[0.0f32; 4]; CHUNKS], [[0.0f32; 4]; CHUNKS]);
    // SAFETY (copies): stage 0 is not read before the wait and barrier below.
    if a_async {
        unsafe { a_src.copy::<EDGE>(a, slot, k_end, stride) };
    } else {
        av = a_src.load::<VEC, A_K, EDGE>(a, k_end);
    }
    if b_async {
        unsafe { b_src.copy::<EDGE>(b, slot + tile_bytes, k_end, stride) };
    } else {
        bv = b_src.load::<VEC, B_K, EDGE>(b, k_end);
    }
    if !a_async {
        store(stage_ptr(0), A_K, av);
    }
    if !b_async {
        store(unsafe { stage_ptr(0).add(tile) }, B_K, bv);
    }
    if a_async || b_async {
        cp_async_wait_all();
    }
    // SAFETY: uniform control flow throughout the main loop.
    unsafe { sync_threads() };
    let mut stage = 0;
    while k0 < k_end {
        let next = k0 + BLOCK_K as u32;
        if next < k_end {
            a_src.advance();
            b_src.advance();
            // The other stage was last read before the previous barrier: free.
            let dst = slot + (stage ^ 1) as u32 * 2 * tile_bytes;
            if a_async {
                // SAFETY: the other stage is read only after the wait and barrier below.
                unsafe { a_src.copy::<EDGE>(a, dst, k_end, stride) };
            } else {
                av = a_src.load::<VEC, A_K, EDGE>(a, k_end);
            }
            if b_async {
                // SAFETY: as for `A`.
                unsafe { b_src.copy::<EDGE>(b, dst + tile_bytes, k_end, stride) };
            } else {
                bv = b_src.load::<VEC, B_K, EDGE>(b, k_end);
            }
        }
        // SAFETY: all indices stay inside this stage's two tiles.
        unsafe { M::step(&mut acc, smem.add(stage * 2 * tile), smem.add(stage * 2 * tile + tile), th) };
        if next < k_end {
            if !a_async {
                store(stage_ptr(stage ^ 1), A_K, av);
            }
            if !b_async {
                store(unsafe { stage_ptr(stage ^ 1).add(tile) }, B_K, bv);
            }
        }
        if a_async || b_async {
            cp_async_wait_all();
        }
        // SAFETY: uniform; orders this step's reads before the next step's overwrite,
        // and this step's copies and stores before the next step's reads.
        unsafe { sync_threads() };
        stage ^= 1;
        k0 = next;
    }

    acc
}

/// The arithmetic of the main loop: how a thread turns one staged k-step of the `A`
/// and `B` tiles (`[BLOCK_K][STRIDE]`, `k` outermost) into its accumulators, and how
/// it writes them to the `[128][STAGE_STRIDE]` staging tile for the epilogue. Only
/// [`Fma`] implements it since the tensor cores got their own kernels; it stays because
/// folding it away changes the SASS ptxas allocates at the 128-register cap (v2.8).
trait TileMath {
    type Acc: Copy;
    /// Floats per `k` row of a staged operand tile (padding chosen per math for banks).
    const STRIDE: usize;
    fn zero() -> Self::Acc;
    /// # Safety
    /// `sa` and `sb` point at one stage's staged tiles.
    unsafe fn step(acc: &mut Self::Acc, sa: *const f32, sb: *const f32, th: Thread);
    /// # Safety
    /// `smem` holds the staging tile.
    unsafe fn stage(acc: &Self::Acc, smem: *mut f32, th: Thread);
}

/// A thread's index and the FMA path's coordinates, computed once per kernel.
#[derive(Clone, Copy)]
struct Thread {
    t: usize,
    ty: usize,
    tx: usize,
}

impl Thread {
    #[inline(always)]
    fn new(t: usize) -> Thread {
        Thread { t, ty: (t / 32) * 2 + (t % 32) / 16, tx: t % 16 }
    }
}

/// Strict FP32 on the FMA units: 8 x 8 outputs per thread, rows `ty*4 + {0..3}` and
/// `64 + ty*4 + {0..3}` (`ty = 2 warp + lane / 16`), columns likewise with `tx = lane % 16`.
struct Fma;

impl TileMath for Fma {
    type Acc = [[f32; TN]; TM];
    // 4 floats of padding: the two halves of a warp's transposed stores land in
    // different banks, and rows stay 16-byte aligned for the fragment loads.
    const STRIDE: usize = BLOCK_M + 4;

    fn zero() -> Self::Acc {
        [[0.0; TN]; TM]
    }

    #[inline(always)]
    unsafe fn step(acc: &mut Self::Acc, sa: *const f32, sb: *const f32, th: Thread) {
        let (ty, tx) = (th.ty, th.tx);
        let (sx, sw) = (sa as *const F4, sb as *const F4);
        // One k of the step: two 16-byte fragments of each operand, 64 FMAs.
        let mut step_k = |kk: usize| {
            let q = kk * Self::STRIDE / 4;
            // SAFETY: q + 16 + 15 < BLOCK_K * STRIDE / 4.
            let (a0, a1, b0, b1) = unsafe {
                ((*sx.add(q + ty)).0, (*sx.add(q + HALF / 4 + ty)).0, (*sw.add(q + tx)).0, (*sw.add(q + HALF / 4 + tx)).0)
            };
            let a = [a0[0], a0[1], a0[2], a0[3], a1[0], a1[1], a1[2], a1[3]];
            let b = [b0[0], b0[1], b0[2], b0[3], b1[0], b1[1], b1[2], b1[3]];
            unroll!(i in 0..8 => { unroll!(j in 0..8 => { acc[i][j] = fma(a[i], b[j], acc[i][j]); }); });
        };
        unroll!(kk in 0..16 => { step_k(kk); });
    }

    #[inline(always)]
    unsafe fn stage(acc: &Self::Acc, smem: *mut f32, th: Thread) {
        let (ty, tx) = (th.ty, th.tx);
        unroll!(i in 0..8 => {
            unroll!(h in 0..2 => {
                let j = h * 4;
                let v = F4([acc[i][j], acc[i][j + 1], acc[i][j + 2], acc[i][j + 3]]);
                // SAFETY: row and column < 128, inside the staging tile.
                unsafe { *(smem.add(owned(ty, i) * STAGE_STRIDE + owned(tx, j)) as *mut F4) = v };
            });
        });
    }
}

/// Where one thread reads its 4 elements of an operand for the current k-step.
///
/// The position is a 32-bit element offset from the operand's base (a kernel
/// parameter, so it costs no register): two registers fewer per operand than a
/// 64-bit pointer and stride, which is what keeps every layout within 128 registers.
/// The host refuses operands of 2^32 elements or more.
struct Loader {
    /// Offset of the thread's first element this step (chunk 0 of 8 k; chunk 1, the next
    /// 8 k, is half a step further).
    off: u32,
    /// Offset increment per k-step.
    step: u32,
    /// The thread's first k this step.
    kk: u32,
    /// How many of the thread's rows are inside the matrix, at most 4 (k-contiguous:
    /// its one row is inside when this is not 0; row-contiguous: all 4 are when it is 4).
    rows_left: u32,
}

impl Loader {
    #[inline(always)]
    fn new<const K_MAJOR: bool>(ld: usize, rows: usize, r0: usize, k0: usize, t: usize) -> Loader {
        let (r, kk) = if K_MAJOR { (r0 + t / 2, k0 + (t % 2) * 4) } else { (r0 + (t % 32) * 4, k0 + t / 32) };
        let (off, step) = if K_MAJOR { (r * ld + kk, BLOCK_K) } else { (kk * ld + r, BLOCK_K * ld) };
        Loader {
            off: off as u32,
            step: step as u32,
            kk: kk as u32,
            rows_left: rows.saturating_sub(r).min(4) as u32,
        }
    }

    #[inline(always)]
    fn advance(&mut self) {
        self.off = self.off.wrapping_add(self.step);
        self.kk += BLOCK_K as u32;
    }

    /// Row-contiguous operands with 16-byte loads: starts the copies of this step's two
    /// chunks of 4 rows to `dst` (the thread's slot in the stage's tile, a shared
    /// address; chunk 1 is 8 k rows further), zero-filled outside `rows` x `k_end`.
    ///
    /// # Safety
    /// `dst` as above, not accessed until [`cp_async_wait_all`]; the operand's rows are
    /// 16-byte aligned.
    #[inline(always)]
    unsafe fn copy<const EDGE: bool>(&self, src: *const f32, dst: u32, k_end: u32, stride: usize) {
        unroll!(c in 0..2 => {
            let kk = self.kk + 8 * c as u32;
            let bytes = if kk >= k_end { 0 } else if EDGE { self.rows_left * 4 } else { 16 };
            // A copy of 0 bytes still gets a valid address: the operand's base.
            let p = if bytes != 0 { src.wrapping_add((self.off + c as u32 * (self.step / 2)) as usize) } else { src };
            // SAFETY: reads `bytes` bytes, all inside rows x k_end; the caller's `dst`.
            unsafe { cp_async_16(dst + (4 * 8 * c * stride) as u32, p, bytes) };
        });
    }

    /// The 4 elements, zero where outside `rows` x `k_end`. Without `EDGE` the rows are
    /// known to be inside; with `VEC`, `k_end` and the 4 k or rows are 4-aligned, so
    /// one compare decides the whole vector.
    #[inline(always)]
    fn load<const VEC: bool, const K_MAJOR: bool, const EDGE: bool>(&self, src: *const f32, k_end: u32) -> [[f32; 4]; CHUNKS] {
        let mut out = [[0.0f32; 4]; CHUNKS];
        unroll!(c in 0..2 => {
            out[c] = self.load_chunk::<VEC, K_MAJOR, EDGE>(src, k_end, c as u32);
        });
        out
    }

    #[inline(always)]
    fn load_chunk<const VEC: bool, const K_MAJOR: bool, const EDGE: bool>(
        &self,
        src: *const f32,
        k_end: u32,
        c: u32,
    ) -> [f32; 4] {
        let p = src.wrapping_add((self.off + c * (self.step / 2)) as usize);
        let kk = self.kk + 8 * c;
        if VEC && !EDGE {
            // SAFETY: rows inside (no EDGE); kk < k_end covers all 4 (aligned).
            return if kk < k_end { unsafe { (*(p as *const F4)).0 } } else { [0.0; 4] };
        }
        let mut v = [0.0f32; 4];
        let (kk, k_end) = (kk as usize, k_end as usize);
        // SAFETY (all reads): element (r', k') read only when r' < rows and k' < k_end.
        unsafe {
            if K_MAJOR {
                if self.rows_left != 0 {
                    if VEC && kk + 4 <= k_end {
                        v = (*(p as *const F4)).0;
                    } else {
                        unroll!(e in 0..4 => { if kk + e < k_end { v[e] = *p.add(e); } });
                    }
                }
            } else if kk < k_end {
                if VEC && self.rows_left == 4 {
                    v = (*(p as *const F4)).0;
                } else {
                    unroll!(e in 0..4 => { if e < self.rows_left as usize { v[e] = *p.add(e); } });
                }
            }
        }
        v
    }
}

gemm_entries! {
    gemm_fma;
    /// Forward `x W^T` (both operands k-contiguous), FP32 FMA, 16-byte loads.
    gemm_fma_nt_vec4 = <Fma, true, true, true>;
    /// Forward `x W^T`, FP32 FMA, scalar loads (any `k`).
    gemm_fma_nt_scalar = <Fma, false, true, true>;
    /// `dX = dZ W` (`B` row-contiguous), FP32 FMA, 16-byte loads.
    gemm_fma_nn_vec4 = <Fma, true, true, false>;
    /// `dX = dZ W`, FP32 FMA, scalar loads.
    gemm_fma_nn_scalar = <Fma, false, true, false>;
    /// `dW = dZ^T X` (both row-contiguous), FP32 FMA, 16-byte loads.
    gemm_fma_tn_vec4 = <Fma, true, false, false>;
    /// `dW = dZ^T X`, FP32 FMA, scalar loads.
    gemm_fma_tn_scalar = <Fma, false, false, false>;
}

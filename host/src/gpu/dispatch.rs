//! Every kernel choice, in one place. Launchers launch what these functions name and
//! choose nothing themselves:
//!
//! * [`plan`] — a block's forward: one kernel with the chain fused into the GEMM's
//!   store, or the GEMM (split-K where the GPU would be idle) then the row-wise
//!   epilogue; [`not_fusable`] says why an op cannot ride in the store; [`split_sums`]
//!   which kernel adds split-K's ranges;
//! * [`route`] — which GEMM family and kernel runs each GEMM of a Linear layer, for the
//!   precision, the shape and how the tensors are stored ([`Storage`]);
//! * [`gemv_chain_fits`], [`gemv_kernel`], [`gemv_tc_wins`] — the small-batch forward's
//!   chain, kernel and row limits;
//! * [`fold_kernel`], [`unfold_kernel`] — a leading AvgPool's fold into the weight, and
//!   its gradient, by the weight's dtype;
//! * [`tile_backward`] and [`tiles_backward_kernel`] — the chain's backward tile-wise
//!   or row by row, and the tile kernel for the gradients' dtype;
//! * [`values_one_by_one`] — how the kink scan hands doubtful values to the refinement.
//!
//! The GEMM families have one name each across kernels, modules and this table:
//! `fma` (`gemm_fma_*`, strict FP32 on the FMA units), `mma` (`gemm_mma_*`, `mma.sync`),
//! `wgmma` (`gemm_wgmma_*`) and `tma` (`gemm_tma_*`, persistent TMA-fed `wgmma`).

use super::memory::Dtype;
use crate::chain::Op;
use crate::precision::Precision;
use kernel_abi::Kernel;
use kernel_abi::dot::OUTER_MAX_RANK;
use kernel_abi::epilogue::{self, OP_GROUP_NORM, OpDesc};
use kernel_abi::gemm_fma::{BLOCK_K, BLOCK_M, BLOCK_N, MAX_FUSED_GROUP, MIN_FUSED_GROUP};
use kernel_abi::gemm_tma::{self, MIN_K};
use kernel_abi::gemv::{ROWS as GEMV_ROWS, SLAB as GEMV_SLAB};

/// Most rows the tensor-core small-batch kernel (`gemv_tc_*`) takes before the tile
/// GEMMs do (the kernel's own limit is `kernel_abi::gemv_tc::ROWS`, 64). Its `mma.sync`
/// work grows with the rows (padded to 8) while `W`'s bytes do not, and the tile GEMMs'
/// idle SMs fill up as the rows grow (split-K). Measured against the tile GEMMs (`host
/// bench --shape ROWS,IN,OUT --small-batch-kernels`, M1's chain, H100, 2026-11-27, bf16
/// and TF32, 8-64 rows of 1024-8192 x 1024-8192): at 64 rows the tiles were level or up
/// to 1.26x faster on every shape; see [`gemv_tc_wins`] for the rest of the rule.
pub const GEMV_TC_ROWS: usize = 48;
const _: () = assert!(GEMV_TC_ROWS <= kernel_abi::gemv_tc::ROWS && GEMV_TC_ROWS >= GEMV_ROWS);

/// Memory order of the operands of `y = A B^T` as a kernel reads them (see
/// `kernels-gpu/src/gemm/fma.rs`; the bf16 TMA kernels read the same three).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Both `k`-contiguous: the forward `x W^T`.
    Nt,
    /// `B` row-contiguous (MN-major): `dX = dZ W`.
    Nn,
    /// Both row-contiguous (MN-major): `dW = dZ^T X`.
    Tn,
    /// `A` row-contiguous, `B` `k`-contiguous: the tensor-core backward on `wgmma`
    /// (`dX^T = W^T dZ^T`, and `dW = dZ^T X` with `X` transposed first).
    Tk,
}

/// The GEMM kernel families, each with its launcher in a module of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// `gemm_fma_*`: strict FP32 on the FMA units, any alignment, split-K
    /// (kernels-gpu/src/gemm/fma.rs; launcher [`super::gemm::grid`]).
    Fma,
    /// `gemm_mma_*`: `mma.sync` TF32, 3xTF32 and bf16, any alignment, split-K
    /// (kernels-gpu/src/gemm/mma.rs; launcher [`super::gemm::grid`]).
    Mma,
    /// `gemm_wgmma_*`: `wgmma` TF32 and 3xTF32 over 16-byte rows, split-K
    /// (kernels-gpu/src/gemm/wgmma.rs; launcher [`super::gemm::grid`]).
    Wgmma,
    /// `gemm_tma_*`: persistent, TMA-fed, warp-specialised `wgmma`, TF32, 3xTF32 and
    /// bf16 over 16-byte rows, `k >= MIN_K`, split-K in the forward
    /// (kernels-gpu/src/gemm/tma/; launcher [`super::gemm::tma`]).
    Tma,
    /// `dot.rs`'s one-pass kernels at the memory's rate, FP32 sums, FP32 and 16-bit
    /// models: `dW` of at most `OUTER_MAX_RANK` rows as that many outer products
    /// (`outer*`, launcher [`super::dot::outer_sum`]), `dX` of a few rows as `W`'s rows
    /// weighted by `dZ` and summed (`column_dot*`, and a 16-bit model's on tensor cores,
    /// `dx_tc_*`; launcher [`super::dot::weighted_rows`]).
    Dot,
}

/// A GEMM of a Linear layer `y (m, n) = x (m, k) W^T`, `W (n, k)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// `x W^T`; with `splits > 1`, that many split-K partial products (no epilogue).
    Forward { splits: usize },
    /// `dX (m, k) = dZ (m, n) W`.
    GradInput,
    /// `dW (n, k) = dZ (m, n)^T X`.
    GradWeight,
}

/// Which of a role's operands are transposed before its GEMM (into new tensors).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transposed {
    /// Both are read as stored.
    Nothing,
    /// `B`: `W^T` for a bf16 `dX`, `X^T` for a tensor-core `dW` on `Tk`.
    B,
    /// `A` and `B`: `dZ^T` and `X^T` for a bf16 `dW`.
    Both,
}

/// How a GEMM's tensors are stored: its operands, its output, and whether every one
/// of them starts on a 16-byte boundary (as the TMA unit reads and writes them; a
/// framework's view at an odd offset does not).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Storage {
    pub operands: Dtype,
    pub output: Dtype,
    pub aligned: bool,
}

impl Storage {
    /// FP32 tensors: an FP32 model's, or widened copies.
    pub const F32: Storage = Storage { operands: Dtype::F32, output: Dtype::F32, aligned: true };

    /// A bf16 model's operands, the output in `output`.
    pub const fn bf16(output: Dtype, aligned: bool) -> Storage {
        Storage { operands: Dtype::Bf16, output, aligned }
    }

    /// A 16-bit model's operands (`operands`: bf16 or fp16), the output in `output`.
    pub const fn half(operands: Dtype, output: Dtype, aligned: bool) -> Storage {
        Storage { operands, output, aligned }
    }
}

/// The kernels of one 16-bit operand type, as typed identities: the bf16 and fp16
/// kernels are instances of the same generic bodies, so one table row names both and
/// [`HalfKernels::of`] picks by the dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HalfKernels {
    /// TMA `wgmma`: forward into FP32 (also the precision's kernel on rounded copies).
    pub tma_nt: Kernel,
    /// `tma_nt` split-K into FP32 partial products (no bias or chain): the kernel a
    /// launch of `tma_nt`'s route with `splits > 1` runs (`gemm::tma::launch_half`).
    pub tma_nt_split: Kernel,
    /// TMA `wgmma` on a 16-bit model's tensors as stored, 16-bit output: forward, `dX`, `dW`.
    pub tma_nt_to_half: Kernel,
    pub tma_nn_to_half: Kernel,
    /// `dX` at few rows: split-K's FP32 partial products ([`dx_splits`]).
    pub tma_nn: Kernel,
    pub tma_tn_to_half: Kernel,
    /// `dW` into FP32 (a folded AvgPool's weight).
    pub tma_tn: Kernel,
    /// `dW` of a few rows, 16-bit throughout ([`Family::Dot`]).
    pub outer_sum: Kernel,
    /// `dX` of a few rows on tensor cores ([`dx_tc`]): 16-bit `dX`, or FP32 partial sums
    /// over ranges of `W`'s rows.
    pub dx_tc: Kernel,
    pub dx_tc_parts: Kernel,
    /// `mma.sync` on FP32 operands rounded as loaded: `[layout][vec4, scalar]`, layouts
    /// `Nt`, `Nn`, `Tn`.
    pub mma: [[Kernel; 2]; 3],
    /// The small-batch forward, FP32 `y` and 16-bit `y`: FP32 FMAs, and tensor cores.
    pub gemv: Kernel,
    pub gemv_to_half: Kernel,
    pub gemv_tc: Kernel,
    pub gemv_tc_to_half: Kernel,
    /// The tile-wise chain backward with 16-bit `dy`, `dz`.
    pub tiles_backward: Kernel,
    /// The row-wise epilogue into 16-bit `y`, and its backward with 16-bit `dy`, `dz`
    /// (each: the entry for wide rows, the `_narrow` one).
    pub rows: [Kernel; 2],
    /// Split-K's partial products summed tile-wise into 16-bit `y`.
    pub split_tiles: Kernel,
    /// `split_tiles` without bias or chain.
    pub split_sums: Kernel,
    pub rows_backward: [Kernel; 2],
    /// A leading AvgPool's fold of a 16-bit weight, and its gradient rounded back.
    pub fold: Kernel,
    /// The fold into two 16-bit halves (`hi + lo`, the GEMM's weight in the type).
    pub fold_halves: Kernel,
    /// The same from FP32 means (a window folded in two passes).
    pub fold_f32_halves: Kernel,
    pub unfold: Kernel,
    /// The rounding transpose, the rounding and the widening.
    pub transpose_to_half: Kernel,
    pub narrow: Kernel,
    pub widen: Kernel,
    /// A BatchNorm's column kernels with 16-bit `y`, and `dy` and `dz`.
    pub batch_norm_apply: Kernel,
    pub batch_norm_backward_sums: Kernel,
    pub batch_norm_backward_dz: Kernel,
}

impl HalfKernels {
    pub const BF16: HalfKernels = HalfKernels {
        tma_nt: Kernel::GemmTmaBf16Nt,
        tma_nt_split: Kernel::GemmTmaBf16NtSplit,
        tma_nt_to_half: Kernel::GemmTmaBf16NtToBf16,
        tma_nn_to_half: Kernel::GemmTmaBf16NnToBf16,
        tma_nn: Kernel::GemmTmaBf16Nn,
        tma_tn_to_half: Kernel::GemmTmaBf16TnToBf16,
        tma_tn: Kernel::GemmTmaBf16Tn,
        outer_sum: Kernel::OuterSumBf16,
        dx_tc: Kernel::DxTcBf16,
        dx_tc_parts: Kernel::DxTcBf16Parts,
        mma: [
            [Kernel::GemmMmaBf16NtVec4, Kernel::GemmMmaBf16NtScalar],
            [Kernel::GemmMmaBf16NnVec4, Kernel::GemmMmaBf16NnScalar],
            [Kernel::GemmMmaBf16TnVec4, Kernel::GemmMmaBf16TnScalar],
        ],
        gemv: Kernel::GemvBf16,
        gemv_to_half: Kernel::GemvBf16ToBf16,
        gemv_tc: Kernel::GemvTcBf16,
        gemv_tc_to_half: Kernel::GemvTcBf16ToBf16,
        tiles_backward: Kernel::EpilogueTilesBackwardBf16,
        rows: [Kernel::EpilogueRowsBf16, Kernel::EpilogueRowsNarrowBf16],
        split_tiles: Kernel::EpilogueSplitTilesBf16,
        split_sums: Kernel::SplitSumsBf16,
        rows_backward: [Kernel::EpilogueRowsBackwardBf16, Kernel::EpilogueRowsBackwardNarrowBf16],
        fold: Kernel::FoldRowsMeanBf16,
        fold_halves: Kernel::FoldRowsMeanHalvesBf16,
        fold_f32_halves: Kernel::FoldRowsMeanF32HalvesBf16,
        unfold: Kernel::UnfoldRowsMeanGradToBf16,
        transpose_to_half: Kernel::TransposeVec4ToBf16,
        narrow: Kernel::F32ToBf16,
        widen: Kernel::Bf16ToF32,
        batch_norm_apply: Kernel::BatchNormApplyBf16,
        batch_norm_backward_sums: Kernel::BatchNormBackwardSumsBf16,
        batch_norm_backward_dz: Kernel::BatchNormBackwardDzBf16,
    };

    pub const F16: HalfKernels = HalfKernels {
        tma_nt: Kernel::GemmTmaF16Nt,
        tma_nt_split: Kernel::GemmTmaF16NtSplit,
        tma_nt_to_half: Kernel::GemmTmaF16NtToF16,
        tma_nn_to_half: Kernel::GemmTmaF16NnToF16,
        tma_nn: Kernel::GemmTmaF16Nn,
        tma_tn_to_half: Kernel::GemmTmaF16TnToF16,
        tma_tn: Kernel::GemmTmaF16Tn,
        outer_sum: Kernel::OuterSumF16,
        dx_tc: Kernel::DxTcF16,
        dx_tc_parts: Kernel::DxTcF16Parts,
        mma: [
            [Kernel::GemmMmaF16NtVec4, Kernel::GemmMmaF16NtScalar],
            [Kernel::GemmMmaF16NnVec4, Kernel::GemmMmaF16NnScalar],
            [Kernel::GemmMmaF16TnVec4, Kernel::GemmMmaF16TnScalar],
        ],
        gemv: Kernel::GemvF16,
        gemv_to_half: Kernel::GemvF16ToF16,
        gemv_tc: Kernel::GemvTcF16,
        gemv_tc_to_half: Kernel::GemvTcF16ToF16,
        tiles_backward: Kernel::EpilogueTilesBackwardF16,
        rows: [Kernel::EpilogueRowsF16, Kernel::EpilogueRowsNarrowF16],
        split_tiles: Kernel::EpilogueSplitTilesF16,
        split_sums: Kernel::SplitSumsF16,
        rows_backward: [Kernel::EpilogueRowsBackwardF16, Kernel::EpilogueRowsBackwardNarrowF16],
        fold: Kernel::FoldRowsMeanF16,
        fold_halves: Kernel::FoldRowsMeanHalvesF16,
        fold_f32_halves: Kernel::FoldRowsMeanF32HalvesF16,
        unfold: Kernel::UnfoldRowsMeanGradToF16,
        transpose_to_half: Kernel::TransposeVec4ToF16,
        narrow: Kernel::F32ToF16,
        widen: Kernel::F16ToF32,
        batch_norm_apply: Kernel::BatchNormApplyF16,
        batch_norm_backward_sums: Kernel::BatchNormBackwardSumsF16,
        batch_norm_backward_dz: Kernel::BatchNormBackwardDzF16,
    };

    /// The kernels of a 16-bit `dtype` (`None` for FP32).
    pub const fn of(dtype: Dtype) -> Option<&'static HalfKernels> {
        match dtype {
            Dtype::F32 => None,
            Dtype::Bf16 => Some(&HalfKernels::BF16),
            Dtype::F16 => Some(&HalfKernels::F16),
        }
    }

    /// The kernels of a 16-bit precision's operands (`None` for the others).
    pub const fn of_precision(precision: Precision) -> Option<&'static HalfKernels> {
        match precision {
            Precision::Bf16 => Some(&HalfKernels::BF16),
            Precision::Fp16 => Some(&HalfKernels::F16),
            Precision::Fp32 | Precision::Tf32 | Precision::Tf32x3 | Precision::Fp8 | Precision::Fp8GwBf16 => None,
        }
    }
}

/// How one GEMM runs: its family and kernel, the layout the kernel reads, what is
/// transposed first, whether the kernel stores `y^T`, and whether bf16 operands are
/// widened to FP32 copies first (and the output rounded after).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Route {
    pub family: Family,
    pub kernel: Kernel,
    pub layout: Layout,
    pub transposed: Transposed,
    /// The kernel stores `y^T (n, m)` (`dX` through `dX^T = W^T dZ^T`).
    pub transpose_y: bool,
    /// The operands are bf16 but no kernel here reads them as stored: the route is
    /// that of FP32 tensors, run on widened copies.
    pub widened: bool,
}

/// The kernel a launch of `kernel` over `splits` ranges of `k` runs: a 16-bit forward's
/// split twin ([`HalfKernels::tma_nt_split`]) where it splits, else `kernel` itself.
pub fn split_kernel(kernel: Kernel, splits: usize) -> Kernel {
    match [HalfKernels::BF16, HalfKernels::F16].into_iter().find(|h| h.tma_nt == kernel) {
        Some(h) if splits > 1 => h.tma_nt_split,
        _ => kernel,
    }
}

/// The largest `W` (values) whose `dX` of 2 to `OUTER_MAX_RANK` rows takes `W`'s rows
/// weighted by `dZ` (`column_dots*`) rather than a GEMM; one row's takes them from any
/// `W` ([`dot_dx`]). Measured on the H200 (2026-11-29, graph training step of a swish
/// chain): at 1024^2 one row's step 0.0325 -> 0.0294 ms (bf16) and 0.0326 -> 0.0292
/// (TF32), eight rows level to 3% faster; at 8 x 8192^2 slower by up to 23%: eight rows'
/// `column_dots_bf16` take 0.082 ms over 8192^2 where the TMA GEMM takes 0.047.
pub const DOT_DX_MAX_WEIGHTS: usize = 1 << 20;

/// Whether `dX` of `rows` rows from an `(n, k)` `W` runs as `W`'s rows weighted by `dZ`
/// ([`Family::Dot`]). One row from any `W`: `column_dot` streams it at the GEMM's rate
/// or faster (1 x 8192^2: bf16 0.041 against the TMA GEMM's 0.046 ms, TF32 0.076 against
/// 0.091; H200), and its ranges' sum is one short kernel (`split_sums`' one-row form).
/// 2 to `OUTER_MAX_RANK` rows from a `W` of at most [`DOT_DX_MAX_WEIGHTS`] values.
pub fn dot_dx(rows: usize, n: usize, k: usize) -> bool {
    rows == 1 || ((2..=OUTER_MAX_RANK).contains(&rows) && n * k <= DOT_DX_MAX_WEIGHTS)
}

/// The largest `W` (values) whose `dX` of one row runs on [`dx_tc`]'s kernel; 2-8 rows
/// take it from any `W`. Measured on the H200 (2026-11-29, graph training step of a
/// bf16 model, M1's chain, against `column_dot*` and the TMA GEMM in the same calls):
/// 2-8 rows 5-14% faster at 1024^2, 1024 x 4096 and 4096^2 (8 x 4096^2: `dx_tc_bf16`
/// 0.0143 ms where the TMA GEMM took 0.0160 and its ranges' sum 0.0021) and level to 4%
/// faster at 8192^2 (the step's `dW` streams beside it); one row 0.4-4.9% faster up to
/// 4096^2, but 1.6-2.4% slower at 8192^2, where `column_dot`'s 256-column blocks stream
/// `W` at ~3.3 TB/s and these 32-column slabs at ~2.5 (blocks of eight slabs side by
/// side reached ~2.9 TB/s and made no step faster: not kept).
pub const DX_TC_ONE_ROW_MAX_WEIGHTS: usize = 1 << 25;

/// Whether `dX` of `rows` rows from an `(n, k)` `W` runs on the tensor cores
/// (`dx_tc_*`, launcher [`super::dot::weighted_rows`]): a 16-bit model's `dZ` and `W`
/// as stored with a 16-bit `dX`, 16-byte aligned, rows of whole 16-byte chunks (`n` and
/// `k` multiples of 8), at most `OUTER_MAX_RANK` rows (one `n8` fragment; one row up to
/// [`DX_TC_ONE_ROW_MAX_WEIGHTS`] weights): one stream of `W` like the small-batch
/// forward's, where the FP32 sums of `column_dots*` were compute-bound beyond
/// [`DOT_DX_MAX_WEIGHTS`].
pub fn dx_tc((rows, n, k): (usize, usize, usize), storage: Storage) -> bool {
    HalfKernels::of(storage.operands).is_some()
        && storage.output == storage.operands
        && storage.aligned
        && (1..=OUTER_MAX_RANK).contains(&rows)
        && n > 0
        && k > 0
        && n.is_multiple_of(8)
        && k.is_multiple_of(8)
        && (rows > 1 || n * k <= DX_TC_ONE_ROW_MAX_WEIGHTS)
}

/// The dispatch table: the route of `role` in `precision` for a Linear layer of
/// `(m, n, k)` (batch, out, in features) over tensors stored as `storage` says. `tma`:
/// whether the TMA kernels may run ([`Tuning::tma`](crate::gpu::Tuning::tma)); without
/// them a TMA row is skipped and the next row that fits runs.
///
/// Before the tables, a batch of at most `OUTER_MAX_RANK` rows (FP32 tensors in FP32,
/// TF32 or 3xTF32; 16-bit tensors with a 16-bit output): `dW` is the rows' outer
/// products (`outer`, `outer_sum_*`), and `dX` where [`dx_tc`] or [`dot_dx`] says `W`'s
/// rows weighted by `dZ` (a 16-bit model's on tensor cores, `dx_tc_*`; else `column_dot*`
/// for one row, `column_dots*` for more), FP32 sums ([`Family::Dot`]).
///
/// A bf16 model's tensors (bf16 operands) are read as stored where the shapes give
/// 16-byte rows (multiples of 8 values: `k` for the forward, `n` and `k` for `dX` and
/// `dW`), every tensor is 16-byte aligned, and a kernel writes the output's dtype (a
/// bf16 output by TMA needs `n % 8 == 0` too and no split-K; `dX` has no FP32-output
/// kernel):
///
/// | role | operands | output | kernel | layout |
/// |------|----------|--------|--------|--------|
/// | forward | `x`, `W` | bf16 (the fused block) | `gemm_tma_bf16_nt_to_bf16` | `Nt` |
/// | | | FP32 (`z` before the row-wise epilogue, or split-K's partial products) | `gemm_tma_bf16_nt` | `Nt` |
/// | `dX` | `dZ`, `W` | bf16 | `gemm_tma_bf16_nn_to_bf16` | `Nn` |
/// | `dW` | `dZ`, `X` | bf16, or FP32 | `gemm_tma_bf16_tn_to_bf16`, `gemm_tma_bf16_tn` | `Tn` |
///
/// Otherwise the route is FP32 tensors' below, `widened`. FP32 tensors, the first row
/// that fits wins:
///
/// | role | precision | when | family: kernel | operands |
/// |------|-----------|------|----------------|----------|
/// | forward | tf32, tf32x3 | `k % 4 == 0`, `k >= MIN_K` | TMA: `gemm_tma_{p}_nt` | `x`, `W` as stored (`Nt`) |
/// | | bf16 | `k % 8 == 0`, `k >= MIN_K` | TMA: `gemm_tma_bf16_nt` | bf16 copies of `x`, `W` |
/// | | tf32, tf32x3 | `k % 4 == 0` | wgmma: `gemm_wgmma_{p}_nt_vec4` | as stored |
/// | | fp32 | always | FMA: `gemm_fma_nt_{vec4,scalar}` | as stored |
/// | | tf32, tf32x3, bf16 | otherwise | mma.sync: `gemm_mma_{p}_nt_{vec4,scalar}` | as stored |
/// | `dX` | tf32, tf32x3 | `n, k % 4 == 0`, `n >= MIN_K` | TMA: `gemm_tma_{p}_tk_t` | `dX^T = W^T dZ^T`, `W`, `dZ` as stored (`Tk`) |
/// | | tf32, tf32x3 | `n, k % 4 == 0` | wgmma: `gemm_wgmma_{p}_dx_vec4` | the same |
/// | | bf16 | `n % 8 == 0`, `n >= MIN_K` | TMA: `gemm_tma_bf16_nt` | `dZ`, `W^T` (transposed and rounded) |
/// | | fp32 | always | FMA: `gemm_fma_nn_{vec4,scalar}` | `dZ`, `W` as stored (`Nn`) |
/// | | tf32, tf32x3, bf16 | otherwise | mma.sync: `gemm_mma_{p}_nn_{vec4,scalar}` | the same |
/// | `dW` | tf32, tf32x3 | `m, n % 4 == 0`, `m >= MIN_K` | TMA: `gemm_tma_{p}_tk` | `dZ` as stored, `X^T` (`Tk`) |
/// | | tf32, tf32x3 | `m, n % 4 == 0` | wgmma: `gemm_wgmma_{p}_dw_vec4` | the same |
/// | | bf16 | `m % 8 == 0`, `m >= MIN_K` | TMA: `gemm_tma_bf16_nt` | `dZ^T`, `X^T` (transposed and rounded) |
/// | | fp32 | always | FMA: `gemm_fma_tn_{vec4,scalar}` | `dZ`, `X` as stored (`Tn`) |
/// | | tf32, tf32x3, bf16 | otherwise | mma.sync: `gemm_mma_{p}_tn_{vec4,scalar}` | the same |
///
/// `vec4` (16-byte loads) where both operands' row pitches are multiples of 4 floats:
/// `k` for the forward, `n` and `k` for `Nn` and `Tn`. The TMA kernels want 16-byte
/// row pitches (4 floats, or 8 values of the bf16 copies) and take the epilogue
/// between a tile's k-loops with the tensor cores idle, hence `MIN_K` (measured at
/// 1024 and 8192; `kernel_abi::gemm_tma::MIN_K`). The backward's bf16 GEMMs run as
/// `Nt` after transposing, since the bf16 TMA kernel reads `k`-contiguous rows only.
pub fn route(precision: Precision, role: Role, dims: (usize, usize, usize), storage: Storage, tma: bool) -> Route {
    // `dW` of a few rows: a tile GEMM as deep as the batch fills a whole tile's pipeline
    // for each `128 x 256` of `dW` (TF32 at one row of 8192^2: 0.141 ms where writing
    // the 256 MB takes ~0.06). FP32 sums: as exact as 3xTF32's, exacter than TF32's.
    // `dX` of one row, or as few as `dW`'s from a small `W`: one pass over `W` ([`dot_dx`]).
    let tc = role == Role::GradInput && dx_tc(dims, storage);
    let dot = match role {
        Role::GradWeight if (1..=OUTER_MAX_RANK).contains(&dims.0) => Some(Layout::Tn),
        Role::GradInput if tc || dot_dx(dims.0, dims.1, dims.2) => Some(Layout::Nn),
        _ => None,
    };
    if let Some(layout) = dot {
        let kernels = |dtype| (dot_kernels(dtype), HalfKernels::of(dtype));
        let pick = |(d, h): (DotKernels, Option<&HalfKernels>)| match layout {
            Layout::Tn => h.map_or(Kernel::Outer, |h| h.outer_sum),
            _ if tc => h.map_or(d.column_dots, |h| h.dx_tc),
            _ if dims.0 == 1 => d.column_dot,
            _ => d.column_dots,
        };
        match HalfKernels::of(storage.operands) {
            Some(_) if storage.output == storage.operands => {
                return Route::dot(pick(kernels(storage.operands)), layout);
            }
            None if matches!(precision, Precision::Fp32 | Precision::Tf32 | Precision::Tf32x3) => {
                return Route::dot(pick(kernels(Dtype::F32)), layout);
            }
            _ => {}
        }
    }
    if let Some(kernels) = HalfKernels::of(storage.operands) {
        return match half_as_stored(kernels, role, dims, storage, tma) {
            Some((kernel, layout)) => Route { layout, ..Route::tma(layout, kernel) },
            None => Route { widened: true, ..f32_route(precision, role, dims, tma) },
        };
    }
    f32_route(precision, role, dims, tma)
}

/// The kernel reading a 16-bit model's tensors as stored, and its layout, if one fits.
fn half_as_stored(
    kernels: &HalfKernels,
    role: Role,
    (m, n, k): (usize, usize, usize),
    storage: Storage,
    tma: bool,
) -> Option<(Kernel, Layout)> {
    let rows16 = |dims: &[usize]| dims.iter().all(|d| d.is_multiple_of(8));
    if !tma || !storage.aligned || [m, n, k].contains(&0) {
        return None;
    }
    let half_out = storage.output == storage.operands;
    match role {
        Role::Forward { splits } if rows16(&[k]) => match half_out {
            true if splits <= 1 && rows16(&[n]) => Some((kernels.tma_nt_to_half, Layout::Nt)),
            true => None,
            false => Some((kernels.tma_nt, Layout::Nt)),
        },
        Role::GradInput if half_out && rows16(&[n, k]) => Some((kernels.tma_nn_to_half, Layout::Nn)),
        Role::GradWeight if rows16(&[n, k]) => {
            Some((if half_out { kernels.tma_tn_to_half } else { kernels.tma_tn }, Layout::Tn))
        }
        _ => None,
    }
}

/// The table's rows for FP32 tensors.
fn f32_route(precision: Precision, role: Role, (m, n, k): (usize, usize, usize), tma: bool) -> Route {
    use Precision::{Tf32, Tf32x3};
    // FP8: one kernel, over `k`-major e4m3 copies quantised by `gemm::fp8` (`dX`'s `W`
    // and `dW`'s two operands transposed as they are quantised).
    match (precision, role) {
        (Precision::Fp8, Role::GradWeight) => {
            return Route { transposed: Transposed::Both, ..Route::tma(Layout::Nt, Kernel::GemmTmaE4m3Nt) };
        }
        (Precision::Fp8 | Precision::Fp8GwBf16, Role::GradInput) => {
            return Route { transposed: Transposed::B, ..Route::tma(Layout::Nt, Kernel::GemmTmaE4m3Nt) };
        }
        (Precision::Fp8 | Precision::Fp8GwBf16, Role::Forward { .. }) => {
            return Route::tma(Layout::Nt, Kernel::GemmTmaE4m3Nt);
        }
        (Precision::Fp8GwBf16, Role::GradWeight) => return f32_route(Precision::Bf16, role, (m, n, k), tma),
        _ => {}
    }
    let split = precision == Tf32x3;
    let half = HalfKernels::of_precision(precision);
    let fits = |dims: &[usize], by: usize| dims.iter().all(|d| d.is_multiple_of(by));
    // The TMA kernels: allowed, a deep enough reduction.
    let deep = |depth: usize| tma && depth >= MIN_K;
    match (role, precision) {
        // (TF32's split-K into partial products: `gemm_wgmma`, faster there; `tma_plan`.)
        (Role::Forward { splits }, Tf32 | Tf32x3) if fits(&[k], 4) && deep(k) && (split || splits <= 1) => {
            Route::tma(Layout::Nt, if split { Kernel::GemmTmaTf32x3Nt } else { Kernel::GemmTmaTf32Nt })
        }
        (Role::Forward { .. }, _) if half.is_some() && fits(&[k], 8) && deep(k) => {
            Route::tma(Layout::Nt, half.map_or(Kernel::GemmTmaBf16Nt, |h| h.tma_nt))
        }
        (Role::Forward { .. }, Tf32 | Tf32x3) if fits(&[k], 4) => {
            Route::wgmma(Layout::Nt, if split { Kernel::GemmWgmmaTf32x3NtVec4 } else { Kernel::GemmWgmmaTf32NtVec4 })
        }
        (Role::Forward { .. }, _) => Route::grid(precision, Stored::Nt, fits(&[k], 4)),

        (Role::GradInput, Tf32 | Tf32x3) if fits(&[n, k], 4) && deep(n) => Route {
            transpose_y: true,
            ..Route::tma(Layout::Tk, if split { Kernel::GemmTmaTf32x3TkT } else { Kernel::GemmTmaTf32TkT })
        },
        (Role::GradInput, Tf32 | Tf32x3) if fits(&[n, k], 4) => Route {
            transpose_y: true,
            ..Route::wgmma(Layout::Tk, if split { Kernel::GemmWgmmaTf32x3DxVec4 } else { Kernel::GemmWgmmaTf32DxVec4 })
        },
        (Role::GradInput, _) if half.is_some() && fits(&[n], 8) && deep(n) => Route {
            transposed: Transposed::B,
            ..Route::tma(Layout::Nt, half.map_or(Kernel::GemmTmaBf16Nt, |h| h.tma_nt))
        },
        (Role::GradInput, _) => Route::grid(precision, Stored::Nn, fits(&[n, k], 4)),

        (Role::GradWeight, Tf32 | Tf32x3) if fits(&[m, n], 4) && deep(m) => Route {
            transposed: Transposed::B,
            ..Route::tma(Layout::Tk, if split { Kernel::GemmTmaTf32x3Tk } else { Kernel::GemmTmaTf32Tk })
        },
        (Role::GradWeight, Tf32 | Tf32x3) if fits(&[m, n], 4) => Route {
            transposed: Transposed::B,
            ..Route::wgmma(Layout::Tk, if split { Kernel::GemmWgmmaTf32x3DwVec4 } else { Kernel::GemmWgmmaTf32DwVec4 })
        },
        (Role::GradWeight, _) if half.is_some() && fits(&[m], 8) && deep(m) => Route {
            transposed: Transposed::Both,
            ..Route::tma(Layout::Nt, half.map_or(Kernel::GemmTmaBf16Nt, |h| h.tma_nt))
        },
        (Role::GradWeight, _) => Route::grid(precision, Stored::Tn, fits(&[n, k], 4)),
    }
}

/// The layouts the FMA and `mma.sync` kernels read (`Tk` is `wgmma`'s alone), in the
/// order of [`HalfKernels::mma`].
#[derive(Clone, Copy)]
enum Stored {
    Nt,
    Nn,
    Tn,
}

impl Route {
    /// A TMA kernel reading its operands as stored (also: the bf16 kernel on rounded
    /// copies the launcher makes).
    pub fn tma(layout: Layout, kernel: Kernel) -> Route {
        Route {
            family: Family::Tma,
            kernel,
            layout,
            transposed: Transposed::Nothing,
            transpose_y: false,
            widened: false,
        }
    }

    /// A `dot.rs` kernel over its operands as stored: `outer*` for `dW` (`Tn`),
    /// `column_dot*` for `dX` (`Nn`).
    fn dot(kernel: Kernel, layout: Layout) -> Route {
        Route {
            family: Family::Dot,
            kernel,
            layout,
            transposed: Transposed::Nothing,
            transpose_y: false,
            widened: false,
        }
    }

    fn wgmma(layout: Layout, kernel: Kernel) -> Route {
        Route {
            family: Family::Wgmma,
            kernel,
            layout,
            transposed: Transposed::Nothing,
            transpose_y: false,
            widened: false,
        }
    }

    /// The FMA kernel (FP32) or the `mma.sync` one (the tensor-core precisions) for a
    /// layout, with 16-byte loads where `vec4`.
    fn grid(precision: Precision, stored: Stored, vec4: bool) -> Route {
        use Kernel::*;
        use Stored::{Nn, Nt, Tn};
        let pick = |v: Kernel, s: Kernel| if vec4 { v } else { s };
        let kernel = match (precision, stored) {
            (Precision::Fp32, Nt) => pick(GemmFmaNtVec4, GemmFmaNtScalar),
            (Precision::Fp32, Nn) => pick(GemmFmaNnVec4, GemmFmaNnScalar),
            (Precision::Fp32, Tn) => pick(GemmFmaTnVec4, GemmFmaTnScalar),
            (Precision::Tf32, Nt) => pick(GemmMmaTf32NtVec4, GemmMmaTf32NtScalar),
            (Precision::Tf32, Nn) => pick(GemmMmaTf32NnVec4, GemmMmaTf32NnScalar),
            (Precision::Tf32, Tn) => pick(GemmMmaTf32TnVec4, GemmMmaTf32TnScalar),
            (Precision::Tf32x3, Nt) => pick(GemmMmaTf32x3NtVec4, GemmMmaTf32x3NtScalar),
            (Precision::Tf32x3, Nn) => pick(GemmMmaTf32x3NnVec4, GemmMmaTf32x3NnScalar),
            (Precision::Tf32x3, Tn) => pick(GemmMmaTf32x3TnVec4, GemmMmaTf32x3TnScalar),
            // Never chosen: FP8's GEMMs route to `gemm_tma_e4m3_nt` (`f32_route`) on every
            // shape; the arms keep the table whole.
            (Precision::Fp8 | Precision::Fp8GwBf16, Nt) => pick(GemmFmaNtVec4, GemmFmaNtScalar),
            (Precision::Fp8 | Precision::Fp8GwBf16, Nn) => pick(GemmFmaNnVec4, GemmFmaNnScalar),
            (Precision::Fp8 | Precision::Fp8GwBf16, Tn) => pick(GemmFmaTnVec4, GemmFmaTnScalar),
            (Precision::Bf16 | Precision::Fp16, _) => {
                let half = HalfKernels::of_precision(precision).map_or(&HalfKernels::BF16, |h| h);
                let [v, s] = half.mma[stored as usize];
                pick(v, s)
            }
        };
        let family = if matches!(precision, Precision::Fp32 | Precision::Fp8 | Precision::Fp8GwBf16) {
            Family::Fma
        } else {
            Family::Mma
        };
        let layout = match stored {
            Nt => Layout::Nt,
            Nn => Layout::Nn,
            Tn => Layout::Tn,
        };
        Route { family, kernel, layout, transposed: Transposed::Nothing, transpose_y: false, widened: false }
    }
}

/// Which kernels run a block's forward for one batch size.
#[derive(Clone, Debug, PartialEq)]
pub enum Plan {
    /// One kernel: the GEMM with bias and chain in its store.
    Fused,
    /// The GEMM into `z` (in `splits` partial products where `splits > 1`), then the
    /// row-wise epilogue (split-K's sums of a fusable chain: tile-wise, [`split_sums`]).
    GemmThenRows { splits: usize },
    /// A few rows: a small-batch kernel, with the chain on its slabs (`chain`), or
    /// storing `z` for the row-wise epilogue; on the tensor cores (`gemv_tc_*`,
    /// `tensor_cores`) or FP32 FMAs (`gemv_*`).
    Gemv { chain: bool, tensor_cores: bool },
    /// A chain that reduces each row once ([`row_partials_at`]): the TMA GEMM runs the
    /// ops before the reduction and stores each half tile's row partials (two floats a
    /// row, `kernel_abi::epilogue::row_partials`), `row_partials_finish` adds them up and
    /// runs the ops after it. Neither writes `z` unless the caller saves it.
    RowPartials,
    /// One output column (a layer of one output feature, or folded to one by a whole
    /// row's sum or mean, [`fold`]): a dot product per row of `x` with the weight (its
    /// FP32 means where folded) into `z`, then the bias and chain as after split-K
    /// ([`split_sums`]).
    RowDot,
}

/// The small-batch kernel reading `operands` and writing `output` (`z`, or `y` before
/// rounding, where FP32 for 16-bit operands):
///
/// | operands | precision | `tensor_cores` | kernel |
/// |----------|-----------|----------------|--------|
/// | bf16 (a bf16 model's, as stored) | bf16 | yes | `gemv_tc_bf16`, `gemv_tc_bf16_to_bf16` (`mma.sync` `m16n8k16`) |
/// | | | no | `gemv_bf16`, `gemv_bf16_to_bf16` (FP32 FMAs) |
/// | fp16 (an fp16 model's) | fp16 | yes | `gemv_tc_f16`, `gemv_tc_f16_to_f16` (`m16n8k16`) |
/// | | | no | `gemv_f16`, `gemv_f16_to_f16` (FP32 FMAs) |
/// | FP32 | tf32 | yes | `gemv_tc_tf32` (`m16n8k8`) |
/// | | any | no | `gemv_f32` (FP32 FMAs; strict FP32, 3xTF32, FP32 models at bf16 precision) |
///
/// [`plan`] sets `tensor_cores` only where a tensor-core kernel exists
/// ([`Forward::gemv_tc`]).
pub fn gemv_kernel(operands: Dtype, output: Dtype, precision: Precision, tensor_cores: bool) -> Kernel {
    match (operands, output, tensor_cores, precision) {
        (Dtype::Bf16 | Dtype::F16, _, tensor_cores, _) => {
            let h = HalfKernels::of(operands).expect("a 16-bit dtype");
            match (output == operands, tensor_cores) {
                (true, true) => h.gemv_tc_to_half,
                (false, true) => h.gemv_tc,
                (true, false) => h.gemv_to_half,
                (false, false) => h.gemv,
            }
        }
        (Dtype::F32, _, true, Precision::Tf32) => Kernel::GemvTcTf32,
        (Dtype::F32, ..) => Kernel::GemvF32,
    }
}

/// Whether a tensor-core small-batch kernel serves a block whose tensors are `dtype`
/// at `precision`: a bf16 or fp16 model's (as stored), or FP32 tensors in TF32. Strict FP32 and
/// 3xTF32 stay on FP32 FMAs: a 3xTF32 tensor-core form measured 1.5e-4 from float64 on
/// a one-row `hardtanh,mean` (a mean's cancellation over 1000 values; H100, 2026-11-27),
/// beyond the 1e-4 that 3xTF32 promises, where the FMAs are FP32's own rounding. FP32
/// tensors at bf16 precision (operands rounded per call) have no such kernel.
pub fn gemv_tc_serves(dtype: Dtype, precision: Precision) -> bool {
    match dtype {
        Dtype::Bf16 | Dtype::F16 => true,
        Dtype::F32 => precision == Precision::Tf32,
    }
}

/// Whether the tensor-core small-batch kernel beats the tile GEMMs at `rows x k x n` on
/// `sms` multiprocessors, by the measurements behind [`GEMV_TC_ROWS`]: it owns `n / 32`
/// columns per block (`SLAB`), two blocks per SM up to 24 rows (its shared memory,
/// `16 KB x (4 + rows / 8)`), one above. So
/// - its blocks must run in one wave: at 32 rows of `n` = 8192 (256 blocks, one per SM)
///   it took 1.08x the tiles' time in bf16 and 1.24x in TF32 (1024 x 8192), where at 24
///   it was 0.77-1.00x;
/// - with fewer blocks than a quarter of the SMs, each streams a deep `k` alone: at
///   `n` = 1024 and `k` = 8192 it took 1.35-1.78x (bf16) and 1.93-2.18x (TF32) the
///   tiles' time at every row count; at `k` = 1024 0.65-0.96x.
pub fn gemv_tc_wins(rows: usize, k: usize, n: usize, sms: usize) -> bool {
    let blocks = n.div_ceil(GEMV_SLAB);
    use kernel_abi::epilogue::{SM90_SHARED_PER_SM, SM90_SHARED_RESERVED_PER_BLOCK};
    let block_bytes = kernel_abi::gemv_tc::smem_bytes(rows) + SM90_SHARED_RESERVED_PER_BLOCK;
    let per_sm = if 2 * block_bytes <= SM90_SHARED_PER_SM { 2 } else { 1 };
    rows <= GEMV_TC_ROWS && blocks <= per_sm * sms && !(4 * blocks < sms && k >= 4096)
}

/// Whether the small-batch kernel can run the chain `ops` on its slabs of
/// `gemv::SLAB` columns (the GEMM's `n` columns in): per-element ops and GroupNorms
/// whose groups lie inside a slab, `n` a whole number of slabs. Else the chain needs
/// whole rows (or wider groups), and runs in the row-wise epilogue after `z`.
pub fn gemv_chain_fits(ops: &[Op], n: usize) -> bool {
    n.is_multiple_of(GEMV_SLAB)
        && ops.iter().all(|op| match *op {
            Op::Pointwise(..) => true,
            Op::GroupNorm { groups, .. } => GEMV_SLAB.is_multiple_of(n / groups),
            _ => false,
        })
}

/// How a block holds a folded AvgPool's weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FoldedAs {
    /// FP32 means: the FP32 kernels' operand (a 16-bit model's forward then runs
    /// 3xTF32 on a widened `x`).
    Means,
    /// A 16-bit model's means as two halves in its type: two GEMMs on `x` as stored,
    /// each split-K range's sums beside the other's for the second kernel.
    Halves,
}

/// A block's forward as [`plan`] sees it.
#[derive(Clone, Copy, Debug)]
pub struct Forward {
    pub batch: usize,
    /// The GEMM's width (after a folded AvgPool) and depth.
    pub n: usize,
    pub k: usize,
    /// The model's tensors: a bf16 model's forward reads them as stored where
    /// [`route`] allows.
    pub dtype: Dtype,
    /// The weight is a folded AvgPool's, held as [`FoldedAs`] says.
    pub folded: Option<FoldedAs>,
    /// Some op of the chain cannot ride in the GEMM's store ([`not_fusable`]).
    pub fusable: bool,
    /// The chain runs on the small-batch kernel's slabs ([`gemv_chain_fits`]).
    pub gemv_chain: bool,
    /// `W` starts on a 16-byte boundary (the small-batch kernel reads it by vectors).
    pub w_aligned: bool,
    /// The row-wise epilogue can take rows of `n` on this GPU ([`rows_fit`]).
    pub rows_fit: bool,
    /// The small-batch kernels may run ([`Tuning::gemv`](crate::gpu::Tuning::gemv)).
    pub gemv: bool,
    /// A tensor-core small-batch kernel serves this block ([`gemv_tc_serves`]) and may
    /// run ([`Tuning::gemv_tensor_cores`](crate::gpu::Tuning::gemv_tensor_cores)).
    pub gemv_tc: bool,
    /// The GEMM is FP8 (`gemm_tma_e4m3_*`): no small-batch kernel or split-K takes it.
    pub fp8: bool,
    /// The GEMMs' arithmetic for FP32 tensors (a 16-bit model's is its type's).
    pub precision: Precision,
    /// A split count forced by the tuning ([`Tuning::split_k`](crate::gpu::Tuning::split_k)).
    pub split_k: Option<usize>,
    /// The chain has a BatchNorm: its own kernels run the forward (`gpu/batch_norm.rs`).
    pub batch_norm: bool,
    /// The chain reduces each row once, after ops the GEMM's epilogue runs and before
    /// per-element ones ([`row_partials_at`]).
    pub row_partials: bool,
}

/// Where `ops` (the kernels' chain, op `i` seeing `features(i)` features) reduce each row
/// once in a way the TMA GEMM can start: ops the fused epilogue runs ([`not_fusable`]),
/// then a row `max`, `min`, `sum`, `mean` or `logsumexp`, then per-element ops only.
/// Returns the reduction's index.
pub fn row_partials_at(ops: &[Op], features: impl Fn(usize) -> usize) -> Option<usize> {
    let at = (0..ops.len()).find(|&i| not_fusable(&ops[i], features(i)).is_some())?;
    let reduces = matches!(ops[at], Op::RowMax | Op::Reduce(_));
    let tail_pointwise = ops[at + 1..].iter().all(|op| matches!(op, Op::Pointwise(..)));
    (reduces && tail_pointwise).then_some(at)
}

/// Whether the row-wise epilogue's forward takes rows of `n` features with `smem_optin`
/// bytes of shared memory per block.
pub fn rows_fit(n: usize, smem_optin: usize) -> bool {
    kernel_abi::epilogue::row_smem_bytes(n) <= smem_optin
}

/// A reduction of the Linear layer's features that the GPU folds into its weight: a
/// leading `avgpool(k)`, or a leading row `sum` or `mean` after per-feature `bias` ops
/// and then constant scalings (`scale(s)`, `double`), pooled over the whole row.
/// Averaging outputs of a Linear layer is the Linear layer of the averaged weight rows
/// and bias (exact algebra); a `bias` op right after the Linear adds to its bias, and a
/// scaling commutes with the mean, so the GEMM shrinks `pool` times: KernelBench 14's
/// `(x W^T / 2).sum(1) * s` and 51's `(x W^T + b - p).mean(1)` become one dot product
/// per row.
#[derive(Clone, Debug, PartialEq)]
pub struct Fold {
    /// Outputs averaged into one.
    pub pool: usize,
    /// The chain's first op the kernels run after the fold.
    pub first_op: usize,
    /// Ops the kernels run on the pooled values before `first_op`'s: the scalings moved
    /// after the mean, and for a `sum` a scaling by the row's width.
    pub before: Vec<Op>,
    /// The chain's leading `bias` ops, folded with the Linear's bias (their parameters'
    /// gradients are the bias's).
    pub biases: usize,
}

/// The fold of `spec`'s chain, if it starts with one ([`Fold`]).
pub fn fold(spec: &crate::BlockSpec) -> Option<Fold> {
    use kernel_abi::ops::Pointwise;
    let ops = &spec.chain.0;
    if let Some(&Op::AvgPool(pool)) = ops.first() {
        return Some(Fold { pool, first_op: 1, before: Vec::new(), biases: 0 });
    }
    let biases = ops.iter().take_while(|op| matches!(op, Op::Pointwise(Pointwise::Bias, _))).count();
    let scalings = ops[biases..].iter().take_while(|op| matches!(op, Op::Pointwise(Pointwise::Scale, _))).count();
    let n = spec.out_features;
    let mut before = ops[biases..biases + scalings].to_vec();
    match ops.get(biases + scalings) {
        Some(Op::Reduce(crate::chain::Reduce::Mean)) => {}
        Some(Op::Reduce(crate::chain::Reduce::Sum)) => before.push(Op::Pointwise(Pointwise::Scale, [n as f32, 0.0])),
        _ => return None,
    }
    Some(Fold { pool: n, first_op: biases + scalings + 1, before, biases })
}

/// The width of the GEMM the GPU runs for `spec`: its features out, or fewer after a [`fold`].
pub fn gemm_width(spec: &crate::BlockSpec) -> usize {
    fold(spec).map_or(spec.out_features, |f| spec.out_features / f.pool)
}

/// Why the GPU cannot run `spec`'s chain forward and backward, if it cannot: an op
/// that needs whole rows ([`not_fusable`]) over rows wider than the row-wise kernels
/// take (`max_row_features`, for sm_90's shared memory). `fuse()` leaves such chains
/// to PyTorch; the CPU backend has no such limit.
pub fn rows_too_wide(spec: &crate::BlockSpec) -> Option<String> {
    let first = fold(spec).map_or(0, |f| f.first_op);
    let n = spec.features_at(first);
    let limit = kernel_abi::epilogue::max_row_features(true);
    let op = spec
        .chain
        .0
        .iter()
        .enumerate()
        .skip(first)
        .find_map(|(i, op)| not_fusable(op, spec.features_at(i)).map(|_| op))?;
    (n > limit).then(|| {
        format!("`{op}` needs whole rows, and rows of {n} features exceed the row-wise kernels' {limit} on sm_90")
    })
}

/// The plan of a forward on a GPU of `sms` multiprocessors. Too few tiles to occupy
/// the GPU, and enough `k` to share out: split `k` ([`tma_splits`] where the GEMM runs
/// on the TMA kernels, else `grid_splits`). The partial products go through memory to a
/// second kernel, which adds them with the bias and runs the chain ([`split_sums`]).
///
/// A few rows, a depth of whole 16-byte chunks (`k % 8 == 0`) and an aligned `W` not
/// folded from an AvgPool: a small-batch kernel, which streams `W` across every SM
/// where the tile GEMMs would give it a few dozen: on the tensor cores where a kernel
/// serves the block ([`Forward::gemv_tc`]) and wins ([`gemv_tc_wins`]: up to
/// [`GEMV_TC_ROWS`] rows), else up to `gemv::ROWS` on FP32 FMAs.
pub fn plan(f: Forward, sms: usize, tma: bool) -> Plan {
    if f.fp8 {
        return if f.fusable { Plan::Fused } else { Plan::GemmThenRows { splits: 1 } };
    }
    if f.n == 1 && f.folded != Some(FoldedAs::Halves) && !f.batch_norm {
        return Plan::RowDot;
    }
    let gemv_ok = f.gemv && (f.gemv_chain || f.rows_fit) && f.k.is_multiple_of(8) && f.w_aligned && f.folded.is_none();
    let small = match f.gemv_tc {
        true => gemv_tc_wins(f.batch, f.k, f.n, sms),
        false => f.batch <= GEMV_ROWS,
    };
    if gemv_ok && f.batch >= 1 && small {
        return Plan::Gemv { chain: f.gemv_chain, tensor_cores: f.gemv_tc };
    }
    let unsplit = Plan::GemmThenRows { splits: 1 };
    let (precision, route) = forward_route(f, f.precision, &unsplit, true, tma);
    // (Split-K hands the sums to a second kernel: only where the row-wise one takes the
    // rows.) On the TMA kernels by their tiles, except TF32's ranges, which run on
    // `gemm_wgmma` ([`route`]), by its count: at 65-256 x 4096 x 4096 that was
    // 0.061-0.072 ms, the TMA kernel's 0.066-0.080 (H100, through PyTorch, M1's chain,
    // the row-wise epilogue after both).
    let splits = match (f.rows_fit, route.family, precision) {
        (false, ..) => 1,
        (true, Family::Tma, p) if p != Precision::Tf32 => tma_splits(f.batch, f.n, f.k, p, sms, f.split_k),
        (true, ..) => grid_splits(f, sms),
    };
    // A folded weight's two halves: two GEMMs of as many ranges each, whose sums the
    // second kernel adds.
    if f.folded == Some(FoldedAs::Halves) && !route.widened {
        return Plan::GemmThenRows { splits: 2 * splits };
    }
    match (f.fusable, splits) {
        (true, 1) => Plan::Fused,
        // (Only the TMA kernels' epilogue stores row partials; not 3xTF32's, which adds
        // its runs of `k` up in the output itself.)
        (false, 1)
            if f.row_partials
                && f.folded.is_none()
                && route.family == Family::Tma
                && precision != Precision::Tf32x3 =>
        {
            Plan::RowPartials
        }
        _ => Plan::GemmThenRows { splits },
    }
}

/// Split-K on the TMA kernels (`gemm_tma_*_nt`): where the `128 x 256` tiles fill at most
/// half the SMs, as many `k` ranges as give each SM a unit, each range at least
/// `MIN_SPLIT_K` deep, none empty. At 128 x 4096 x 4096
/// in bf16 the 16 tiles alone took 0.054 ms where cuBLAS's GEMM took 0.014 (H100, the
/// profiler through PyTorch): a `128 x 256` tile's `k` loop is a fixed latency however
/// few tiles run beside it.
/// `forced`: the tuning's count instead of the rule's (still none empty).
pub fn tma_splits(batch: usize, n: usize, k: usize, precision: Precision, sms: usize, forced: Option<usize>) -> usize {
    let tiles = batch.div_ceil(gemm_tma::BLOCK_M) * n.div_ceil(gemm_tma::BLOCK_N);
    if tiles == 0 || 2 * tiles > sms {
        return 1;
    }
    // The kernels' range granularity: their k-tile.
    let step = match precision {
        Precision::Tf32x3 => gemm_tma::SPLIT_BLOCK_K,
        Precision::Tf32 => gemm_tma::BLOCK_K,
        _ => gemm_tma::BF16_BLOCK_K,
    };
    let wanted = forced.unwrap_or((sms / tiles).min(k / gemm_tma::MIN_SPLIT_K).min(16)).clamp(1, 64);
    covering_ranges(k, step, wanted)
}

/// How many ranges of a depth cut as the split-K kernels cut it (each `ceil(steps / s)`
/// whole steps of `step`, `s` the count) cover `depth` with none empty, at most `wanted`:
/// fewer than asked may cover it. (Each range must start inside: a kernel's range
/// starting past the end would wrap its unsigned length.)
fn covering_ranges(depth: usize, step: usize, wanted: usize) -> usize {
    match depth.div_ceil(step) {
        0 => 1,
        steps => steps.div_ceil(steps.div_ceil(wanted.max(1))),
    }
}

/// Split-K of a 16-bit model's `dX (m, k) = dZ (m, n) W (n, k)` on `gemm_tma_*_nn`, by
/// [`tma_splits`]'s rule over the output `(m, k)` and the depth `n`: at few rows a
/// handful of tiles would each stream all of `W` (bf16 8 x 1024 x 4096: 4 tiles, 0.039
/// ms, where cuBLAS's split GEMM took 0.004; H200, the profiler through PyTorch).
pub fn dx_splits(m: usize, n: usize, k: usize, sms: usize, forced: Option<usize>) -> usize {
    tma_splits(m, k, n, Precision::Bf16, sms, forced)
}

/// Split-K of FP32 tensors' TF32 or 3xTF32 `dX` at few rows, on `gemm_wgmma_*_dx` (the
/// TMA `tk_t` kernels walk whole tiles): where its `128 x 128` tiles over the output
/// `(k, m)` fill fewer than half the SMs, ranges at least `MIN_SPLIT_K` of the depth `n`
/// deep, at most two blocks per SM (as `grid_splits`). TF32 8 x 1024 x 4096 ran 8
/// TMA tiles for 0.077 ms where cuBLAS's GEMM took 0.007 (H200, the profiler through
/// PyTorch).
pub fn dx_grid_splits(m: usize, n: usize, k: usize, sms: usize, forced: Option<usize>) -> usize {
    let tiles = k.div_ceil(BLOCK_M) * m.div_ceil(BLOCK_N);
    if tiles * 2 >= sms || n < 2 * gemm_tma::MIN_SPLIT_K {
        return 1;
    }
    let wanted = forced.unwrap_or((2 * sms / tiles).min(n / gemm_tma::MIN_SPLIT_K).min(16)).clamp(1, 64);
    covering_ranges(n, kernel_abi::gemm_wgmma::BLOCK_K, wanted)
}

/// Split-K on the grid kernels (`gemm_fma`, `gemm_mma`, `gemm_wgmma`): where their
/// `128 x 128` tiles fill fewer than half the SMs and `k` is deep. (A 16-bit model's
/// GEMM gets here on widened copies only, which the unsplit GEMM takes too.)
/// TF32 and 3xTF32 (`gemm_wgmma`) split into at most two blocks per SM: one more
/// split past that, a partial second wave, cost 14-18% (H100, `host forward` at 64-256
/// rows x 4096² and 8192²: 256 x 4096 x 4096 TF32 0.087 ms in 5 splits, 0.075 in 4;
/// 128 x 8192 x 8192 3xTF32 0.270 in 5, 0.233 in 4). The other precisions' kernels keep
/// the rounded-up count (not measured). The tuning's count (`f.split_k`) replaces the
/// rule's wherever the rule splits.
fn grid_splits(f: Forward, sms: usize) -> usize {
    let tiles = f.batch.div_ceil(BLOCK_M) * f.n.div_ceil(BLOCK_N);
    if tiles * 2 >= sms || f.k < 64 * BLOCK_K {
        return 1;
    }
    // (The rule's ranges are 512 deep or more, whole at 32; a forced count may not be.
    // 32, the deepest k-tile of the grid families, also covers the FMA kernels' 16.)
    if let Some(forced) = f.split_k {
        return covering_ranges(f.k, kernel_abi::gemm_wgmma::BLOCK_K, forced);
    }
    let tensor_cores = f.dtype == Dtype::F32 && matches!(f.precision, Precision::Tf32 | Precision::Tf32x3);
    let per_wave = if tensor_cores { 2 * sms / tiles } else { (2 * sms).div_ceil(tiles) };
    per_wave.min(f.k / (32 * BLOCK_K)).clamp(1, 16)
}

/// The forward GEMM's precision and route under `plan` (`aligned`: every tensor
/// starts on a 16-byte boundary). A 16-bit model's folded AvgPool weight holds means
/// that the type cannot hold (rounded to bf16, they moved M4's row max on some rows:
/// `dx` 7.9e-2 from f64 at seed size): as two halves in the type ([`FoldedAs::Halves`])
/// two GEMMs read them as stored, into FP32 partial sums; where the type's kernels
/// cannot take the shapes, or the block holds FP32 means, the GEMM runs in 3xTF32
/// (FP32-accurate) on a widened `x`. A 16-bit model's other GEMMs write a 16-bit `y`
/// where fused, else the FP32 `z`, in the precision of the storage type
/// ([`Precision::of_storage`]).
pub fn forward_route(f: Forward, precision: Precision, plan: &Plan, aligned: bool, tma: bool) -> (Precision, Route) {
    let (splits, output) = match *plan {
        Plan::Fused => (1, f.dtype),
        Plan::GemmThenRows { splits } => (splits, Dtype::F32),
        Plan::Gemv { .. } | Plan::RowDot | Plan::RowPartials => (1, Dtype::F32),
    };
    let (role, dims) = (Role::Forward { splits }, (f.batch.max(1), f.n, f.k));
    let widened =
        || (Precision::Tf32x3, Route { widened: true, ..route(Precision::Tf32x3, role, dims, Storage::F32, tma) });
    match (Precision::of_storage(f.dtype), f.folded) {
        (Some(p), Some(FoldedAs::Halves)) => {
            match route(p, role, dims, Storage::half(f.dtype, Dtype::F32, aligned), tma) {
                r if r.widened => widened(),
                r => (p, r),
            }
        }
        (Some(_), Some(FoldedAs::Means)) => widened(),
        (Some(p), None) => (p, route(p, role, dims, Storage::half(f.dtype, output, aligned), tma)),
        (None, _) => (precision, route(precision, role, dims, Storage::F32, tma)),
    }
}

/// Why the GEMMs' fused epilogue cannot apply `op` to `features` channels, or `None`
/// if it can.
pub fn not_fusable(op: &Op, features: usize) -> Option<String> {
    match *op {
        Op::AvgPool(_) | Op::RowMax | Op::Reduce(_) | Op::MaxPool(_) => Some(format!("`{op}` reduces across tiles")),
        Op::Softmax | Op::RmsNorm { .. } => Some(format!("`{op}` needs the whole row")),
        Op::Residual => Some(format!("`{op}` re-reads the chain's input (the row-wise kernels do)")),
        Op::BatchNorm { .. } => Some(format!("`{op}` needs the statistics of every row")),
        // LayerNorm runs as a GroupNorm of one group: fused where the row is such a group.
        Op::GroupNorm { .. } | Op::LayerNorm { .. } => {
            let groups = if let Op::GroupNorm { groups, .. } = *op { groups } else { 1 };
            let g = features / groups;
            (!(g.is_power_of_two() && (MIN_FUSED_GROUP..=MAX_FUSED_GROUP).contains(&g))).then(|| {
                format!(
                    "`{op}` has groups of {g} channels; the fused kernel takes powers of two from \
                     {MIN_FUSED_GROUP} to {MAX_FUSED_GROUP}"
                )
            })
        }
        _ => None,
    }
}

/// Whether the chain's backward runs tile-wise: a chain the GEMM can fuse has a
/// tile-wise backward too, where its gradient slots and ops fit the tile kernel
/// (`tiles_fit`); others go row by row. Also which kink scan may walk it.
pub fn tile_backward(fusable: bool, tiles_fit: bool) -> bool {
    fusable && tiles_fit
}

/// The tile-wise chain backward for `dy` and `dz` of `dtype` (16-bit: 8-byte copies of
/// four values).
pub fn tiles_backward_kernel(dtype: Dtype) -> Kernel {
    HalfKernels::of(dtype).map_or(Kernel::EpilogueTilesBackward, |h| h.tiles_backward)
}

/// A BatchNorm's column kernels `(apply, backward sums, backward dz)` for `y`, `dy`
/// and `dz` of `dtype`.
pub fn batch_norm_kernels(dtype: Dtype) -> (Kernel, Kernel, Kernel) {
    HalfKernels::of(dtype)
        .map_or((Kernel::BatchNormApply, Kernel::BatchNormBackwardSums, Kernel::BatchNormBackwardDz), |h| {
            (h.batch_norm_apply, h.batch_norm_backward_sums, h.batch_norm_backward_dz)
        })
}

/// Whether rows of `n` features take the row-wise kernels' `_narrow` entries, and
/// their blocks' threads.
fn row_block(n: usize) -> (usize, usize) {
    let narrow = n <= epilogue::NARROW_ROW_FEATURES;
    (usize::from(narrow), if narrow { epilogue::NARROW_ROW_THREADS } else { epilogue::ROW_THREADS })
}

/// The row-wise epilogue's forward for an output of `dtype` over rows of `n` features,
/// and its blocks' threads: a 16-bit model's `y` is rounded as it is stored, not by a
/// second pass.
pub fn rows_kernel(dtype: Dtype, n: usize) -> (Kernel, usize) {
    let (narrow, threads) = row_block(n);
    (HalfKernels::of(dtype).map_or([Kernel::EpilogueRows, Kernel::EpilogueRowsNarrow], |h| h.rows)[narrow], threads)
}

/// Split-K's partial products added, with the bias and the chain, for an output of
/// `dtype`: tile-wise where the chain is one the GEMM could fuse (`fusable`), else by
/// the row-wise epilogue. The row-wise kernel's block per row left 128 rows of 4096 to
/// 128 blocks: 0.025 ms for 8 slices.
pub fn split_sums(fusable: bool) -> SplitSums {
    if fusable { SplitSums::Tiles } else { SplitSums::Rows }
}

/// Which kernel adds split-K's partial products ([`split_sums`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SplitSums {
    /// `epilogue_split_tiles*` ([`split_tiles_kernel`]).
    Tiles,
    /// `epilogue_rows*` ([`rows_kernel`]).
    Rows,
}

/// The tile-wise split-K sums into an output of `dtype`.
pub fn split_tiles_kernel(dtype: Dtype) -> Kernel {
    HalfKernels::of(dtype).map_or(Kernel::EpilogueSplitTiles, |h| h.split_tiles)
}

/// [`split_tiles_kernel`] without bias, saved `z` or chain: the ranges added and rounded,
/// several ranges' loads at a time.
pub fn split_sums_kernel(dtype: Dtype) -> Kernel {
    HalfKernels::of(dtype).map_or(Kernel::SplitSums, |h| h.split_sums)
}

/// The row-wise chain backward for `dy` and `dz` of `dtype` over rows of `n` features,
/// and its blocks' threads.
pub fn rows_backward_kernel(dtype: Dtype, n: usize) -> (Kernel, usize) {
    let (narrow, threads) = row_block(n);
    let pair = [Kernel::EpilogueRowsBackward, Kernel::EpilogueRowsBackwardNarrow];
    (HalfKernels::of(dtype).map_or(pair, |h| h.rows_backward)[narrow], threads)
}

/// The AvgPool fold's kernel for a weight of `dtype`: the means in FP32 from FP32 or
/// 16-bit rows.
pub fn fold_kernel(dtype: Dtype) -> Kernel {
    HalfKernels::of(dtype).map_or(Kernel::FoldRowsMean, |h| h.fold)
}

/// The kernels of a layer folded to one column, for tensors of one dtype
/// (`kernels-gpu/src/dot.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DotKernels {
    pub column_dot: Kernel,
    pub row_dot: Kernel,
    pub outer: Kernel,
    /// `dX` of 2 to `OUTER_MAX_RANK` rows ([`Family::Dot`]).
    pub column_dots: Kernel,
}

/// [`DotKernels`] reading and writing `dtype` as stored.
pub fn dot_kernels(dtype: Dtype) -> DotKernels {
    match dtype {
        Dtype::F32 => DotKernels {
            column_dot: Kernel::ColumnDot,
            row_dot: Kernel::RowDot,
            outer: Kernel::Outer,
            column_dots: Kernel::ColumnDots,
        },
        Dtype::Bf16 => DotKernels {
            column_dot: Kernel::ColumnDotBf16,
            row_dot: Kernel::RowDotBf16,
            outer: Kernel::OuterBf16,
            column_dots: Kernel::ColumnDotsBf16,
        },
        Dtype::F16 => DotKernels {
            column_dot: Kernel::ColumnDotF16,
            row_dot: Kernel::RowDotF16,
            outer: Kernel::OuterF16,
            column_dots: Kernel::ColumnDotsF16,
        },
    }
}

/// The fold's gradient spread back over a weight of `dtype`: FP32, or rounded once into
/// a 16-bit weight's gradient.
pub fn unfold_kernel(dtype: Dtype) -> Kernel {
    HalfKernels::of(dtype).map_or(Kernel::UnfoldRowsMeanGrad, |h| h.unfold)
}

/// Whether the tile scan's rows should hand their doubtful values to `refine_values`
/// one by one rather than by chunks to `refine_z` (the scanned `ops`, `z` computed in
/// `precision`). It pays where `refine_z` then has (almost) nothing left to do, since
/// its weight reads cost the same for a few listed rows as for many: where every kink
/// comes before any GroupNorm, so that a decision depends on its own value only (M5:
/// TF32 ~9 values per row, 0.236 -> 0.200 ms), and the flags are sparse. A kink after
/// a GroupNorm takes the whole group (M3: ~10 groups of 16 per row), and bf16's
/// rounding flags ~80 values per row of M5: both read less by chunks (M3 0.215 ->
/// 0.245 ms, bf16 M5 0.487 -> 0.525 one by one).
pub fn values_one_by_one(ops: &[OpDesc], precision: Precision) -> bool {
    let mut grouped = false;
    for d in ops {
        if super::epilogue::kinks::kinked(d.code) && grouped {
            return false;
        }
        grouped |= d.code == OP_GROUP_NORM;
    }
    precision != Precision::Bf16
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kernel(p: Precision, role: Role, dims: (usize, usize, usize)) -> &'static str {
        route(p, role, dims, Storage::F32, true).kernel.name()
    }

    /// The table's rows, at the edges of their conditions.
    #[test]
    fn kernels_are_chosen_by_precision_role_alignment_and_depth() {
        use Precision::*;
        let (deep, shallow) = (MIN_K, MIN_K / 2);
        let fwd = Role::Forward { splits: 1 };
        let split2 = Role::Forward { splits: 2 };
        // Forward: TMA for deep, 16-byte aligned `k`, split or not (TF32's split-K into
        // partial products: wgmma); else wgmma (TF32, 3xTF32 with 16-byte rows) or
        // mma.sync / FMA.
        assert_eq!(kernel(Tf32, fwd, (7, 9, deep)), "gemm_tma_tf32_nt");
        assert_eq!(kernel(Tf32x3, fwd, (7, 9, deep)), "gemm_tma_tf32x3_nt");
        assert_eq!(kernel(Tf32x3, split2, (7, 9, deep)), "gemm_tma_tf32x3_nt");
        assert_eq!(kernel(Tf32, split2, (7, 9, deep)), "gemm_wgmma_tf32_nt_vec4");
        assert_eq!(kernel(Tf32, split2, (7, 9, shallow)), "gemm_wgmma_tf32_nt_vec4");
        assert_eq!(kernel(Tf32, fwd, (7, 9, shallow)), "gemm_wgmma_tf32_nt_vec4");
        assert_eq!(kernel(Tf32, fwd, (7, 9, deep + 1)), "gemm_mma_tf32_nt_scalar");
        assert_eq!(kernel(Bf16, fwd, (7, 9, deep)), "gemm_tma_bf16_nt");
        // bf16 rows of 4 values (8 bytes), a shallow `k`: mma.sync.
        assert_eq!(kernel(Bf16, fwd, (7, 9, deep + 4)), "gemm_mma_bf16_nt_vec4");
        assert_eq!(kernel(Bf16, fwd, (7, 9, shallow)), "gemm_mma_bf16_nt_vec4");
        assert_eq!(kernel(Bf16, split2, (7, 9, deep)), "gemm_tma_bf16_nt");
        assert_eq!(kernel(Bf16, split2, (7, 9, shallow)), "gemm_mma_bf16_nt_vec4");
        assert_eq!(kernel(Fp32, fwd, (7, 9, deep)), "gemm_fma_nt_vec4");
        assert_eq!(kernel(Fp32, fwd, (7, 9, deep + 1)), "gemm_fma_nt_scalar");
        // dX: `Tk` with `W` and `dZ` as stored where `n` and `k` allow 16-byte rows (TMA
        // from `n = MIN_K`); bf16 on TMA after transposing `W`; else `Nn`; at most eight
        // rows (FP32 and the TF32 precisions) `W`'s rows weighted and summed.
        let dx = Role::GradInput;
        assert_eq!(kernel(Tf32, dx, (12, deep, 8)), "gemm_tma_tf32_tk_t");
        assert_eq!(kernel(Tf32x3, dx, (12, shallow, 8)), "gemm_wgmma_tf32x3_dx_vec4");
        assert_eq!(kernel(Tf32, dx, (12, deep, 9)), "gemm_mma_tf32_nn_scalar");
        assert_eq!(kernel(Bf16, dx, (5, deep, 9)), "gemm_tma_bf16_nt");
        assert_eq!(kernel(Bf16, dx, (5, deep + 4, 8)), "gemm_mma_bf16_nn_vec4");
        assert_eq!(kernel(Fp32, dx, (12, deep, 8)), "gemm_fma_nn_vec4");
        for p in [Tf32, Tf32x3, Fp32] {
            assert_eq!(kernel(p, dx, (5, deep, 9)), "column_dots");
        }
        // dW: `Tk` with `dZ` as stored where `m` and `n` allow (TMA from `m = MIN_K`);
        // bf16 on TMA after transposing `dZ` and `X`; else `Tn`; at most eight rows
        // (FP32 and the TF32 precisions) the rows' outer products.
        let dw = Role::GradWeight;
        assert_eq!(kernel(Tf32, dw, (deep, 8, 9)), "gemm_tma_tf32_tk");
        assert_eq!(kernel(Tf32x3, dw, (12, 8, 9)), "gemm_wgmma_tf32x3_dw_vec4");
        for p in [Tf32, Tf32x3, Fp32] {
            assert_eq!(kernel(p, dw, (8, 8, 9)), "outer");
            assert_eq!(kernel(p, dw, (1, 9, 8)), "outer");
        }
        assert_eq!(kernel(Bf16, dw, (1, 8, 8)), "gemm_mma_bf16_tn_vec4");
        // dX of one row: `W`'s rows weighted by `dZ`, as stored.
        for p in [Tf32, Tf32x3, Fp32] {
            assert_eq!(kernel(p, dx, (1, deep, 8)), "column_dot");
            assert_eq!(route(p, dx, (1, deep, 8), Storage::F32, true).layout, Layout::Nn);
        }
        assert_eq!(kernel(Bf16, dx, (1, deep, 8)), "gemm_tma_bf16_nt");
        // ... of more rows from a small `W` only: a larger one's `dX` is a GEMM's.
        let big = DOT_DX_MAX_WEIGHTS / 1024 + 4;
        for rows in [1, 2, 8] {
            assert_eq!(kernel(Tf32, dx, (rows, 1024, 1024)), if rows == 1 { "column_dot" } else { "column_dots" });
            assert_eq!(
                kernel(Tf32, dx, (rows, 1024, big)),
                if rows == 1 { "column_dot" } else { "gemm_tma_tf32_tk_t" }
            );
        }
        assert_eq!(kernel(Tf32, dx, (9, 1024, 1024)), "gemm_tma_tf32_tk_t");
        assert_eq!(kernel(Tf32, dw, (deep, 9, 8)), "gemm_mma_tf32_tn_scalar");
        assert_eq!(kernel(Bf16, dw, (deep, 9, 9)), "gemm_tma_bf16_nt");
        assert_eq!(kernel(Bf16, dw, (deep + 4, 8, 8)), "gemm_mma_bf16_tn_vec4");
        assert_eq!(kernel(Fp32, dw, (deep, 8, 8)), "gemm_fma_tn_vec4");
        // What each route reads.
        let r = route(Tf32, dx, (12, deep, 8), Storage::F32, true);
        assert!(r.transpose_y && r.layout == Layout::Tk && r.transposed == Transposed::Nothing);
        assert_eq!(route(Tf32, dw, (deep, 8, 9), Storage::F32, true).transposed, Transposed::B);
        assert_eq!(route(Bf16, dx, (5, deep, 9), Storage::F32, true).transposed, Transposed::B);
        assert_eq!(route(Bf16, dw, (deep, 9, 9), Storage::F32, true).transposed, Transposed::Both);
    }

    /// Without the TMA kernels every GEMM takes the next row that fits: `wgmma` for
    /// TF32 and 3xTF32, `mma.sync` for bf16.
    #[test]
    fn without_tma_the_next_row_runs() {
        use Precision::*;
        let dims = (MIN_K, MIN_K, MIN_K);
        let r = |p, role| route(p, role, dims, Storage::F32, false);
        assert_eq!(r(Tf32, Role::Forward { splits: 1 }).kernel, Kernel::GemmWgmmaTf32NtVec4);
        assert_eq!(r(Tf32x3, Role::GradInput).kernel, Kernel::GemmWgmmaTf32x3DxVec4);
        assert_eq!(r(Tf32, Role::GradWeight).kernel, Kernel::GemmWgmmaTf32DwVec4);
        assert_eq!(r(Bf16, Role::Forward { splits: 1 }).kernel, Kernel::GemmMmaBf16NtVec4);
        assert_eq!(r(Bf16, Role::GradInput).kernel, Kernel::GemmMmaBf16NnVec4);
        assert_eq!(r(Bf16, Role::GradWeight).kernel, Kernel::GemmMmaBf16TnVec4);
        assert_eq!(r(Fp16, Role::Forward { splits: 1 }).kernel, Kernel::GemmMmaF16NtVec4);
        assert_eq!(r(Fp16, Role::GradInput).kernel, Kernel::GemmMmaF16NnVec4);
        assert_eq!(r(Fp16, Role::GradWeight).kernel, Kernel::GemmMmaF16TnVec4);
    }

    /// Rows of at most `NARROW_ROW_FEATURES` take the row-wise kernels' `_narrow`
    /// entries in blocks of `NARROW_ROW_THREADS`, wider ones the 256-thread entries, in
    /// every dtype, forward and backward; each entry's launch bounds are its block's.
    #[test]
    fn row_kernels_take_narrow_blocks_for_narrow_rows() {
        use kernel_abi::epilogue::{NARROW_ROW_FEATURES, NARROW_ROW_THREADS, ROW_THREADS};
        let (narrow, wide) = (NARROW_ROW_FEATURES, NARROW_ROW_FEATURES + 1);
        assert_eq!(rows_kernel(Dtype::F32, narrow), (Kernel::EpilogueRowsNarrow, NARROW_ROW_THREADS));
        assert_eq!(rows_kernel(Dtype::Bf16, wide), (Kernel::EpilogueRowsBf16, ROW_THREADS));
        assert_eq!(rows_kernel(Dtype::F16, 1), (Kernel::EpilogueRowsNarrowF16, NARROW_ROW_THREADS));
        let backward = rows_backward_kernel(Dtype::Bf16, narrow);
        assert_eq!(backward, (Kernel::EpilogueRowsBackwardNarrowBf16, NARROW_ROW_THREADS));
        assert_eq!(rows_backward_kernel(Dtype::F32, wide), (Kernel::EpilogueRowsBackward, ROW_THREADS));
        for dtype in [Dtype::F32, Dtype::Bf16, Dtype::F16] {
            for n in [narrow, wide] {
                let (kernel, threads) = rows_backward_kernel(dtype, n);
                let bounds = kernel.launch_bounds().expect("the row-wise backward carries launch bounds");
                assert_eq!(bounds.max_threads as usize, threads, "{kernel}");
                assert_eq!(kernel.name().contains("_narrow"), n == narrow, "{kernel}");
                assert_eq!(rows_kernel(dtype, n).0.name().contains("_narrow"), n == narrow);
            }
        }
    }

    /// An fp16 model's tensors take the same rows as a bf16 model's, on the fp16 kernels;
    /// every kernel of one 16-bit type's table is that type's.
    #[test]
    fn fp16_tensors_are_read_as_stored_by_the_fp16_kernels() {
        use Dtype::{F16, F32};
        let r =
            |role, dims, output, aligned| route(Precision::Fp16, role, dims, Storage::half(F16, output, aligned), true);
        let fwd = Role::Forward { splits: 1 };
        assert_eq!(r(fwd, (3, 16, 8), F16, true).kernel, Kernel::GemmTmaF16NtToF16);
        assert_eq!(r(fwd, (3, 12, 8), F32, true).kernel, Kernel::GemmTmaF16Nt);
        assert_eq!(r(Role::GradInput, (16, 16, 8), F16, true).kernel, Kernel::GemmTmaF16NnToF16);
        assert_eq!(r(Role::GradInput, (3, 16, 8), F16, true).kernel, Kernel::DxTcF16);
        assert_eq!(r(Role::GradInput, (3, 16, 12), F16, true).kernel, Kernel::ColumnDotsF16);
        assert_eq!(r(Role::GradWeight, (3, 16, 8), F32, true).kernel, Kernel::GemmTmaF16Tn);
        assert_eq!(r(Role::GradWeight, (16, 16, 8), F16, true).kernel, Kernel::GemmTmaF16TnToF16);
        assert_eq!(r(Role::GradWeight, (3, 16, 8), F16, true).kernel, Kernel::OuterSumF16);
        // The widened fallback runs the FP32 tensors' route in fp16.
        let w = r(fwd, (3, 12, 12), F16, true);
        assert!(w.widened && w.kernel == Kernel::GemmMmaF16NtVec4, "{w:?}");
        assert_eq!(gemv_kernel(F16, F16, Precision::Fp16, false), Kernel::GemvF16ToF16);
        assert_eq!(gemv_kernel(F16, F32, Precision::Fp16, false), Kernel::GemvF16);
        assert!(gemv_tc_serves(F16, Precision::Fp16));
        assert_eq!(gemv_kernel(F16, F16, Precision::Fp16, true), Kernel::GemvTcF16ToF16);
        assert_eq!(gemv_kernel(F16, F32, Precision::Fp16, true), Kernel::GemvTcF16);
        assert_eq!(tiles_backward_kernel(F16), Kernel::EpilogueTilesBackwardF16);
        for (h, tag) in [(&HalfKernels::BF16, "bf16"), (&HalfKernels::F16, "f16")] {
            let all = [h.tma_nt, h.tma_nt_split, h.tma_nt_to_half, h.tma_nn_to_half, h.tma_tn_to_half, h.tma_tn];
            let all = all.into_iter().chain([h.gemv, h.gemv_to_half, h.gemv_tc, h.gemv_tc_to_half]);
            let all = all.chain(h.mma.into_iter().flatten());
            let all = all
                .chain([h.tiles_backward, h.split_tiles, h.split_sums, h.fold, h.unfold])
                .chain(h.rows)
                .chain(h.rows_backward);
            let all = all.chain([h.transpose_to_half, h.narrow, h.widen, h.outer_sum]);
            for k in all {
                let other = if tag == "f16" { "bf16" } else { "_f16" };
                assert!(k.name().contains(tag) && !k.name().contains(other), "{tag}: {k}");
            }
        }
    }

    /// Over many shapes: every route's kernel belongs to its family and precision, has
    /// launch bounds, only `wgmma` and TMA kernels read `Tk` or transpose `y`, and a
    /// split forward writes FP32.
    #[test]
    fn every_route_is_consistent() {
        let sizes = [1, 4, 8, 12, MIN_K - 8, MIN_K, MIN_K + 4, MIN_K + 8, 3 * MIN_K + 1];
        for p in Precision::ALL {
            for role in [Role::Forward { splits: 1 }, Role::Forward { splits: 3 }, Role::GradInput, Role::GradWeight] {
                for (m, n, k) in
                    sizes.iter().flat_map(|&m| sizes.iter().flat_map(move |&n| sizes.map(move |k| (m, n, k))))
                {
                    for tma in [false, true] {
                        let r = route(p, role, (m, n, k), Storage::F32, tma);
                        let name = r.kernel.name();
                        // FP8 has one kernel, whatever the shape or tuning (its dW in bf16
                        // for `Fp8GwBf16`: bf16's route).
                        let bf16_dw = p == Precision::Fp8GwBf16 && role == Role::GradWeight;
                        if p.is_fp8() && !bf16_dw {
                            assert_eq!(r.kernel, Kernel::GemmTmaE4m3Nt, "{p} {role:?}");
                            assert_eq!(r.layout, Layout::Nt);
                            continue;
                        }
                        let p = if bf16_dw { Precision::Bf16 } else { p };
                        let family = match r.family {
                            Family::Fma => "gemm_fma_",
                            Family::Mma => "gemm_mma_",
                            Family::Wgmma => "gemm_wgmma_",
                            Family::Tma => "gemm_tma_",
                            Family::Dot if role == Role::GradWeight => "outer",
                            Family::Dot => "column_dot",
                        };
                        assert!(name.starts_with(family), "{p} {role:?} ({m}, {n}, {k}): {name} in {:?}", r.family);
                        if r.family == Family::Dot {
                            // (FP32 sums whatever the precision: `dW` of a few rows, `dX` of one.)
                            let dw = role == Role::GradWeight && m <= OUTER_MAX_RANK && r.kernel == Kernel::Outer;
                            let dx = role == Role::GradInput
                                && dot_dx(m, n, k)
                                && r.kernel == if m == 1 { Kernel::ColumnDot } else { Kernel::ColumnDots };
                            // (FP32 tensors: `dx_tc_*` takes 16-bit ones only.)
                            assert!(!r.kernel.name().starts_with("dx_tc"), "{name}");
                            assert!(dw || dx, "{p} {role:?} ({m}, {n}, {k}): {name}");
                        } else if p != Precision::Fp32 {
                            // (The fp16 kernels are named by their element, `f16`.)
                            let tag = if p == Precision::Fp16 { "f16".to_string() } else { p.to_string() };
                            assert!(name.starts_with(&format!("{family}{tag}_")), "{p} {role:?}: {name}");
                        }
                        assert!(r.kernel.launch_bounds().is_some(), "{name}");
                        assert!(tma || r.family != Family::Tma);
                        let tensor_cores = matches!(r.family, Family::Wgmma | Family::Tma);
                        assert!(tensor_cores || (r.layout != Layout::Tk && !r.transpose_y), "{name}");
                        assert!(!r.transpose_y || r.layout == Layout::Tk, "{name}");
                        if matches!(role, Role::Forward { splits: 3 }) {
                            assert!(!name.contains("_to_"), "split-K on {name}");
                        }
                    }
                }
            }
        }
    }

    /// A bf16 model's tensors are read as stored where rows are 16 bytes, every tensor
    /// is aligned and a kernel writes the output's dtype; else the FP32 route, widened.
    #[test]
    fn bf16_tensors_are_read_as_stored_where_they_fit() {
        use Dtype::{Bf16, F32};
        let r = |role, dims, output, aligned| route(Precision::Bf16, role, dims, Storage::bf16(output, aligned), true);
        let fwd = Role::Forward { splits: 1 };
        assert_eq!(r(fwd, (3, 16, 8), Bf16, true).kernel, Kernel::GemmTmaBf16NtToBf16);
        assert_eq!(r(fwd, (3, 12, 8), F32, true).kernel, Kernel::GemmTmaBf16Nt);
        assert_eq!(r(Role::GradInput, (3, 16, 8), Bf16, true).layout, Layout::Nn);
        assert_eq!(r(Role::GradWeight, (3, 16, 8), F32, true).kernel, Kernel::GemmTmaBf16Tn);
        assert_eq!(r(Role::GradWeight, (16, 16, 8), Bf16, true).kernel, Kernel::GemmTmaBf16TnToBf16);
        // `dW` of at most eight rows: their outer products, any shape or alignment.
        for (dims, aligned) in [((8, 16, 8), true), ((3, 16, 12), true), ((1, 5, 3), false)] {
            let outer = r(Role::GradWeight, dims, Bf16, aligned);
            assert!(outer.kernel == Kernel::OuterSumBf16 && !outer.widened, "{dims:?}: {outer:?}");
        }
        // `dX` of at most eight rows: `dx_tc_bf16` where the rows are whole 16-byte chunks
        // and aligned (one row's up to DX_TC_ONE_ROW_MAX_WEIGHTS); else one row's
        // `column_dot_bf16`, any shape.
        for dims in [(1, 16, 8), (8, 16, 8), (1, 4096, 4096), (2, 8192, 8192)] {
            let dx = r(Role::GradInput, dims, Bf16, true);
            assert!(dx.kernel == Kernel::DxTcBf16 && dx.family == Family::Dot, "{dims:?}: {dx:?}");
        }
        for (dims, aligned) in [((1, 16, 8), false), ((1, 5, 3), true), ((1, 8192, 8192), true)] {
            let dx = r(Role::GradInput, dims, Bf16, aligned);
            assert!(dx.kernel == Kernel::ColumnDotBf16 && dx.family == Family::Dot, "{dims:?}: {dx:?}");
        }
        assert_eq!(r(Role::GradInput, (9, 16, 8), Bf16, true).kernel, Kernel::GemmTmaBf16NnToBf16);
        // Split-K's FP32 partial products, as stored.
        let split = r(Role::Forward { splits: 2 }, (3, 16, 8), F32, true);
        assert!(split.kernel == Kernel::GemmTmaBf16Nt && !split.widened, "{split:?}");
        // No bf16 `y` by TMA over 12 columns, no FP32 `dX` kernel, misaligned tensors,
        // a split bf16 `y`, 8-byte rows, TMA off: widened.
        for (role, dims, output, aligned) in [
            (fwd, (3, 12, 8), Bf16, true),
            (Role::GradInput, (3, 16, 8), F32, true),
            (fwd, (3, 16, 8), Bf16, false),
            (Role::Forward { splits: 2 }, (3, 16, 8), Bf16, true),
            (Role::GradWeight, (16, 16, 12), Bf16, true),
        ] {
            let route = r(role, dims, output, aligned);
            assert!(route.widened && route.kernel != Kernel::GemmTmaBf16NtToBf16, "{role:?} {dims:?}: {route:?}");
        }
        assert!(route(Precision::Bf16, fwd, (3, 16, 8), Storage::bf16(Bf16, true), false).widened);
    }

    /// Row partials take fusable ops, one row reduction, then per-element ops only.
    #[test]
    fn finds_a_chain_that_reduces_each_row_once() {
        use crate::chain::Reduce;
        use kernel_abi::ops::Pointwise;
        let pw = |kind| Op::Pointwise(kind, [2.0, 0.0]);
        let norm = |groups| Op::GroupNorm { groups, eps: 1e-5 };
        let at = |ops: &[Op]| row_partials_at(ops, |_| 8192);
        // KernelBench 22, 64, 80 and 75 (GroupNorm groups of 16 channels).
        assert_eq!(at(&[pw(Pointwise::Scale), pw(Pointwise::Hardtanh), Op::Reduce(Reduce::LogSumExp)]), Some(2));
        assert_eq!(at(&[Op::Reduce(Reduce::LogSumExp), pw(Pointwise::LeakyRelu), pw(Pointwise::Gelu)]), Some(0));
        assert_eq!(at(&[Op::RowMax, pw(Pointwise::Scale), pw(Pointwise::Gelu)]), Some(0));
        assert_eq!(at(&[norm(512), Op::Reduce(Reduce::Min)]), Some(1));
        assert_eq!(at(&[pw(Pointwise::Sigmoid), Op::Reduce(Reduce::Sum)]), Some(1));
        // Not: no reduction, one the epilogue cannot start (groups of 8192 channels, a
        // softmax), a second whole-row op after it, or a pooling one.
        assert_eq!(at(&[pw(Pointwise::Tanh)]), None);
        assert_eq!(at(&[norm(1), Op::Reduce(Reduce::Sum)]), None);
        assert_eq!(at(&[Op::Softmax, Op::Reduce(Reduce::Sum)]), None);
        assert_eq!(at(&[Op::RowMax, Op::Reduce(Reduce::Mean)]), None);
        assert_eq!(at(&[Op::MaxPool(2), Op::Reduce(Reduce::Sum)]), None);
        assert_eq!(at(&[Op::Reduce(Reduce::Sum), Op::Residual]), None);
    }

    /// Few tiles and a deep `k`: split-K, on the TMA kernels as they read the tensors
    /// (a bf16 model's as stored) by their `128 x 256` tiles, on the others by `128 x
    /// 128`. At most 8 rows take the small-batch kernel (`GEMV_TC_ROWS` on the tensor
    /// cores), unless `W` is misaligned or folded, `k` not whole chunks, or the tuning
    /// says no.
    #[test]
    fn plans_split_k_where_tiles_are_few() {
        let f = |dtype, folded| Forward {
            batch: 32,
            n: 4096,
            k: 4096,
            dtype,
            folded,
            fusable: true,
            gemv_chain: true,
            w_aligned: true,
            rows_fit: true,
            gemv: true,
            gemv_tc: false,
            fp8: false,
            precision: Precision::Fp32,
            split_k: None,
            batch_norm: false,
            row_partials: false,
        };
        // A bf16 model as stored: 16 TMA tiles, 8 ranges of 512, whatever the chain
        // (the second kernel adds them); 3xTF32 on a folded AvgPool's FP32 means too.
        let rows = Forward { fusable: false, ..f(Dtype::Bf16, None) };
        assert_eq!(plan(rows, 132, true), Plan::GemmThenRows { splits: 8 });
        assert_eq!(plan(f(Dtype::Bf16, None), 132, true), Plan::GemmThenRows { splits: 8 });
        assert_eq!(plan(f(Dtype::Bf16, Some(FoldedAs::Means)), 132, true), Plan::GemmThenRows { splits: 8 });
        // A folded weight's halves: 8 ranges each, two GEMMs; not split where the tiles
        // fill the GPU, but still two sums; 3xTF32 on a widened `x` where TMA is off.
        let halves = f(Dtype::Bf16, Some(FoldedAs::Halves));
        assert_eq!(plan(halves, 132, true), Plan::GemmThenRows { splits: 16 });
        assert_eq!(plan(Forward { batch: 8192, ..halves }, 132, true), Plan::GemmThenRows { splits: 2 });
        assert_eq!(
            forward_route(halves, Precision::Bf16, &Plan::GemmThenRows { splits: 16 }, true, true).0,
            Precision::Bf16
        );
        let (p, r) = forward_route(halves, Precision::Bf16, &Plan::GemmThenRows { splits: 2 }, true, false);
        assert!(p == Precision::Tf32x3 && r.widened, "{p} {r:?}");
        assert_eq!(plan(Forward { k: 4092, ..halves }, 132, true), Plan::GemmThenRows { splits: 8 });
        let square = Forward { batch: 1024, n: 1024, k: 1024, ..f(Dtype::Bf16, None) };
        assert_eq!(plan(square, 132, true), Plan::GemmThenRows { splits: 4 });
        // One output column, folded (a whole row's sum or mean) or not: the row dot, every
        // dtype and batch, TMA or not; in FP8 the e4m3 GEMM (on the quantised means), and
        // a BatchNorm's block its own kernels.
        for dtype in [Dtype::F32, Dtype::Bf16, Dtype::F16] {
            for (batch, folded) in [(1, None), (32, Some(FoldedAs::Means)), (8192, Some(FoldedAs::Means)), (8192, None)]
            {
                let one = Forward { batch, n: 1, ..f(dtype, folded) };
                assert_eq!(plan(one, 132, true), Plan::RowDot);
                assert_eq!(plan(one, 132, false), Plan::RowDot);
                assert_ne!(plan(Forward { fp8: true, ..one }, 132, true), Plan::RowDot);
                assert_ne!(plan(Forward { batch_norm: true, ..one }, 132, true), Plan::RowDot);
            }
        }
        // TF32: `gemm_wgmma`'s count (32 tiles of 128 x 128: 8).
        let tf32 = Forward { batch: 128, precision: Precision::Tf32, ..f(Dtype::F32, None) };
        assert_eq!(plan(tf32, 132, true), Plan::GemmThenRows { splits: 8 });
        assert!(matches!(plan(f(Dtype::F32, None), 132, true), Plan::GemmThenRows { splits } if splits > 1));
        let big = Forward { batch: 4096, ..f(Dtype::F32, None) };
        assert_eq!(plan(big, 132, true), Plan::Fused);
        assert_eq!(plan(Forward { fusable: false, ..big }, 132, true), Plan::GemmThenRows { splits: 1 });
        // A chain reducing each row once: row partials where a TMA kernel runs it unsplit
        // (a bf16 model's, an FP32 one's in bf16), else the GEMM into `z` and the row-wise
        // epilogue (TMA off, split-K, a folded weight, 3xTF32's flushes of `y`, strict
        // FP32's FMA GEMM).
        let reducing =
            Forward { batch: 1024, n: 8192, k: 8192, fusable: false, row_partials: true, ..f(Dtype::Bf16, None) };
        assert_eq!(plan(reducing, 132, true), Plan::RowPartials);
        let bf16 = Forward { dtype: Dtype::F32, precision: Precision::Bf16, ..reducing };
        assert_eq!(plan(bf16, 132, true), Plan::RowPartials);
        let tf32x3 = Forward { precision: Precision::Tf32x3, ..bf16 };
        assert_eq!(plan(tf32x3, 132, true), Plan::GemmThenRows { splits: 1 });
        assert_eq!(plan(reducing, 132, false), Plan::GemmThenRows { splits: 1 });
        assert_eq!(
            plan(Forward { batch: 32, n: 4096, k: 4096, ..reducing }, 132, true),
            Plan::GemmThenRows { splits: 8 }
        );
        let folded = Forward { folded: Some(FoldedAs::Means), ..reducing };
        assert_eq!(plan(folded, 132, true), Plan::GemmThenRows { splits: 1 });
        let strict = Forward { precision: Precision::Fp32, ..tf32x3 };
        assert_eq!(plan(strict, 132, true), Plan::GemmThenRows { splits: 1 });
        // Rows too wide for the row-wise epilogue: no split-K, the fused kernel.
        assert_eq!(plan(Forward { rows_fit: false, ..f(Dtype::F32, None) }, 132, true), Plan::Fused);
        // 128 x 16384 x 16384 is 64 TMA tiles on 132 SMs: 3xTF32 in 2 ranges; TF32's
        // 128 tiles of 128 x 128 fill the GPU; 4096 rows fill it in 3xTF32 too.
        let deep = Forward { batch: 128, n: 16384, k: 16384, precision: Precision::Tf32x3, ..f(Dtype::F32, None) };
        assert_eq!(plan(deep, 132, true), Plan::GemmThenRows { splits: 2 });
        assert_eq!(plan(Forward { precision: Precision::Tf32, ..deep }, 132, true), Plan::Fused);
        assert_eq!(plan(Forward { batch: 4096, ..deep }, 132, true), Plan::Fused);
        // 128 x 8192 x 8192: 32 TMA tiles, 4 ranges; TF32 64 tiles, 264 / 64 -> 4.
        let mid = Forward { batch: 128, n: 8192, k: 8192, precision: Precision::Tf32x3, ..f(Dtype::F32, None) };
        assert_eq!(plan(mid, 132, true), Plan::GemmThenRows { splits: 4 });
        assert_eq!(plan(Forward { precision: Precision::Tf32, ..mid }, 132, true), Plan::GemmThenRows { splits: 4 });
        // FP32's FMA kernel: 64 tiles of 128 x 128, the rounded-up count 264 / 64 -> 5;
        // without TMA, TF32's `gemm_wgmma` at most two blocks per SM: 4.
        assert_eq!(plan(Forward { precision: Precision::Fp32, ..mid }, 132, true), Plan::GemmThenRows { splits: 5 });
        assert_eq!(plan(Forward { precision: Precision::Tf32, ..mid }, 132, false), Plan::GemmThenRows { splits: 4 });
        // No range is empty: 65 bf16 k-tiles asked into 16 ranges run as 13 of 5; 5
        // TF32 k-tiles into 4, as 3 of 2.
        assert_eq!(tma_splits(128, 256, 65 * 64, Precision::Bf16, 132, None), 13);
        assert_eq!(tma_splits(128, 33 * 256, 5 * 32, Precision::Tf32, 132, Some(4)), 3);
        assert_eq!(tma_splits(128, 67 * 256, 8192, Precision::Bf16, 132, None), 1);
        // The tuning's count where the rule would split at all; 1 is unsplit.
        assert_eq!(tma_splits(128, 256, 8192, Precision::Bf16, 132, Some(5)), 5);
        assert_eq!(tma_splits(128, 67 * 256, 8192, Precision::Bf16, 132, Some(5)), 1);
        // dX over (m, k) with the depth n: 8 x 1024 x 4096 is 4 tiles, 16 ranges of 256;
        // 8 x 8192 x 8192 32 tiles, 4 ranges; 1024 rows fill the GPU unsplit.
        assert_eq!(dx_splits(8, 4096, 1024, 132, None), 16);
        assert_eq!(dx_splits(8, 8192, 8192, 132, None), 4);
        assert_eq!(dx_splits(1024, 8192, 8192, 132, None), 1);
        // FP32 tensors' dX: 8 tiles of 128 x 128 at 8 x 1024 x 4096, 16 ranges; 1 x 8192
        // x 8192 64 tiles, 4; 1024 rows unsplit.
        assert_eq!(dx_grid_splits(8, 4096, 1024, 132, None), 16);
        assert_eq!(dx_grid_splits(1, 8192, 8192, 132, None), 4);
        assert_eq!(dx_grid_splits(1024, 8192, 8192, 132, None), 1);
        // 4100 deep asked into 16 ranges of whole 32-value k-tiles: 15 of 288 (16 of 288
        // would leave the last one empty).
        assert_eq!(dx_grid_splits(8, 4100, 1024, 132, None), 15);
        // No range empty, as each kernel cuts them: `gemm_wgmma` ranges of `ceil(n / s)`
        // rounded up to whole k-tiles, the TMA pipeline `ceil(k_tiles / s)` k-tiles.
        for n in (256..9000).step_by(4) {
            for (m, k) in [(1, 64), (8, 1024), (40, 4096), (128, 264)] {
                for forced in [None, Some(5), Some(64)] {
                    let s = dx_grid_splits(m, n, k, 132, forced);
                    let bk = kernel_abi::gemm_wgmma::BLOCK_K;
                    let k_split = n.div_ceil(s).div_ceil(bk) * bk;
                    assert!((s - 1) * k_split < n, "wgmma dX {m} x {n} x {k} in {s} ranges of {k_split}");
                    if n % 8 == 0 {
                        let s = dx_splits(m, n, k, 132, forced);
                        let k_tiles = n.div_ceil(gemm_tma::BF16_BLOCK_K);
                        assert!((s - 1) * k_tiles.div_ceil(s) < k_tiles, "TMA dX {m} x {n} x {k} in {s} ranges");
                    }
                }
            }
        }
        assert_eq!(plan(Forward { split_k: Some(1), ..f(Dtype::Bf16, None) }, 132, true), Plan::Fused);
        assert_eq!(plan(Forward { split_k: Some(3), ..mid }, 132, false), Plan::GemmThenRows { splits: 3 });
        // A forced count the depth cannot take whole: 64 asked of 35 k-tiles, 35 ranges.
        assert_eq!(plan(Forward { split_k: Some(64), k: 1100, ..mid }, 132, false), Plan::GemmThenRows { splits: 35 });

        let small = Forward { batch: 8, ..f(Dtype::Bf16, None) };
        let fma = |chain| Plan::Gemv { chain, tensor_cores: false };
        assert_eq!(plan(small, 132, true), fma(true));
        assert_eq!(plan(Forward { gemv_chain: false, ..small }, 132, true), fma(false));
        // On the tensor cores: up to GEMV_TC_ROWS rows where it wins (`gemv_tc_wins`).
        let tc = Forward { gemv_tc: true, ..small };
        for batch in [1, 9, GEMV_TC_ROWS] {
            let want = Plan::Gemv { chain: true, tensor_cores: true };
            assert_eq!(plan(Forward { batch, ..tc }, 132, true), want, "{batch} rows");
        }
        assert_eq!(
            plan(Forward { gemv_chain: false, ..tc }, 132, true),
            Plan::Gemv { chain: false, tensor_cores: true }
        );
        for not_gemv in [
            Forward { batch: GEMV_TC_ROWS + 1, ..tc },
            Forward { batch: 32, n: 8192, ..tc },
            Forward { batch: 1, n: 1024, k: 8192, ..tc },
            Forward { k: 4092, ..tc },
            Forward { gemv: false, ..tc },
            Forward { gemv: false, ..small },
            Forward { batch: 9, ..small },
            Forward { batch: 0, ..small },
            Forward { w_aligned: false, ..small },
            Forward { folded: Some(FoldedAs::Means), ..small },
            Forward { folded: Some(FoldedAs::Halves), ..small },
            Forward { k: 4092, ..small },
            Forward { gemv_chain: false, rows_fit: false, ..small },
        ] {
            assert!(!matches!(plan(not_gemv, 132, true), Plan::Gemv { .. }), "{not_gemv:?}");
        }
    }

    /// The tensor-core small-batch kernel where the measurements had it ahead of the
    /// tile GEMMs: its blocks in one wave, and not a handful of them each streaming a
    /// deep `k`.
    #[test]
    fn gemv_tc_wins_where_measured() {
        let sms = 132;
        // 8192 columns: 256 blocks, two per SM up to 24 rows.
        assert!(gemv_tc_wins(24, 8192, 8192, sms) && !gemv_tc_wins(25, 8192, 8192, sms));
        assert!(gemv_tc_wins(24, 1024, 8192, sms) && !gemv_tc_wins(32, 1024, 8192, sms));
        // 4096 columns: 128 blocks, one wave at any row count up to the cap.
        assert!(gemv_tc_wins(GEMV_TC_ROWS, 4096, 4096, sms) && !gemv_tc_wins(GEMV_TC_ROWS + 1, 4096, 4096, sms));
        // 1024 columns: 32 blocks, a shallow `k` only.
        assert!(gemv_tc_wins(48, 1024, 1024, sms) && gemv_tc_wins(1, 2048, 1024, sms));
        assert!(!gemv_tc_wins(1, 4096, 1024, sms) && !gemv_tc_wins(8, 8192, 1024, sms));
    }

    /// The small-batch kernel's slab holds whole groups and divides `n`; ops that need
    /// whole rows leave the chain to the row-wise epilogue.
    #[test]
    fn gemv_slabs_hold_whole_groups() {
        let gn = |groups| Op::GroupNorm { groups, eps: 1e-5 };
        let swish = Op::of(kernel_abi::ops::Pointwise::Swish);
        assert!(gemv_chain_fits(&[], 4096));
        assert!(gemv_chain_fits(&[swish], 96));
        assert!(gemv_chain_fits(&[gn(256), swish], 8192)); // groups of 32
        assert!(gemv_chain_fits(&[gn(512), swish], 8192)); // of 16
        assert!(!gemv_chain_fits(&[gn(64)], 8192)); // of 128: wider than a slab
        assert!(!gemv_chain_fits(&[swish], 100)); // n not whole slabs
        assert!(!gemv_chain_fits(&[Op::RowMax], 4096));
        assert!(!gemv_chain_fits(&[Op::AvgPool(4)], 4096));
        use Precision::*;
        assert_eq!(gemv_kernel(Dtype::Bf16, Dtype::Bf16, Bf16, false), Kernel::GemvBf16ToBf16);
        assert_eq!(gemv_kernel(Dtype::Bf16, Dtype::Bf16, Bf16, true), Kernel::GemvTcBf16ToBf16);
        assert_eq!(gemv_kernel(Dtype::Bf16, Dtype::F32, Bf16, true), Kernel::GemvTcBf16);
        assert_eq!(gemv_kernel(Dtype::F32, Dtype::F32, Tf32, true), Kernel::GemvTcTf32);
        assert_eq!(gemv_kernel(Dtype::F32, Dtype::F32, Tf32, false), Kernel::GemvF32);
        // Strict FP32, 3xTF32 and FP32 tensors at bf16 precision have no tensor-core kernel.
        assert!(gemv_tc_serves(Dtype::Bf16, Bf16) && gemv_tc_serves(Dtype::F32, Tf32));
        assert!(!gemv_tc_serves(Dtype::F32, Fp32) && !gemv_tc_serves(Dtype::F32, Bf16));
        assert!(!gemv_tc_serves(Dtype::F32, Tf32x3));
    }

    /// Folds: a leading AvgPool, and a leading row sum or mean after `bias` ops and then
    /// constant scalings (the biases into the Linear's, the scalings moved after the
    /// mean, a sum's width as one more); nothing else.
    #[test]
    fn leading_means_and_sums_fold_into_the_weight() {
        use kernel_abi::ops::Pointwise::Scale;
        let spec = |chain: &str| crate::BlockSpec::new(64, 4096, chain.parse().unwrap()).unwrap();
        let fold_of = |chain: &str| fold(&spec(chain));
        assert_eq!(fold_of("avgpool(16),gelu"), Some(Fold { pool: 16, first_op: 1, before: vec![], biases: 0 }));
        assert_eq!(fold_of("mean,max"), Some(Fold { pool: 4096, first_op: 1, before: vec![], biases: 0 }));
        // KernelBench 51's chain: its subtraction is a `bias` op.
        let biased = Fold { pool: 4096, first_op: 2, before: vec![], biases: 1 };
        assert_eq!(fold_of("bias,mean,logsumexp,gelu"), Some(biased));
        let two = fold_of("bias,bias,double,sum").unwrap();
        let doubled = vec![Op::Pointwise(Scale, [2.0, 0.0]), Op::Pointwise(Scale, [4096.0, 0.0])];
        assert_eq!(two, Fold { pool: 4096, first_op: 4, before: doubled, biases: 2 });
        let sum = fold_of("scale(0.5),double,sum,scale(1.5)").unwrap();
        let want = vec![
            Op::Pointwise(Scale, [0.5, 0.0]),
            Op::Pointwise(Scale, [2.0, 0.0]),
            Op::Pointwise(Scale, [4096.0, 0.0]),
        ];
        assert_eq!(sum, Fold { pool: 4096, first_op: 3, before: want, biases: 0 });
        // A bias after a scaling, a per-feature multiply, a bias before a non-reduction: not.
        let not_folded = ["", "gelu,sum", "scale(2),bias,sum", "mul,sum", "bias,max", "max,sum", "logsumexp"];
        for not in not_folded.into_iter().chain(["scale(2),min", "swish,avgpool(4)", "bias,avgpool(4)"]) {
            assert_eq!(fold_of(not), None, "{not}");
        }
        assert_eq!(gemm_width(&spec("scale(3),sum")), 1);
        assert_eq!(gemm_width(&spec("bias,mean,logsumexp,gelu")), 1);
        assert_eq!(gemm_width(&spec("scale(2),bias,sum")), 4096);
        assert_eq!(gemm_width(&spec("avgpool(16)")), 256);
        assert_eq!(gemm_width(&spec("gelu,sum")), 4096);
    }

    /// A chain that needs whole rows is refused over rows wider than the row-wise
    /// kernels take; a fusable one, or a leading AvgPool's folded width, is not.
    #[test]
    fn rows_wider_than_the_row_kernels_are_named() {
        let limit = kernel_abi::epilogue::max_row_features(true);
        let spec = |out: usize, ops: &str| crate::BlockSpec::new(8, out, ops.parse().unwrap()).unwrap();
        assert!(rows_too_wide(&spec(32768, "sigmoid,sum")).is_some_and(|why| why.contains("`sum`")));
        assert!(rows_too_wide(&spec(limit, "sigmoid,sum")).is_none());
        assert!(rows_too_wide(&spec(32768, "swish,scale(2)")).is_none());
        assert!(rows_too_wide(&spec(32768, "avgpool(2),gelu,max")).is_none());
        assert!(rows_fit(limit, kernel_abi::epilogue::SM90_MAX_SHARED_OPTIN));
    }
}

//! Every entry point of `kernels-gpu`, by identifier: its name in the PTX and its launch
//! bounds. Host launches load kernels through these identifiers, and `host/build.rs`
//! writes the launch bounds into the PTX from [`Kernel::ALL`]; `tests/ptx.rs` checks
//! that the identifiers and the PTX's entries are the same set.

use crate::{batch_norm, dot, epilogue, fp8, gemm_fma, gemm_mma, gemm_tma, gemm_wgmma, gemv, gemv_tc, kinks};

/// `__launch_bounds__(max_threads, min_blocks_per_sm)`, which rustc cannot express:
/// `host/build.rs` writes them into the PTX (`.maxntid`, `.minnctapersm`) so that
/// ptxas caps each kernel's registers to fit that many blocks per SM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchBounds {
    pub max_threads: u32,
    pub min_blocks_per_sm: u32,
}

/// Declares [`Kernel`]: each variant with its entry point's name and, where it has
/// them, its launch bounds `(threads, blocks per SM)`.
macro_rules! kernels {
    ($($(#[$doc:meta])* $variant:ident = $name:literal $(, bounds($threads:expr, $blocks:expr))?;)*) => {
        /// A kernel entry point of `kernels-gpu` (see the module).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum Kernel {
            $($(#[$doc])* $variant,)*
        }

        impl Kernel {
            /// Every kernel, in the order declared.
            pub const ALL: &'static [Kernel] = &[$(Kernel::$variant,)*];

            /// The entry point's name in the PTX.
            pub const fn name(self) -> &'static str {
                match self {
                    $(Kernel::$variant => $name,)*
                }
            }

            /// The launch bounds the PTX carries for this kernel, if any.
            pub const fn launch_bounds(self) -> Option<LaunchBounds> {
                match self {
                    $(Kernel::$variant => kernels!(@bounds $($threads, $blocks)?),)*
                }
            }
        }
    };
    (@bounds) => { None };
    (@bounds $threads:expr, $blocks:expr) => {
        Some(LaunchBounds { max_threads: $threads as u32, min_blocks_per_sm: $blocks as u32 })
    };
}

kernels! {
    // The register-blocked FP32 GEMMs (`gemm/fma.rs`): 2 blocks per SM, 128 registers.
    GemmFmaNtVec4 = "gemm_fma_nt_vec4", bounds(gemm_fma::THREADS, gemm_fma::MIN_BLOCKS_PER_SM);
    GemmFmaNtScalar = "gemm_fma_nt_scalar", bounds(gemm_fma::THREADS, gemm_fma::MIN_BLOCKS_PER_SM);
    GemmFmaNnVec4 = "gemm_fma_nn_vec4", bounds(gemm_fma::THREADS, gemm_fma::MIN_BLOCKS_PER_SM);
    GemmFmaNnScalar = "gemm_fma_nn_scalar", bounds(gemm_fma::THREADS, gemm_fma::MIN_BLOCKS_PER_SM);
    GemmFmaTnVec4 = "gemm_fma_tn_vec4", bounds(gemm_fma::THREADS, gemm_fma::MIN_BLOCKS_PER_SM);
    GemmFmaTnScalar = "gemm_fma_tn_scalar", bounds(gemm_fma::THREADS, gemm_fma::MIN_BLOCKS_PER_SM);

    // The `mma.sync` GEMMs (`gemm/mma.rs`): 2 blocks per SM (128 registers),
    // except the 3xTF32 forward (its two `ldmatrix` operands and their residuals need
    // ~8 registers more: ptxas spills at 128) and the bf16 and fp16 kernels (two TF32
    // steps' words feed one `m16n8k16`): 1 block per SM.
    GemmMmaTf32NtVec4 = "gemm_mma_tf32_nt_vec4", bounds(gemm_mma::THREADS, 2);
    GemmMmaTf32NtScalar = "gemm_mma_tf32_nt_scalar", bounds(gemm_mma::THREADS, 2);
    GemmMmaTf32NnVec4 = "gemm_mma_tf32_nn_vec4", bounds(gemm_mma::THREADS, 2);
    GemmMmaTf32NnScalar = "gemm_mma_tf32_nn_scalar", bounds(gemm_mma::THREADS, 2);
    GemmMmaTf32TnVec4 = "gemm_mma_tf32_tn_vec4", bounds(gemm_mma::THREADS, 2);
    GemmMmaTf32TnScalar = "gemm_mma_tf32_tn_scalar", bounds(gemm_mma::THREADS, 2);
    GemmMmaBf16NtVec4 = "gemm_mma_bf16_nt_vec4", bounds(gemm_mma::THREADS, 1);
    GemmMmaBf16NtScalar = "gemm_mma_bf16_nt_scalar", bounds(gemm_mma::THREADS, 1);
    GemmMmaBf16NnVec4 = "gemm_mma_bf16_nn_vec4", bounds(gemm_mma::THREADS, 1);
    GemmMmaBf16NnScalar = "gemm_mma_bf16_nn_scalar", bounds(gemm_mma::THREADS, 1);
    GemmMmaBf16TnVec4 = "gemm_mma_bf16_tn_vec4", bounds(gemm_mma::THREADS, 1);
    GemmMmaBf16TnScalar = "gemm_mma_bf16_tn_scalar", bounds(gemm_mma::THREADS, 1);
    GemmMmaF16NtVec4 = "gemm_mma_f16_nt_vec4", bounds(gemm_mma::THREADS, 1);
    GemmMmaF16NtScalar = "gemm_mma_f16_nt_scalar", bounds(gemm_mma::THREADS, 1);
    GemmMmaF16NnVec4 = "gemm_mma_f16_nn_vec4", bounds(gemm_mma::THREADS, 1);
    GemmMmaF16NnScalar = "gemm_mma_f16_nn_scalar", bounds(gemm_mma::THREADS, 1);
    GemmMmaF16TnVec4 = "gemm_mma_f16_tn_vec4", bounds(gemm_mma::THREADS, 1);
    GemmMmaF16TnScalar = "gemm_mma_f16_tn_scalar", bounds(gemm_mma::THREADS, 1);
    GemmMmaTf32x3NtVec4 = "gemm_mma_tf32x3_nt_vec4", bounds(gemm_mma::THREADS, 1);
    GemmMmaTf32x3NtScalar = "gemm_mma_tf32x3_nt_scalar", bounds(gemm_mma::THREADS, 1);
    GemmMmaTf32x3NnVec4 = "gemm_mma_tf32x3_nn_vec4", bounds(gemm_mma::THREADS, 2);
    GemmMmaTf32x3NnScalar = "gemm_mma_tf32x3_nn_scalar", bounds(gemm_mma::THREADS, 2);
    GemmMmaTf32x3TnVec4 = "gemm_mma_tf32x3_tn_vec4", bounds(gemm_mma::THREADS, 2);
    GemmMmaTf32x3TnScalar = "gemm_mma_tf32x3_tn_scalar", bounds(gemm_mma::THREADS, 2);

    // The `wgmma` GEMMs (`gemm/wgmma.rs`): TF32 keeps 64 accumulators and no fragments
    // (2 blocks per SM); 3xTF32 also holds `A` fragments and needs 193 KiB of shared
    // memory (1 block per SM).
    GemmWgmmaTf32NtVec4 = "gemm_wgmma_tf32_nt_vec4", bounds(gemm_wgmma::THREADS, 2);
    GemmWgmmaTf32x3NtVec4 = "gemm_wgmma_tf32x3_nt_vec4", bounds(gemm_wgmma::THREADS, 1);
    GemmWgmmaTf32DxVec4 = "gemm_wgmma_tf32_dx_vec4", bounds(gemm_wgmma::THREADS, 2);
    GemmWgmmaTf32x3DxVec4 = "gemm_wgmma_tf32x3_dx_vec4", bounds(gemm_wgmma::THREADS, 1);
    GemmWgmmaTf32DwVec4 = "gemm_wgmma_tf32_dw_vec4", bounds(gemm_wgmma::THREADS, 2);
    GemmWgmmaTf32x3DwVec4 = "gemm_wgmma_tf32x3_dw_vec4", bounds(gemm_wgmma::THREADS, 1);

    // The TMA-fed, warp-specialised `wgmma` GEMMs (`gemm/tma/`): one producer warpgroup
    // and two consumer warpgroups holding 128 accumulators each, 1 block per SM: 168
    // registers at entry, then `setmaxnreg` moves the producer's to the consumers (24
    // and 240 per thread).
    GemmTmaTf32Nt = "gemm_tma_tf32_nt", bounds(gemm_tma::THREADS, 1);
    GemmTmaTf32x3Nt = "gemm_tma_tf32x3_nt", bounds(gemm_tma::THREADS, 1);
    GemmTmaBf16Nt = "gemm_tma_bf16_nt", bounds(gemm_tma::THREADS, 1);
    // bf16 tensors as stored, bf16 out: the forward, `dX` and `dW`.
    GemmTmaBf16NtToBf16 = "gemm_tma_bf16_nt_to_bf16", bounds(gemm_tma::THREADS, 1);
    GemmTmaBf16NnToBf16 = "gemm_tma_bf16_nn_to_bf16", bounds(gemm_tma::THREADS, 1);
    GemmTmaBf16TnToBf16 = "gemm_tma_bf16_tn_to_bf16", bounds(gemm_tma::THREADS, 1);
    GemmTmaBf16Tn = "gemm_tma_bf16_tn", bounds(gemm_tma::THREADS, 1);
    // `dX` at few rows, split-K into FP32 partial products.
    GemmTmaBf16Nn = "gemm_tma_bf16_nn", bounds(gemm_tma::THREADS, 1);
    // The forward split-K into FP32 partial products (no bias or chain).
    GemmTmaBf16NtSplit = "gemm_tma_bf16_nt_split", bounds(gemm_tma::THREADS, 1);
    // The same seven in fp16.
    GemmTmaF16Nt = "gemm_tma_f16_nt", bounds(gemm_tma::THREADS, 1);
    GemmTmaF16NtToF16 = "gemm_tma_f16_nt_to_f16", bounds(gemm_tma::THREADS, 1);
    GemmTmaF16NnToF16 = "gemm_tma_f16_nn_to_f16", bounds(gemm_tma::THREADS, 1);
    GemmTmaF16TnToF16 = "gemm_tma_f16_tn_to_f16", bounds(gemm_tma::THREADS, 1);
    GemmTmaF16Tn = "gemm_tma_f16_tn", bounds(gemm_tma::THREADS, 1);
    GemmTmaF16Nn = "gemm_tma_f16_nn", bounds(gemm_tma::THREADS, 1);
    GemmTmaF16NtSplit = "gemm_tma_f16_nt_split", bounds(gemm_tma::THREADS, 1);
    GemmTmaE4m3Nt = "gemm_tma_e4m3_nt", bounds(gemm_tma::THREADS, 1);
    GemmTmaE4m3NtToBf16 = "gemm_tma_e4m3_nt_to_bf16", bounds(gemm_tma::THREADS, 1);
    GemmTmaE4m3NtToF16 = "gemm_tma_e4m3_nt_to_f16", bounds(gemm_tma::THREADS, 1);
    GemmTmaTf32Tk = "gemm_tma_tf32_tk", bounds(gemm_tma::THREADS, 1);
    GemmTmaTf32TkT = "gemm_tma_tf32_tk_t", bounds(gemm_tma::THREADS, 1);
    GemmTmaTf32x3Tk = "gemm_tma_tf32x3_tk", bounds(gemm_tma::THREADS, 1);
    GemmTmaTf32x3TkT = "gemm_tma_tf32x3_tk_t", bounds(gemm_tma::THREADS, 1);

    // The small-batch forward (`gemm/gemv.rs`): FP32, bf16 or fp16 `x` and `W`, the
    // chain on the block's slab, `y` in FP32 or the operands' type. Two blocks per SM (128 registers): more
    // warps in flight measured faster than a second slice of `W` in registers at one.
    GemvF32 = "gemv_f32", bounds(gemv::THREADS, 2);
    GemvBf16 = "gemv_bf16", bounds(gemv::THREADS, 2);
    GemvBf16ToBf16 = "gemv_bf16_to_bf16", bounds(gemv::THREADS, 2);
    GemvF16 = "gemv_f16", bounds(gemv::THREADS, 2);
    GemvF16ToF16 = "gemv_f16_to_f16", bounds(gemv::THREADS, 2);

    // The tensor-core small-batch forward (`gemm/gemv_tc.rs`): `mma.sync` bf16, fp16 or
    // TF32, up to 64 rows; two blocks per SM where its shared memory allows (up to
    // 24 rows), so at most 128 registers.
    GemvTcBf16 = "gemv_tc_bf16", bounds(gemv_tc::THREADS, 2);
    GemvTcBf16ToBf16 = "gemv_tc_bf16_to_bf16", bounds(gemv_tc::THREADS, 2);
    GemvTcF16 = "gemv_tc_f16", bounds(gemv_tc::THREADS, 2);
    GemvTcF16ToF16 = "gemv_tc_f16_to_f16", bounds(gemv_tc::THREADS, 2);
    GemvTcTf32 = "gemv_tc_tf32", bounds(gemv_tc::THREADS, 2);
    // `dX` of at most eight rows on the same tensor cores (`gemm/dx_tc.rs`): a 16-bit
    // model's `dZ` and `W` as stored, `dX` in their type or, split over `W`'s rows,
    // FP32 partial sums.
    DxTcBf16 = "dx_tc_bf16", bounds(gemv_tc::THREADS, 2);
    DxTcBf16Parts = "dx_tc_bf16_parts", bounds(gemv_tc::THREADS, 2);
    DxTcF16 = "dx_tc_f16", bounds(gemv_tc::THREADS, 2);
    DxTcF16Parts = "dx_tc_f16_parts", bounds(gemv_tc::THREADS, 2);

    // The epilogue chain on whole rows and tiles, its backward, the kink scan and
    // refinement (`epilogue/`). The tile-wise backward and the refinements carry the
    // blocks per SM their grids are sized for.
    EpilogueRows = "epilogue_rows";
    EpilogueRowsBf16 = "epilogue_rows_bf16";
    EpilogueRowsF16 = "epilogue_rows_f16";
    EpilogueRowsNarrow = "epilogue_rows_narrow";
    EpilogueRowsNarrowBf16 = "epilogue_rows_narrow_bf16";
    EpilogueRowsNarrowF16 = "epilogue_rows_narrow_f16";
    EpilogueRowsBackward = "epilogue_rows_backward",
        bounds(epilogue::ROW_THREADS, epilogue::ROW_BACKWARD_BLOCKS_PER_SM);
    EpilogueRowsBackwardBf16 = "epilogue_rows_backward_bf16",
        bounds(epilogue::ROW_THREADS, epilogue::ROW_BACKWARD_BLOCKS_PER_SM);
    EpilogueRowsBackwardF16 = "epilogue_rows_backward_f16",
        bounds(epilogue::ROW_THREADS, epilogue::ROW_BACKWARD_BLOCKS_PER_SM);
    EpilogueRowsBackwardNarrow = "epilogue_rows_backward_narrow",
        bounds(epilogue::NARROW_ROW_THREADS, epilogue::NARROW_ROW_BACKWARD_BLOCKS_PER_SM);
    EpilogueRowsBackwardNarrowBf16 = "epilogue_rows_backward_narrow_bf16",
        bounds(epilogue::NARROW_ROW_THREADS, epilogue::NARROW_ROW_BACKWARD_BLOCKS_PER_SM);
    EpilogueRowsBackwardNarrowF16 = "epilogue_rows_backward_narrow_f16",
        bounds(epilogue::NARROW_ROW_THREADS, epilogue::NARROW_ROW_BACKWARD_BLOCKS_PER_SM);
    EpilogueTilesBackward = "epilogue_tiles_backward",
        bounds(epilogue::TILE_THREADS, epilogue::TILES_BACKWARD_BLOCKS_PER_SM);
    EpilogueTilesBackwardBf16 = "epilogue_tiles_backward_bf16",
        bounds(epilogue::TILE_THREADS, epilogue::TILES_BACKWARD_BLOCKS_PER_SM);
    EpilogueTilesBackwardF16 = "epilogue_tiles_backward_f16",
        bounds(epilogue::TILE_THREADS, epilogue::TILES_BACKWARD_BLOCKS_PER_SM);
    EpilogueSplitTiles = "epilogue_split_tiles";
    EpilogueSplitTilesBf16 = "epilogue_split_tiles_bf16";
    EpilogueSplitTilesF16 = "epilogue_split_tiles_f16";
    // The same without bias or chain: split ranges added and rounded.
    SplitSums = "split_sums";
    SplitSumsBf16 = "split_sums_bf16";
    SplitSumsF16 = "split_sums_f16";
    SumPartials = "sum_partials";
    SumPartialsTo = "sum_partials_to";
    RowPartialsFinish = "row_partials_finish";
    RowPartialsFinishBf16 = "row_partials_finish_bf16";
    RowPartialsFinishF16 = "row_partials_finish_f16";
    KinkScan = "kink_scan";
    KinkScanTiles = "kink_scan_tiles";
    RefineOrder = "refine_order";
    RefineZ = "refine_z", bounds(kinks::REFINE_THREADS, 2);
    RefineValues = "refine_values", bounds(epilogue::ROW_THREADS, kinks::REFINE_VALUES_BLOCKS_PER_SM);

    // Elementwise kernels (`elementwise.rs`), the optimisers (`optim.rs`).
    AddAssign = "add_assign";
    FoldRowsMean = "fold_rows_mean";
    FoldRowsMeanBf16 = "fold_rows_mean_bf16";
    FoldRowsMeanF16 = "fold_rows_mean_f16";
    FoldRowsMeanHalvesBf16 = "fold_rows_mean_halves_bf16";
    FoldRowsMeanHalvesF16 = "fold_rows_mean_halves_f16";
    FoldRowsMeanF32HalvesBf16 = "fold_rows_mean_f32_halves_bf16";
    FoldRowsMeanF32HalvesF16 = "fold_rows_mean_f32_halves_f16";
    UnfoldRowsMeanGrad = "unfold_rows_mean_grad";
    UnfoldRowsMeanGradToBf16 = "unfold_rows_mean_grad_to_bf16";
    UnfoldRowsMeanGradToF16 = "unfold_rows_mean_grad_to_f16";
    // The folded layer of one column (`dot.rs`).
    ColumnDot = "column_dot", bounds(dot::THREADS, dot::BLOCKS_PER_SM);
    ColumnDotBf16 = "column_dot_bf16", bounds(dot::THREADS, dot::BLOCKS_PER_SM);
    ColumnDotF16 = "column_dot_f16", bounds(dot::THREADS, dot::BLOCKS_PER_SM);
    RowDot = "row_dot", bounds(dot::THREADS, dot::BLOCKS_PER_SM);
    RowDotBf16 = "row_dot_bf16", bounds(dot::THREADS, dot::BLOCKS_PER_SM);
    RowDotF16 = "row_dot_f16", bounds(dot::THREADS, dot::BLOCKS_PER_SM);
    Outer = "outer", bounds(dot::THREADS, dot::BLOCKS_PER_SM);
    OuterBf16 = "outer_bf16", bounds(dot::THREADS, dot::BLOCKS_PER_SM);
    OuterF16 = "outer_f16", bounds(dot::THREADS, dot::BLOCKS_PER_SM);
    OuterSumBf16 = "outer_sum_bf16", bounds(dot::THREADS, dot::BLOCKS_PER_SM);
    OuterSumF16 = "outer_sum_f16", bounds(dot::THREADS, dot::BLOCKS_PER_SM);
    ColumnDots = "column_dots", bounds(dot::THREADS, dot::COLUMN_DOTS_BLOCKS_PER_SM);
    ColumnDotsBf16 = "column_dots_bf16", bounds(dot::THREADS, dot::COLUMN_DOTS_BLOCKS_PER_SM);
    ColumnDotsF16 = "column_dots_f16", bounds(dot::THREADS, dot::COLUMN_DOTS_BLOCKS_PER_SM);
    Transpose = "transpose";
    TransposeVec4 = "transpose_vec4";
    TransposeVec4ToBf16 = "transpose_vec4_to_bf16";
    TransposeVec4ToF16 = "transpose_vec4_to_f16";
    F32ToBf16 = "f32_to_bf16";
    Bf16ToF32 = "bf16_to_f32";
    F32ToF16 = "f32_to_f16";
    F16ToF32 = "f16_to_f32";
    StoreWords = "store_words";
    ConvertVectors = "convert_vectors";
    MseLossGrad = "mse_loss_grad";
    SgdStep = "sgd_step";
    AdamStep = "adam_step";

    // FP8 operands (`fp8.rs`).
    Fp8QuantiseRowsF32 = "fp8_quantise_rows_f32", bounds(fp8::ROW_THREADS, 1);
    Fp8QuantiseRowsBf16 = "fp8_quantise_rows_bf16", bounds(fp8::ROW_THREADS, 1);
    Fp8QuantiseRowsF16 = "fp8_quantise_rows_f16", bounds(fp8::ROW_THREADS, 1);
    Fp8ColumnAmaxF32 = "fp8_column_amax_f32", bounds(256, 1);
    Fp8ColumnAmaxBf16 = "fp8_column_amax_bf16", bounds(256, 1);
    Fp8ColumnAmaxF16 = "fp8_column_amax_f16", bounds(256, 1);
    Fp8QuantiseColumnsTF32 = "fp8_quantise_columns_t_f32", bounds(256, 1);
    Fp8QuantiseColumnsTBf16 = "fp8_quantise_columns_t_bf16", bounds(256, 1);
    Fp8QuantiseColumnsTF16 = "fp8_quantise_columns_t_f16", bounds(256, 1);
    Fp8TransposeWeight = "fp8_transpose_weight", bounds(256, 1);
    // BatchNorm on batch statistics (`batch_norm.rs`).
    BatchNormStats = "batch_norm_stats", bounds(batch_norm::THREADS, batch_norm::STATS_BLOCKS_PER_SM);
    BatchNormFinish = "batch_norm_finish";
    BatchNormGrad = "batch_norm_grad";
    BatchNormApply = "batch_norm_apply", bounds(batch_norm::THREADS, batch_norm::APPLY_BLOCKS_PER_SM);
    BatchNormApplyBf16 = "batch_norm_apply_bf16", bounds(batch_norm::THREADS, batch_norm::APPLY_BLOCKS_PER_SM);
    BatchNormApplyF16 = "batch_norm_apply_f16", bounds(batch_norm::THREADS, batch_norm::APPLY_BLOCKS_PER_SM);
    BatchNormBackwardSums = "batch_norm_backward_sums", bounds(batch_norm::THREADS, batch_norm::SUMS_BLOCKS_PER_SM);
    BatchNormBackwardSumsBf16 = "batch_norm_backward_sums_bf16", bounds(batch_norm::THREADS, batch_norm::SUMS_BLOCKS_PER_SM);
    BatchNormBackwardSumsF16 = "batch_norm_backward_sums_f16", bounds(batch_norm::THREADS, batch_norm::SUMS_BLOCKS_PER_SM);
    BatchNormBackwardDz = "batch_norm_backward_dz", bounds(batch_norm::THREADS, batch_norm::DZ_BLOCKS_PER_SM);
    BatchNormBackwardDzBf16 = "batch_norm_backward_dz_bf16", bounds(batch_norm::THREADS, batch_norm::DZ_BLOCKS_PER_SM);
    BatchNormBackwardDzF16 = "batch_norm_backward_dz_f16", bounds(batch_norm::THREADS, batch_norm::DZ_BLOCKS_PER_SM);
    // A tensor-parallel row max (`parallel.rs`).
    RowMaxKeys = "row_max_keys";
    RowMaxValues = "row_max_values";
    RowMaxGrad = "row_max_grad";
}

impl Kernel {
    /// The kernel whose entry point is `name`, if any.
    pub fn by_name(name: &str) -> Option<Kernel> {
        Kernel::ALL.iter().copied().find(|k| k.name() == name)
    }
}

impl AsRef<str> for Kernel {
    fn as_ref(&self) -> &str {
        self.name()
    }
}

impl core::fmt::Display for Kernel {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(self.name())
    }
}

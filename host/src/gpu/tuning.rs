//! Switches between the GPU backend's production paths, for A/B measurements: one
//! value ([`Tuning`]) carried by the [`Gpu`](super::Gpu) the work runs on, set through
//! the library ([`Gpu::with_tuning`](super::Gpu::with_tuning)) or the command line's
//! tuning flags. Nothing in the environment changes what runs.

/// Which production paths the GPU backend may take. [`Tuning::default`] is production:
/// every switch at its measured-best setting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tuning {
    /// Let the TF32, 3xTF32 and bf16 GEMMs run on the persistent TMA kernels where the
    /// dispatch table allows them (`gpu::dispatch::route`). Off (`--no-tma`),
    /// those GEMMs take the table's next row: the `gemm_wgmma` kernels, `mma.sync` for
    /// bf16. Default: on.
    pub tma: bool,
    /// Recompute the saved `z` exactly where its rounding could flip a kink's
    /// derivative, before the backward (`gpu::epilogue::kinks`). Off
    /// (`--no-kink-refinement`), the backward takes the derivatives at the forward's
    /// rounded `z`: faster, and off the exact function's gradients near kinks.
    /// Default: on.
    pub kink_refinement: bool,
    /// Where the tile scan walks the chain and it pays, hand a row's few doubtful values
    /// to `refine_values` one by one rather than by 16-column chunks to `refine_z`. Off
    /// (`--kink-chunks-only`), every chain is refined by chunks. Default: on.
    pub kink_values: bool,
    /// Print, after each refinement, how much of `z` was recomputed (`--kink-stats`;
    /// it waits for the GPU to read the counts): for tuning the error model. Default:
    /// off.
    pub kink_stats: bool,
    /// Let a forward of a few rows run a small-batch kernel (`gemv_*`, `gemv_tc_*`)
    /// where the dispatch allows (`gpu::dispatch::plan`). Off (`--no-gemv`), the tile
    /// GEMMs run every batch. Default: on.
    pub gemv: bool,
    /// Let the small-batch forward run on the tensor cores (`gemv_tc_*`, up to
    /// `dispatch::GEMV_TC_ROWS` rows where `dispatch::gemv_tc_wins`) for bf16 and fp16
    /// models and TF32. Off
    /// (`--no-gemv-tensor-cores`), the FP32-FMA `gemv_*` takes up to 8 rows and the
    /// tile GEMMs the rest. Default: on.
    pub gemv_tensor_cores: bool,
    /// Run a forward that the dispatch would split into `k` ranges (few tiles, a deep
    /// `k`: `gpu::dispatch::plan`) in this many instead (`--split-k N`; 1: unsplit;
    /// on the TMA kernels, fewer where ranges would be empty). Default: the dispatch's
    /// count.
    pub split_k: Option<usize>,
}

impl Default for Tuning {
    fn default() -> Tuning {
        Tuning {
            tma: true,
            kink_refinement: true,
            kink_values: true,
            kink_stats: false,
            gemv: true,
            gemv_tensor_cores: true,
            split_k: None,
        }
    }
}

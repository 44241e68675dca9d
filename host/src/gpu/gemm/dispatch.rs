//! The GEMM dispatch: which kernel family — and which of its kernels — runs each GEMM
//! of a Linear layer, in one table ([`route`]). The families' launchers only launch
//! the kernel a [`Route`] names; nothing else chooses.

use crate::precision::Precision;
use kernel_abi::Kernel;
use kernel_abi::gemm_tma::MIN_K;

/// Memory order of the operands of `y = A B^T` as a kernel reads them (see
/// `kernels-gpu/src/gemm/simt.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Both `k`-contiguous: the forward `x W^T`.
    Nt,
    /// `B` row-contiguous: `dX = dZ W`.
    Nn,
    /// Both row-contiguous: `dW = dZ^T X`.
    Tn,
    /// `A` row-contiguous, `B` `k`-contiguous: the tensor-core backward on `wgmma`
    /// (`dX^T = W^T dZ^T`, and `dW = dZ^T X` with `X` transposed first).
    Tk,
}

/// The GEMM kernel families, each with its launcher in a module of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// `gemm_f32_*`: strict FP32 on the FMA units, any alignment, split-K
    /// (kernels-gpu/src/gemm/simt.rs; launcher [`super::grid`]).
    Fma,
    /// `gemm_tc_*`: `mma.sync` TF32, 3xTF32 and bf16, any alignment, split-K
    /// (kernels-gpu/src/gemm/tensor_core.rs; launcher [`super::grid`]).
    MmaSync,
    /// `gemm_wg_*`: `wgmma` TF32 and 3xTF32 over 16-byte rows, split-K
    /// (kernels-gpu/src/gemm/wgmma.rs; launcher [`super::grid`]).
    Wgmma,
    /// `gemm_tma_*`: persistent, TMA-fed, warp-specialised `wgmma`, TF32, 3xTF32 and
    /// bf16 over 16-byte rows, `k >= MIN_K`, no split-K (kernels-gpu/src/gemm/tma/;
    /// launcher [`super::tma`]).
    Tma,
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

/// How one GEMM runs: its family and kernel, the layout the kernel reads, what is
/// transposed first, and whether the kernel stores `y^T`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Route {
    pub family: Family,
    pub kernel: Kernel,
    pub layout: Layout,
    pub transposed: Transposed,
    /// The kernel stores `y^T (n, m)` (`dX` through `dX^T = W^T dZ^T`).
    pub transpose_y: bool,
}

/// The dispatch table: the route of `role` in `precision` for a Linear layer of
/// `(m, n, k)` (batch, out, in features). `tma`: whether the TMA kernels may run
/// ([`Tuning::tma`](crate::gpu::Tuning::tma)); without them a TMA row is skipped and
/// the next row that fits runs. The first row that fits wins:
///
/// | role | precision | when | family: kernel | operands |
/// |------|-----------|------|----------------|----------|
/// | forward | tf32, tf32x3 | `k % 4 == 0`, `k >= MIN_K`, no split-K | TMA: `gemm_tma_{p}_nt` | `x`, `W` as stored (`Nt`) |
/// | | bf16 | `k % 8 == 0`, `k >= MIN_K`, no split-K | TMA: `gemm_tma_bf16_nt` | bf16 copies of `x`, `W` |
/// | | tf32, tf32x3 | `k % 4 == 0` | wgmma: `gemm_wg_{p}_nt_vec4` | as stored |
/// | | fp32 | always | FMA: `gemm_f32_nt_{vec4,scalar}` | as stored |
/// | | tf32, tf32x3, bf16 | otherwise | mma.sync: `gemm_tc_{p}_nt_{vec4,scalar}` | as stored |
/// | `dX` | tf32, tf32x3 | `n, k % 4 == 0`, `n >= MIN_K` | TMA: `gemm_tma_{p}_tk_t` | `dX^T = W^T dZ^T`, `W`, `dZ` as stored (`Tk`) |
/// | | tf32, tf32x3 | `n, k % 4 == 0` | wgmma: `gemm_wg_{p}_dx_vec4` | the same |
/// | | bf16 | `n % 8 == 0`, `n >= MIN_K` | TMA: `gemm_tma_bf16_nt` | `dZ`, `W^T` (transposed and rounded) |
/// | | fp32 | always | FMA: `gemm_f32_nn_{vec4,scalar}` | `dZ`, `W` as stored (`Nn`) |
/// | | tf32, tf32x3, bf16 | otherwise | mma.sync: `gemm_tc_{p}_nn_{vec4,scalar}` | the same |
/// | `dW` | tf32, tf32x3 | `m, n % 4 == 0`, `m >= MIN_K` | TMA: `gemm_tma_{p}_tk` | `dZ` as stored, `X^T` (`Tk`) |
/// | | tf32, tf32x3 | `m, n % 4 == 0` | wgmma: `gemm_wg_{p}_dw_vec4` | the same |
/// | | bf16 | `m % 8 == 0`, `m >= MIN_K` | TMA: `gemm_tma_bf16_nt` | `dZ^T`, `X^T` (transposed and rounded) |
/// | | fp32 | always | FMA: `gemm_f32_tn_{vec4,scalar}` | `dZ`, `X` as stored (`Tn`) |
/// | | tf32, tf32x3, bf16 | otherwise | mma.sync: `gemm_tc_{p}_tn_{vec4,scalar}` | the same |
///
/// `vec4` (16-byte loads) where both operands' row pitches are multiples of 4 floats:
/// `k` for the forward, `n` and `k` for `Nn` and `Tn`. The TMA kernels want 16-byte
/// row pitches (4 floats, or 8 values of the bf16 copies) and take the epilogue
/// between a tile's k-loops with the tensor cores idle, hence `MIN_K` (measured at
/// 1024 and 8192; `kernel_abi::gemm_tma::MIN_K`). The backward's bf16 GEMMs run as
/// `Nt` after transposing, since the bf16 TMA kernel reads `k`-contiguous rows only.
pub fn route(precision: Precision, role: Role, (m, n, k): (usize, usize, usize), tma: bool) -> Route {
    use Precision::{Bf16, Tf32, Tf32x3};
    let split = precision == Tf32x3;
    let fits = |dims: &[usize], by: usize| dims.iter().all(|d| d.is_multiple_of(by));
    // The TMA kernels: allowed, a deep enough reduction, no split-K.
    let deep = |depth: usize, splits: usize| tma && depth >= MIN_K && splits <= 1;
    match (role, precision) {
        (Role::Forward { splits }, Tf32 | Tf32x3) if fits(&[k], 4) && deep(k, splits) => {
            Route::tma(Layout::Nt, if split { Kernel::GemmTmaTf32x3Nt } else { Kernel::GemmTmaTf32Nt })
        }
        (Role::Forward { splits }, Bf16) if fits(&[k], 8) && deep(k, splits) => {
            Route::tma(Layout::Nt, Kernel::GemmTmaBf16Nt)
        }
        (Role::Forward { .. }, Tf32 | Tf32x3) if fits(&[k], 4) => {
            Route::wgmma(Layout::Nt, if split { Kernel::GemmWgTf32x3NtVec4 } else { Kernel::GemmWgTf32NtVec4 })
        }
        (Role::Forward { .. }, _) => Route::grid(precision, Stored::Nt, fits(&[k], 4)),

        (Role::GradInput, Tf32 | Tf32x3) if fits(&[n, k], 4) && deep(n, 1) => Route {
            transpose_y: true,
            ..Route::tma(Layout::Tk, if split { Kernel::GemmTmaTf32x3TkT } else { Kernel::GemmTmaTf32TkT })
        },
        (Role::GradInput, Tf32 | Tf32x3) if fits(&[n, k], 4) => Route {
            transpose_y: true,
            ..Route::wgmma(Layout::Tk, if split { Kernel::GemmWgTf32x3DxVec4 } else { Kernel::GemmWgTf32DxVec4 })
        },
        (Role::GradInput, Bf16) if fits(&[n], 8) && deep(n, 1) => {
            Route { transposed: Transposed::B, ..Route::tma(Layout::Nt, Kernel::GemmTmaBf16Nt) }
        }
        (Role::GradInput, _) => Route::grid(precision, Stored::Nn, fits(&[n, k], 4)),

        (Role::GradWeight, Tf32 | Tf32x3) if fits(&[m, n], 4) && deep(m, 1) => Route {
            transposed: Transposed::B,
            ..Route::tma(Layout::Tk, if split { Kernel::GemmTmaTf32x3Tk } else { Kernel::GemmTmaTf32Tk })
        },
        (Role::GradWeight, Tf32 | Tf32x3) if fits(&[m, n], 4) => Route {
            transposed: Transposed::B,
            ..Route::wgmma(Layout::Tk, if split { Kernel::GemmWgTf32x3DwVec4 } else { Kernel::GemmWgTf32DwVec4 })
        },
        (Role::GradWeight, Bf16) if fits(&[m], 8) && deep(m, 1) => {
            Route { transposed: Transposed::Both, ..Route::tma(Layout::Nt, Kernel::GemmTmaBf16Nt) }
        }
        (Role::GradWeight, _) => Route::grid(precision, Stored::Tn, fits(&[n, k], 4)),
    }
}

/// The layouts the FMA and `mma.sync` kernels read (`Tk` is `wgmma`'s alone).
#[derive(Clone, Copy)]
enum Stored {
    Nt,
    Nn,
    Tn,
}

impl Route {
    fn tma(layout: Layout, kernel: Kernel) -> Route {
        Route { family: Family::Tma, kernel, layout, transposed: Transposed::Nothing, transpose_y: false }
    }

    fn wgmma(layout: Layout, kernel: Kernel) -> Route {
        Route { family: Family::Wgmma, kernel, layout, transposed: Transposed::Nothing, transpose_y: false }
    }

    /// The FMA kernel (FP32) or the `mma.sync` one (the tensor-core precisions) for a
    /// layout, with 16-byte loads where `vec4`.
    fn grid(precision: Precision, stored: Stored, vec4: bool) -> Route {
        use Kernel::*;
        use Stored::{Nn, Nt, Tn};
        let pick = |v: Kernel, s: Kernel| if vec4 { v } else { s };
        let kernel = match (precision, stored) {
            (Precision::Fp32, Nt) => pick(GemmF32NtVec4, GemmF32NtScalar),
            (Precision::Fp32, Nn) => pick(GemmF32NnVec4, GemmF32NnScalar),
            (Precision::Fp32, Tn) => pick(GemmF32TnVec4, GemmF32TnScalar),
            (Precision::Tf32, Nt) => pick(GemmTcTf32NtVec4, GemmTcTf32NtScalar),
            (Precision::Tf32, Nn) => pick(GemmTcTf32NnVec4, GemmTcTf32NnScalar),
            (Precision::Tf32, Tn) => pick(GemmTcTf32TnVec4, GemmTcTf32TnScalar),
            (Precision::Tf32x3, Nt) => pick(GemmTcTf32x3NtVec4, GemmTcTf32x3NtScalar),
            (Precision::Tf32x3, Nn) => pick(GemmTcTf32x3NnVec4, GemmTcTf32x3NnScalar),
            (Precision::Tf32x3, Tn) => pick(GemmTcTf32x3TnVec4, GemmTcTf32x3TnScalar),
            (Precision::Bf16, Nt) => pick(GemmTcBf16NtVec4, GemmTcBf16NtScalar),
            (Precision::Bf16, Nn) => pick(GemmTcBf16NnVec4, GemmTcBf16NnScalar),
            (Precision::Bf16, Tn) => pick(GemmTcBf16TnVec4, GemmTcBf16TnScalar),
        };
        let family = if precision == Precision::Fp32 { Family::Fma } else { Family::MmaSync };
        let layout = match stored {
            Nt => Layout::Nt,
            Nn => Layout::Nn,
            Tn => Layout::Tn,
        };
        Route { family, kernel, layout, transposed: Transposed::Nothing, transpose_y: false }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kernel(p: Precision, role: Role, dims: (usize, usize, usize)) -> &'static str {
        route(p, role, dims, true).kernel.name()
    }

    /// The table's rows, at the edges of their conditions.
    #[test]
    fn kernels_are_chosen_by_precision_role_alignment_and_depth() {
        use Precision::*;
        let (deep, shallow) = (MIN_K, MIN_K / 2);
        let fwd = Role::Forward { splits: 1 };
        let split2 = Role::Forward { splits: 2 };
        // Forward: TMA for deep, 16-byte aligned `k` without split-K; else wgmma (TF32,
        // 3xTF32 with 16-byte rows) or mma.sync / FMA.
        assert_eq!(kernel(Tf32, fwd, (7, 9, deep)), "gemm_tma_tf32_nt");
        assert_eq!(kernel(Tf32x3, fwd, (7, 9, deep)), "gemm_tma_tf32x3_nt");
        assert_eq!(kernel(Tf32, split2, (7, 9, deep)), "gemm_wg_tf32_nt_vec4");
        assert_eq!(kernel(Tf32, fwd, (7, 9, shallow)), "gemm_wg_tf32_nt_vec4");
        assert_eq!(kernel(Tf32, fwd, (7, 9, deep + 1)), "gemm_tc_tf32_nt_scalar");
        assert_eq!(kernel(Bf16, fwd, (7, 9, deep)), "gemm_tma_bf16_nt");
        // bf16 rows of 4 values (8 bytes), a shallow `k`, split-K: mma.sync.
        assert_eq!(kernel(Bf16, fwd, (7, 9, deep + 4)), "gemm_tc_bf16_nt_vec4");
        assert_eq!(kernel(Bf16, fwd, (7, 9, shallow)), "gemm_tc_bf16_nt_vec4");
        assert_eq!(kernel(Bf16, split2, (7, 9, deep)), "gemm_tc_bf16_nt_vec4");
        assert_eq!(kernel(Fp32, fwd, (7, 9, deep)), "gemm_f32_nt_vec4");
        assert_eq!(kernel(Fp32, fwd, (7, 9, deep + 1)), "gemm_f32_nt_scalar");
        // dX: `Tk` with `W` and `dZ` as stored where `n` and `k` allow 16-byte rows (TMA
        // from `n = MIN_K`); bf16 on TMA after transposing `W`; else `Nn`.
        let dx = Role::GradInput;
        assert_eq!(kernel(Tf32, dx, (5, deep, 8)), "gemm_tma_tf32_tk_t");
        assert_eq!(kernel(Tf32x3, dx, (5, shallow, 8)), "gemm_wg_tf32x3_dx_vec4");
        assert_eq!(kernel(Tf32, dx, (5, deep, 9)), "gemm_tc_tf32_nn_scalar");
        assert_eq!(kernel(Bf16, dx, (5, deep, 9)), "gemm_tma_bf16_nt");
        assert_eq!(kernel(Bf16, dx, (5, deep + 4, 8)), "gemm_tc_bf16_nn_vec4");
        assert_eq!(kernel(Fp32, dx, (5, deep, 8)), "gemm_f32_nn_vec4");
        // dW: `Tk` with `dZ` as stored where `m` and `n` allow (TMA from `m = MIN_K`);
        // bf16 on TMA after transposing `dZ` and `X`; else `Tn`.
        let dw = Role::GradWeight;
        assert_eq!(kernel(Tf32, dw, (deep, 8, 9)), "gemm_tma_tf32_tk");
        assert_eq!(kernel(Tf32x3, dw, (4, 8, 9)), "gemm_wg_tf32x3_dw_vec4");
        assert_eq!(kernel(Tf32, dw, (deep, 9, 8)), "gemm_tc_tf32_tn_scalar");
        assert_eq!(kernel(Bf16, dw, (deep, 9, 9)), "gemm_tma_bf16_nt");
        assert_eq!(kernel(Bf16, dw, (deep + 4, 8, 8)), "gemm_tc_bf16_tn_vec4");
        assert_eq!(kernel(Fp32, dw, (deep, 8, 8)), "gemm_f32_tn_vec4");
        // What each route reads.
        let r = route(Tf32, dx, (5, deep, 8), true);
        assert!(r.transpose_y && r.layout == Layout::Tk && r.transposed == Transposed::Nothing);
        assert_eq!(route(Tf32, dw, (deep, 8, 9), true).transposed, Transposed::B);
        assert_eq!(route(Bf16, dx, (5, deep, 9), true).transposed, Transposed::B);
        assert_eq!(route(Bf16, dw, (deep, 9, 9), true).transposed, Transposed::Both);
    }

    /// Without the TMA kernels every GEMM takes the next row that fits: `wgmma` for
    /// TF32 and 3xTF32, `mma.sync` for bf16.
    #[test]
    fn without_tma_the_next_row_runs() {
        use Precision::*;
        let dims = (MIN_K, MIN_K, MIN_K);
        let r = |p, role| route(p, role, dims, false);
        assert_eq!(r(Tf32, Role::Forward { splits: 1 }).kernel, Kernel::GemmWgTf32NtVec4);
        assert_eq!(r(Tf32x3, Role::GradInput).kernel, Kernel::GemmWgTf32x3DxVec4);
        assert_eq!(r(Tf32, Role::GradWeight).kernel, Kernel::GemmWgTf32DwVec4);
        assert_eq!(r(Bf16, Role::Forward { splits: 1 }).kernel, Kernel::GemmTcBf16NtVec4);
        assert_eq!(r(Bf16, Role::GradInput).kernel, Kernel::GemmTcBf16NnVec4);
        assert_eq!(r(Bf16, Role::GradWeight).kernel, Kernel::GemmTcBf16TnVec4);
    }

    /// Over many shapes: every route's kernel belongs to its family and precision, has
    /// launch bounds, and only `wgmma` and TMA kernels read `Tk` or transpose `y`.
    #[test]
    fn every_route_is_consistent() {
        let sizes = [1, 4, 8, 12, MIN_K - 8, MIN_K, MIN_K + 4, MIN_K + 8, 3 * MIN_K + 1];
        for p in Precision::ALL {
            for role in [Role::Forward { splits: 1 }, Role::Forward { splits: 3 }, Role::GradInput, Role::GradWeight] {
                for (m, n, k) in
                    sizes.iter().flat_map(|&m| sizes.iter().flat_map(move |&n| sizes.map(move |k| (m, n, k))))
                {
                    for tma in [false, true] {
                        let r = route(p, role, (m, n, k), tma);
                        let name = r.kernel.name();
                        let family = match r.family {
                            Family::Fma => "gemm_f32_",
                            Family::MmaSync => "gemm_tc_",
                            Family::Wgmma => "gemm_wg_",
                            Family::Tma => "gemm_tma_",
                        };
                        assert!(name.starts_with(family), "{p} {role:?} ({m}, {n}, {k}): {name} in {:?}", r.family);
                        if p != Precision::Fp32 {
                            assert!(name.starts_with(&format!("{family}{p}_")), "{p} {role:?}: {name}");
                        }
                        assert!(r.kernel.launch_bounds().is_some(), "{name}");
                        assert!(tma || r.family != Family::Tma);
                        let tensor_cores = matches!(r.family, Family::Wgmma | Family::Tma);
                        assert!(tensor_cores || (r.layout != Layout::Tk && !r.transpose_y), "{name}");
                        assert!(!r.transpose_y || r.layout == Layout::Tk, "{name}");
                        if matches!(role, Role::Forward { splits: 3 }) {
                            assert_ne!(r.family, Family::Tma, "split-K on {name}");
                        }
                    }
                }
            }
        }
    }
}

//! Launchers of the GEMM kernels (`kernels-gpu/src/gemm`), by module:
//!
//! * [`dispatch`] — which family and kernel runs each GEMM of a Linear layer: the one
//!   table ([`dispatch::route`]) and the typed route it gives;
//! * [`linear`] — the layer's three GEMMs (forward with its fused epilogue, `dX`,
//!   `dW`): routes them, transposes operands where a route asks, checks, and hands
//!   each to its family's launcher;
//! * the launchers: [`grid`] for the three grid-of-tiles families (FMA `gemm_f32_*`,
//!   `mma.sync` `gemm_tc_*`, `wgmma` `gemm_wg_*`: one grid of tiles, one kernel
//!   signature, each family's stage depth and shared memory), and [`tma`] (the
//!   persistent TMA kernels, `gemm_tma_*`, with their tensor maps);
//! * [`args`] — the GEMM as a kernel reads it, and the arguments all kernels share.
//!
//! Nothing here depends on a family's launcher but [`linear`].

pub mod args;
pub mod dispatch;
pub mod grid;
pub mod linear;
pub mod tma;

pub use dispatch::{Family, Layout, Role, Route, Transposed, route};
pub use linear::{Gemm, forward_gemm, grad_input, grad_input_route, grad_weight, grad_weight_into, linear_dims};

use crate::chain::Op;
use kernel_abi::gemm_simt::{MAX_FUSED_GROUP, MIN_FUSED_GROUP};

/// Why the GEMMs' fused epilogue cannot apply `op` to `features` channels, or `None`
/// if it can.
pub fn not_fusable(op: &Op, features: usize) -> Option<String> {
    match *op {
        Op::AvgPool(_) | Op::RowMax | Op::Reduce(_) | Op::MaxPool(_) => Some(format!("`{op}` reduces across tiles")),
        Op::Softmax | Op::RmsNorm { .. } => Some(format!("`{op}` needs the whole row")),
        // Run as a GroupNorm of one group: fused where the row is such a group.
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

//! Launchers of the GEMM kernels (`kernels-gpu/src/gemm`); which family and kernel
//! runs each GEMM is [`super::dispatch::route`]'s to say. By module:
//!
//! * [`linear`] — the layer's three GEMMs (forward with its fused epilogue, `dX`,
//!   `dW`): routes them, transposes operands where a route asks, checks, and hands
//!   each to its family's launcher;
//! * the launchers: [`grid`] for the three grid-of-tiles families (FMA `gemm_fma_*`,
//!   `mma.sync` `gemm_mma_*`, `wgmma` `gemm_wgmma_*`: one grid of tiles, one kernel
//!   signature, each family's stage depth and shared memory), and [`tma`] (the
//!   persistent TMA kernels, `gemm_tma_*`, with their tensor maps);
//! * [`args`] — the GEMM as a kernel reads it, and the arguments all kernels share.
//!
//! Nothing here depends on a family's launcher but [`linear`].

pub mod args;
pub mod fp8;
pub mod gemv;
pub mod grid;
pub mod linear;
pub mod tma;

pub use super::dispatch::{Family, Layout, Role, Route, Storage, Transposed, route};
pub use linear::{Gemm, forward_gemm, grad_input, grad_input_route, grad_weight, grad_weight_into, linear_dims};

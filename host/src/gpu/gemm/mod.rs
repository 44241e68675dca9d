//! Launchers of the GEMM family (`kernels-gpu/src/gemm`).

pub mod tiled;
pub mod simt;

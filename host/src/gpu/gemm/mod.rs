//! Launchers of the GEMM family (`kernels-gpu/src/gemm`).

pub mod simt;
pub mod tiled;

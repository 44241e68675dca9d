//! The GEMM family: `y = x W^T + b` with `W` stored `(out, in)` row-major, as PyTorch does.

pub mod simt;
pub mod staged;
pub mod tensor_core;
pub mod tiled;
pub mod wgmma;

//! The GEMM family: `y = x W^T + b` with `W` stored `(out, in)` row-major, as PyTorch does.

pub mod tiled;
pub mod simt;

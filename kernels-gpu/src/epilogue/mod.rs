//! Epilogues: the chain of ops applied to a GEMM's output.
//!
//! `pointwise` holds each elementwise op's forward (and, beside it, its derivative);
//! `rows` is the kernel that runs a whole chain over rows of a finished GEMM output.

pub mod pointwise;
pub mod rows;

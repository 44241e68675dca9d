//! Host side of the fused Linear + epilogue blocks: tensors, chains, the CPU reference,
//! the CPU backend, the autograd tape, the CUDA runtime and the launchers of the
//! kernels in `kernels-gpu`.

// cudarc either loads CUDA at run time (the default) or, for candle's CUDA tensors, links it.
#[cfg(not(any(feature = "cuda-loading", feature = "candle-cuda")))]
compile_error!("host takes cudarc's loading mode (feature `cuda-loading`, the default) or `candle-cuda`");

pub mod block;
#[cfg(feature = "candle")]
pub mod candle;
pub mod chain;
pub mod check;
pub mod cli;
pub mod cpu;
pub mod error;
pub mod fp8;
pub mod gpu;
pub mod io;
pub mod parallel;
pub mod precision;
pub mod reference;
pub mod tape;
pub mod tensor;

pub use block::{BlockSpec, Params};
pub use chain::{Chain, Op, Pointwise, Preset};
pub use error::{Error, Result};
pub use precision::Precision;
pub use tensor::Tensor;

//! The one error type of the host crate. Every message names what is wrong
//! (the tensor, the parameter, the flag, the file) so a user can fix it.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Tensor shapes that do not fit together (input vs weights vs chain), or sizes
    /// beyond what can be indexed, launched or allocated.
    #[error("bad shape: {0}")]
    Shape(String),
    /// An epilogue chain that is malformed or cannot be applied to these features.
    #[error("invalid chain: {0}")]
    Chain(String),
    /// A bad flag value or argument.
    #[error("invalid argument: {0}")]
    Argument(String),
    /// A named tensor that is missing, misshapen or of the wrong dtype.
    #[error("tensor `{name}`: {problem}")]
    Tensor { name: String, problem: String },
    /// A file that cannot be read, written or parsed.
    #[error("{}: {problem}", path.display())]
    File { path: PathBuf, problem: String },
    /// The GPU backend was asked for and there is none usable.
    #[error("no GPU: {0}")]
    NoGpu(String),
    /// A CUDA driver or library call failed.
    #[error("CUDA error in {context}: {message}")]
    Cuda { context: String, message: String },
    /// The GPU backend cannot run this (yet); the message says what can.
    #[error("unsupported on the GPU: {0}")]
    Unsupported(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn tensor(name: impl Into<String>, problem: impl Into<String>) -> Self {
        Error::Tensor { name: name.into(), problem: problem.into() }
    }
    pub fn file(path: impl Into<PathBuf>, problem: impl ToString) -> Self {
        Error::File { path: path.into(), problem: problem.to_string() }
    }
    pub fn cuda(context: impl Into<String>, err: impl std::fmt::Display) -> Self {
        Error::Cuda { context: context.into(), message: err.to_string() }
    }
}

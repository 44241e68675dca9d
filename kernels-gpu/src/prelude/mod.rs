//! What the kernels need from the device, in one small documented place: the role
//! `cuda_std` plays in rust-cuda, which cannot be used with rustc's PTX backend.

pub mod index;
pub mod math;
pub mod shared;
pub mod sync;
pub mod warp;

pub use index::*;
pub use shared::dynamic_shared;
pub use sync::sync_threads;

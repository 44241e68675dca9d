//! What the kernels need from the device, in one small documented place: the role
//! `cuda_std` plays in rust-cuda, which cannot be used with rustc's PTX backend.

pub mod async_copy;
pub mod bulk_copy;
pub mod element;
pub mod global;
pub mod index;
pub mod math;
pub mod shared;
pub mod sync;
pub mod mma;
pub mod vector;
pub mod warp;
pub mod wgmma;

pub use index::*;
pub use shared::dynamic_shared;
pub use sync::{sync_threads, sync_warp};
pub use vector::{AsStored, Fp32Params, ReadParams, Typed, Vector};

/// Repeats `$body` with `$i` bound to `0, 1, ..` (`0..2`, `0..3`, `0..4`, `0..8` or `0..16`), unrolled in the
/// source. Register arrays indexed only this way stay in registers: LLVM declines to
/// unroll loops whose bodies are large (an activation inlined 64 times), and a
/// run-time index would send the whole array to local memory.
#[macro_export]
macro_rules! unroll {
    ($i:ident in 0..2 => $body:block) => {{
        { let $i: usize = 0; $body }
        { let $i: usize = 1; $body }
    }};
    ($i:ident in 0..3 => $body:block) => {{
        { let $i: usize = 0; $body }
        { let $i: usize = 1; $body }
        { let $i: usize = 2; $body }
    }};
    ($i:ident in 0..4 => $body:block) => {{
        { let $i: usize = 0; $body }
        { let $i: usize = 1; $body }
        { let $i: usize = 2; $body }
        { let $i: usize = 3; $body }
    }};
    ($i:ident in 0..8 => $body:block) => {{
        $crate::unroll!($i in 0..4 => $body);
        { let $i: usize = 4; $body }
        { let $i: usize = 5; $body }
        { let $i: usize = 6; $body }
        { let $i: usize = 7; $body }
    }};
    ($i:ident in 0..16 => $body:block) => {{
        $crate::unroll!($i in 0..8 => $body);
        { let $i: usize = 8; $body }
        { let $i: usize = 9; $body }
        { let $i: usize = 10; $body }
        { let $i: usize = 11; $body }
        { let $i: usize = 12; $body }
        { let $i: usize = 13; $body }
        { let $i: usize = 14; $body }
        { let $i: usize = 15; $body }
    }};
}

//! The ways a tensor's values are stored, FP32 or a 16-bit float ([`Bf16`], [`F16`]), as
//! the kernels read and write them: arithmetic is FP32 either way, and a 16-bit value
//! is rounded to nearest (ties to even) once, on the way out. [`Half`] is what the
//! 16-bit kernels need of their element beyond that: its packing and its MMAs, so each
//! MMA shape is written once for both.

use super::mma::{mma_bf16, mma_f16, pack_bf16x2, pack_f16x2, unpack_f16x2};
use super::wgmma::*;

/// Two floats, 8-byte aligned: one vector access.
#[derive(Clone, Copy)]
#[repr(C, align(8))]
pub(crate) struct F2(pub(crate) [f32; 2]);

/// Two 32-bit words, 8-byte aligned: one vector store.
#[derive(Clone, Copy)]
#[repr(C, align(8))]
struct Words2([u32; 2]);

/// An element type of the tensors a kernel reads or writes.
pub trait Element: Copy {
    /// How a parameter vector of this type is tagged (`kernel_abi::vector`).
    const STORED: kernel_abi::vector::Stored;

    /// Stores `a` at `at`.
    ///
    /// # Safety
    /// `at` is valid for one element.
    unsafe fn store1(at: *mut Self, a: f32);

    /// Stores `a`, `b` at `at`, `at + 1` in one access.
    ///
    /// # Safety
    /// `at` is valid for two elements and aligned to two.
    unsafe fn store2(at: *mut Self, a: f32, b: f32);

    /// Stores four values at `at` in one access.
    ///
    /// # Safety
    /// `at` is valid for four elements and aligned to four.
    unsafe fn store4(at: *mut Self, v: [f32; 4]);

    /// Reads four values in one access, through the read-only path.
    ///
    /// # Safety
    /// `at` is valid for four elements and aligned to four; nothing writes them during the kernel.
    unsafe fn load4_nc(at: *const Self) -> [f32; 4];

    /// Reads one value.
    ///
    /// # Safety
    /// `at` is valid for one element.
    unsafe fn load1(at: *const Self) -> f32;

    /// Four values from the two 32-bit words that hold them (16-bit types; FP32's four
    /// values do not fit two words, so its kernels never ask).
    fn unpack4(words: [u32; 2]) -> [f32; 4];
}

impl Element for f32 {
    const STORED: kernel_abi::vector::Stored = kernel_abi::vector::Stored::F32;
    #[inline(always)]
    unsafe fn store1(at: *mut f32, a: f32) {
        unsafe { *at = a };
    }
    #[inline(always)]
    unsafe fn store2(at: *mut f32, a: f32, b: f32) {
        unsafe { *(at as *mut F2) = F2([a, b]) };
    }
    #[inline(always)]
    unsafe fn store4(at: *mut f32, v: [f32; 4]) {
        unsafe { super::global::store_v4(at, v) };
    }
    #[inline(always)]
    unsafe fn load4_nc(at: *const f32) -> [f32; 4] {
        unsafe { super::global::load_v4_nc(at) }
    }
    #[inline(always)]
    unsafe fn load1(at: *const f32) -> f32 {
        unsafe { *at }
    }
    #[inline(always)]
    fn unpack4([a, b]: [u32; 2]) -> [f32; 4] {
        [f32::from_bits(a), f32::from_bits(b), 0.0, 0.0]
    }
}

/// A bfloat16 value's bit pattern (the top half of an FP32's).
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct Bf16(pub u16);

/// An IEEE binary16 (fp16) value's bit pattern.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct F16(pub u16);

/// A 16-bit float the tensor cores take as an operand: how two FP32 values are
/// rounded into one register and back, and its MMAs (FP32 accumulation).
pub trait Half: Element {
    /// Two floats rounded to nearest (ties to even) and packed, `lo` in the low half.
    fn pack2(lo: u32, hi: u32) -> u32;
    /// The two values of a 32-bit word (low half first) as floats: exact.
    fn unpack2(w: u32) -> [f32; 2];
    /// `d += a b` for one `m16n8k16` fragment product (`mma.sync`).
    fn mma(d: &mut [f32; 4], a: [u32; 4], b: [u32; 2]);
    /// One 64-deep `wgmma` k-tile (four `m64n256k16` steps; see
    /// `wgmma::wgmma_n256_k_tile_fn`), `A` and `B` `k`-major or MN-major (`TRANS_*`).
    ///
    /// # Safety
    /// As the `wgmma_n256_k_tile_*` functions.
    unsafe fn wgmma_k_tile<const TRANS_A: bool, const TRANS_B: bool>(acc: &mut [u32; 128], da: [u64; 4], db: [u64; 4]);
}

/// The [`Element`] of a [`Half`]: values rounded by its `pack2`, widened by `unpack2`.
macro_rules! half_element {
    ($t:ident) => {
        impl Element for $t {
            const STORED: kernel_abi::vector::Stored = kernel_abi::vector::Stored::$t;
            #[inline(always)]
            unsafe fn store1(at: *mut $t, a: f32) {
                unsafe { *at = $t(<$t as Half>::pack2(a.to_bits(), 0) as u16) };
            }
            #[inline(always)]
            unsafe fn store2(at: *mut $t, a: f32, b: f32) {
                unsafe { *(at as *mut u32) = <$t as Half>::pack2(a.to_bits(), b.to_bits()) };
            }
            #[inline(always)]
            unsafe fn store4(at: *mut $t, v: [f32; 4]) {
                let v = v.map(f32::to_bits);
                let words = [<$t as Half>::pack2(v[0], v[1]), <$t as Half>::pack2(v[2], v[3])];
                unsafe { *(at as *mut Words2) = Words2(words) };
            }
            #[inline(always)]
            unsafe fn load4_nc(at: *const $t) -> [f32; 4] {
                let Words2(words) = unsafe { *(at as *const Words2) };
                Self::unpack4(words)
            }
            #[inline(always)]
            unsafe fn load1(at: *const $t) -> f32 {
                <$t as Half>::unpack2(unsafe { (*at).0 } as u32)[0]
            }
            #[inline(always)]
            fn unpack4([a, b]: [u32; 2]) -> [f32; 4] {
                let ([v0, v1], [v2, v3]) = (<$t as Half>::unpack2(a), <$t as Half>::unpack2(b));
                [v0, v1, v2, v3]
            }
        }
    };
}

half_element!(Bf16);
half_element!(F16);

impl Half for Bf16 {
    #[inline(always)]
    fn pack2(lo: u32, hi: u32) -> u32 {
        pack_bf16x2(lo, hi)
    }
    #[inline(always)]
    fn unpack2(w: u32) -> [f32; 2] {
        [f32::from_bits(w << 16), f32::from_bits(w & 0xffff_0000)]
    }
    #[inline(always)]
    fn mma(d: &mut [f32; 4], a: [u32; 4], b: [u32; 2]) {
        mma_bf16(d, a, b)
    }
    #[inline(always)]
    unsafe fn wgmma_k_tile<const TRANS_A: bool, const TRANS_B: bool>(acc: &mut [u32; 128], da: [u64; 4], db: [u64; 4]) {
        // SAFETY: as the caller's.
        unsafe {
            match (TRANS_A, TRANS_B) {
                (true, _) => wgmma_n256_k_tile_bf16_tn(acc, da, db),
                (false, true) => wgmma_n256_k_tile_bf16_nn(acc, da, db),
                (false, false) => wgmma_n256_k_tile_bf16(acc, da, db),
            }
        }
    }
}

impl Half for F16 {
    #[inline(always)]
    fn pack2(lo: u32, hi: u32) -> u32 {
        pack_f16x2(lo, hi)
    }
    #[inline(always)]
    fn unpack2(w: u32) -> [f32; 2] {
        unpack_f16x2(w)
    }
    #[inline(always)]
    fn mma(d: &mut [f32; 4], a: [u32; 4], b: [u32; 2]) {
        mma_f16(d, a, b)
    }
    #[inline(always)]
    unsafe fn wgmma_k_tile<const TRANS_A: bool, const TRANS_B: bool>(acc: &mut [u32; 128], da: [u64; 4], db: [u64; 4]) {
        // SAFETY: as the caller's.
        unsafe {
            match (TRANS_A, TRANS_B) {
                (true, _) => wgmma_n256_k_tile_f16_tn(acc, da, db),
                (false, true) => wgmma_n256_k_tile_f16_nn(acc, da, db),
                (false, false) => wgmma_n256_k_tile_f16(acc, da, db),
            }
        }
    }
}

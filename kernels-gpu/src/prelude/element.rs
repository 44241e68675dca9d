//! The two ways a tensor's values are stored, FP32 or bf16 (16-bit words, `u16`), as
//! the kernels read and write them: arithmetic is FP32 either way, and a bf16 value is
//! rounded to nearest (ties to even) once, on the way out.

use super::mma::pack_bf16x2;

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
}

impl Element for f32 {
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
}

/// bf16 bit patterns.
impl Element for u16 {
    #[inline(always)]
    unsafe fn store1(at: *mut u16, a: f32) {
        unsafe { *at = pack_bf16x2(a.to_bits(), 0) as u16 };
    }
    #[inline(always)]
    unsafe fn store2(at: *mut u16, a: f32, b: f32) {
        unsafe { *(at as *mut u32) = pack_bf16x2(a.to_bits(), b.to_bits()) };
    }
    #[inline(always)]
    unsafe fn store4(at: *mut u16, v: [f32; 4]) {
        let v = v.map(f32::to_bits);
        unsafe { *(at as *mut Words2) = Words2([pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3])]) };
    }
    #[inline(always)]
    unsafe fn load4_nc(at: *const u16) -> [f32; 4] {
        let Words2([a, b]) = unsafe { *(at as *const Words2) };
        unpack_bf16x4([a, b])
    }
    #[inline(always)]
    unsafe fn load1(at: *const u16) -> f32 {
        f32::from_bits((unsafe { *at } as u32) << 16)
    }
}

/// The two bf16 values of a 32-bit word (low half first) as floats: exact.
#[inline(always)]
pub fn unpack_bf16x2(w: u32) -> [f32; 2] {
    [f32::from_bits(w << 16), f32::from_bits(w & 0xffff_0000)]
}

/// The four bf16 values of two 32-bit words (in memory order) as floats: exact.
#[inline(always)]
pub fn unpack_bf16x4([a, b]: [u32; 2]) -> [f32; 4] {
    let ([v0, v1], [v2, v3]) = (unpack_bf16x2(a), unpack_bf16x2(b));
    [v0, v1, v2, v3]
}

//! A per-feature parameter vector as the kernels take it (`kernel_abi::vector`): its
//! device address and how its values are stored, FP32 or a 16-bit model's bf16 or
//! fp16, widened on load (exactly). A kernel reads them through a [`ReadParams`]:
//! [`Typed`] (one instance of an op's code per storage type, chosen by
//! `with_reader!`), [`AsStored`] (per load, for an op whose vectors differ), or
//! [`Fp32Params`] (FP32 only, for the kernels whose host widens a 16-bit model's
//! vectors first).

use super::element::{Bf16, Element, F16, Half};
use super::global::load_v2_b32_nc;
use super::mma::unpack_f16x2;
use crate::unroll;
use kernel_abi::vector::{self as abi, Stored};

/// A parameter vector's word: address and storage (`kernel_abi::vector::word`).
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct Vector(pub u64);

impl Vector {
    /// How the values are stored.
    #[inline(always)]
    pub fn stored(self) -> Stored {
        abi::stored(self.0)
    }

    /// Whether there is no vector (an absent bias).
    #[inline(always)]
    pub fn is_null(self) -> bool {
        abi::address(self.0) == 0
    }

    /// The first value's address, as `E`s (the caller matched [`Vector::stored`]).
    #[inline(always)]
    pub fn ptr<E>(self) -> *const E {
        abi::address(self.0) as *const E
    }

    /// The same vector from its value `i` on.
    #[inline(always)]
    pub fn skip(self, i: usize) -> Vector {
        Vector(self.0 + (i * abi::value_bytes(self.stored())) as u64)
    }

    /// Value `i`: two 16-bit loads, of its halves (FP32) or both of the one value (a
    /// 16-bit type), the address picked by a select, so the three storage types share
    /// one code path with no branch and read nothing outside the value. (A branch per
    /// read, and a load of 32 or 16 bits by a predicate, each cost the register-bound
    /// row-wise backward spills when it read as stored; one load of the aligned 32-bit
    /// word read 2 bytes past an odd-length 16-bit vector, which compute-sanitizer
    /// reports on exact-size allocations.)
    ///
    /// # Safety
    /// `i` is below the vector's length and the vector starts at a 2-byte boundary (4 for
    /// FP32).
    #[inline(always)]
    pub unsafe fn get(self, i: usize) -> f32 {
        let stored = self.stored();
        let at = abi::address(self.0) as usize + i * abi::value_bytes(stored);
        let wide = stored == Stored::F32;
        let (lo, hi) = unsafe { (*(at as *const u16) as u32, *((at + if wide { 2 } else { 0 }) as *const u16) as u32) };
        f32::from_bits(match stored {
            Stored::F32 => lo | hi << 16,
            Stored::Bf16 => lo << 16,
            Stored::F16 => unpack_f16x2(lo)[0].to_bits(),
        })
    }

    /// Whether values `i..i + 4` are one aligned access (16 bytes of FP32, 8 of a
    /// 16-bit type).
    #[inline(always)]
    pub fn quad_aligned(self, i: usize) -> bool {
        let bytes = abi::value_bytes(self.stored());
        (abi::address(self.0) as usize + i * bytes).is_multiple_of(4 * bytes)
    }

    /// Values `i..i + 4` through the read-only path: two 8-byte loads (FP32's 16 bytes;
    /// a 16-bit type's 8 bytes, loaded twice, the second an L1 hit), the values picked
    /// and widened by selects. No branch, as in [`Vector::get`]: the column kernels'
    /// backward is register-bound.
    ///
    /// # Safety
    /// `i + 3` is below the vector's length, [`Vector::quad_aligned`] holds, and nothing
    /// writes the vector while the kernel runs.
    #[inline(always)]
    pub unsafe fn quad(self, i: usize) -> [f32; 4] {
        let stored = self.stored();
        let at = abi::address(self.0) as usize + i * abi::value_bytes(stored);
        let wide = stored == Stored::F32;
        let (a, b) =
            unsafe { (load_v2_b32_nc(at as *const u32), load_v2_b32_nc((at + if wide { 8 } else { 0 }) as *const u32)) };
        let widen = |w: u32| if stored == Stored::F16 { unpack_f16x2(w) } else { Bf16::unpack2(w) };
        let ([h0, h1], [h2, h3]) = (widen(a[0]), widen(a[1]));
        let v = if wide { [a[0], a[1], b[0], b[1]] } else { [h0, h1, h2, h3].map(f32::to_bits) };
        v.map(f32::from_bits)
    }
}

/// Values `c..c + 4` of `v` set to `values` (rounded to nearest into a 16-bit type),
/// those from `n` on left alone: one store where they are inside and aligned. For a
/// kernel's vector outputs (a backward's small gradients), whose types its host picks.
///
/// # Safety
/// `v` holds `n` values, starts at a 2-byte boundary (4 for FP32), and nothing else
/// reads or writes values `c..c + 4` while the kernel runs.
#[inline(always)]
pub unsafe fn store4_to(v: Vector, n: usize, c: usize, values: [f32; 4]) {
    // SAFETY: as the caller's contract says; each store below `n`.
    unsafe {
        match v.stored() {
            Stored::F32 => store4_as::<f32>(v.ptr::<f32>() as *mut f32, n, c, values),
            Stored::Bf16 => store4_as::<Bf16>(v.ptr::<Bf16>() as *mut Bf16, n, c, values),
            Stored::F16 => store4_as::<F16>(v.ptr::<F16>() as *mut F16, n, c, values),
        }
    }
}

/// Value `i` of `v` set to `value` (rounded to nearest into a 16-bit type).
///
/// # Safety
/// `i` is below `v`'s length; `v` starts at a 2-byte boundary (4 for FP32).
#[inline(always)]
pub unsafe fn store1_to(v: Vector, i: usize, value: f32) {
    // SAFETY: as the caller's contract says.
    unsafe {
        match v.stored() {
            Stored::F32 => *(v.ptr::<f32>() as *mut f32).add(i) = value,
            Stored::Bf16 => Bf16::store1((v.ptr::<Bf16>() as *mut Bf16).add(i), value),
            Stored::F16 => F16::store1((v.ptr::<F16>() as *mut F16).add(i), value),
        }
    }
}

/// `p[c..c + 4] = values` as `E`, those from `n` on left alone: one store where they are
/// inside and aligned, else one at a time.
///
/// # Safety
/// `p` holds `n` values.
#[inline(always)]
unsafe fn store4_as<E: Element>(p: *mut E, n: usize, c: usize, values: [f32; 4]) {
    // SAFETY: c + 4 <= n and aligned (checked), else every index written is below n.
    unsafe {
        if c + 4 <= n && (p as usize + c * core::mem::size_of::<E>()).is_multiple_of(4 * core::mem::size_of::<E>()) {
            E::store4(p.add(c), values);
        } else {
            unroll!(e in 0..4 => {
                if c + e < n {
                    E::store1(p.add(c + e), values[e]);
                }
            });
        }
    }
}

/// How a kernel reads its parameter vectors, fixed when it is compiled.
pub trait ReadParams {
    /// Value `i` of `v`.
    ///
    /// # Safety
    /// As [`Vector::get`].
    unsafe fn get(v: Vector, i: usize) -> f32;

    /// Values `c..c + 4` of `v`, 0 past `n`: one load where they are inside and aligned.
    ///
    /// # Safety
    /// `v` holds `n` values.
    unsafe fn column4(v: Vector, n: usize, c: usize) -> [f32; 4];

    /// Stops the kernel (a launch error, not a wrong answer) where the ops' vectors are
    /// stored in a way this reader does not take.
    ///
    /// # Safety
    /// `ops` holds `n_ops` descriptors.
    unsafe fn check(ops: *const kernel_abi::epilogue::OpDesc, n_ops: usize);
}

/// Vectors as stored: FP32, bf16 or fp16 ([`Vector::get`]).
pub struct AsStored;

impl ReadParams for AsStored {
    #[inline(always)]
    unsafe fn get(v: Vector, i: usize) -> f32 {
        unsafe { v.get(i) }
    }
    #[inline(always)]
    unsafe fn column4(v: Vector, n: usize, c: usize) -> [f32; 4] {
        if c + 4 <= n && v.quad_aligned(c) {
            unsafe { v.quad(c) }
        } else {
            [0, 1, 2, 3].map(|e| if c + e < n { unsafe { v.get(c + e) } } else { 0.0 })
        }
    }
    #[inline(always)]
    unsafe fn check(_: *const kernel_abi::epilogue::OpDesc, _: usize) {}
}

/// FP32 vectors only, read as plain floats: for a kernel at its register limit (the
/// row-wise backward), whose host widens a 16-bit model's vectors first.
pub struct Fp32Params;

impl ReadParams for Fp32Params {
    #[inline(always)]
    unsafe fn get(v: Vector, i: usize) -> f32 {
        unsafe { *v.ptr::<f32>().add(i) }
    }
    #[inline(always)]
    unsafe fn column4(v: Vector, n: usize, c: usize) -> [f32; 4] {
        unsafe { column4_as::<f32>(v.ptr(), n, c) }
    }
    #[inline(always)]
    unsafe fn check(ops: *const kernel_abi::epilogue::OpDesc, n_ops: usize) {
        unsafe { check_stored::<f32>(ops, n_ops) }
    }
}

/// Stops the kernel (a launch error, not a wrong answer) unless every vector of
/// `ops[..n_ops]` is stored as `E` (or absent): for a kernel that reads them through
/// [`Typed<E>`] whatever their tags say.
///
/// # Safety
/// `ops` holds `n_ops` descriptors.
#[inline(always)]
pub unsafe fn check_stored<E: Element>(ops: *const kernel_abi::epilogue::OpDesc, n_ops: usize) {
    for o in 0..n_ops {
        // SAFETY: o < n_ops.
        let op = unsafe { &*ops.add(o) };
        let off = |w: u64| w != 0 && Vector(w).stored() != E::STORED;
        if off(op.param0) || off(op.param1) {
            // SAFETY: aborts the kernel.
            unsafe { core::arch::nvptx::trap() }
        }
    }
}

/// Vectors all stored as `E` (the caller matched their [`Vector::stored`]): plain loads.
pub struct Typed<E>(core::marker::PhantomData<E>);

impl<E: Element> ReadParams for Typed<E> {
    #[inline(always)]
    unsafe fn get(v: Vector, i: usize) -> f32 {
        unsafe { E::load1(v.ptr::<E>().add(i)) }
    }
    #[inline(always)]
    unsafe fn column4(v: Vector, n: usize, c: usize) -> [f32; 4] {
        unsafe { column4_as::<E>(v.ptr(), n, c) }
    }
    #[inline(always)]
    unsafe fn check(_: *const kernel_abi::epilogue::OpDesc, _: usize) {}
}

/// `p[c..c + 4]` of values stored as `E`, 0 past `n`: one read-only load where they are
/// inside and aligned (16 bytes of FP32, 8 of a 16-bit type), else one at a time.
///
/// # Safety
/// `p` holds `n` values.
#[inline(always)]
pub unsafe fn column4_as<E: Element>(p: *const E, n: usize, c: usize) -> [f32; 4] {
    // SAFETY: c + 4 <= n, the vector's length, and aligned (checked: parameter vectors
    // need not be); else every index read is below n.
    unsafe {
        if c + 4 <= n && (p as usize + 4 * c * core::mem::size_of::<E>()).is_multiple_of(4 * core::mem::size_of::<E>()) {
            E::load4_nc(p.add(c))
        } else {
            [0, 1, 2, 3].map(|e| if c + e < n { E::load1(p.add(c + e)) } else { 0.0 })
        }
    }
}

/// How an op's parameter vectors are stored where they share one storage type (an op
/// without parameters: FP32, read by nothing); `None` where they differ.
#[inline(always)]
pub fn op_storage(op: &kernel_abi::epilogue::OpDesc) -> Option<Stored> {
    let (a, b) = (Vector(op.param0), Vector(op.param1));
    match (op.param0 != 0, op.param1 != 0) {
        (true, true) if a.stored() != b.stored() => None,
        (true, _) => Some(a.stored()),
        (false, true) => Some(b.stored()),
        (false, false) => Some(Stored::F32),
    }
}

/// `$body` with `$reader` the [`ReadParams`] for `op`'s vectors: one instance per
/// storage type ([`Typed`]: plain loads) where they share one ([`op_storage`]), the
/// per-load [`AsStored`] where they differ (a mixed model).
macro_rules! with_reader {
    ($op:expr, $reader:ident => $body:expr) => {
        match $crate::prelude::vector::op_storage($op) {
            Some(kernel_abi::vector::Stored::F32) => {
                type $reader = $crate::prelude::vector::Typed<f32>;
                $body
            }
            Some(kernel_abi::vector::Stored::Bf16) => {
                type $reader = $crate::prelude::vector::Typed<$crate::prelude::element::Bf16>;
                $body
            }
            Some(kernel_abi::vector::Stored::F16) => {
                type $reader = $crate::prelude::vector::Typed<$crate::prelude::element::F16>;
                $body
            }
            None => {
                type $reader = $crate::prelude::vector::AsStored;
                $body
            }
        }
    };
}
pub(crate) use with_reader;

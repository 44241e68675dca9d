//! Device memory: buffers that free themselves, or an allocator's or a caller's (a
//! framework's tensors), the element types they hold, and the small word tables the
//! launchers read.

use crate::error::{Error, Result};
use crate::tensor::{Bf16, F16};
use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr, LaunchArgs, PushKernelArg};
use kernel_abi::vector::Stored;
use std::any::Any;
use std::mem::ManuallyDrop;
use std::sync::Arc;

/// Device memory owned by someone other than cudarc — a framework's caching
/// allocator — handed out in bytes on the GPU's stream (in that stream's order).
///
/// The keep-alive handle returned with the pointer owns the memory: dropping it gives
/// the memory back (to the allocator, in the order of the stream it was allocated on).
pub trait DeviceAllocator: Send + Sync {
    /// Device memory for `shape`'s values of `element` (`Bytes`: `shape` counts bytes),
    /// at least 16-byte aligned. The shape is what the caller will use: an allocator
    /// that hands out framework tensors makes them in it, so none needs reshaping later.
    fn allocate(&self, shape: &[usize], element: ElementKind) -> Result<(u64, Box<dyn Any + Send + Sync>)>;
}

/// What an allocation holds, so an allocator can hand out a typed buffer (a framework
/// tensor of that dtype) that its caller can use as it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ElementKind {
    F32,
    /// A bf16 tensor's values.
    Bf16,
    /// An fp16 tensor's values.
    F16,
    /// Anything else: 16-bit words, 32-bit indices, 64-bit table words.
    Bytes,
}

/// A row-major f32 tensor in device memory.
pub struct DeviceTensor<T = f32> {
    pub shape: Vec<usize>,
    pub buf: DeviceBuf<T>,
}

/// What a device tensor holds: FP32, or bf16 or fp16 (a 16-bit model's tensors, kept
/// as they are).
pub trait DeviceElement: DeviceRepr + cudarc::driver::ValidAsZeroBits + Copy + Default + Send + Sync + 'static {
    /// The dtype's name in messages.
    const NAME: &'static str;
    /// The bit pattern of a quiet NaN (poisoned outputs).
    const NAN_BITS: u32;
    /// The dtype: a 16-bit model's tensors are read as stored by its own kernels, which
    /// [`dispatch`](super::dispatch) chooses by this, never by the type's size.
    const DTYPE: Dtype;
}

/// The dtypes of the tensors the kernels read and write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    F32,
    Bf16,
    F16,
}

impl Dtype {
    /// The dtype's name in messages.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => f32::NAME,
            Dtype::Bf16 => Bf16::NAME,
            Dtype::F16 => F16::NAME,
        }
    }

    /// How a parameter vector of this dtype is tagged for the kernels
    /// (`kernel_abi::vector`).
    pub fn stored(self) -> Stored {
        match self {
            Dtype::F32 => Stored::F32,
            Dtype::Bf16 => Stored::Bf16,
            Dtype::F16 => Stored::F16,
        }
    }

    /// The element kind an allocator hands out for this dtype.
    pub fn kind(self) -> ElementKind {
        match self {
            Dtype::F32 => ElementKind::F32,
            Dtype::Bf16 => ElementKind::Bf16,
            Dtype::F16 => ElementKind::F16,
        }
    }
}

impl DeviceElement for f32 {
    const NAME: &'static str = "float32";
    const NAN_BITS: u32 = 0x7fc0_0000;
    const DTYPE: Dtype = Dtype::F32;
}

// SAFETY: `Bf16` is a `repr(transparent)` `u16`: plain bits, any pattern valid, zero included.
unsafe impl DeviceRepr for Bf16 {}
unsafe impl cudarc::driver::ValidAsZeroBits for Bf16 {}

impl DeviceElement for Bf16 {
    const NAME: &'static str = "bfloat16";
    const NAN_BITS: u32 = 0x7fc0;
    const DTYPE: Dtype = Dtype::Bf16;
}

/// A 16-bit model's element (bf16 or fp16): a device element with its own kernels.
pub trait HalfElement: DeviceElement + crate::tensor::Half {
    /// The kernels reading and writing this type.
    const KERNELS: &'static super::dispatch::HalfKernels;
    /// A parameter vector of this type, as the kernels read it.
    fn vector(t: DeviceTensor<Self>) -> DeviceVector;
}

impl HalfElement for Bf16 {
    const KERNELS: &'static super::dispatch::HalfKernels = &super::dispatch::HalfKernels::BF16;
    fn vector(t: DeviceTensor<Bf16>) -> DeviceVector {
        DeviceVector::Bf16(t)
    }
}

impl HalfElement for F16 {
    const KERNELS: &'static super::dispatch::HalfKernels = &super::dispatch::HalfKernels::F16;
    fn vector(t: DeviceTensor<F16>) -> DeviceVector {
        DeviceVector::F16(t)
    }
}

// SAFETY: as `Bf16`'s.
unsafe impl DeviceRepr for F16 {}
unsafe impl cudarc::driver::ValidAsZeroBits for F16 {}

impl DeviceElement for F16 {
    const NAME: &'static str = "float16";
    const NAN_BITS: u32 = 0x7e00;
    const DTYPE: Dtype = Dtype::F16;
}

/// A per-feature parameter vector (a Linear bias, a chain op's parameter) in device
/// memory as stored: FP32, or a 16-bit model's bf16 or fp16 values, which the kernels
/// read as they are (`kernel_abi::vector`) instead of from FP32 copies made per call.
pub enum DeviceVector {
    F32(DeviceTensor),
    Bf16(DeviceTensor<Bf16>),
    F16(DeviceTensor<F16>),
}

impl From<DeviceTensor> for DeviceVector {
    fn from(t: DeviceTensor) -> DeviceVector {
        DeviceVector::F32(t)
    }
}

impl DeviceVector {
    pub fn shape(&self) -> &[usize] {
        match self {
            DeviceVector::F32(t) => &t.shape,
            DeviceVector::Bf16(t) => &t.shape,
            DeviceVector::F16(t) => &t.shape,
        }
    }

    pub fn len(&self) -> usize {
        self.shape().iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The dtype its values are stored in.
    pub fn dtype(&self) -> Dtype {
        match self {
            DeviceVector::F32(_) => Dtype::F32,
            DeviceVector::Bf16(_) => Dtype::Bf16,
            DeviceVector::F16(_) => Dtype::F16,
        }
    }

    /// The device address of its first value.
    pub fn address(&self) -> u64 {
        match self {
            DeviceVector::F32(t) => t.buf.device_address(),
            DeviceVector::Bf16(t) => t.buf.device_address(),
            DeviceVector::F16(t) => t.buf.device_address(),
        }
    }

    /// The word the kernels take for it: its address, with how it is stored in the top
    /// byte.
    pub fn word(&self) -> Result<VectorWord> {
        let address = self.address();
        kernel_abi::vector::word(address, self.dtype().stored()).map(VectorWord).ok_or_else(|| {
            Error::Shape(format!(
                "a parameter vector at device address {address:#x}: the kernels take addresses below 2^{}",
                kernel_abi::vector::STORED_SHIFT
            ))
        })
    }

    /// The FP32 tensor, where the vector is one (a path that reads it as FP32 only).
    pub fn f32(&self) -> Result<&DeviceTensor> {
        match self {
            DeviceVector::F32(t) => Ok(t),
            _ => Err(Error::Shape(format!("a {} parameter vector where FP32 is wanted", self.dtype().name()))),
        }
    }

    /// [`DeviceVector::f32`], mutable (an optimizer's step).
    pub fn f32_mut(&mut self) -> Result<&mut DeviceTensor> {
        let dtype = self.dtype();
        match self {
            DeviceVector::F32(t) => Ok(t),
            _ => Err(Error::Shape(format!("a {} parameter vector where FP32 is wanted", dtype.name()))),
        }
    }
}

/// A parameter vector as a launch takes it, borrowed: the kernels' word and its length.
#[derive(Clone, Copy, Debug)]
pub struct VectorArg<'a> {
    pub word: VectorWord,
    pub len: usize,
    _vector: std::marker::PhantomData<&'a ()>,
}

impl<'a> VectorArg<'a> {
    /// An FP32 tensor's (its word is its address).
    pub fn f32(t: &DeviceTensor) -> VectorArg<'_> {
        VectorArg { word: VectorWord::of_f32(&t.buf), len: t.len(), _vector: std::marker::PhantomData }
    }

    /// The same vector read from `word` instead (its FP32 copy, which the caller keeps
    /// alive as long as this vector).
    pub fn read_from(self, word: VectorWord) -> VectorArg<'a> {
        VectorArg { word, ..self }
    }
}

impl DeviceVector {
    /// The vector as a launch takes it.
    pub fn arg(&self) -> Result<VectorArg<'_>> {
        Ok(VectorArg { word: self.word()?, len: self.len(), _vector: std::marker::PhantomData })
    }
}

/// A parameter vector's word as a kernel argument ([`DeviceVector::word`]; 0: none).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct VectorWord(pub u64);

// SAFETY: a plain 64-bit word, as the kernels' `Vector` argument.
unsafe impl DeviceRepr for VectorWord {}

impl VectorWord {
    /// No vector (an absent bias).
    pub const NONE: VectorWord = VectorWord(0);

    /// An FP32 buffer's word (a vector made here: a fold's bias, a BatchNorm's statistics).
    pub fn of_f32(buf: &CudaSlice<f32>) -> VectorWord {
        VectorWord(buf.device_ptr(buf.stream()).0)
    }
}

/// Who frees a [`DeviceBuf`]'s memory.
pub(super) enum Owner {
    /// cudarc, on the buffer's stream, when the buffer drops.
    Cudarc,
    /// Nobody here: the memory is a caller's (a framework tensor passed in).
    Borrowed,
    /// An allocator's keep-alive handle, dropped with the buffer.
    External(Box<dyn Any + Send + Sync>),
}

/// A small table in device memory that launches read (written once, never again):
/// shared by every launch that asks for the same words.
#[derive(Clone)]
pub struct Table(pub(super) Arc<DeviceBuf<u64>>);

unsafe impl<'a, 'b: 'a> PushKernelArg<&'b Table> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b Table) -> &mut Self {
        <Self as PushKernelArg<&'b CudaSlice<u64>>>::arg(self, &arg.0.slice)
    }
}

/// One stream's tables by content (the main stream's, or the side stream's for work
/// ordered after that main stream's). The words hold the pointers and shapes they
/// describe, so a table found here describes exactly what was asked for; a table is
/// freed only when the cache is cleared, at `TABLES_KEPT` (a side stream's in the
/// main stream's order after the side stream's, as its other buffers).
#[derive(Clone, Default)]
pub(super) struct Tables(Arc<std::sync::Mutex<std::collections::HashMap<Vec<u64>, Table>>>);

/// Tables [`Tables`] keeps before it starts again (each 256 bytes to a few KB).
const TABLES_KEPT: usize = 512;

impl Tables {
    pub(super) fn get(&self, words: &[u64]) -> Option<Table> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).get(words).cloned()
    }
    pub(super) fn insert(&self, words: &[u64], table: &Table) {
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if map.len() >= TABLES_KEPT {
            map.clear();
        }
        map.insert(words.to_vec(), table.clone());
    }
}

/// An allocator's small buffers that the work on one lent stream dropped, kept for its
/// next calls instead of given back and asked for again: through PyTorch each
/// allocation is a call into the interpreter (~9 us on the H100 machine's host, 15 in
/// a small bf16 block's training step). Kept only while their stream is not captured
/// into a CUDA graph (a graph's buffers come from its own pool), and reused only on the
/// stream they were dropped on, so stream order keeps every reuse after the last use.
#[derive(Clone, Default)]
pub(super) struct Spares(Arc<std::sync::Mutex<Vec<Spare>>>);

/// One kept buffer: its size, what it holds, address and the allocator's handle.
struct Spare {
    bytes: usize,
    kind: ElementKind,
    ptr: u64,
    keep: Box<dyn Any + Send + Sync>,
}

/// The largest buffer [`Spares`] keeps, and all of them together: the small
/// temporaries (widened parameters, tables, partial sums, a small batch's `dz`).
pub(super) const SPARE_MAX_BYTES: usize = 4 << 20;
const SPARES_HELD_BYTES: usize = 32 << 20;

impl Spares {
    /// A kept buffer of `bytes` holding `kind`, the latest dropped first.
    pub(super) fn take(&self, bytes: usize, kind: ElementKind) -> Option<(u64, Box<dyn Any + Send + Sync>)> {
        let mut held = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let i = held.iter().rposition(|s| s.bytes == bytes && s.kind == kind)?;
        let s = held.swap_remove(i);
        Some((s.ptr, s.keep))
    }

    /// Keeps a dropped buffer, or hands its handle back (to be dropped, freeing it)
    /// where the kept ones already hold `SPARES_HELD_BYTES`.
    fn put(&self, spare: Spare) -> Option<Box<dyn Any + Send + Sync>> {
        let mut held = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if held.iter().map(|s| s.bytes).sum::<usize>() + spare.bytes > SPARES_HELD_BYTES {
            return Some(spare.keep);
        }
        held.push(spare);
        None
    }
}

/// Handles of an allocator's buffers whose memory the side stream may still use.
#[derive(Clone, Default)]
pub(super) struct SideFrees(Arc<std::sync::Mutex<Vec<Box<dyn Any + Send + Sync>>>>);

impl SideFrees {
    pub(super) fn hold(&self, keep: Box<dyn Any + Send + Sync>) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).push(keep);
    }
    pub(super) fn release(&self) {
        let held = std::mem::take(&mut *self.0.lock().unwrap_or_else(|p| p.into_inner()));
        drop(held);
    }
    pub(super) fn is_empty(&self) -> bool {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).is_empty()
    }
}

/// Device memory for the kernels: a cudarc slice that frees itself, or one over memory
/// an allocator or a caller owns (leaked, never freed, when the buffer drops). Derefs
/// to the slice, so the launchers take either.
pub struct DeviceBuf<T> {
    pub(super) slice: ManuallyDrop<CudaSlice<T>>,
    owner: Owner,
    /// For an allocator's buffer of the side stream: where its handle waits when the
    /// buffer drops, instead of freeing the memory at once.
    defer: Option<SideFrees>,
    /// For an allocator's small buffer of a lent stream: where it goes when it drops
    /// (its handle kept for the next calls), with its size and kind.
    spare: Option<(Spares, usize, ElementKind)>,
}

impl<T> DeviceBuf<T> {
    pub(super) fn new(slice: CudaSlice<T>, owner: Owner, defer: Option<SideFrees>) -> Self {
        DeviceBuf { slice: ManuallyDrop::new(slice), owner, defer, spare: None }
    }

    /// An allocator's buffer that goes back to `spares` when it drops.
    pub(super) fn kept_by(mut self, spares: Spares, bytes: usize, kind: ElementKind) -> Self {
        self.spare = Some((spares, bytes, kind));
        self
    }

    /// The allocator's keep-alive handle of this memory (its framework tensor), if it
    /// came from one: the buffer is given up and the handle now owns the memory.
    pub fn into_external(mut self) -> Option<Box<dyn Any + Send + Sync>> {
        match std::mem::replace(&mut self.owner, Owner::Borrowed) {
            Owner::External(keep) => Some(keep),
            other => {
                self.owner = other;
                None
            }
        }
    }

    /// The device address of the first element.
    pub fn device_address(&self) -> u64 {
        // With event tracking off (`Gpu::open`), reading the address records nothing.
        self.slice.device_ptr(self.slice.stream()).0
    }
}

impl<T> Drop for DeviceBuf<T> {
    fn drop(&mut self) {
        let ptr = self.device_address();
        // SAFETY: the slice is not touched again (`drop` runs once).
        let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
        match self.owner {
            Owner::Cudarc => drop(slice),
            // Not ours to free: forget the slice; `owner` (dropped next) frees it, if anyone here does.
            Owner::Borrowed | Owner::External(_) => {
                slice.leak();
            }
        }
        if let Some(side) = self.defer.take()
            && let Owner::External(keep) = std::mem::replace(&mut self.owner, Owner::Borrowed)
        {
            side.hold(keep);
        } else if let Some((spares, bytes, kind)) = self.spare.take()
            && let Owner::External(keep) = std::mem::replace(&mut self.owner, Owner::Borrowed)
        {
            // Not kept: the handle drops here, outside the spares' lock.
            drop(spares.put(Spare { bytes, kind, ptr, keep }));
        }
    }
}

impl<T> std::ops::Deref for DeviceBuf<T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        &self.slice
    }
}

impl<T> std::ops::DerefMut for DeviceBuf<T> {
    fn deref_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.slice
    }
}

// Kernel arguments: a buffer passes as its slice does.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b DeviceBuf<T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b DeviceBuf<T>) -> &mut Self {
        <Self as PushKernelArg<&'b CudaSlice<T>>>::arg(self, &arg.slice)
    }
}

unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b mut DeviceBuf<T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut DeviceBuf<T>) -> &mut Self {
        <Self as PushKernelArg<&'b mut CudaSlice<T>>>::arg(self, &mut arg.slice)
    }
}

impl<T> DeviceTensor<T> {
    pub fn len(&self) -> usize {
        self.buf.len()
    }
    pub fn is_empty(&self) -> bool {
        self.buf.len() == 0
    }

    /// The same buffer under another shape of equal size.
    pub fn reshape(self, shape: &[usize]) -> Result<DeviceTensor<T>> {
        if shape.iter().product::<usize>() != self.buf.len() {
            return Err(Error::Shape(format!("cannot view {} values as {shape:?}", self.buf.len())));
        }
        Ok(DeviceTensor { shape: shape.to_vec(), buf: self.buf })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spare(bytes: usize, kind: ElementKind, ptr: u64) -> Spare {
        Spare { bytes, kind, ptr, keep: Box::new(ptr) }
    }

    #[test]
    fn spares_hand_out_a_kept_buffer_of_the_same_size_and_kind_once() {
        let spares = Spares::default();
        assert!(spares.put(spare(256, ElementKind::F32, 0x100)).is_none());
        assert!(spares.put(spare(256, ElementKind::Bf16, 0x200)).is_none());
        assert!(spares.put(spare(512, ElementKind::F32, 0x300)).is_none());
        assert!(spares.take(128, ElementKind::F32).is_none());
        let (ptr, keep) = spares.take(256, ElementKind::F32).unwrap();
        assert_eq!((ptr, *keep.downcast::<u64>().unwrap()), (0x100, 0x100));
        assert!(spares.take(256, ElementKind::F32).is_none(), "handed out twice");
        assert_eq!(spares.take(256, ElementKind::Bf16).unwrap().0, 0x200);
        assert_eq!(spares.take(512, ElementKind::F32).unwrap().0, 0x300);
    }

    #[test]
    fn spares_give_back_what_exceeds_their_bytes() {
        let spares = Spares::default();
        let big = SPARE_MAX_BYTES;
        let mut kept = 0;
        for i in 0..2 * SPARES_HELD_BYTES / big {
            if spares.put(spare(big, ElementKind::Bytes, i as u64)).is_none() {
                kept += 1;
            }
        }
        assert_eq!(kept, SPARES_HELD_BYTES / big);
    }
}

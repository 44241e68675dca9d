//! Collectives between the ranks of one process: NCCL when every rank has a GPU of
//! its own, host memory when ranks share one (the checks of a split on one GPU).
//!
//! NCCL is loaded at run time, as the driver is: a machine without it runs everything
//! else. One process drives all its GPUs, so every collective is one NCCL group over
//! the ranks' communicators, each queued on its rank's stream (nothing waits on the
//! host). Set `NCCL_NVLS_ENABLE=0` where NVLink multicast must stay off.

use super::{DeviceBuf, Gpu};
use crate::error::{Error, Result};
use cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};
use cudarc::nccl::{Comm, NcclType, ReduceOp};

/// How the ranks' buffers combine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduce {
    Sum,
    /// The mean over the ranks (data parallel's gradients).
    Avg,
    Max,
}

/// The ranks' GPUs and how their buffers meet.
pub struct Collective {
    gpus: Vec<Gpu>,
    nccl: Option<Vec<Comm>>,
}

/// Why NCCL cannot be used here, if it cannot.
pub fn nccl_present() -> Result<()> {
    if super::cuda_library_present(super::presence_probe!(nccl)) {
        Ok(())
    } else {
        Err(Error::NoGpu(
            "NCCL (libnccl.so) was not found: several GPUs need it. PyTorch's CUDA wheels carry it as \
             nvidia/nccl/lib/libnccl.so.2; put a libnccl.so link to it on LD_LIBRARY_PATH"
                .into(),
        ))
    }
}

fn nccl_error(context: &str, e: impl std::fmt::Debug) -> Error {
    Error::Cuda { context: format!("NCCL {context}"), message: format!("{e:?}") }
}

impl Collective {
    /// The ranks `gpus` (rank `r` on `gpus[r]`): over NCCL when they are distinct
    /// devices, through host memory when some share a device (or for one rank
    /// where there is no NCCL).
    pub fn new(gpus: Vec<Gpu>) -> Result<Collective> {
        if gpus.is_empty() {
            return Err(Error::Argument("a collective over no GPUs".into()));
        }
        let mut ordinals: Vec<usize> = gpus.iter().map(|g| g.context().ordinal()).collect();
        ordinals.sort_unstable();
        ordinals.dedup();
        // One rank needs no communication: NCCL if it is here, else nothing is lost.
        if ordinals.len() < gpus.len() || (gpus.len() == 1 && nccl_present().is_err()) {
            return Ok(Collective { gpus, nccl: None });
        }
        Self::over_nccl(gpus)
    }

    /// The ranks meeting through host memory, whatever their devices (one rank: no
    /// communication at all).
    pub fn in_host_memory(gpus: Vec<Gpu>) -> Result<Collective> {
        if gpus.is_empty() {
            return Err(Error::Argument("a collective over no GPUs".into()));
        }
        Ok(Collective { gpus, nccl: None })
    }

    /// The ranks over NCCL (each on its own device), whatever their count.
    pub fn over_nccl(gpus: Vec<Gpu>) -> Result<Collective> {
        nccl_present()?;
        let streams = gpus.iter().map(|g| g.stream().clone()).collect();
        // cudarc panics on a missing NCCL symbol (a library older than it expects).
        let comms = std::panic::catch_unwind(|| Comm::from_devices(streams))
            .map_err(|_| Error::NoGpu("the NCCL library lacks functions cudarc needs".into()))?
            .map_err(|e| nccl_error("initialising the communicators", e))?;
        Ok(Collective { gpus, nccl: Some(comms) })
    }

    pub fn gpus(&self) -> &[Gpu] {
        &self.gpus
    }

    /// Whether the buffers meet through NCCL (else through host memory).
    pub fn is_nccl(&self) -> bool {
        self.nccl.is_some()
    }

    /// Every rank's `bufs[rank]` (on its GPU) replaced by the ranks' combination.
    pub fn all_reduce<T: Element>(&self, bufs: &mut [&mut DeviceBuf<T>], op: Reduce) -> Result<()> {
        if bufs.len() != self.gpus.len() {
            return Err(Error::Argument(format!("{} buffers for {} ranks", bufs.len(), self.gpus.len())));
        }
        let len = bufs[0].len();
        if bufs.iter().any(|b| b.len() != len) {
            return Err(Error::Shape("the ranks' buffers differ in length".into()));
        }
        match &self.nccl {
            Some(comms) => {
                let op = match op {
                    Reduce::Sum => ReduceOp::Sum,
                    Reduce::Avg => ReduceOp::Avg,
                    Reduce::Max => ReduceOp::Max,
                };
                cudarc::nccl::result::group_start().map_err(|e| nccl_error("group start", e))?;
                let mut queued = Ok(());
                for (comm, buf) in comms.iter().zip(bufs.iter_mut()) {
                    let slice: &mut CudaSlice<T> = buf;
                    if let Err(e) = comm.all_reduce_in_place(slice, &op) {
                        queued = Err(nccl_error("all-reduce", e));
                        break;
                    }
                }
                // The group ends even when a call failed: NCCL needs its calls paired.
                let ended = cudarc::nccl::result::group_end().map_err(|e| nccl_error("group end", e));
                queued.and(ended.map(|_| ()))
            }
            None => {
                let mut acc: Option<Vec<T>> = None;
                for (gpu, buf) in self.gpus.iter().zip(bufs.iter()) {
                    let host = gpu.stream().clone_dtoh(&***buf).map_err(|e| Error::cuda("copying to the host", e))?;
                    acc = Some(match acc {
                        None => host,
                        Some(mut a) => {
                            a.iter_mut().zip(&host).for_each(|(a, &b)| *a = T::combine(op, *a, b));
                            a
                        }
                    });
                }
                let mut acc = acc.expect("at least one rank");
                if op == Reduce::Avg {
                    let n = self.gpus.len();
                    acc.iter_mut().for_each(|a| *a = T::divide(*a, n));
                }
                for (gpu, buf) in self.gpus.iter().zip(bufs.iter_mut()) {
                    let slice: &mut CudaSlice<T> = buf;
                    gpu.stream().memcpy_htod(&acc, slice).map_err(|e| Error::cuda("copying to the device", e))?;
                }
                Ok(())
            }
        }
    }

    /// Waits for every rank's queued work.
    pub fn synchronize(&self) -> Result<()> {
        self.gpus.iter().try_for_each(Gpu::synchronize)
    }
}

/// What the collectives carry: FP32 values (sums, means) and 64-bit row-max keys.
pub trait Element: NcclType + DeviceRepr + ValidAsZeroBits + Copy + Default + Unpin + 'static {
    /// `a` and `b` combined by `op` (the host path).
    fn combine(op: Reduce, a: Self, b: Self) -> Self;
    fn divide(a: Self, n: usize) -> Self;
}

impl Element for f32 {
    fn combine(op: Reduce, a: f32, b: f32) -> f32 {
        match op {
            Reduce::Sum | Reduce::Avg => a + b,
            Reduce::Max => a.max(b),
        }
    }
    fn divide(a: f32, n: usize) -> f32 {
        a / n as f32
    }
}

impl Element for u64 {
    fn combine(op: Reduce, a: u64, b: u64) -> u64 {
        match op {
            Reduce::Sum | Reduce::Avg => a.wrapping_add(b),
            Reduce::Max => a.max(b),
        }
    }
    fn divide(a: u64, n: usize) -> u64 {
        a / n as u64
    }
}

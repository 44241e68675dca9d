//! Launcher of `row_partials_finish` (kernels-gpu/src/epilogue/partials.rs): a chain
//! that reduces each row once, finished from the TMA GEMM's row partials.

use super::super::Dtype;
use super::super::memory::DeviceElement;
use super::super::{DeviceTensor, Gpu, launched};
use super::DeviceChain;
use crate::error::{Error, Result};
use cudarc::driver::PushKernelArg;
use kernel_abi::epilogue::{Pointwise, row_partials};
use kernel_abi::kernels::Kernel;

/// The finishing kernel writing `dtype`.
pub fn finish_kernel(dtype: Dtype) -> Kernel {
    match dtype {
        Dtype::F32 => Kernel::RowPartialsFinish,
        Dtype::Bf16 => Kernel::RowPartialsFinishBf16,
        Dtype::F16 => Kernel::RowPartialsFinishF16,
    }
}

/// Queues `y[r] = tail(reduce_p partials[p, r])`: `partials (row_partials(n), rows, 2)`
/// from the GEMM that ran `head` (ending in the row reduction) over `n` features, then
/// `tail`'s per-element ops, into `y`'s `rows` values.
pub fn row_partials_finish<T: DeviceElement>(
    gpu: &Gpu,
    partials: &DeviceTensor,
    n: usize,
    (head, tail): (&DeviceChain, &DeviceChain),
    y: &mut DeviceTensor<T>,
) -> Result<()> {
    let parts = row_partials(n);
    let [p, rows, 2] = partials.shape[..] else {
        return Err(Error::Shape(format!("row partials must be (parts, rows, 2), got {:?}", partials.shape)));
    };
    if p != parts || y.len() != rows || rows == 0 || n > u32::MAX as usize || rows * 32 > u32::MAX as usize {
        return Err(Error::Shape(format!(
            "row partials {:?} of {n} features into {:?}: expected ({parts}, rows, 2) and one value per row",
            partials.shape, y.shape
        )));
    }
    let reduction = head.reduction().filter(|_| tail.ops.iter().all(|op| Pointwise::from_code(op.code).is_some()));
    let Some(reduction) = reduction else {
        return Err(Error::Chain("row partials finish a row reduction with per-element ops only".into()));
    };
    let kernel = finish_kernel(T::DTYPE);
    // A warp per row.
    let (func, cfg) = gpu.kernel_1d(kernel, rows * 32, 0)?;
    let (parts32, rows32, n32, n_ops) = (parts as u32, rows as u32, n as u32, tail.ops.len() as u32);
    let mut launch = gpu.stream().launch_builder(&func);
    launch.arg(&partials.buf).arg(&parts32).arg(&rows32).arg(&n32).arg(&reduction);
    launch.arg(&tail.descs).arg(&n_ops).arg(&mut y.buf);
    // SAFETY: matches the kernel's signature; the partials hold parts * rows * 2 floats
    // and `y` rows values (checked above); the tail's ops are per-element, their
    // parameters (one column after the reduction) validated with the chain.
    launched(kernel, unsafe { launch.launch(cfg) })
}

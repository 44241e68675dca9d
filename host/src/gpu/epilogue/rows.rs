//! Launchers of `epilogue_rows`, `epilogue_rows_backward` and `sum_partials`
//! (kernels-gpu/src/epilogue/rows.rs): any chain, row by row, forward and backward.

use super::super::dispatch::{rows_backward_kernel, rows_kernel};
use super::super::memory::DeviceElement;
use super::super::{DeviceTensor, Gpu, VectorArg, VectorWord, launched};
use super::{DeviceChain, Widened};
use crate::error::{Error, Result};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use kernel_abi::epilogue::{
    OP_AVG_POOL, OP_MAX_POOL, row_backward_smem_bytes, row_smem_bytes, row_smem_bytes_unpooled,
};
use kernel_abi::gemm_fma::MAX_GRAD_SLOTS;
use kernel_abi::kernels::Kernel;

/// Refuses what the kernel cannot launch: one block per row (`gridDim.x` < 2^31),
/// `n` and `splits` as u32 (at most 64 split-K parts).
fn check_rows_size(splits: usize, rows: usize, n: usize) -> Result<()> {
    if rows == 0 || rows > i32::MAX as usize || n == 0 || n > u32::MAX as usize || splits == 0 || splits > 64 {
        return Err(Error::Shape(format!("epilogue over {splits} x {rows} rows of {n} is outside the kernel's range")));
    }
    Ok(())
}

/// Whether an op of `chain` pools (AvgPool, MaxPool): the row-wise kernels then need
/// a second row buffer.
fn pools(chain: &DeviceChain) -> bool {
    chain.ops.iter().any(|op| matches!(op.code, OP_AVG_POOL | OP_MAX_POOL))
}

/// Queues `y = chain(sum_s z[s] + bias)` row by row. `z` is `(rows, n)`, or
/// `(splits, rows, n)` holding split-K parts; `y` has the chain's output width, in
/// FP32 or bf16. `save_z`, if given, receives the chain's input `(rows, n)`.
pub fn epilogue_rows<T: DeviceElement>(
    gpu: &Gpu,
    chain: &DeviceChain,
    z: &DeviceTensor,
    bias: Option<VectorArg<'_>>,
    y: &mut DeviceTensor<T>,
    save_z: Option<&mut DeviceTensor>,
) -> Result<()> {
    let (splits, rows, n) = match z.shape[..] {
        [rows, n] => (1, rows, n),
        [splits, rows, n] => (splits, rows, n),
        _ => return Err(Error::Shape(format!("epilogue input must be 2-D or 3-D, got {:?}", z.shape))),
    };
    check_rows_size(splits, rows, n)?;
    if bias.is_some_and(|b| b.len != n) || save_z.as_ref().is_some_and(|s| s.shape != [rows, n]) {
        return Err(Error::Shape(format!("epilogue bias / saved input must have {n} columns")));
    }
    let (kernel, threads) = rows_kernel(T::DTYPE, n);
    let func = gpu.function(kernel)?;
    // The pooling buffer only where an op pools.
    let smem = if pools(chain) { row_smem_bytes(n) } else { row_smem_bytes_unpooled(n) };
    gpu.allow_shared(&func, kernel, smem)
        .map_err(|e| Error::Unsupported(format!("{e}: rows of {n} features are too wide for the row-wise epilogue")))?;
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let (splits, n, n_ops) = (splits as u32, n as u32, chain.ops.len() as u32);
    let null = 0u64;
    let mut launch = gpu.stream().launch_builder(&func);
    launch.arg(&z.buf).arg(&splits);
    let bias = bias.map_or(VectorWord::NONE, |b| b.word);
    launch.arg(&bias);
    launch.arg(&mut y.buf);
    match save_z {
        Some(s) => launch.arg(&mut s.buf),
        None => launch.arg(&null),
    };
    launch.arg(&n).arg(&chain.descs).arg(&n_ops);
    // SAFETY: matches the kernel's signature; z holds splits * rows * n values; the
    // chain was validated against n when its BlockSpec was built, and its parameter
    // vectors have the matching lengths.
    unsafe { launch.launch(cfg) }.map_err(|e| Error::cuda(format!("launching `{kernel}`"), e))?;
    Ok(())
}

/// Backward of the chain: `dz` from the saved chain input `z (rows, n)` and `dy`, and
/// the parameter gradients `(grad_slots, n)`: slot 0 the Linear bias, then each op
/// parameter in chain order (the first `features` entries of each slot are used).
/// `dy` and `dz` are FP32, or both bf16 (the sums FP32 either way).
pub fn epilogue_rows_backward<T: DeviceElement>(
    gpu: &Gpu,
    chain: &DeviceChain,
    z: &DeviceTensor,
    dy: &DeviceTensor<T>,
    out_width: usize,
) -> Result<(DeviceTensor<T>, DeviceTensor)> {
    let [rows, n] = z.shape[..] else {
        return Err(Error::Shape(format!("saved chain input must be 2-D, got {:?}", z.shape)));
    };
    check_rows_size(1, rows, n)?;
    if dy.len() != rows * out_width {
        return Err(Error::tensor("dy", format!("expected {rows} x {out_width} values, got shape {:?}", dy.shape)));
    }
    // Its kernel reads FP32 parameters only (`Fp32Params`: at its register limit, the
    // stored-type reads spilled): a 16-bit model's are widened here first.
    let widened = chain.widened(gpu, n, None)?;
    let chain = Widened::chain(&widened, chain);
    let slots = chain.grad_slots;
    let pools = pools(chain);
    // The parameter-gradient sums stay in shared memory whenever they fit beside the
    // rows, even at fewer blocks per SM: in global memory each thread's read-add-write
    // of a sum waits out the previous one's L2 round trip.
    let in_smem = row_backward_smem_bytes(n, slots, pools) <= gpu.props.max_shared_per_block_optin;
    let smem = row_backward_smem_bytes(n, if in_smem { slots } else { 0 }, pools);
    // As many blocks as fit on the GPU at once (its shared memory, the blocks its
    // launch bounds leave registers for); each sums its rows' parameter gradients.
    let (kernel, threads) = rows_backward_kernel(T::DTYPE, n);
    let most = kernel.launch_bounds().map_or(1, |b| b.min_blocks_per_sm as usize);
    let per_sm = (gpu.props.shared_per_multiprocessor / smem.max(1)).clamp(1, most);
    let blocks = rows.min(per_sm * gpu.props.multiprocessors);
    let mut partials = if in_smem { gpu.alloc(&[blocks, slots, n])? } else { gpu.zeros(&[blocks, slots, n])? };
    let mut dz = gpu.alloc_as::<T>(&[rows, n])?;
    let func = gpu.function(kernel)?;
    gpu.allow_shared(&func, kernel, smem)
        .map_err(|e| Error::Unsupported(format!("{e}: rows of {n} features are too wide for the row-wise backward")))?;
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let (rows32, n32, n_ops, in_smem32) = (rows as u32, n as u32, chain.ops.len() as u32, u32::from(in_smem));
    let mut launch = gpu.stream().launch_builder(&func);
    launch.arg(&z.buf).arg(&dy.buf).arg(&mut dz.buf).arg(&mut partials.buf);
    launch.arg(&rows32).arg(&n32).arg(&chain.descs).arg(&n_ops).arg(&in_smem32);
    // SAFETY: matches the kernel's signature; z and dz hold rows * n, dy rows * out_width,
    // partials blocks * slots * n (zeroed unless the kernel sums in shared memory and
    // writes it whole); the chain was validated against n.
    unsafe { launch.launch(cfg) }.map_err(|e| Error::cuda(format!("launching `{kernel}`"), e))?;

    let grads = sum_partials(gpu, partials, blocks, slots * n)?.reshape(&[slots, n])?;
    Ok((dz, grads))
}

/// `out[j] = sum_b partials[b, j]` over `blocks` rows of `len`: the second level of the
/// parameter-gradient reduction. One block's partials are the sums already: returned as
/// they are, no launch (a backward of up to 16 rows: one launch and ~2 us of a one-row
/// training step's graph).
pub fn sum_partials(gpu: &Gpu, partials: DeviceTensor, blocks: usize, len: usize) -> Result<DeviceTensor> {
    if blocks == 1 && partials.len() == len {
        return partials.reshape(&[len]);
    }
    let out = gpu.alloc(&[len])?;
    // SAFETY: `out` holds len floats.
    unsafe { sum_partials_into(gpu, &partials, blocks, len, out.buf.device_address())? };
    Ok(out)
}

/// [`sum_partials`] into `len` floats at device address `out`.
///
/// # Safety
/// `out` is valid for `len` floats until the stream has run the launch.
pub unsafe fn sum_partials_into(gpu: &Gpu, partials: &DeviceTensor, blocks: usize, len: usize, out: u64) -> Result<()> {
    if partials.len() < blocks * len {
        return Err(Error::Shape(format!("{} partial sums for {blocks} x {len}", partials.len())));
    }
    let (b32, len32) = (blocks as u32, len as u32);
    let (func, cfg) = gpu.kernel_1d(Kernel::SumPartials, len, 0)?;
    let mut l = gpu.stream().launch_builder(&func);
    l.arg(&partials.buf).arg(&b32).arg(&len32).arg(&out);
    // SAFETY: (partials, blocks, len, out) as `sum_partials` takes; sizes checked above,
    // `out`'s by the caller.
    launched(Kernel::SumPartials, unsafe { l.launch(cfg) })
}

/// [`sum_partials`] of the tile-wise backward's `(blocks, slots, n)` sums into the
/// vectors of `words` (`kernel_abi::vector` words, `n` values each), each rounded once
/// into its own type.
///
/// # Safety
/// Each of `words[..slots]` names a vector of `n` values, valid until the stream has
/// run the launch.
pub unsafe fn sum_partials_to(
    gpu: &Gpu,
    partials: &DeviceTensor,
    blocks: usize,
    slots: usize,
    n: usize,
    words: &[u64; MAX_GRAD_SLOTS],
) -> Result<()> {
    let len = slots * n;
    if partials.len() < blocks * len || slots > MAX_GRAD_SLOTS || len > u32::MAX as usize {
        return Err(Error::Shape(format!("{} partial sums for {blocks} x {slots} x {n}", partials.len())));
    }
    let (b32, n32, s32) = (blocks as u32, n as u32, slots as u32);
    let (func, cfg) = gpu.kernel_1d(Kernel::SumPartialsTo, len, 0)?;
    let mut l = gpu.stream().launch_builder(&func);
    l.arg(&partials.buf).arg(&b32).arg(&n32).arg(&s32).arg(words);
    // SAFETY: (partials, blocks, n, slots, outs) as `sum_partials_to` takes; sizes
    // checked above, the vectors' by the caller.
    launched(Kernel::SumPartialsTo, unsafe { l.launch(cfg) })
}

#[cfg(test)]
mod tests {
    #[test]
    fn sizes_outside_the_launch_are_refused() {
        use super::check_rows_size;
        assert!(check_rows_size(1, i32::MAX as usize + 1, 8).is_err());
        assert!(check_rows_size(1, 8, u32::MAX as usize + 1).is_err());
        assert!(check_rows_size(65, 8, 8).is_err());
        assert!(check_rows_size(1, 0, 8).is_err());
        assert!(check_rows_size(16, i32::MAX as usize, u32::MAX as usize).is_ok());
    }
}

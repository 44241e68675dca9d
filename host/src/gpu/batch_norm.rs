//! A chain with a BatchNorm (`batchnorm`, batch statistics) on the GPU: the rows stop
//! being independent at the BatchNorm, so the block runs in phases around a column
//! reduction, with the existing GEMM and row-wise epilogue kernels on either side.
//!
//! With `u` the BatchNorm's input (the GEMM, its bias and the per-element ops before
//! the BatchNorm, which the block's `chain` holds):
//! * forward: the GEMM plan of that shorter chain writes `u` (and saves `z`);
//!   `batch_norm_stats` reduces each chunk of 256 rows of each column of `u` to its count,
//!   mean and sum of squared deviations (Welford per thread, Chan's merges across a
//!   block's warps: no `E[x^2] - E[x]^2`), `batch_norm_finish` merges the chunks and adds
//!   `-mean` and `rstd = 1 / sqrt(var + eps)`; then
//!   `epilogue_rows` runs `bias(-mean), mul(rstd), mul(gamma), bias(beta)` and the ops
//!   after the BatchNorm on `u`: the normalisation is four per-element ops on device
//!   vectors, `xhat` formed as `(u - mean) rstd` before the affine.
//! * backward: `u` and the statistics again from `z`; `epilogue_rows_backward` of that
//!   chain gives `g`, the gradient of `u` at fixed statistics, and its parameter sums
//!   `S2 = sum dv xhat` (`mul(gamma)`'s: `d gamma`) and `S1 = sum dv` (`bias(beta)`'s:
//!   `d beta`); `batch_norm_grad` adds the paths through the statistics,
//!   `du = g - gamma rstd (S1 + xhat S2) / N`; the ops before the BatchNorm take `du`
//!   back to `dz` (`epilogue_rows_backward` again, which also sums the Linear bias's
//!   gradient), and the GEMMs follow as for any chain.

use super::block::{GpuBlock, Workspace};
use super::elementwise::{Convert, Vector, convert_vectors};
use super::epilogue::DeviceChain;
use super::epilogue::rows::{epilogue_rows, epilogue_rows_backward};
use super::{DeviceElement, DeviceTensor, Gpu, launched};
use crate::chain::{Op, Pointwise};
use crate::error::{Error, Result};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use kernel_abi::Kernel;
use kernel_abi::batch_norm::{CHUNK_ROWS, COLUMNS, ROW_GROUPS, SMEM_BYTES};

/// `[mean; var; -mean; rstd]` `(4, n)` of the columns of `u` `(rows, n)`.
pub fn batch_norm_stats(gpu: &Gpu, u: &DeviceTensor, eps: f32) -> Result<DeviceTensor> {
    let [rows, n] = u.shape[..] else {
        return Err(Error::Shape(format!("the BatchNorm's input must be 2-D, got {:?}", u.shape)));
    };
    if rows < 2 || rows > u32::MAX as usize || n > u32::MAX as usize {
        return Err(Error::Shape(format!("a BatchNorm over {rows} rows of {n} features")));
    }
    let chunks = rows.div_ceil(CHUNK_ROWS);
    if chunks > 65535 {
        return Err(Error::Shape(format!("a BatchNorm over {rows} rows: at most {} rows", 65535 * CHUNK_ROWS)));
    }
    let (rows32, n32, chunks32) = (rows as u32, n as u32, chunks as u32);
    let mut partials = gpu.alloc(&[chunks, 3, n])?;
    let func = gpu.function(Kernel::BatchNormStats)?;
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(COLUMNS) as u32, chunks32, 1),
        block_dim: ((COLUMNS * ROW_GROUPS) as u32, 1, 1),
        shared_mem_bytes: SMEM_BYTES as u32,
    };
    let mut l = gpu.stream().launch_builder(&func);
    l.arg(&u.buf).arg(&rows32).arg(&n32).arg(&mut partials.buf);
    // SAFETY: (u, rows, n, partials) as the kernel takes them: u holds rows * n,
    // partials 3 n per chunk of the grid.
    launched(Kernel::BatchNormStats, unsafe { l.launch(cfg) })?;
    let mut stats = gpu.alloc(&[4, n])?;
    let (func, cfg) = gpu.kernel_1d(Kernel::BatchNormFinish, n, 0)?;
    let mut l = gpu.stream().launch_builder(&func);
    l.arg(&partials.buf).arg(&chunks32).arg(&n32).arg(&eps).arg(&mut stats.buf);
    // SAFETY: partials holds 3 n chunks, stats 4 n.
    launched(Kernel::BatchNormFinish, unsafe { l.launch(cfg) })?;
    Ok(stats)
}

impl<W: DeviceElement> GpuBlock<W> {
    /// The BatchNorm `k` and the ops after it as the row-wise epilogue runs them, over
    /// the statistics `stats` (`[mean; var; -mean; rstd]`).
    pub(super) fn batch_norm_post(&self, gpu: &Gpu, k: usize, stats: &DeviceTensor) -> Result<DeviceChain> {
        let n = stats.shape[1];
        let row = |r: usize| stats.buf.device_address() + (r * n * 4) as u64;
        let (bias, mul) = (Op::of(Pointwise::Bias), Op::of(Pointwise::Mul));
        let mut ops = vec![bias, mul, mul, bias];
        ops.extend_from_slice(&self.spec.chain.0[k + 1..]);
        let address = |t: &DeviceTensor| t.buf.device_address();
        let gamma_beta = &self.params.ops[k];
        let mut ptrs = vec![[row(2), 0], [row(3), 0], [address(&gamma_beta[0]), 0], [address(&gamma_beta[1]), 0]];
        for p in &self.params.ops[k + 1..] {
            let mut pair = [0u64; 2];
            for (slot, t) in pair.iter_mut().zip(p) {
                *slot = address(t);
            }
            ptrs.push(pair);
        }
        DeviceChain::from_ptrs(gpu, &ops, &ptrs)
    }

    /// The rest of a forward with a BatchNorm (op `k`, `eps`) once the GEMM, its bias and
    /// the ops before the BatchNorm have written its input `u` (FP32): the statistics,
    /// then the normalisation and the later ops into `y`. Returns the statistics.
    pub(super) fn finish_batch_norm(
        &self,
        gpu: &Gpu,
        u: &DeviceTensor,
        y: &mut DeviceTensor<W>,
        (k, eps): (usize, f32),
    ) -> Result<DeviceTensor> {
        let stats = batch_norm_stats(gpu, u, eps)?;
        let post = self.batch_norm_post(gpu, k, &stats)?;
        epilogue_rows(gpu, &post, u, None, y, None)?;
        Ok(stats)
    }

    /// `dz` and the gradient slots (the block's layout, [`GpuBlock::small_grad_slots`])
    /// of a chain with a BatchNorm (op `k`, `eps`), from the saved `z` and `dy`.
    pub(super) fn backward_batch_norm(
        &self,
        gpu: &Gpu,
        z: &DeviceTensor,
        dy: &DeviceTensor,
        (k, eps): (usize, f32),
    ) -> Result<(DeviceTensor, DeviceTensor)> {
        let [rows, n] = z.shape[..] else {
            return Err(Error::Shape(format!("the saved z must be 2-D, got {:?}", z.shape)));
        };
        self.spec.check_batch(rows)?;
        let recomputed;
        let u = if k == 0 {
            z
        } else {
            let mut u = gpu.alloc(&[rows, n])?;
            epilogue_rows(gpu, &self.chain, z, None, &mut u, None)?;
            recomputed = u;
            &recomputed
        };
        let stats = batch_norm_stats(gpu, u, eps)?;
        let post = self.batch_norm_post(gpu, k, &stats)?;
        // Slots of `post`: 0 its input's sum, 1 `-mean`'s, 2 `rstd`'s, 3 gamma's (S2),
        // 4 beta's (S1), then the later ops' parameters.
        let (mut g, post_slots) = epilogue_rows_backward(gpu, &post, u, dy, self.out_width())?;
        let slot = |s: usize| post_slots.buf.device_address() + (s * n * 4) as u64;
        let (s1, s2) = (slot(4), slot(3));
        let (rows32, n32) = (rows as u32, n as u32);
        let (func, cfg) = gpu.kernel_1d(Kernel::BatchNormGrad, rows * n, 0)?;
        let mut l = gpu.stream().launch_builder(&func);
        l.arg(&mut g.buf).arg(&u.buf).arg(&stats.buf).arg(&self.params.ops[k][0].buf);
        l.arg(&s1).arg(&s2).arg(&rows32).arg(&n32).arg(&eps);
        // SAFETY: g and u hold rows * n, stats 4 n, gamma n, s1 and s2 n each (slots 4
        // and 3 of post_slots, which lives past the launch).
        launched(Kernel::BatchNormGrad, unsafe { l.launch(cfg) })?;
        let (dz, pre_slots) = epilogue_rows_backward(gpu, &self.chain, z, &g, n)?;
        // The block's slots: the Linear bias's and the earlier ops' (`pre_slots`), then
        // gamma's, beta's and the later ops' (`post` slots 3 on).
        let (pre, post_n) = (pre_slots.shape[0], post_slots.shape[0] - 3);
        let out = gpu.alloc(&[pre + post_n, n])?;
        let copies = [
            Vector {
                src: pre_slots.buf.device_address(),
                dst: out.buf.device_address(),
                len: pre * n,
                mode: Convert::F32,
            },
            Vector {
                src: slot(3),
                dst: out.buf.device_address() + (pre * n * 4) as u64,
                len: post_n * n,
                mode: Convert::F32,
            },
        ];
        // SAFETY: both sources lie inside their slot tensors, the destinations inside
        // `out`, which holds (pre + post_n) n; all outlive the launch (stream order).
        unsafe { convert_vectors(gpu, gpu.stream(), &copies)? };
        Ok((dz, out))
    }
}

impl GpuBlock {
    /// The forward of a chain with a BatchNorm (op `k`, `eps`) into `ws.y`, `z` into
    /// `save` if given; returns the statistics.
    pub(super) fn forward_batch_norm(
        &self,
        gpu: &Gpu,
        x: &DeviceTensor,
        ws: &mut Workspace,
        save: Option<&mut DeviceTensor>,
        bn: (usize, f32),
    ) -> Result<DeviceTensor> {
        let mut u = gpu.alloc(&[x.shape[0], self.gemm_width()])?;
        let (w, b) = (&self.params.linear_weight, &self.params.linear_bias);
        self.forward_f32(gpu, self.precision, x, (w, b), (&ws.plan, ws.z.as_mut()), &mut u, save)?;
        self.finish_batch_norm(gpu, &u, &mut ws.y, bn)
    }
}

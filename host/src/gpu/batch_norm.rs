//! A chain with a BatchNorm (`batchnorm`, batch statistics) on the GPU: the rows stop
//! being independent at the BatchNorm, so the block runs in phases around column
//! reductions, the GEMM on one side.
//!
//! With `u` the BatchNorm's input (the GEMM, its bias and the per-element ops `P` before
//! the BatchNorm, which the block's `chain` holds) and `Q` the ops after it:
//! * forward: the GEMM plan of that shorter chain writes `u` (and saves `z`; where `P`
//!   is empty, `u` is `z` and written once); `batch_norm_stats` reduces each block's rows
//!   of each column of `u` to its count, mean and sum of squared deviations (Welford
//!   per thread, Chan's merges: no `E[x^2] - E[x]^2`), `batch_norm_finish` merges the
//!   blocks' and adds `-mean` and `rstd = 1 / sqrt(var + eps)`; then
//!   `batch_norm_apply` writes `y = Q(gamma (u - mean) rstd + beta)`.
//! * backward: the statistics again from `z` (`P` applied on the fly);
//!   `batch_norm_backward_sums` takes `dy` back through `Q` to `dv` and sums
//!   `S2 = sum dv xhat` (gamma's gradient), `S1 = sum dv` (beta's) and `Q`'s parameter
//!   gradients; `batch_norm_backward_dz` forms `du = gamma rstd (dv - (S1 + xhat S2) / N)`
//!   and takes it back through `P` to `dz`, summing `P`'s and the Linear bias's
//!   gradients; the GEMMs follow as for any chain.
//!
//! Those column kernels take `Q` per element. A `Q` that needs whole rows (a softmax,
//! a GroupNorm) runs as the row-wise epilogue's ops: forward `bias(-mean), mul(rstd),
//! mul(gamma), bias(beta)` and `Q` by `epilogue_rows` on `u`; backward, the BatchNorm's
//! output formed again by `batch_norm_apply`, `epilogue_rows_backward` of `Q` from it to
//! `dv`, and the column kernels on `dv` with no ops after the BatchNorm. (Where the
//! column kernels do not take `P`, at most [`MAX_OPS`] ops, the backward runs row-wise
//! throughout: `epilogue_rows_backward` of the normalisation and `Q`, `batch_norm_grad`
//! for the paths through the statistics, `epilogue_rows_backward` of `P`.)

use super::block::{GpuBlock, Workspace};
use super::dispatch::batch_norm_kernels;
use super::elementwise::{Convert, Vector, convert_vectors};
use super::epilogue::DeviceChain;
use super::epilogue::rows::{epilogue_rows, epilogue_rows_backward, sum_partials_into};
use super::{DeviceElement, DeviceTensor, Gpu, launched};
use crate::chain::{Op, Pointwise};
use crate::error::{Error, Result};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use kernel_abi::Kernel;
use kernel_abi::batch_norm::{
    APPLY_BLOCKS_PER_SM, COLUMNS, DZ_BLOCKS_PER_SM, MAX_OPS, MAX_SLOTS, STATS_BLOCKS_PER_SM, STATS_SMEM_BYTES,
    SUMS_BLOCKS_PER_SM, THREADS, sums_smem_bytes,
};

/// The column kernels' grid over `(rows, n)`: blocks of 128 columns and a run of rows
/// (even: a warp takes rows in pairs), one wave of them at the kernel's blocks per SM
/// (its launch bounds), so each block's sums and its final reduction are paid once.
#[derive(Clone, Copy)]
struct Columns {
    rows: usize,
    n: usize,
    rows_per_block: usize,
    blocks: usize,
}

impl Columns {
    fn of(gpu: &Gpu, rows: usize, n: usize, per_sm: u32) -> Result<Columns> {
        if rows < 2 || rows * n > u32::MAX as usize {
            return Err(Error::Shape(format!("a BatchNorm over {rows} rows of {n} features")));
        }
        let col_tiles = n.div_ceil(COLUMNS);
        let per_wave = per_sm as usize * gpu.props.multiprocessors;
        let blocks = (per_wave / col_tiles).clamp(1, rows.div_ceil(16));
        let rows_per_block = rows.div_ceil(blocks).next_multiple_of(2);
        let blocks = rows.div_ceil(rows_per_block);
        if blocks > 65535 {
            return Err(Error::Shape(format!("a BatchNorm over {rows} rows of {n} features: too many row blocks")));
        }
        Ok(Columns { rows, n, rows_per_block, blocks })
    }

    fn config(&self, shared_mem_bytes: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (self.n.div_ceil(COLUMNS) as u32, self.blocks as u32, 1),
            block_dim: (THREADS as u32, 1, 1),
            shared_mem_bytes: shared_mem_bytes as u32,
        }
    }

    /// `(rows, n, rows per block)` as the kernels take them.
    fn args(&self) -> [u32; 3] {
        [self.rows, self.n, self.rows_per_block].map(|v| v as u32)
    }
}

/// Whether the column kernels may read and write these tensors with 4-value accesses
/// where `n % 4 == 0` (16 bytes of FP32, 8 of a 16-bit type).
fn vector_aligned(n: usize, addresses: &[(u64, usize)]) -> bool {
    !n.is_multiple_of(4) || addresses.iter().all(|&(a, size)| a.is_multiple_of(4 * size as u64))
}

/// The later ops' table and count as the column kernels take them (none: 0 and 0).
fn later_ops(post: Option<&DeviceChain>) -> (u64, u32) {
    post.map_or((0, 0), |c| (c.descs.0.device_address(), c.ops.len() as u32))
}

/// `[mean; var; -mean; rstd]` `(4, n)` of the columns of `u = P(src)`, `src` `(rows, n)`,
/// `P` the per-element ops of `pre` (none: `src` is `u`).
pub fn batch_norm_stats(gpu: &Gpu, src: &DeviceTensor, pre: Option<&DeviceChain>, eps: f32) -> Result<DeviceTensor> {
    let (partials, blocks) = stats_partials(gpu, src, pre)?;
    let n = src.shape[1];
    let mut stats = gpu.alloc(&[4, n])?;
    let (func, cfg) = gpu.kernel_1d(Kernel::BatchNormFinish, n, 0)?;
    let (blocks32, n32) = (blocks as u32, n as u32);
    let mut l = gpu.stream().launch_builder(&func);
    l.arg(&partials.buf).arg(&blocks32).arg(&n32).arg(&eps).arg(&mut stats.buf);
    // SAFETY: partials holds 3 n doubles per row block, stats 4 n.
    launched(Kernel::BatchNormFinish, unsafe { l.launch(cfg) })?;
    Ok(stats)
}

/// Each row block's count, mean and sum of squared deviations of the columns of
/// `u = P(src)` (`batch_norm_stats`' first kernel): `(blocks, 3, n)` and `blocks`.
fn stats_partials(gpu: &Gpu, src: &DeviceTensor, pre: Option<&DeviceChain>) -> Result<(DeviceTensor, usize)> {
    let [rows, n] = src.shape[..] else {
        return Err(Error::Shape(format!("the BatchNorm's input must be 2-D, got {:?}", src.shape)));
    };
    let grid = Columns::of(gpu, rows, n, STATS_BLOCKS_PER_SM)?;
    if !vector_aligned(n, &[(src.buf.device_address(), 4)]) {
        return Err(Error::Shape("the BatchNorm's input is not 16-byte aligned".into()));
    }
    let n_pre = pre.map_or(0, |c| c.ops.len());
    if n_pre > MAX_OPS {
        return Err(Error::Unsupported(format!("{n_pre} ops before a BatchNorm: at most {MAX_OPS}")));
    }
    // FP64 partials, as pairs of FP32 words.
    let mut partials = gpu.alloc(&[grid.blocks, 3, 2 * n])?;
    let func = gpu.function(Kernel::BatchNormStats)?;
    let [rows32, n32, per_block] = grid.args();
    let (n_pre32, none) = (n_pre as u32, 0u64);
    let mut l = gpu.stream().launch_builder(&func);
    l.arg(&src.buf).arg(&rows32).arg(&n32).arg(&per_block);
    match pre {
        Some(chain) => l.arg(&chain.descs),
        None => l.arg(&none),
    };
    l.arg(&n_pre32).arg(&mut partials.buf);
    // SAFETY: (src, rows, n, rows per block, pre, n_pre, partials) as the kernel takes
    // them: src holds rows * n (aligned as checked), partials 3 n doubles per row block, the
    // ops per element (the block's chain before a BatchNorm).
    launched(Kernel::BatchNormStats, unsafe { l.launch(grid.config(STATS_SMEM_BYTES)) })?;
    Ok((partials, grid.blocks))
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
        let gamma_beta = &self.params.ops[k];
        let mut ptrs = vec![[row(2), 0], [row(3), 0], [gamma_beta[0].word()?.0, 0], [gamma_beta[1].word()?.0, 0]];
        for p in &self.params.ops[k + 1..] {
            let mut pair = [0u64; 2];
            for (slot, t) in pair.iter_mut().zip(p) {
                *slot = t.word()?.0;
            }
            ptrs.push(pair);
        }
        DeviceChain::from_ptrs(gpu, &ops, &ptrs)
    }

    /// The ops after the BatchNorm `k` as the column kernels take them (`Q`: per element,
    /// and few enough for their tables and sums), or `None` where the row-wise path
    /// runs them.
    fn batch_norm_columns_post(&self, gpu: &Gpu, k: usize) -> Result<Option<DeviceChain>> {
        if !self.batch_norm_by_columns(k) {
            return Ok(None);
        }
        DeviceChain::new(gpu, &[], &self.spec.chain.0[k + 1..], &self.params.ops[k + 1..]).map(Some)
    }

    /// Whether the column kernels take the chain around the BatchNorm `k` (tensors
    /// aligned for them): the ops after it per element, few enough for their tables
    /// and gradient sums.
    pub(super) fn batch_norm_by_columns(&self, k: usize) -> bool {
        let after = &self.spec.chain.0[k + 1..];
        let per_element = after.iter().all(|op| matches!(op, Op::Pointwise(..)));
        // The dz kernel's sums: the Linear bias's, P's and Q's; the sums kernel's: 2 + Q's.
        let q: usize = after.iter().map(|op| op.param_bases().len()).sum();
        per_element && after.len() <= MAX_OPS && self.pre_by_columns(q)
    }

    /// Whether the column kernels take the ops before the BatchNorm beside `q` gradient
    /// slots of later ops.
    fn pre_by_columns(&self, q: usize) -> bool {
        self.chain.ops.len() <= MAX_OPS && self.chain.grad_slots + q <= MAX_SLOTS && 2 + q <= MAX_SLOTS
    }

    /// The rest of a forward with a BatchNorm (op `k`, `eps`) once the GEMM, its bias and
    /// the ops before the BatchNorm have written its input `u` (FP32): the statistics,
    /// then the normalisation and the later ops into `y`. Returns the statistics, the
    /// batch's mean and biased variance in their first two rows.
    pub(super) fn finish_batch_norm(
        &self,
        gpu: &Gpu,
        u: &DeviceTensor,
        y: &mut DeviceTensor<W>,
        (k, eps): (usize, f32),
    ) -> Result<DeviceTensor> {
        let [rows, n] = u.shape[..] else {
            return Err(Error::Shape(format!("the BatchNorm's input must be 2-D, got {:?}", u.shape)));
        };
        let aligned = vector_aligned(n, &[(u.buf.device_address(), 4), (y.buf.device_address(), size_of::<W>())]);
        let post = if aligned && y.len() == rows * n { self.batch_norm_columns_post(gpu, k)? } else { None };
        let Some(post) = post else {
            let stats = batch_norm_stats(gpu, u, None, eps)?;
            let post = self.batch_norm_post(gpu, k, &stats)?;
            epilogue_rows(gpu, &post, u, None, y, None)?;
            return Ok(stats);
        };
        let stats = batch_norm_stats(gpu, u, None, eps)?;
        self.apply_columns(gpu, u, &stats, (k, eps), Some(&post), y)?;
        Ok(stats)
    }

    /// `y = Q(gamma (u - mean) rstd + beta)` by `batch_norm_apply` (`Q` the per-element
    /// ops of `post`; none: the BatchNorm's output itself), `stats` `[mean; var]`.
    fn apply_columns<O: DeviceElement>(
        &self,
        gpu: &Gpu,
        u: &DeviceTensor,
        stats: &DeviceTensor,
        (k, eps): (usize, f32),
        post: Option<&DeviceChain>,
        y: &mut DeviceTensor<O>,
    ) -> Result<()> {
        let [rows, n] = u.shape[..] else {
            return Err(Error::Shape(format!("the BatchNorm's input must be 2-D, got {:?}", u.shape)));
        };
        let aligned = vector_aligned(n, &[(u.buf.device_address(), 4), (y.buf.device_address(), size_of::<O>())]);
        if !aligned || y.len() != rows * n || stats.len() < 2 * n {
            return Err(Error::Shape(format!("batch_norm_apply over {rows} x {n} into {:?}", y.shape)));
        }
        let grid = Columns::of(gpu, rows, n, APPLY_BLOCKS_PER_SM)?;
        let (kernel, _, _) = batch_norm_kernels(O::DTYPE);
        let func = gpu.function(kernel)?;
        let [rows32, n32, per_block] = grid.args();
        let (descs, n_post) = later_ops(post);
        let (gamma, beta) = (self.params.ops[k][0].word()?, self.params.ops[k][1].word()?);
        let mut l = gpu.stream().launch_builder(&func);
        l.arg(&u.buf).arg(&rows32).arg(&n32).arg(&per_block).arg(&stats.buf).arg(&gamma).arg(&beta).arg(&eps);
        l.arg(&descs).arg(&n_post).arg(&mut y.buf);
        // SAFETY: as `batch_norm_apply` takes them: u and y hold rows * n (aligned as
        // checked), stats 2 n at least, gamma and beta n; post per element, at most
        // MAX_OPS ops (batch_norm_by_columns).
        launched(kernel, unsafe { l.launch(grid.config(sums_smem_bytes(0))) })
    }

    /// `dz` and the gradient slots (the block's layout, [`GpuBlock::small_grad_slots`])
    /// of a chain with a BatchNorm (op `k`, `eps`), from the saved `z` and `dy`, by the
    /// column kernels: `None` where they do not take the chain or the tensors
    /// ([`GpuBlock::backward_batch_norm_rows`] then runs it).
    pub(super) fn backward_batch_norm<T: DeviceElement>(
        &self,
        gpu: &Gpu,
        (z, saved_stats): (&DeviceTensor, Option<&DeviceTensor>),
        dy: &DeviceTensor<T>,
        (k, eps): (usize, f32),
    ) -> Result<Option<(DeviceTensor<T>, DeviceTensor)>> {
        let [rows, n] = z.shape[..] else {
            return Err(Error::Shape(format!("the saved z must be 2-D, got {:?}", z.shape)));
        };
        self.spec.check_batch(rows)?;
        let aligned = vector_aligned(n, &[(z.buf.device_address(), 4), (dy.buf.device_address(), size_of::<T>())]);
        if !aligned || dy.len() != rows * n {
            return Ok(None);
        }
        let Some(post) = self.batch_norm_columns_post(gpu, k)? else { return Ok(None) };
        let mut recomputed = None;
        let stats = self.backward_stats(gpu, z, saved_stats, eps, &mut recomputed)?;
        self.backward_columns(gpu, z, stats, dy, (k, eps), Some(&post)).map(Some)
    }

    /// The statistics a backward reads: the forward's where the caller kept them
    /// (`saved`, `[mean; var]` at least), else recomputed from the saved `z` into
    /// `recomputed`.
    fn backward_stats<'a>(
        &self,
        gpu: &Gpu,
        z: &DeviceTensor,
        saved: Option<&'a DeviceTensor>,
        eps: f32,
        recomputed: &'a mut Option<DeviceTensor>,
    ) -> Result<&'a DeviceTensor> {
        match saved {
            Some(s) if s.len() >= 2 * z.shape[1] => Ok(s),
            _ => Ok(recomputed.insert(batch_norm_stats(gpu, z, Some(&self.chain), eps)?)),
        }
    }

    /// `dz` and the block's gradient slots by `batch_norm_backward_sums` and
    /// `batch_norm_backward_dz`, `post` the per-element ops after the BatchNorm (none:
    /// `dy` is the gradient of the BatchNorm's output itself), `stats` `[mean; var]`.
    fn backward_columns<T: DeviceElement>(
        &self,
        gpu: &Gpu,
        z: &DeviceTensor,
        stats: &DeviceTensor,
        dy: &DeviceTensor<T>,
        (k, eps): (usize, f32),
        post: Option<&DeviceChain>,
    ) -> Result<(DeviceTensor<T>, DeviceTensor)> {
        let [rows, n] = z.shape[..] else {
            return Err(Error::Shape(format!("the saved z must be 2-D, got {:?}", z.shape)));
        };
        let (_, sums_kernel, dz_kernel) = batch_norm_kernels(T::DTYPE);
        // The block's slots: the Linear bias's and P's (`p`), gamma's, beta's, Q's (`q`).
        let (p, q) = (self.chain.grad_slots, post.map_or(0, |c| c.grad_slots - 1));
        let out = gpu.alloc(&[p + 2 + q, n])?;
        let at = |slot: usize| out.buf.device_address() + (slot * n * 4) as u64;
        let n_pre = self.chain.ops.len() as u32;
        let (post_descs, n_post) = later_ops(post);
        let (gamma, beta) = (self.params.ops[k][0].word()?, self.params.ops[k][1].word()?);

        let grid = Columns::of(gpu, rows, n, SUMS_BLOCKS_PER_SM)?;
        let [rows32, n32, per_block] = grid.args();
        let mut partials = gpu.alloc(&[grid.blocks, 2 + q, n])?;
        let func = gpu.function(sums_kernel)?;
        let smem = sums_smem_bytes(2 + q);
        gpu.allow_shared(&func, sums_kernel, smem)?;
        let mut l = gpu.stream().launch_builder(&func);
        l.arg(&z.buf).arg(&dy.buf).arg(&rows32).arg(&n32).arg(&per_block).arg(&self.chain.descs).arg(&n_pre);
        l.arg(&stats.buf).arg(&gamma).arg(&beta).arg(&eps).arg(&post_descs).arg(&n_post).arg(&mut partials.buf);
        // SAFETY: as `batch_norm_backward_sums` takes them: z and dy hold rows * n
        // (aligned: the callers checked), stats 2 n at least, gamma and beta n, partials
        // (2 + q) n per row block; P and Q per element, at most MAX_OPS each, their slots
        // within MAX_SLOTS (batch_norm_by_columns, pre_by_columns).
        launched(sums_kernel, unsafe { l.launch(grid.config(smem)) })?;
        // SAFETY: slots p.. of `out` hold (2 + q) n floats; `out` outlives the launch.
        unsafe { sum_partials_into(gpu, &partials, grid.blocks, (2 + q) * n, at(p))? };

        let mut dz = gpu.alloc_as::<T>(&[rows, n])?;
        let grid = Columns::of(gpu, rows, n, DZ_BLOCKS_PER_SM)?;
        let per_block = grid.args()[2];
        let mut partials = gpu.alloc(&[grid.blocks, p, n])?;
        let func = gpu.function(dz_kernel)?;
        let smem = sums_smem_bytes(p + q);
        gpu.allow_shared(&func, dz_kernel, smem)?;
        let sums = at(p);
        let mut l = gpu.stream().launch_builder(&func);
        l.arg(&z.buf).arg(&dy.buf).arg(&mut dz.buf).arg(&rows32).arg(&n32).arg(&per_block);
        l.arg(&self.chain.descs).arg(&n_pre).arg(&stats.buf).arg(&gamma).arg(&beta).arg(&eps);
        l.arg(&post_descs).arg(&n_post).arg(&sums).arg(&mut partials.buf);
        // SAFETY: as above, with dz of rows * n (a new buffer), `sums` gamma's and beta's
        // 2 n summed slots in `out`, partials p n per row block.
        launched(dz_kernel, unsafe { l.launch(grid.config(smem)) })?;
        // SAFETY: slots ..p of `out` hold p n floats.
        unsafe { sum_partials_into(gpu, &partials, grid.blocks, p * n, at(0))? };
        Ok((dz, out))
    }

    /// [`GpuBlock::backward_batch_norm`] for ops after the BatchNorm that need whole rows,
    /// on FP32 `dy`. The BatchNorm's output `v` is formed again (`batch_norm_apply`), the
    /// row-wise backward of the later ops takes `dy` to `dv`, and the column kernels take
    /// `dv` on (`backward_columns`, no later ops); the later ops' gradient slots follow the
    /// block's. Where the column kernels do not take the ops before the BatchNorm or
    /// the tensors, the whole backward runs row-wise.
    pub(super) fn backward_batch_norm_rows(
        &self,
        gpu: &Gpu,
        (z, saved_stats): (&DeviceTensor, Option<&DeviceTensor>),
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
        if self.pre_by_columns(0) && vector_aligned(n, &[(z.buf.device_address(), 4), (u.buf.device_address(), 4)]) {
            let mut recomputed = None;
            let stats = self.backward_stats(gpu, z, saved_stats, eps, &mut recomputed)?;
            let mut v = gpu.alloc(&[rows, n])?;
            self.apply_columns(gpu, u, stats, (k, eps), None, &mut v)?;
            let later = DeviceChain::new(gpu, &[], &self.spec.chain.0[k + 1..], &self.params.ops[k + 1..])?;
            let (dv, later_slots) = epilogue_rows_backward(gpu, &later, &v, dy, self.out_width())?;
            drop(v);
            let (dz, slots) = self.backward_columns(gpu, z, stats, &dv, (k, eps), None)?;
            // The block's slots: the column kernels' (the Linear bias's, P's, gamma's,
            // beta's), then the later ops' (their chain's slots 1 on; slot 0 sums `dv`).
            let (head, tail) = (slots.shape[0], later_slots.shape[0] - 1);
            let out = gpu.alloc(&[head + tail, n])?;
            let to = out.buf.device_address();
            let copies = [
                Vector { src: slots.buf.device_address(), dst: to, len: head * n, mode: Convert::F32 },
                Vector {
                    src: later_slots.buf.device_address() + (n * 4) as u64,
                    dst: to + (head * n * 4) as u64,
                    len: tail * n,
                    mode: Convert::F32,
                },
            ];
            // SAFETY: both sources lie inside their slot tensors, the destinations inside
            // `out`, which holds (head + tail) n; all outlive the launch (stream order).
            unsafe { convert_vectors(gpu, gpu.stream(), &copies)? };
            return Ok((dz, out));
        }
        let stats = batch_norm_stats(gpu, u, None, eps)?;
        let post = self.batch_norm_post(gpu, k, &stats)?;
        // Slots of `post`: 0 its input's sum, 1 `-mean`'s, 2 `rstd`'s, 3 gamma's (S2),
        // 4 beta's (S1), then the later ops' parameters.
        let (mut g, post_slots) = epilogue_rows_backward(gpu, &post, u, dy, self.out_width())?;
        let slot = |s: usize| post_slots.buf.device_address() + (s * n * 4) as u64;
        let (s1, s2) = (slot(4), slot(3));
        let (rows32, n32) = (rows as u32, n as u32);
        let (func, cfg) = gpu.kernel_1d(Kernel::BatchNormGrad, rows * n, 0)?;
        let gamma = self.params.ops[k][0].word()?;
        let mut l = gpu.stream().launch_builder(&func);
        l.arg(&mut g.buf).arg(&u.buf).arg(&stats.buf).arg(&gamma);
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
        let (w, b) = (&self.params.linear_weight, self.params.linear_bias.arg()?);
        let plan = (&ws.plan, ws.z.as_mut());
        match save {
            // No ops before the BatchNorm: its input is `z`, written once.
            Some(z) if self.chain.ops.is_empty() => {
                self.forward_f32(gpu, self.precision, x, (w, b), plan, z, None)?;
                self.finish_batch_norm(gpu, z, &mut ws.y, bn)
            }
            save => {
                let mut u = gpu.alloc(&[x.shape[0], self.gemm_width()])?;
                self.forward_f32(gpu, self.precision, x, (w, b), plan, &mut u, save)?;
                self.finish_batch_norm(gpu, &u, &mut ws.y, bn)
            }
        }
    }
}

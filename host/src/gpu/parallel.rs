//! Tensor parallel on several GPUs of one process: each rank runs the fused block on
//! its channels ([`TensorSplit`]), the ranks meet in a [`Collective`] (NCCL). The
//! forward needs no communication but a row max's one all-reduce; the backward, one
//! all-reduce of the input gradient (the column-parallel Linear's rule).

use super::block::{DeviceGrads, GpuBlock, Saved};
use super::collective::{Collective, Reduce};
use super::{DeviceBuf, DeviceTensor, Gpu, launched};
use crate::block::{BlockSpec, Params};
use crate::error::{Error, Result};
use crate::parallel::TensorSplit;
use crate::precision::Precision;
use crate::reference::BlockGrads;
use crate::tensor::Tensor;
use cudarc::driver::PushKernelArg;
use kernel_abi::Kernel;

/// A block split over the GPUs of a [`Collective`], rank `r` on its `r`-th GPU.
pub struct TensorParallel {
    split: TensorSplit,
    blocks: Vec<GpuBlock>,
    collective: Collective,
}

/// What one rank's training forward keeps for its backward.
pub struct RankSaved {
    saved: Saved,
    /// The reduced row-max keys (row max only): which rank each row's gradient goes to.
    keys: Option<DeviceBuf<u64>>,
}

impl TensorParallel {
    /// `spec` with `params` (the whole block's, on the host) split over `collective`'s
    /// GPUs; refuses a count of GPUs that would cut a group ([`TensorSplit::new`]).
    pub fn new(collective: Collective, spec: &BlockSpec, params: &Params<f32>) -> Result<TensorParallel> {
        let split = TensorSplit::new(spec, collective.gpus().len())?;
        let blocks = collective
            .gpus()
            .iter()
            .enumerate()
            .map(|(r, gpu)| GpuBlock::new(gpu, split.shard(), &split.shard_params(params, r)?))
            .collect::<Result<_>>()?;
        Ok(TensorParallel { split, blocks, collective })
    }

    /// The GEMMs' arithmetic on every rank.
    pub fn with_precision(mut self, precision: Precision) -> TensorParallel {
        self.blocks = self.blocks.into_iter().map(|b| b.with_precision(precision)).collect();
        self
    }

    pub fn split(&self) -> &TensorSplit {
        &self.split
    }

    pub fn collective(&self) -> &Collective {
        &self.collective
    }

    /// Each rank's block (its shard of the parameters).
    pub fn blocks(&self) -> &[GpuBlock] {
        &self.blocks
    }

    fn gpus(&self) -> &[Gpu] {
        self.collective.gpus()
    }

    /// `x` (the whole input, on the host) copied to every rank.
    pub fn upload_input(&self, x: &Tensor<f32>) -> Result<Vec<DeviceTensor>> {
        self.split.full().check_input(x)?;
        self.gpus().iter().map(|g| g.upload(x)).collect()
    }

    /// Each rank's part of the output gradient `dy` (shaped as the whole output) on its
    /// GPU, as [`TensorParallel::backward_ranks`] takes it: its columns, or (row max)
    /// all of it.
    pub fn upload_grad_output(&self, dy: &Tensor<f32>) -> Result<Vec<DeviceTensor>> {
        let split = &self.split;
        self.gpus()
            .iter()
            .enumerate()
            .map(|(r, g)| if split.reduces_row_max() { g.upload(dy) } else { g.upload(&split.shard_columns(dy, r)?) })
            .collect()
    }

    /// Queues the forward on every rank (`xs[r]`, the whole input, on rank `r`'s GPU)
    /// and returns each rank's output: its columns `(batch, F / ranks)`, or for a chain
    /// ending in `max` the row maxima `(batch, 1)`, reduced, on every rank.
    pub fn forward_ranks(&self, xs: &[DeviceTensor]) -> Result<Vec<DeviceTensor>> {
        self.check_ranks(xs.len())?;
        let mut ys = Vec::new();
        for ((gpu, block), x) in self.gpus().iter().zip(&self.blocks).zip(xs) {
            let mut ws = block.workspace_with(gpu, x.shape[0], false)?;
            block.forward_into(gpu, x, &mut ws, None)?;
            ys.push(ws.y);
        }
        if self.split.reduces_row_max() {
            self.reduce_row_max(&mut ys)?;
        }
        Ok(ys)
    }

    /// The training forward on every rank: outputs as [`TensorParallel::forward_ranks`]
    /// and what each rank's backward needs.
    pub fn forward_train_ranks(&self, xs: &[DeviceTensor]) -> Result<(Vec<DeviceTensor>, Vec<RankSaved>)> {
        self.check_ranks(xs.len())?;
        let (mut ys, mut saved) = (Vec::new(), Vec::new());
        for ((gpu, block), x) in self.gpus().iter().zip(&self.blocks).zip(xs) {
            let (y, s) = block.forward_train(gpu, x, false)?;
            ys.push(y);
            saved.push(RankSaved { saved: s, keys: None });
        }
        if self.split.reduces_row_max() {
            for (s, k) in saved.iter_mut().zip(self.reduce_row_max(&mut ys)?) {
                s.keys = Some(k);
            }
        }
        Ok((ys, saved))
    }

    /// Gradients on every rank from the output's gradient: `dys[r]` is rank `r`'s
    /// columns of it, or (row max) the whole `(batch,)` gradient. The input gradient
    /// comes back all-reduced (the same on every rank), the parameters' as each rank's
    /// shard.
    pub fn backward_ranks(
        &self,
        xs: &[DeviceTensor],
        saved: Vec<RankSaved>,
        dys: &[DeviceTensor],
    ) -> Result<Vec<DeviceGrads>> {
        self.check_ranks(xs.len())?;
        self.check_ranks(saved.len())?;
        self.check_ranks(dys.len())?;
        let ranks = self.split.ranks() as u32;
        let mut grads = Vec::new();
        for (rank, (((gpu, block), x), (s, dy))) in
            self.gpus().iter().zip(&self.blocks).zip(xs).zip(saved.into_iter().zip(dys)).enumerate()
        {
            let g = match &s.keys {
                None => block.backward(gpu, x, s.saved, dy)?,
                Some(keys) => {
                    if dy.len() != keys.len() {
                        return Err(Error::tensor("dy", format!("expected {} rows, got {:?}", keys.len(), dy.shape)));
                    }
                    let mut mine = gpu.alloc(&dy.shape)?;
                    let (rank, len) = (rank as u32, dy.len() as u32);
                    let (func, cfg) = gpu.kernel_1d(Kernel::RowMaxGrad, dy.len(), 0)?;
                    let mut l = gpu.stream().launch_builder(&func);
                    l.arg(keys).arg(&dy.buf).arg(&mut mine.buf).arg(&rank).arg(&ranks).arg(&len);
                    // SAFETY: (keys, dy, dy_rank, rank, ranks, len) as the kernel takes; each holds len values.
                    launched(Kernel::RowMaxGrad, unsafe { l.launch(cfg) })?;
                    block.backward(gpu, x, s.saved, &mine)?
                }
            };
            grads.push(g);
        }
        let mut dx: Vec<&mut DeviceBuf<f32>> = grads.iter_mut().map(|g| &mut g.x.buf).collect();
        self.collective.all_reduce(&mut dx, Reduce::Sum)?;
        Ok(grads)
    }

    /// The block's output for `x`, gathered on the host.
    pub fn forward(&self, x: &Tensor<f32>) -> Result<Tensor<f32>> {
        let batch = x.rows();
        let ys = self.forward_ranks(&self.upload_input(x)?)?;
        self.gather_output(&ys)?.reshape(&self.split.full().output_shape(batch))
    }

    /// Output and gradients of `L = sum(y * dy)` (`dy` shaped as the output), gathered
    /// on the host.
    pub fn forward_backward(&self, x: &Tensor<f32>, dy: &Tensor<f32>) -> Result<(Tensor<f32>, BlockGrads<f32>)> {
        let batch = self.split.full().check_input(x)?;
        let out_shape = self.split.full().output_shape(batch);
        if dy.shape() != out_shape.as_slice() {
            return Err(Error::tensor("dy", format!("expected shape {out_shape:?}, got {:?}", dy.shape())));
        }
        let xs = self.upload_input(x)?;
        let (ys, saved) = self.forward_train_ranks(&xs)?;
        let dys = self.upload_grad_output(dy)?;
        let grads = self.backward_ranks(&xs, saved, &dys)?;
        let y = self.gather_output(&ys)?.reshape(&out_shape)?;
        let dx = self.gpus()[0].download(&grads[0].x)?;
        let params = grads
            .iter()
            .zip(self.gpus())
            .map(|(g, gpu)| g.params.download(gpu, self.split.shard()))
            .collect::<Result<Vec<_>>>()?;
        Ok((y, BlockGrads { x: dx, params: self.split.gather_params(&params)? }))
    }

    /// The ranks' outputs on the host: rank 0's row maxima, or the columns gathered.
    pub fn gather_output(&self, ys: &[DeviceTensor]) -> Result<Tensor<f32>> {
        self.check_ranks(ys.len())?;
        if self.split.reduces_row_max() {
            return self.gpus()[0].download(&ys[0]);
        }
        let host = ys.iter().zip(self.gpus()).map(|(y, g)| g.download(y)).collect::<Result<Vec<_>>>()?;
        self.split.gather_columns(&host)
    }

    /// Every rank's row maxima `ys[r]` replaced by the row's maximum over the ranks;
    /// returns the reduced keys (which rank holds each row's maximum).
    fn reduce_row_max(&self, ys: &mut [DeviceTensor]) -> Result<Vec<DeviceBuf<u64>>> {
        let ranks = self.split.ranks() as u32;
        let mut keys = Vec::new();
        for (rank, (gpu, y)) in self.gpus().iter().zip(ys.iter()).enumerate() {
            let mut k = gpu.zeroed_buf::<u64>(gpu.stream(), y.len())?;
            let (rank, len) = (rank as u32, y.len() as u32);
            let (func, cfg) = gpu.kernel_1d(Kernel::RowMaxKeys, y.len(), 0)?;
            let mut l = gpu.stream().launch_builder(&func);
            l.arg(&y.buf).arg(&mut k).arg(&rank).arg(&ranks).arg(&len);
            // SAFETY: (local, keys, rank, ranks, len) as the kernel takes; both hold len values.
            launched(Kernel::RowMaxKeys, unsafe { l.launch(cfg) })?;
            keys.push(k);
        }
        let mut refs: Vec<&mut DeviceBuf<u64>> = keys.iter_mut().collect();
        self.collective.all_reduce(&mut refs, Reduce::Max)?;
        for ((gpu, y), k) in self.gpus().iter().zip(ys.iter_mut()).zip(&keys) {
            let len = y.len() as u32;
            let (func, cfg) = gpu.kernel_1d(Kernel::RowMaxValues, y.len(), 0)?;
            let mut l = gpu.stream().launch_builder(&func);
            l.arg(k).arg(&mut y.buf).arg(&len);
            // SAFETY: (keys, y, len) as the kernel takes; both hold len values.
            launched(Kernel::RowMaxValues, unsafe { l.launch(cfg) })?;
        }
        Ok(keys)
    }

    fn check_ranks(&self, n: usize) -> Result<()> {
        if n != self.split.ranks() {
            return Err(Error::Argument(format!("{n} tensors for {} ranks", self.split.ranks())));
        }
        Ok(())
    }
}

//! A 16-bit model's block on the GPU (`GpuBlock<Bf16>`, `GpuBlock<F16>`): `x`, the
//! Linear weight, `y`, `dy`, `dX` and `dW` in bf16 or fp16 as the model keeps them. The
//! three GEMMs read them as stored — `wgmma` takes 16-bit operands `k`-major or
//! MN-major from shared memory — so nothing is rounded or transposed per call; the
//! bias, the chain's parameters and arithmetic (GroupNorm statistics included) and the
//! saved `z` stay FP32, and each 16-bit output is rounded once, from FP32. The two
//! types share every line here: their kernels are instances of the same generic bodies,
//! named by [`HalfElement::KERNELS`].
//!
//! A folded AvgPool's weight (means the type cannot hold) runs as two GEMMs on the
//! means' two halves in the type (`FoldedWeight::Halves` in `block.rs`), their FP32 sums added by
//! the second kernel. Shapes the 16-bit kernels cannot take (rows not 16-byte aligned)
//! run the FP32-tensor kernels at the type's precision on widened copies (a folded
//! weight's FP32 means in 3xTF32), their outputs rounded once: slower, the same numbers.
//! The kink refinement does not run: with the operands exact in the 16-bit type, `z`
//! carries only the FP32 accumulation's error (docs/NUMERICS.md).

use super::block::{DeviceGrads, DeviceParams, Folded, FoldedWeight, GpuBlock, HostGrads, Plan, Saved, Workspace};
use super::dispatch::{self, Family, Role, Route, Storage};
use super::dot;
use super::elementwise::{to_half, unfold_rows_mean_grad, widen, widen_on};
use super::epilogue::lanes::{GradOuts, epilogue_split_tiles, epilogue_tiles_backward};
use super::epilogue::partials;
use super::epilogue::rows::{epilogue_rows, epilogue_rows_backward};
use super::gemm::fp8;
use super::gemm::gemv::launch_gemv;
use super::gemm::tma::launch_half;
use super::gemm::{grad_input, grad_weight};
use super::{DeviceElement, DeviceTensor, DeviceVector, Dtype, Gpu, HalfElement, VectorArg};
use crate::block::{BlockSpec, Params};
use crate::error::{Error, Result};
use crate::precision::Precision;
use crate::tensor::{Bf16, Tensor};

impl<H: HalfElement> DeviceParams<H, DeviceVector> {
    /// Uploads a 16-bit model's parameters as stored: the kernels read the bias and the
    /// chain's parameters in its type (widened on load; the epilogue computes in FP32).
    pub fn upload_half(gpu: &Gpu, p: &Params<H>) -> Result<DeviceParams<H, DeviceVector>> {
        Ok(DeviceParams {
            linear_weight: gpu.upload(&p.linear_weight)?,
            linear_bias: H::vector(gpu.upload(&p.linear_bias)?),
            ops: p
                .ops
                .iter()
                .map(|v| v.iter().map(|t| Ok(H::vector(gpu.upload(t)?))).collect())
                .collect::<Result<_>>()?,
        })
    }
}

impl DeviceParams<Bf16, DeviceVector> {
    /// [`DeviceParams::upload_half`] of a bf16 model.
    pub fn upload_bf16(gpu: &Gpu, p: &Params<Bf16>) -> Result<DeviceParams<Bf16, DeviceVector>> {
        Self::upload_half(gpu, p)
    }
}

impl GpuBlock<Bf16> {
    /// A bf16 model's block from host parameters.
    pub fn new_bf16(gpu: &Gpu, spec: &BlockSpec, params: &Params<Bf16>) -> Result<GpuBlock<Bf16>> {
        Self::new_half(gpu, spec, params)
    }
}

impl<H: HalfElement> GpuBlock<H> {
    /// A 16-bit model's block from host parameters, its GEMMs in its type's precision.
    pub fn new_half(gpu: &Gpu, spec: &BlockSpec, params: &Params<H>) -> Result<GpuBlock<H>> {
        let precision = Precision::of_storage(H::DTYPE).unwrap_or(Precision::Bf16);
        Self::from_device_in(gpu, spec, DeviceParams::upload_half(gpu, params)?, precision)
    }

    /// The forward of 16-bit `x (batch, in)` into `ws.y` (the same type); with `save`,
    /// the chain's input `z` (FP32) too.
    pub fn forward_into(
        &self,
        gpu: &Gpu,
        x: &DeviceTensor<H>,
        ws: &mut Workspace<H>,
        save: Option<&mut DeviceTensor>,
    ) -> Result<()> {
        let (n, k) = (self.gemm_width(), self.spec.in_features);
        let m = match x.shape[..] {
            [m, xk] if xk == k && Some(&m) == ws.y.shape.first() => m,
            _ => return Err(Error::tensor("x", format!("shape {:?} does not fit this workspace", x.shape))),
        };
        if let Some(bn) = self.batch_norm {
            self.spec.check_batch(m)?;
            ws.stats = Some(self.forward_batch_norm_half(gpu, x, ws, save, bn)?);
            return Ok(());
        }
        if self.precision.is_fp8() {
            return self.forward_fp8(gpu, x, ws, save);
        }
        // (Before the GEMMs' route: the row dot takes none.)
        if let (Plan::RowDot, Some(z)) = (&ws.plan, ws.z.as_mut()) {
            let mut made = None;
            let Some((w, bias)) = self.row_dot_params(gpu, &mut made)? else {
                return Err(Error::Unsupported("a row dot without a one-column weight".into()));
            };
            dot::row_dot(gpu, x, w, z)?;
            return self.add_split_sums(gpu, z, bias, &mut ws.y, save);
        }
        let w = &self.params.linear_weight;
        let b = self.params.linear_bias.arg()?;
        let fused = matches!(ws.plan, Plan::Fused);
        let aligned = aligned(&[x, w]) && (!fused || ws.y.buf.device_address().is_multiple_of(16));
        let tma = gpu.tuning().tma;
        let (precision, route) =
            dispatch::forward_route(self.forward_case(gpu, m), self.precision, &ws.plan, aligned, tma);
        let (ab, dims, lds, stream) = ((&*x.buf, &*w.buf), (m, n, k), (k, k), gpu.stream());
        match (&ws.plan, ws.z.as_mut(), route.widened) {
            // A few rows: the small-batch kernel on x and W as stored, the chain on its
            // slabs into 16-bit y; or into FP32 `z`, then the row-wise epilogue into 16-bit `y`.
            (&Plan::Gemv { chain: true, tensor_cores }, ..) => {
                let kernel = dispatch::gemv_kernel(H::DTYPE, H::DTYPE, precision, tensor_cores);
                launch_gemv(gpu, kernel, x, w, Some(b), Some(&self.chain), &mut ws.y, save)
            }
            (&Plan::Gemv { chain: false, tensor_cores }, Some(z), _) => {
                let kernel = dispatch::gemv_kernel(H::DTYPE, Dtype::F32, precision, tensor_cores);
                launch_gemv(gpu, kernel, x, w, Some(b), None, z, None)?;
                epilogue_rows(gpu, &self.chain, z, None, &mut ws.y, save)
            }
            // One kernel: x and W as stored, 16-bit y.
            (Plan::Fused, _, false) => {
                launch_half(gpu, stream, &route, ab, dims, lds, (Some(b), Some(&self.chain)), &mut ws.y, save, 1)
            }
            // The GEMM as stored with the chain up to its row reduction, each half tile's
            // row partials in FP32, then the finishing kernel into 16-bit `y`.
            (Plan::RowPartials, Some(parts), false)
                if let (Family::Tma, Some(rp)) = (route.family, &self.row_partials) =>
            {
                launch_half(gpu, stream, &route, ab, dims, lds, (Some(b), Some(&rp.head)), parts, save, 1)?;
                partials::row_partials_finish(gpu, parts, n, (&rp.head, &rp.tail), &mut ws.y)
            }
            // The GEMM as stored into FP32 `z`, the row-wise epilogue into 16-bit `y`.
            (Plan::GemmThenRows { splits: 1 }, Some(z), false) => {
                launch_half(gpu, stream, &route, ab, dims, lds, (Some(b), None), z, None, 1)?;
                epilogue_rows(gpu, &self.chain, z, None, &mut ws.y, save)
            }
            // A folded weight's halves as stored: each GEMM's partial products into its
            // half of FP32 `z (splits, m, n)`, all added with the bias before the chain by
            // a second kernel.
            (&Plan::GemmThenRows { splits }, Some(z), false)
                if let Some(Folded { weight: FoldedWeight::Halves(hi, lo), bias, .. }) = &self.folded =>
            {
                let half = splits / 2;
                if half == 0 || !splits.is_multiple_of(2) || z.shape != [splits, m, n] {
                    return Err(Error::Shape(format!("the halves of a folded weight into partial sums {:?}", z.shape)));
                }
                // (An unsplit GEMM writes `(m, n)`.)
                let part_shape = if half == 1 { vec![m, n] } else { vec![half, m, n] };
                for (i, w) in [hi, lo].into_iter().enumerate() {
                    // SAFETY: half `i` of `z`'s `splits m n` floats, which `z` owns for the call.
                    let mut part = unsafe {
                        gpu.borrow_tensor::<f32>(z.buf.device_address() + (i * half * m * n * 4) as u64, &part_shape)?
                    };
                    launch_half(
                        gpu,
                        stream,
                        &route,
                        (&*x.buf, &*w.buf),
                        dims,
                        lds,
                        (None, None),
                        &mut part,
                        None,
                        half,
                    )?;
                }
                self.add_split_sums(gpu, z, VectorArg::f32(bias), &mut ws.y, save)
            }
            // Split-K as stored: the partial products into FP32 `z (splits, m, n)`, added
            // with the bias before the chain by a second kernel.
            (&Plan::GemmThenRows { splits }, Some(z), false) => {
                launch_half(gpu, stream, &route, ab, dims, lds, (None, None), z, None, splits)?;
                self.add_split_sums(gpu, z, b, &mut ws.y, save)
            }
            (plan, z, _) => {
                // On FP32 copies: `x` widened, and `W` (or a folded AvgPool's FP32 means).
                let x32 = widen(gpu, x)?;
                let w32;
                let mut made = None;
                let (w, b) = match self.folded_means(gpu, &mut made)? {
                    Some(folded) => folded,
                    None => {
                        w32 = widen(gpu, w)?;
                        (&w32, b)
                    }
                };
                let mut y = gpu.alloc(&ws.y.shape)?;
                self.forward_f32(gpu, precision, &x32, (w, b), (plan, z), &mut y, save)?;
                ws.y = to_half(gpu, &y)?;
                Ok(())
            }
        }
    }

    /// The forward of a chain with a BatchNorm on 16-bit `x`: its input `u` (the GEMM on
    /// `x` and `W` as stored, or in FP8, with the bias and the ops before the BatchNorm
    /// fused) in FP32, then the statistics and the rest of the chain into 16-bit `y`, as
    /// the float32 block does (`gpu/batch_norm.rs`). Returns the statistics.
    fn forward_batch_norm_half(
        &self,
        gpu: &Gpu,
        x: &DeviceTensor<H>,
        ws: &mut Workspace<H>,
        save: Option<&mut DeviceTensor>,
        bn: (usize, f32),
    ) -> Result<DeviceTensor> {
        let (m, n, k) = (x.shape[0], self.gemm_width(), self.spec.in_features);
        let (w, b) = (&self.params.linear_weight, self.params.linear_bias.arg()?);
        // No ops before the BatchNorm: its input is the saved `z`, written once.
        let mut fresh = None;
        let (u, save) = match save {
            Some(z) if self.chain.ops.is_empty() => (z, None),
            save => (fresh.insert(gpu.alloc(&[m, n])?), save),
        };
        let stream = gpu.stream();
        if self.precision.is_fp8() {
            if let Some(why) = fp8::unsupported(k, n) {
                return Err(Error::Unsupported(why));
            }
            let xq = fp8::quantise_rows(gpu, stream, x, "x")?;
            let mut made = None;
            let wq = self.fp8_rows(gpu, w, &mut made)?;
            fp8::gemm(gpu, stream, &xq, wq, Some(b), Some(&self.chain), u, save)?;
        } else {
            let storage = Storage::half(H::DTYPE, Dtype::F32, aligned(&[x, w]));
            let route =
                dispatch::route(self.precision, Role::Forward { splits: 1 }, (m, n, k), storage, gpu.tuning().tma);
            if route.widened {
                let (x32, w32) = (widen(gpu, x)?, widen(gpu, w)?);
                self.forward_f32(gpu, self.precision, &x32, (&w32, b), (&Plan::Fused, None), u, save)?;
            } else {
                let (ab, dims, lds) = ((&*x.buf, &*w.buf), (m, n, k), (k, k));
                launch_half(gpu, stream, &route, ab, dims, lds, (Some(b), Some(&self.chain)), u, save, 1)?;
            }
        }
        self.finish_batch_norm(gpu, u, &mut ws.y, bn)
    }

    /// The FP8 forward of 16-bit `x`: `x` quantised by rows, the weight (a folded
    /// AvgPool's FP32 means, or the model's as stored) cached by `refold` or quantised
    /// here, the e4m3 GEMM into 16-bit `y` with the chain, or into FP32 `z` for the
    /// row-wise epilogue.
    fn forward_fp8(
        &self,
        gpu: &Gpu,
        x: &DeviceTensor<H>,
        ws: &mut Workspace<H>,
        save: Option<&mut DeviceTensor>,
    ) -> Result<()> {
        let (n, k) = (self.gemm_width(), self.spec.in_features);
        if let Some(why) = fp8::unsupported(k, n) {
            return Err(Error::Unsupported(why));
        }
        let stream = gpu.stream();
        let xq = fp8::quantise_rows(gpu, stream, x, "x")?;
        let (mut made, mut means) = (None, None);
        let (wq, b) = match self.folded_means(gpu, &mut means)? {
            Some((w, fb)) => (self.fp8_rows(gpu, w, &mut made)?, fb),
            None => {
                let w = &self.params.linear_weight;
                (self.fp8_rows(gpu, w, &mut made)?, self.params.linear_bias.arg()?)
            }
        };
        match (&ws.plan, ws.z.as_mut()) {
            (Plan::Fused, _) => fp8::gemm(gpu, stream, &xq, wq, Some(b), Some(&self.chain), &mut ws.y, save),
            (Plan::GemmThenRows { splits: 1 }, Some(z)) => {
                fp8::gemm(gpu, stream, &xq, wq, Some(b), None, z, None)?;
                epilogue_rows(gpu, &self.chain, z, None, &mut ws.y, save)
            }
            (plan, _) => Err(Error::Unsupported(format!("no fp8 forward for the plan {plan:?}"))),
        }
    }

    /// The forward of a training step on 16-bit `x`: `y` in that type and the FP32 `z` the
    /// backward needs. `poison` NaN-fills the buffers first (for checks).
    pub fn forward_train(&self, gpu: &Gpu, x: &DeviceTensor<H>, poison: bool) -> Result<(DeviceTensor<H>, Saved)> {
        let (y, saved, stats) = self.forward_train_stats(gpu, x, poison)?;
        // A BatchNorm's backward reads the forward's statistics.
        Ok((y, saved.with_batch_stats(stats)))
    }

    /// [`GpuBlock::forward_train`] and a BatchNorm's batch statistics ([`Workspace::stats`]).
    pub fn forward_train_stats(
        &self,
        gpu: &Gpu,
        x: &DeviceTensor<H>,
        poison: bool,
    ) -> Result<(DeviceTensor<H>, Saved, Option<DeviceTensor>)> {
        let batch = x.shape.first().copied().unwrap_or(0);
        let mut ws = self.workspace_with(gpu, batch, poison)?;
        let shape = [batch, self.gemm_width()];
        let mut z = if poison { gpu.poisoned(&shape)? } else { gpu.alloc(&shape)? };
        self.forward_into(gpu, x, &mut ws, Some(&mut z))?;
        Ok((ws.y, Saved { z, refined: true, own: true, batch_stats: None }, ws.stats))
    }

    /// Gradients of a 16-bit block: `dX` and `dW` in its type, the bias's and the chain
    /// parameters' in FP32 (the caller rounds them into its parameters' type), from the
    /// output's gradient `dy (batch, features out)` in its type, the input `x` and the
    /// forward's saved `z`.
    pub fn backward(
        &self,
        gpu: &Gpu,
        x: &DeviceTensor<H>,
        saved: Saved,
        dy: &DeviceTensor<H>,
    ) -> Result<DeviceGrads<H>> {
        let (outs, small) = self.small_grads_by_backward(gpu)?;
        let (dx, dw, (db, ops)) = self.backward_parts(gpu, x, saved, dy, None, outs.as_ref(), small)?;
        Ok(DeviceGrads {
            x: super::block::input_grad(dx)?,
            params: DeviceParams { linear_weight: dw, linear_bias: db, ops },
        })
    }

    /// [`GpuBlock::backward`] up to the small gradients, as the FP32 block's
    /// `backward_parts` (`phases` is not marked: the 16-bit backward has no phase timing).
    #[allow(clippy::too_many_arguments)]
    pub fn backward_parts<S>(
        &self,
        gpu: &Gpu,
        x: &DeviceTensor<H>,
        saved: Saved,
        dy: &DeviceTensor<H>,
        _phases: Option<&mut super::Phases>,
        outs: Option<&GradOuts>,
        small: impl FnOnce(&Self, &Gpu, Option<&DeviceTensor>) -> Result<S>,
    ) -> Result<(Option<DeviceTensor<H>>, DeviceTensor<H>, S)> {
        let (n, k) = (self.gemm_width(), self.spec.in_features);
        let m = match x.shape[..] {
            [m, xk] if xk == k && saved.z.shape == [m, n] => m,
            _ => {
                return Err(Error::tensor(
                    "x",
                    format!("shape {:?} does not fit the saved state {:?}", x.shape, saved.z.shape),
                ));
            }
        };
        if dy.len() != m * self.out_width() {
            return Err(Error::tensor("dy", format!("expected {m} x {} values, got {:?}", self.out_width(), dy.shape)));
        }
        // dz in the 16-bit type: the row-wise backward reads and writes it; the tile-wise
        // one too where rows are 8-byte aligned and the chain's vectors are stored in the
        // type, otherwise the FP32 one on a widened dy, rounded.
        let outs = outs.filter(|_| self.writes_small_grads());
        let (dz, slots) = if let Some(bn) = self.batch_norm {
            // In FP32 through the statistics (`gpu/batch_norm.rs`), `dz` rounded once.
            let (dz, slots) = match self.backward_batch_norm(gpu, (&saved.z, saved.batch_stats.as_ref()), dy, bn)? {
                Some(done) => done,
                None => {
                    let (dz, slots) = self.backward_batch_norm_rows(
                        gpu,
                        (&saved.z, saved.batch_stats.as_ref()),
                        &widen(gpu, dy)?,
                        bn,
                    )?;
                    (to_half(gpu, &dz)?, slots)
                }
            };
            (dz, Some(slots))
        } else if !self.tile_backward() {
            let (dz, slots) = epilogue_rows_backward(gpu, &self.chain, &saved.z, dy, self.out_width())?;
            (dz, Some(slots))
        } else if n % 4 == 0 && dy.buf.device_address().is_multiple_of(8) && self.chain.params_stored_as(H::DTYPE) {
            epilogue_tiles_backward(gpu, &self.chain, &saved.z, dy, outs)?
        } else {
            let (dz, slots) = epilogue_tiles_backward(gpu, &self.chain, &saved.z, &widen(gpu, dy)?, outs)?;
            (to_half(gpu, &dz)?, slots)
        };
        drop(saved);
        if self.precision.is_fp8() {
            let (dx, dw) = self.grad_gemms_fp8(gpu, x, &dz)?;
            drop(dz);
            let small = small(self, gpu, slots.as_ref())?;
            return Ok((dx, dw, small));
        }
        if let Some((dx, dw)) = self.row_dot_grads(gpu, x, &dz)? {
            drop(dz);
            let small = small(self, gpu, slots.as_ref())?;
            return Ok((dx, dw, small));
        }
        // The GEMMs' weight: the block's, or a folded AvgPool's rounded to the type (the
        // high half of its means where the block holds them so).
        let folded16 = match &self.folded {
            Some(Folded { weight: FoldedWeight::Means(w), .. }) => Some(to_half::<H>(gpu, w)?),
            _ => None,
        };
        let w16 = match (&self.folded, &folded16) {
            (_, Some(w)) => w,
            (Some(Folded { weight: FoldedWeight::Halves(hi, _), .. }), None) => hi,
            _ => &self.params.linear_weight,
        };

        // dW = dZ^T X on the side stream, overlapping dX (as the FP32 block does): into
        // the 16-bit type on its kernel, or into FP32 where a folded weight's gradient is
        // spread afterwards or the FP32 kernels run (rounded once, below).
        let side = gpu.side_stream();
        let mut keep = Vec::new();
        let tma = gpu.tuning().tma;
        let precision = self.precision;
        let dw_out = if self.folded.is_some() { Dtype::F32 } else { H::DTYPE };
        let dw_route = dispatch::route(
            precision,
            Role::GradWeight,
            (m, n, k),
            Storage::half(H::DTYPE, dw_out, aligned(&[&dz, x])),
            tma,
        );
        let dw = match (dw_route.widened, dw_out == H::DTYPE) {
            _ if dw_route.family == Family::Dot => WeightGrad::Half(grad_weight_outer(gpu, &dz, x, (n, k, m))?),
            (false, true) => WeightGrad::Half(grad_weight_native(gpu, &dw_route, &dz, x, (n, k, m))?),
            (false, false) => WeightGrad::F32(grad_weight_native(gpu, &dw_route, &dz, x, (n, k, m))?),
            (true, _) => {
                gpu.order(gpu.stream(), side)?;
                let (dz32, x32) = (widen_on(gpu, side, &dz)?, widen_on(gpu, side, x)?);
                let (dw, scratch) = grad_weight(gpu, precision, side, &dz32, &x32)?;
                keep.extend(scratch);
                keep.extend([dz32, x32]);
                WeightGrad::F32(dw)
            }
        };
        // dX = dZ W on the main stream.
        let storage = Storage::half(H::DTYPE, H::DTYPE, aligned(&[&dz, w16]));
        let dx_route = dispatch::route(precision, Role::GradInput, (m, n, k), storage, tma);
        let dx = if !self.input_grad {
            None
        } else if dx_route.family == Family::Dot {
            Some(dot::weighted_rows(gpu, w16, &dz)?)
        } else if !dx_route.widened {
            let mut dx = gpu.alloc_as::<H>(&[m, k])?;
            let (stream, ab, dims, lds) = (gpu.stream(), (&*dz.buf, &*w16.buf), (m, k, n), (n, k));
            match dispatch::dx_splits(m, n, k, gpu.props.multiprocessors, gpu.tuning().split_k) {
                1 => launch_half(gpu, stream, &dx_route, ab, dims, lds, (None, None), &mut dx, None, 1)?,
                splits => {
                    // The ranges' FP32 sums, added in order and rounded once.
                    let route = Route { kernel: H::KERNELS.tma_nn, ..dx_route };
                    let mut parts = gpu.alloc(&[splits, m, k])?;
                    launch_half(gpu, stream, &route, ab, dims, lds, (None, None), &mut parts, None, splits)?;
                    epilogue_split_tiles(gpu, None, &parts, None, &mut dx, None)?;
                }
            }
            Some(dx)
        } else {
            let (dz32, w32) = (widen(gpu, &dz)?, widen(gpu, w16)?);
            Some(to_half(gpu, &grad_input(gpu, precision, &dz32, &w32)?)?)
        };
        gpu.order(side, gpu.stream())?;
        drop((dz, keep, folded16));
        let dw = match (dw, &self.folded) {
            (WeightGrad::Half(dw), _) => dw,
            (WeightGrad::F32(dw), Some(f)) => unfold_rows_mean_grad::<H>(gpu, &dw, self.spec.out_features, f.pool)?,
            (WeightGrad::F32(dw), None) => to_half(gpu, &dw)?,
        };
        let small = small(self, gpu, slots.as_ref())?;
        Ok((dx, dw, small))
    }

    /// `dX` and `dW` in FP8 (`dW` from the 16-bit `dZ` and `X` as stored for
    /// `Fp8GwBf16`): `dX` from `dZ` by rows and the weight's cached (or fresh) transposed
    /// copy, `dW` on the side stream from `dZ^T` and `X^T`, into the model's type (FP32
    /// for a folded AvgPool's, spread back and rounded after).
    fn grad_gemms_fp8(
        &self,
        gpu: &Gpu,
        x: &DeviceTensor<H>,
        dz: &DeviceTensor<H>,
    ) -> Result<(Option<DeviceTensor<H>>, DeviceTensor<H>)> {
        let (m, n, k) = (x.shape[0], self.gemm_width(), self.spec.in_features);
        let side = gpu.side_stream();
        let dw = if self.precision == Precision::Fp8 {
            // `dW` allocated on the GPU's stream first, then the side stream ordered after
            // everything there (as `grad_weight_native` does).
            let mut dw = if self.folded.is_some() {
                WeightGrad::F32(gpu.alloc(&[n, k])?)
            } else {
                WeightGrad::Half(gpu.alloc_as::<H>(&[n, k])?)
            };
            gpu.order(gpu.stream(), side)?;
            let (dzt, xt) =
                (fp8::quantise_columns_t(gpu, side, dz, "dz")?, fp8::quantise_columns_t(gpu, side, x, "x")?);
            match &mut dw {
                WeightGrad::F32(dw) => fp8::gemm(gpu, side, &dzt, &xt, None, None, dw, None)?,
                WeightGrad::Half(dw) => fp8::gemm(gpu, side, &dzt, &xt, None, None, dw, None)?,
            }
            dw
        } else {
            // `Fp8GwBf16`: the model's 16-bit dZ and X as stored (bf16 or fp16 operands).
            let out = if self.folded.is_some() { Dtype::F32 } else { H::DTYPE };
            let route = dispatch::route(
                Precision::of_storage(H::DTYPE).unwrap_or(Precision::Bf16),
                Role::GradWeight,
                (m, n, k),
                Storage::half(H::DTYPE, out, aligned(&[dz, x])),
                gpu.tuning().tma,
            );
            match (route.widened, out == H::DTYPE) {
                _ if route.family == Family::Dot => WeightGrad::Half(grad_weight_outer(gpu, dz, x, (n, k, m))?),
                (false, true) => WeightGrad::Half(grad_weight_native(gpu, &route, dz, x, (n, k, m))?),
                (false, false) => WeightGrad::F32(grad_weight_native(gpu, &route, dz, x, (n, k, m))?),
                (true, _) => {
                    return Err(Error::Unsupported(format!(
                        "fp8_gw_bf16's dW of a {m}-row batch: the 16-bit kernel takes a multiple of 8 rows, \
                         16-byte aligned"
                    )));
                }
            }
        };
        let stream = gpu.stream();
        let (mut made, mut means) = (None, None);
        let dx = if self.input_grad {
            let wq = match self.folded_means(gpu, &mut means)? {
                Some((w, _)) => self.fp8_whole(gpu, w, &mut made)?,
                None => self.fp8_whole(gpu, &self.params.linear_weight, &mut made)?,
            };
            let mut dx = gpu.alloc_as::<H>(&[m, k])?;
            fp8::grad_input(gpu, stream, dz, wq, &mut dx)?;
            Some(dx)
        } else {
            None
        };
        gpu.order(side, gpu.stream())?;
        let dw = match (dw, &self.folded) {
            (WeightGrad::Half(dw), _) => dw,
            (WeightGrad::F32(dw), Some(f)) => unfold_rows_mean_grad::<H>(gpu, &dw, self.spec.out_features, f.pool)?,
            (WeightGrad::F32(dw), None) => to_half(gpu, &dw)?,
        };
        Ok((dx, dw))
    }

    /// Uploads 16-bit `x` and `dy` (shaped as the output), runs the training forward and
    /// the backward, and downloads everything widened to FP32 (exact): the output, the
    /// gradients and the saved `z`.
    pub fn forward_backward(&self, gpu: &Gpu, x: &Tensor<H>, dy: &Tensor<H>) -> Result<HostGrads> {
        let batch = self.spec.check_input(&x.to_f32())?;
        let out_shape = self.spec.output_shape(batch);
        if dy.shape() != out_shape.as_slice() {
            return Err(Error::tensor("dy", format!("expected shape {out_shape:?}, got {:?}", dy.shape())));
        }
        let dx = gpu.upload(x)?;
        let (y, saved) = self.forward_train(gpu, &dx, true)?;
        let z = gpu.download(&saved.z)?;
        let g = self.backward(gpu, &dx, saved, &gpu.upload(dy)?)?;
        let mut flat = vec![gpu.download(&g.params.linear_weight)?.to_f32(), gpu.download(&g.params.linear_bias)?];
        for t in g.params.ops.iter().flatten() {
            flat.push(gpu.download(t)?);
        }
        Ok(HostGrads {
            y: gpu.download(&y)?.to_f32().reshape(&out_shape)?,
            x: gpu.download(&g.x)?.to_f32(),
            params: Params::from_flat(&self.spec, flat)?,
            z,
        })
    }
}

/// Whether every tensor starts on a 16-byte boundary, as the TMA unit reads them (a
/// caller's view at an odd offset takes the widened path instead).
pub(super) fn aligned<H>(tensors: &[&DeviceTensor<H>]) -> bool {
    tensors.iter().all(|t| t.buf.device_address().is_multiple_of(16))
}

/// A weight gradient as its GEMM left it: 16-bit already, or FP32 still to spread (a
/// folded AvgPool's) or round.
enum WeightGrad<H> {
    Half(DeviceTensor<H>),
    F32(DeviceTensor),
}

/// `dW (n, k) = dZ^T X` of a batch of at most `OUTER_MAX_RANK` rows, in `H`, queued as
/// [`grad_weight_native`] queues its GEMM: the batch's outer products summed
/// ([`Family::Dot`]).
fn grad_weight_outer<H: HalfElement>(
    gpu: &Gpu,
    dz: &DeviceTensor<H>,
    x: &DeviceTensor<H>,
    (n, k, m): (usize, usize, usize),
) -> Result<DeviceTensor<H>> {
    let mut dw = gpu.alloc_as::<H>(&[n, k])?;
    let side = gpu.side_stream();
    gpu.order(gpu.stream(), side)?;
    dot::outer_sum(gpu, side, (&dz.buf, n), (&x.buf, k), (m, n, k), &mut dw.buf)?;
    Ok(dw)
}

/// `dW (n, k) = dZ^T X` on the 16-bit kernel, `dZ (m, n)` and `X (m, k)` as stored, into
/// `O` (`H`, or FP32), on the side stream after everything queued on the GPU's stream
/// (the output's allocation included). The caller orders the GPU's stream after the
/// side stream before using `dW` or freeing `dZ`.
fn grad_weight_native<H: HalfElement, O: DeviceElement>(
    gpu: &Gpu,
    route: &Route,
    dz: &DeviceTensor<H>,
    x: &DeviceTensor<H>,
    (n, k, m): (usize, usize, usize),
) -> Result<DeviceTensor<O>> {
    let mut dw = gpu.alloc_as::<O>(&[n, k])?;
    let side = gpu.side_stream();
    gpu.order(gpu.stream(), side)?;
    let (ops, dims, lds) = ((None, None), (n, k, m), (n, k));
    launch_half(gpu, side, route, (&dz.buf, &x.buf), dims, lds, ops, &mut dw, None, 1)?;
    Ok(dw)
}

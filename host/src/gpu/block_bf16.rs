//! A bf16 model's block on the GPU (`GpuBlock<Bf16>`): `x`, the Linear weight, `y`,
//! `dy`, `dX` and `dW` in bf16 as the model keeps them. The three GEMMs read them as
//! stored — `wgmma` takes 16-bit operands `k`-major or MN-major from shared memory —
//! so nothing is rounded or transposed per call; the bias, the chain's parameters and
//! arithmetic (GroupNorm statistics included) and the saved `z` stay FP32, and each
//! bf16 output is rounded once, from FP32.
//!
//! Shapes the bf16 kernels cannot take (rows not 16-byte aligned), split-K forwards
//! and a folded AvgPool's weight (FP32 means) run the FP32-tensor kernels at bf16
//! precision on widened copies, their outputs rounded once: slower, the same numbers.
//! The kink refinement does not run: with the operands exact in bf16, `z` carries only
//! the FP32 accumulation's error (docs/NUMERICS.md).

use super::block::{DeviceGrads, DeviceParams, GpuBlock, HostGrads, Plan, Saved, Workspace};
use super::dispatch::{self, Role, Route, Storage};
use super::elementwise::{to_bf16, unfold_rows_mean_grad, widen, widen_on};
use super::epilogue::lanes::epilogue_tiles_backward;
use super::epilogue::rows::{epilogue_rows, epilogue_rows_backward};
use super::gemm::gemv::launch_gemv;
use super::gemm::tma::launch_bf16;
use super::gemm::{grad_input, grad_weight};
use super::{DeviceElement, DeviceTensor, Dtype, Gpu};
use crate::block::{BlockSpec, Params};
use crate::error::{Error, Result};
use crate::precision::Precision;
use crate::tensor::{Bf16, Tensor};

impl DeviceParams<Bf16> {
    /// Uploads a bf16 model's parameters: the Linear weight as bf16, the others
    /// widened to FP32.
    pub fn upload_bf16(gpu: &Gpu, p: &Params<Bf16>) -> Result<DeviceParams<Bf16>> {
        Ok(DeviceParams {
            linear_weight: gpu.upload(&p.linear_weight)?,
            linear_bias: gpu.upload(&p.linear_bias.to_f32())?,
            ops: p.ops.iter().map(|v| v.iter().map(|t| gpu.upload(&t.to_f32())).collect()).collect::<Result<_>>()?,
        })
    }
}

impl GpuBlock<Bf16> {
    /// A bf16 model's block from host parameters.
    pub fn new_bf16(gpu: &Gpu, spec: &BlockSpec, params: &Params<Bf16>) -> Result<GpuBlock<Bf16>> {
        Ok(Self::from_device(gpu, spec, DeviceParams::upload_bf16(gpu, params)?)?.with_precision(Precision::Bf16))
    }

    /// The forward of bf16 `x (batch, in)` into `ws.y` (bf16); with `save`, the chain's
    /// input `z` (FP32) too.
    pub fn forward_into(
        &self,
        gpu: &Gpu,
        x: &DeviceTensor<Bf16>,
        ws: &mut Workspace<Bf16>,
        save: Option<&mut DeviceTensor>,
    ) -> Result<()> {
        let (n, k) = (self.gemm_width(), self.spec.in_features);
        let m = match x.shape[..] {
            [m, xk] if xk == k && Some(&m) == ws.y.shape.first() => m,
            _ => return Err(Error::tensor("x", format!("shape {:?} does not fit this workspace", x.shape))),
        };
        let w = &self.params.linear_weight;
        let b = &self.params.linear_bias;
        let fused = ws.plan == Plan::Fused;
        let aligned = aligned(&[x, w]) && (!fused || ws.y.buf.device_address().is_multiple_of(16));
        let tma = gpu.tuning().tma;
        let (precision, route) =
            dispatch::forward_route(self.forward_case(gpu, m), self.precision, &ws.plan, aligned, tma);
        let (ab, dims, lds, stream) = ((&*x.buf, &*w.buf), (m, n, k), (k, k), gpu.stream());
        match (&ws.plan, ws.z.as_mut(), route.widened) {
            // A few rows: the small-batch kernel on x and W as stored, the chain on its
            // slabs into bf16 y; or into FP32 `z`, the row-wise epilogue, `y` rounded.
            (Plan::Gemv { chain: true }, ..) => {
                let kernel = dispatch::gemv_kernel(Dtype::Bf16, Dtype::Bf16);
                launch_gemv(gpu, kernel, x, w, Some(&b.buf), Some(&self.chain), &mut ws.y, save)
            }
            (Plan::Gemv { chain: false }, Some(z), _) => {
                let kernel = dispatch::gemv_kernel(Dtype::Bf16, Dtype::F32);
                launch_gemv(gpu, kernel, x, w, Some(&b.buf), None, z, None)?;
                ws.y = self.rows_rounded(gpu, z, save)?;
                Ok(())
            }
            // One kernel: x and W as stored, bf16 y.
            (Plan::Fused, _, false) => {
                launch_bf16(gpu, stream, &route, ab, dims, lds, (Some(&b.buf), Some(&self.chain)), &mut ws.y, save)
            }
            // The GEMM as stored into FP32 `z`, the row-wise epilogue, `y` rounded.
            (Plan::GemmThenRows { splits: 1 }, Some(z), false) => {
                launch_bf16(gpu, stream, &route, ab, dims, lds, (Some(&b.buf), None), z, None)?;
                ws.y = self.rows_rounded(gpu, z, save)?;
                Ok(())
            }
            (plan, z, _) => {
                // On FP32 copies: `x` widened, and `W` (or a folded AvgPool's FP32 means).
                let x32 = widen(gpu, x)?;
                let w32;
                let (w, b) = match &self.folded {
                    Some((_, w, b)) => (w, b),
                    None => {
                        w32 = widen(gpu, w)?;
                        (&w32, b)
                    }
                };
                let mut y = gpu.alloc(&ws.y.shape)?;
                self.forward_f32(gpu, precision, &x32, (w, b), (plan, z), &mut y, save)?;
                ws.y = to_bf16(gpu, &y)?;
                Ok(())
            }
        }
    }

    /// The row-wise epilogue over the FP32 GEMM output `z` (bias included), its FP32
    /// output rounded once into the bf16 `y`; `save` receives `z`.
    fn rows_rounded(&self, gpu: &Gpu, z: &DeviceTensor, save: Option<&mut DeviceTensor>) -> Result<DeviceTensor<Bf16>> {
        let mut y = gpu.alloc(&[z.shape[0], self.out_width()])?;
        epilogue_rows(gpu, &self.chain, z, None, &mut y, save)?;
        to_bf16(gpu, &y)
    }

    /// The forward of a training step on bf16 `x`: `y` in bf16 and the FP32 `z` the
    /// backward needs. `poison` NaN-fills the buffers first (for checks).
    pub fn forward_train(
        &self,
        gpu: &Gpu,
        x: &DeviceTensor<Bf16>,
        poison: bool,
    ) -> Result<(DeviceTensor<Bf16>, Saved)> {
        let batch = x.shape.first().copied().unwrap_or(0);
        let mut ws = self.workspace_with(gpu, batch, poison)?;
        let shape = [batch, self.gemm_width()];
        let mut z = if poison { gpu.poisoned(&shape)? } else { gpu.alloc(&shape)? };
        self.forward_into(gpu, x, &mut ws, Some(&mut z))?;
        Ok((ws.y, Saved { z, refined: true, own: true }))
    }

    /// [`GpuBlock::forward_train`] with the statistics of a BatchNorm: none (a bf16
    /// model's block refuses chains with one).
    pub fn forward_train_stats(
        &self,
        gpu: &Gpu,
        x: &DeviceTensor<Bf16>,
        poison: bool,
    ) -> Result<(DeviceTensor<Bf16>, Saved, Option<DeviceTensor>)> {
        self.forward_train(gpu, x, poison).map(|(y, saved)| (y, saved, None))
    }

    /// Gradients of a bf16 block: `dX` and `dW` in bf16, the bias's and the chain
    /// parameters' in FP32 (the caller rounds them into its parameters' type), from the
    /// output's gradient `dy (batch, features out)` in bf16, the input `x` and the
    /// forward's saved `z`.
    pub fn backward(
        &self,
        gpu: &Gpu,
        x: &DeviceTensor<Bf16>,
        saved: Saved,
        dy: &DeviceTensor<Bf16>,
    ) -> Result<DeviceGrads<Bf16>> {
        let small = |block: &Self, gpu: &Gpu, slots: &DeviceTensor| block.small_grads(gpu, slots);
        let (dx, dw, (db, ops)) = self.backward_parts(gpu, x, saved, dy, None, small)?;
        Ok(DeviceGrads { x: dx, params: DeviceParams { linear_weight: dw, linear_bias: db, ops } })
    }

    /// [`GpuBlock::backward`] up to the small gradients, as the FP32 block's
    /// `backward_parts` (`phases` is not marked: the bf16 backward has no phase timing).
    pub fn backward_parts<S>(
        &self,
        gpu: &Gpu,
        x: &DeviceTensor<Bf16>,
        saved: Saved,
        dy: &DeviceTensor<Bf16>,
        _phases: Option<&mut super::Phases>,
        small: impl FnOnce(&Self, &Gpu, &DeviceTensor) -> Result<S>,
    ) -> Result<(DeviceTensor<Bf16>, DeviceTensor<Bf16>, S)> {
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
        // dz in bf16: the tile-wise backward reads and writes bf16 where rows are
        // 8-byte aligned; otherwise the FP32 one on a widened dy, rounded.
        let (dz, slots) = if self.tile_backward() && n % 4 == 0 && dy.buf.device_address().is_multiple_of(8) {
            epilogue_tiles_backward(gpu, &self.chain, &saved.z, dy)?
        } else {
            let dy32 = widen(gpu, dy)?;
            let (dz, slots) = if self.tile_backward() {
                epilogue_tiles_backward(gpu, &self.chain, &saved.z, &dy32)?
            } else {
                epilogue_rows_backward(gpu, &self.chain, &saved.z, &dy32, self.out_width())?
            };
            (to_bf16(gpu, &dz)?, slots)
        };
        drop(saved);
        // The GEMMs' weight: the block's, or a folded AvgPool's rounded to bf16.
        let folded16 = self.folded.as_ref().map(|(_, w, _)| to_bf16(gpu, w)).transpose()?;
        let w16 = folded16.as_ref().unwrap_or(&self.params.linear_weight);

        // dW = dZ^T X on the side stream, overlapping dX (as the FP32 block does): into
        // bf16 on the bf16 kernel, or into FP32 where a folded weight's gradient is spread
        // afterwards or the FP32 kernels run (rounded once, below).
        let side = gpu.side_stream();
        let mut keep = Vec::new();
        let tma = gpu.tuning().tma;
        let dw_out = if self.folded.is_some() { Dtype::F32 } else { Dtype::Bf16 };
        let dw_route = dispatch::route(
            Precision::Bf16,
            Role::GradWeight,
            (m, n, k),
            Storage::bf16(dw_out, aligned(&[&dz, x])),
            tma,
        );
        let dw = match (dw_route.widened, dw_out) {
            (false, Dtype::Bf16) => WeightGrad::Bf16(grad_weight_native(gpu, &dw_route, &dz, x, (n, k, m))?),
            (false, Dtype::F32) => WeightGrad::F32(grad_weight_native(gpu, &dw_route, &dz, x, (n, k, m))?),
            (true, _) => {
                gpu.order(gpu.stream(), side)?;
                let (dz32, x32) = (widen_on(gpu, side, &dz)?, widen_on(gpu, side, x)?);
                let (dw, scratch) = grad_weight(gpu, Precision::Bf16, side, &dz32, &x32)?;
                keep.extend(scratch);
                keep.extend([dz32, x32]);
                WeightGrad::F32(dw)
            }
        };
        // dX = dZ W on the main stream.
        let storage = Storage::bf16(Dtype::Bf16, aligned(&[&dz, w16]));
        let dx_route = dispatch::route(Precision::Bf16, Role::GradInput, (m, n, k), storage, tma);
        let dx = if !dx_route.widened {
            let mut dx = gpu.alloc_as::<Bf16>(&[m, k])?;
            launch_bf16(
                gpu,
                gpu.stream(),
                &dx_route,
                (&dz.buf, &w16.buf),
                (m, k, n),
                (n, k),
                (None, None),
                &mut dx,
                None,
            )?;
            dx
        } else {
            let (dz32, w32) = (widen(gpu, &dz)?, widen(gpu, w16)?);
            to_bf16(gpu, &grad_input(gpu, Precision::Bf16, &dz32, &w32)?)?
        };
        gpu.order(side, gpu.stream())?;
        drop((dz, keep, folded16));
        let dw = match (dw, &self.folded) {
            (WeightGrad::Bf16(dw), _) => dw,
            (WeightGrad::F32(dw), Some((pool, ..))) => {
                unfold_rows_mean_grad::<Bf16>(gpu, &dw, self.spec.out_features, *pool)?
            }
            (WeightGrad::F32(dw), None) => to_bf16(gpu, &dw)?,
        };
        let small = small(self, gpu, &slots)?;
        Ok((dx, dw, small))
    }

    /// Uploads bf16 `x` and `dy` (shaped as the output), runs the training forward and
    /// the backward, and downloads everything widened to FP32 (exact): the output, the
    /// gradients and the saved `z`.
    pub fn forward_backward(&self, gpu: &Gpu, x: &Tensor<Bf16>, dy: &Tensor<Bf16>) -> Result<HostGrads> {
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
fn aligned(tensors: &[&DeviceTensor<Bf16>]) -> bool {
    tensors.iter().all(|t| t.buf.device_address().is_multiple_of(16))
}

/// A weight gradient as its GEMM left it: bf16 already, or FP32 still to spread (a
/// folded AvgPool's) or round.
enum WeightGrad {
    Bf16(DeviceTensor<Bf16>),
    F32(DeviceTensor),
}

/// `dW (n, k) = dZ^T X` on the bf16 kernel, `dZ (m, n)` and `X (m, k)` as stored, into
/// `O` (bf16, or FP32), on the side stream after everything queued on the GPU's stream
/// (the output's allocation included). The caller orders the GPU's stream after the
/// side stream before using `dW` or freeing `dZ`.
fn grad_weight_native<O: DeviceElement>(
    gpu: &Gpu,
    route: &Route,
    dz: &DeviceTensor<Bf16>,
    x: &DeviceTensor<Bf16>,
    (n, k, m): (usize, usize, usize),
) -> Result<DeviceTensor<O>> {
    let mut dw = gpu.alloc_as::<O>(&[n, k])?;
    let side = gpu.side_stream();
    gpu.order(gpu.stream(), side)?;
    let (ops, dims, lds) = ((None, None), (n, k, m), (n, k));
    launch_bf16(gpu, side, route, (&dz.buf, &x.buf), dims, lds, ops, &mut dw, None)?;
    Ok(dw)
}

//! Launchers of `kernels-gpu/src/optim.rs`: the MSE loss and optimiser steps.

use super::{DeviceTensor, Gpu, launched};
use crate::error::{Error, Result};
use cudarc::driver::PushKernelArg;
use kernel_abi::Kernel;

/// Mean squared error of `y` against `target`: returns the loss and `dloss/dy`.
pub fn mse_loss_grad(gpu: &Gpu, y: &DeviceTensor, target: &DeviceTensor) -> Result<(f64, DeviceTensor)> {
    if y.shape != target.shape {
        return Err(Error::Shape(format!("loss of {:?} against a target of {:?}", y.shape, target.shape)));
    }
    let blocks = y.len().div_ceil(256);
    let mut dy = gpu.alloc(&y.shape)?;
    let mut parts = gpu.alloc(&[blocks])?;
    let len = y.len() as u32;
    {
        let (func, cfg) = gpu.kernel_1d(Kernel::MseLossGrad, y.len(), 32)?;
        let mut l = gpu.stream().launch_builder(&func);
        l.arg(&y.buf).arg(&target.buf).arg(&mut dy.buf).arg(&mut parts.buf).arg(&len);
        // SAFETY: (y, target, dy, parts, len) as the kernel takes; parts holds one float per block.
        launched(Kernel::MseLossGrad, unsafe { l.launch(cfg) })
    }?;
    let parts = gpu.stream().clone_dtoh(&*parts.buf).map_err(|e| Error::cuda("reading the loss", e))?;
    Ok((parts.iter().map(|&p| p as f64).sum::<f64>() / y.len() as f64, dy))
}

/// `p -= lr * g`.
pub fn sgd_step(gpu: &Gpu, p: &mut DeviceTensor, g: &DeviceTensor, lr: f32) -> Result<()> {
    if p.shape != g.shape {
        return Err(Error::Shape(format!("gradient {:?} for parameter {:?}", g.shape, p.shape)));
    }
    let len = p.len() as u32;
    {
        let (func, cfg) = gpu.kernel_1d(Kernel::SgdStep, p.len(), 0)?;
        let mut l = gpu.stream().launch_builder(&func);
        l.arg(&mut p.buf).arg(&g.buf).arg(&lr).arg(&len);
        // SAFETY: (p, g, lr, len) as the kernel takes.
        launched(Kernel::SgdStep, unsafe { l.launch(cfg) })
    }
}

/// Adam's state for one parameter.
pub struct AdamState {
    pub m: DeviceTensor,
    pub v: DeviceTensor,
}

/// One Adam step (`torch.optim.Adam` defaults but `lr`: betas 0.9, 0.999, eps 1e-8);
/// `t` counts steps from 1.
pub fn adam_step(gpu: &Gpu, p: &mut DeviceTensor, g: &DeviceTensor, s: &mut AdamState, lr: f32, t: i32) -> Result<()> {
    if p.shape != g.shape || p.shape != s.m.shape {
        return Err(Error::Shape(format!("gradient {:?} for parameter {:?}", g.shape, p.shape)));
    }
    let (b1, b2, eps) = (0.9f32, 0.999f32, 1e-8f32);
    let c1 = 1.0 / (1.0 - b1.powi(t));
    let c2 = 1.0 / (1.0 - b2.powi(t));
    let len = p.len() as u32;
    {
        let (func, cfg) = gpu.kernel_1d(Kernel::AdamStep, p.len(), 0)?;
        let mut l = gpu.stream().launch_builder(&func);
        l.arg(&mut p.buf).arg(&g.buf).arg(&mut s.m.buf).arg(&mut s.v.buf);
        l.arg(&lr).arg(&b1).arg(&b2).arg(&eps).arg(&c1).arg(&c2).arg(&len);
        // SAFETY: (p, g, m, v, lr, b1, b2, eps, c1, c2, len) as the kernel takes.
        launched(Kernel::AdamStep, unsafe { l.launch(cfg) })
    }
}

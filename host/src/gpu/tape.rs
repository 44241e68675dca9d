//! The autograd tape on the GPU: a block is one tape node whose backward launches the
//! block's backward kernels; gradients are device tensors summed by `add_assign`.

use super::block::GpuBlock;
use super::elementwise::add_assign;
use super::{DeviceTensor, Gpu};
use crate::error::{Error, Result};
use crate::tape::{Gradient, Tape, VarId};
use std::rc::Rc;

/// A gradient on the GPU, with the GPU that can add to it.
pub struct GpuGrad {
    pub t: DeviceTensor,
    gpu: Gpu,
}

impl GpuGrad {
    pub fn new(gpu: &Gpu, t: DeviceTensor) -> GpuGrad {
        GpuGrad { t, gpu: gpu.clone() }
    }
}

impl Gradient for GpuGrad {
    fn accumulate(&mut self, other: GpuGrad) -> Result<()> {
        add_assign(&self.gpu, &mut self.t, &other.t)
    }
}

impl GpuBlock {
    /// Runs the forward on `x` and records the block as one node reading `x` and the
    /// block's parameters (`param_vars` in `BlockSpec::param_specs` order). The node
    /// keeps `x` and the saved state until its backward runs, then frees them.
    pub fn forward_taped(
        self: &Rc<Self>,
        gpu: &Gpu,
        tape: &mut Tape<GpuGrad>,
        x: Rc<DeviceTensor>,
        x_var: VarId,
        param_vars: &[VarId],
    ) -> Result<(Rc<DeviceTensor>, VarId)> {
        if param_vars.len() != self.params.shapes().len() {
            return Err(Error::Argument(format!(
                "{} parameter variables for a block with {} parameters",
                param_vars.len(),
                self.params.shapes().len()
            )));
        }
        let (y, saved) = self.forward_train(gpu, &x, false)?;
        let mut inputs = vec![x_var];
        inputs.extend_from_slice(param_vars);
        let (block, gpu_) = (Rc::clone(self), gpu.clone());
        let out = tape.record(&inputs, move |dy: GpuGrad| {
            let g = block.backward(&gpu_, &x, saved, &dy.t)?;
            let mut grads = vec![Some(GpuGrad::new(&gpu_, g.x))];
            let params = g.params;
            grads.push(Some(GpuGrad::new(&gpu_, params.linear_weight)));
            grads.push(Some(GpuGrad::new(&gpu_, params.linear_bias)));
            grads.extend(params.ops.into_iter().flatten().map(|t| Some(GpuGrad::new(&gpu_, t))));
            Ok(grads)
        });
        Ok((Rc::new(y), out))
    }
}

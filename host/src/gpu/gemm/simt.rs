//! Launchers of the GEMM kernels with fused epilogues: `gemm_f32_*` (FP32 FMA,
//! kernels-gpu/src/gemm/simt.rs) and `gemm_tc_{tf32,tf32x3}_*` (tensor cores,
//! kernels-gpu/src/gemm/tensor_core.rs), which share one signature and one tiling of
//! `y`: the forward GEMM with its fused epilogue, split-K partial products, and the two
//! GEMMs of the backward.

use super::super::elementwise::{slice_to_bf16, transpose_on, transpose_to_bf16_on};
use super::super::epilogue::DeviceChain;
use super::super::{DeviceTensor, Gpu};
use crate::chain::Op;
use crate::error::{Error, Result};
use crate::precision::Precision;
use cudarc::driver::{CudaSlice, CudaStream, LaunchArgs, LaunchConfig, PushKernelArg};
use kernel_abi::gemm_simt::{BLOCK_M, BLOCK_N, MAX_FUSED_GROUP, MIN_FUSED_GROUP, THREADS};
use kernel_abi::{gemm_simt, gemm_tc, gemm_tma, gemm_wg};
use std::sync::Arc;

/// Why the fused kernel cannot apply `op` to `features` channels, or `None` if it can.
pub fn not_fusable(op: &Op, features: usize) -> Option<String> {
    match *op {
        Op::AvgPool(_) | Op::RowMax => Some(format!("`{op}` reduces across tiles")),
        Op::GroupNorm { groups, .. } => {
            let g = features / groups;
            (!(g.is_power_of_two() && (MIN_FUSED_GROUP..=MAX_FUSED_GROUP).contains(&g))).then(|| {
                format!(
                    "`{op}` has groups of {g} channels; the fused kernel takes powers of two from \
                     {MIN_FUSED_GROUP} to {MAX_FUSED_GROUP}"
                )
            })
        }
        _ => None,
    }
}

/// Memory order of the operands of `y = A B^T` (see the kernel's documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Both `k`-contiguous: the forward `x W^T`.
    Nt,
    /// `B` row-contiguous: `dX = dZ W`.
    Nn,
    /// Both row-contiguous: `dW = dZ^T X`.
    Tn,
    /// `A` row-contiguous, `B` `k`-contiguous: the tensor-core backward on `wgmma`
    /// (`dX^T = W^T dZ^T`, and `dW = dZ^T X` with `X` transposed first).
    Tk,
}

/// Whether the `wgmma` kernels implement this precision (TF32 and 3xTF32; bf16 runs
/// on `mma.sync` only).
fn on_wgmma(precision: Precision) -> bool {
    matches!(precision, Precision::Tf32 | Precision::Tf32x3)
}

fn prefix(precision: Precision) -> &'static str {
    match precision {
        Precision::Fp32 => "gemm_f32",
        Precision::Tf32x3 => "gemm_tc_tf32x3",
        Precision::Tf32 => "gemm_tc_tf32",
        Precision::Bf16 => "gemm_tc_bf16",
    }
}

/// The kernel family's `k` depth per stage (split-K slices are multiples of it) and
/// dynamic shared memory in bytes.
fn stage_k_and_smem(precision: Precision) -> (usize, usize) {
    match precision {
        Precision::Fp32 => (gemm_simt::BLOCK_K, gemm_simt::SMEM_BYTES),
        Precision::Tf32x3 | Precision::Tf32 | Precision::Bf16 => (gemm_tc::BLOCK_K, gemm_tc::SMEM_BYTES),
    }
}

/// The kernel a launch runs: its name, its `k` depth per stage (split-K slices are
/// multiples of it) and its dynamic shared memory in bytes — or the TMA forward, which
/// has a launcher of its own ([`super::tma`]).
struct Kernel {
    name: String,
    block_k: usize,
    smem_bytes: usize,
    tma: bool,
}

/// Whether the TF32 and 3xTF32 `Nt` GEMMs may use the TMA kernels: yes unless
/// `HOST_GEMM_NO_TMA` is set (an A/B switch for measurements: the `gemm_wg` kernels
/// then run instead).
fn tma_allowed() -> bool {
    static ALLOWED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ALLOWED.get_or_init(|| std::env::var_os("HOST_GEMM_NO_TMA").is_none())
}

/// The kernel for a precision, layout, leading dimensions (16-byte loads need both
/// divisible by 4), depth `k` and split-K count, storing `y^T` when `transpose_y`. The
/// TF32 and 3xTF32 `Nt` and `Tk` GEMMs and the bf16 `Nt` ones without split-K and with
/// `k >= gemm_tma::MIN_K` run on the persistent TMA kernels (kernels-gpu/src/gemm/tma.rs);
/// TF32 and 3xTF32 with 16-byte loads otherwise on `wgmma` (`gemm_wg_*`,
/// kernels-gpu/src/gemm/wgmma.rs): the forward, and layout `Tk` as `dx` (transposed
/// output) or `dw`; everything else on the `gemm_f32_*` FMA kernels or the `mma.sync`
/// ones (`gemm_tc_*`).
fn kernel(
    precision: Precision,
    layout: Layout,
    (lda, ldb, k): (usize, usize, usize),
    splits: usize,
    transpose_y: bool,
) -> Kernel {
    let vec4 = lda.is_multiple_of(4) && ldb.is_multiple_of(4);
    // The TMA kernels want 16-byte row pitches: 4 floats, or 8 bf16 values for the bf16
    // forward (over bf16 copies of the operands).
    let (on_tma, pitched) = match precision {
        Precision::Bf16 => (true, lda.is_multiple_of(8) && ldb.is_multiple_of(8)),
        _ => (on_wgmma(precision), vec4),
    };
    if on_tma && splits <= 1 && k >= gemm_tma::MIN_K && pitched && tma_allowed() {
        // `Nt` (the forward), `Tk` (TF32 and 3xTF32: `A` row-contiguous, `dW` with `dZ`
        // as stored, and `dX^T = W^T dZ^T` with `W` as stored; `A` through registers).
        let name = match layout {
            Layout::Nt => Some(super::tma::kernel(precision)),
            Layout::Tk if on_wgmma(precision) => Some(super::tma::tk_kernel(precision, transpose_y)),
            _ => None,
        };
        if let Some(name) = name {
            return Kernel { name: name.into(), block_k: 0, smem_bytes: 0, tma: true };
        }
    }
    if on_wgmma(precision) && vec4 && matches!(layout, Layout::Nt | Layout::Tk) {
        let what = match (layout, transpose_y) {
            (Layout::Nt, _) => "nt",
            (_, true) => "dx",
            _ => "dw",
        };
        return Kernel {
            name: format!("gemm_wg_{precision}_{what}_vec4"),
            block_k: gemm_wg::BLOCK_K,
            smem_bytes: gemm_wg::smem_bytes(precision == Precision::Tf32x3),
            tma: false,
        };
    }
    let layout = match layout {
        Layout::Nt => "nt",
        Layout::Nn => "nn",
        Layout::Tn => "tn",
        Layout::Tk => "tk", // refused by `Gemm::launch` before it gets here
    };
    let (block_k, smem_bytes) = stage_k_and_smem(precision);
    let vec = if vec4 { "vec4" } else { "scalar" };
    Kernel { name: format!("{}_{layout}_{vec}", prefix(precision)), block_k, smem_bytes, tma: false }
}

/// Name of the kernel for a precision, layout, leading dimensions, depth `k` and split-K
/// count (see `kernel`).
pub fn kernel_name(
    precision: Precision,
    layout: Layout,
    (lda, ldb, k): (usize, usize, usize),
    splits: usize,
) -> String {
    kernel(precision, layout, (lda, ldb, k), splits, false).name
}

/// The kernel [`grad_input`] runs `dX = dZ W` on for these operands (the GPU tests check
/// the path they mean to cover).
pub fn grad_input_kernel(precision: Precision, dz: &DeviceTensor, w: &DeviceTensor) -> Result<String> {
    let (gemm, _) = grad_input_gemm(precision, dz, w)?;
    if bf16_transposed_on_tma(precision, gemm.k) {
        return Ok(super::tma::kernel(precision).into());
    }
    Ok(kernel(gemm.precision, gemm.layout, (gemm.lda, gemm.ldb, gemm.k), gemm.splits, gemm.transpose_y).name)
}

/// One GEMM launch: `y (m, n) = chain(A B^T + bias)`, or `splits > 1` partial products
/// into `y (splits, m, n)` (no bias, no chain, no `save_z`).
pub struct Gemm<'a> {
    pub precision: Precision,
    pub layout: Layout,
    pub a: &'a CudaSlice<f32>,
    pub b: &'a CudaSlice<f32>,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub lda: usize,
    pub ldb: usize,
    pub bias: Option<&'a CudaSlice<f32>>,
    pub chain: Option<&'a DeviceChain>,
    pub splits: usize,
    /// Store `y^T (n, m)` instead of `y` (layout `Tk` only, no bias or chain).
    pub transpose_y: bool,
}

impl<'a> Gemm<'a> {
    /// A GEMM with no bias, chain, split or transposed output: `(m, n, k)` and the
    /// operands' leading dimensions `(lda, ldb)`.
    fn plain(
        precision: Precision,
        layout: Layout,
        (a, b): (&'a CudaSlice<f32>, &'a CudaSlice<f32>),
        (m, n, k): (usize, usize, usize),
        (lda, ldb): (usize, usize),
    ) -> Gemm<'a> {
        Gemm { precision, layout, a, b, m, n, k, lda, ldb, bias: None, chain: None, splits: 1, transpose_y: false }
    }

    /// Queues the GEMM. `save_z`, if given, receives `A B^T + bias` before the chain.
    pub fn launch(&self, gpu: &Gpu, y: &mut DeviceTensor, save_z: Option<&mut DeviceTensor>) -> Result<()> {
        self.launch_on(gpu, gpu.stream(), y, save_z)
    }

    /// [`Gemm::launch`] on another stream of the same GPU (the caller orders it).
    pub fn launch_on(
        &self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        y: &mut DeviceTensor,
        save_z: Option<&mut DeviceTensor>,
    ) -> Result<()> {
        let (m, n, k, splits) = (self.m, self.n, self.k, self.splits.max(1));
        let (rows, cols) = if self.transpose_y { (n, m) } else { (m, n) };
        let want: Vec<usize> = if splits > 1 { vec![splits, rows, cols] } else { vec![rows, cols] };
        let tk = self.layout == Layout::Tk;
        if self.transpose_y && (!tk || self.bias.is_some() || self.chain.is_some()) {
            return Err(Error::Shape("a transposed GEMM output takes layout Tk and no bias or chain".into()));
        }
        if tk && (!on_wgmma(self.precision) || !(self.lda.is_multiple_of(4) && self.ldb.is_multiple_of(4))) {
            return Err(Error::Unsupported("layout Tk runs on tensor cores with 16-byte aligned rows only".into()));
        }
        if y.shape != want {
            return Err(Error::Shape(format!("GEMM output must be {want:?}, got {:?}", y.shape)));
        }
        if save_z.as_ref().is_some_and(|z| z.shape != [m, n]) || (splits > 1 && save_z.is_some()) {
            return Err(Error::Shape(format!("saved GEMM output must be [{m}, {n}] and not split")));
        }
        let (a_len, b_len) = match self.layout {
            Layout::Nt => (m * self.lda, n * self.ldb),
            Layout::Nn => (m * self.lda, k * self.ldb),
            Layout::Tn => (k * self.lda, k * self.ldb),
            Layout::Tk => (k * self.lda, n * self.ldb),
        };
        if self.a.len() < a_len || self.b.len() < b_len || [m, n, k].contains(&0) {
            return Err(Error::Shape(format!("GEMM operands too small for ({m}, {n}, {k})")));
        }
        // The kernel keeps 32-bit element offsets into its operands.
        if [m, n, k, self.lda, self.ldb, a_len, b_len].iter().any(|&d| d > u32::MAX as usize) {
            return Err(Error::Shape(format!("GEMM size ({m}, {n}, {k}) exceeds the kernel's 32-bit arguments")));
        }
        let Kernel { name, block_k, smem_bytes, tma } =
            kernel(self.precision, self.layout, (self.lda, self.ldb, k), splits, self.transpose_y);
        if tma && tk {
            if self.bias.is_some() || self.chain.is_some() || save_z.is_some() {
                return Err(Error::Unsupported("the TMA `Tk` GEMM takes no bias, chain or saved output".into()));
            }
            let operands = (self.a, self.b);
            let (precision, pitches) = (self.precision, (self.lda, self.ldb));
            return super::tma::launch_tk(gpu, stream, precision, operands, (m, n, k), pitches, self.transpose_y, y);
        }
        if tma {
            let pitches = (self.lda, self.ldb);
            let (operands, dims) = ((self.a, self.b), (m, n, k));
            let precision = self.precision;
            return super::tma::launch_forward(
                gpu, stream, precision, operands, dims, pitches, self.bias, self.chain, y, save_z,
            );
        }
        let name = name.as_str();
        let k_split = k.div_ceil(splits).div_ceil(block_k) * block_k;
        let func = gpu.function(name)?;
        gpu.allow_shared(&func, name, smem_bytes)?;
        let grid = (n.div_ceil(BLOCK_N), m.div_ceil(BLOCK_M), splits);
        if grid.1 > 65535 || grid.2 > 65535 {
            return Err(Error::Shape(format!("GEMM grid {grid:?} exceeds the launch limits")));
        }
        let cfg = LaunchConfig {
            grid_dim: (grid.0 as u32, grid.1 as u32, grid.2 as u32),
            block_dim: (THREADS as u32, 1, 1),
            shared_mem_bytes: smem_bytes as u32,
        };
        let chain = if splits > 1 { None } else { self.chain };
        let tail = EpilogueArgs::new(&[m, n, k, self.lda, self.ldb, k_split], chain);
        let mut launch = stream.launch_builder(&func);
        launch.arg(self.a).arg(self.b);
        tail.push(&mut launch, self.bias.filter(|_| splits == 1), y, save_z, chain);
        // SAFETY: matches the kernel's signature; operand extents checked above; the
        // chain's ops were checked fusable by the caller (`not_fusable`); grid, block
        // and shared memory follow kernel_abi::gemm_simt / gemm_tc / gemm_wg.
        unsafe { launch.launch(cfg) }.map_err(|e| Error::cuda(format!("launching `{name}`"), e))?;
        Ok(())
    }
}

/// The arguments every GEMM kernel takes after its operands — `bias, y, save_z`, the
/// sizes, `ops, n_ops` (null pointers for absent ones) — owned here while a launch
/// builder borrows them.
pub(super) struct EpilogueArgs {
    dims: Vec<u32>,
    n_ops: u32,
    null: u64,
}

impl EpilogueArgs {
    /// `dims`: the kernel's size arguments, in order.
    pub(super) fn new(dims: &[usize], chain: Option<&DeviceChain>) -> EpilogueArgs {
        let dims = dims.iter().map(|&d| d as u32).collect();
        EpilogueArgs { dims, n_ops: chain.map_or(0, |c| c.ops.len() as u32), null: 0 }
    }

    /// Pushes them onto `launch`, after the operands.
    pub(super) fn push<'a>(
        &'a self,
        launch: &mut LaunchArgs<'a>,
        bias: Option<&'a CudaSlice<f32>>,
        y: &'a mut DeviceTensor,
        save_z: Option<&'a mut DeviceTensor>,
        chain: Option<&'a DeviceChain>,
    ) {
        match bias {
            Some(b) => launch.arg(b),
            None => launch.arg(&self.null),
        };
        launch.arg(&mut y.buf);
        match save_z {
            Some(z) => launch.arg(&mut z.buf),
            None => launch.arg(&self.null),
        };
        for d in &self.dims {
            launch.arg(d);
        }
        match chain {
            Some(c) => launch.arg(&c.descs),
            None => launch.arg(&self.null),
        };
        launch.arg(&self.n_ops);
    }
}

/// The forward GEMM `x (m, k) W^T` with `w (n, k)`.
pub fn forward_gemm<'a>(precision: Precision, x: &'a DeviceTensor, w: &'a DeviceTensor) -> Result<Gemm<'a>> {
    let (m, n, k) = super::linear_dims(x, w)?;
    Ok(Gemm::plain(precision, Layout::Nt, (&x.buf, &w.buf), (m, n, k), (k, k)))
}

/// Whether the tensor-core backward GEMMs can run on `wgmma` (`Layout::Tk`): 16-byte
/// aligned rows in every operand it reads.
fn backward_on_wgmma(precision: Precision, dims: &[usize]) -> bool {
    on_wgmma(precision) && dims.iter().all(|d| d.is_multiple_of(4))
}

/// Whether a bf16 GEMM of depth `k` whose operands are transposed into rows of `k`
/// would run on the TMA kernel as `Nt` ([`kernel`] with pitches `k`): the backward's
/// bf16 `dX` and `dW` then transpose `W` (resp. `dZ` and `X`) first, rounding them in
/// the same pass where the shapes allow.
fn bf16_transposed_on_tma(precision: Precision, k: usize) -> bool {
    precision == Precision::Bf16 && kernel(precision, Layout::Nt, (k, k, k), 1, false).tma
}

/// `dX (m, k) = dZ (m, n) W (n, k)`.
pub fn grad_input(gpu: &Gpu, precision: Precision, dz: &DeviceTensor, w: &DeviceTensor) -> Result<DeviceTensor> {
    let (gemm, shape) = grad_input_gemm(precision, dz, w)?;
    let mut dx = gpu.alloc(&shape)?;
    if bf16_transposed_on_tma(precision, gemm.k) {
        // `B` = W^T (k, n), rows of `n`: transposed and rounded in one pass where the
        // shapes allow, else transposed here and rounded by the launcher. Freed in
        // stream order after the GEMM.
        let (m, n, k) = (shape[0], gemm.k, shape[1]);
        let stream = gpu.stream();
        if let Some(wt16) = transpose_to_bf16_on(gpu, stream, w)? {
            let dz16 = slice_to_bf16(gpu, stream, &dz.buf)?;
            super::tma::launch_forward_bf16(gpu, stream, (&dz16, &wt16), (m, k, n), (n, n), None, None, &mut dx, None)?;
        } else {
            let wt = transpose_on(gpu, stream, w)?;
            Gemm::plain(precision, Layout::Nt, (&dz.buf, &wt.buf), (m, k, n), (n, n)).launch(gpu, &mut dx, None)?;
        }
        return Ok(dx);
    }
    gemm.launch(gpu, &mut dx, None)?;
    Ok(dx)
}

/// The GEMM of [`grad_input`] and `dX`'s shape.
fn grad_input_gemm<'a>(
    precision: Precision,
    dz: &'a DeviceTensor,
    w: &'a DeviceTensor,
) -> Result<(Gemm<'a>, [usize; 2])> {
    let (&[m, n], &[wn, k]) = (&dz.shape[..], &w.shape[..]) else {
        return Err(Error::Shape(format!("dX = dZ W: dZ {:?}, W {:?}", dz.shape, w.shape)));
    };
    if wn != n {
        return Err(Error::Shape(format!("dX = dZ W: dZ {:?}, W {:?}", dz.shape, w.shape)));
    }
    let gemm = if backward_on_wgmma(precision, &[n, k]) {
        // dX^T (k, m) = W^T dZ^T: `A` = W read as stored (row-contiguous), `B` = dZ,
        // stored transposed (`n` >= `MIN_K`: the TMA kernel, `A` through registers;
        // else `gemm_wg`'s `dx`). No transpose of W, which cost up to half the GEMM.
        Gemm { transpose_y: true, ..Gemm::plain(precision, Layout::Tk, (&w.buf, &dz.buf), (k, m, n), (k, n)) }
    } else {
        Gemm::plain(precision, Layout::Nn, (&dz.buf, &w.buf), (m, k, n), (n, k))
    };
    Ok((gemm, [m, k]))
}

/// `dW (n, k) = dZ (m, n)^T X (m, k)`, queued on `stream` after all the GPU's stream
/// holds so far (its output is allocated there first). The caller orders the GPU's
/// stream after `stream` before using or freeing anything it reads — including the
/// scratch tensor returned beside `dW` (`X^T`, for the tensor-core path), which it must
/// keep until then.
pub fn grad_weight(
    gpu: &Gpu,
    precision: Precision,
    stream: &Arc<CudaStream>,
    dz: &DeviceTensor,
    x: &DeviceTensor,
) -> Result<(DeviceTensor, Vec<DeviceTensor>)> {
    let (&[_, n], &[_, k]) = (&dz.shape[..], &x.shape[..]) else {
        return Err(Error::Shape(format!("dW = dZ^T X: dZ {:?}, X {:?}", dz.shape, x.shape)));
    };
    let mut dw = gpu.alloc(&[n, k])?;
    let scratch = grad_weight_into(gpu, precision, stream, dz, x, &mut dw)?;
    Ok((dw, scratch))
}

/// [`grad_weight`] into a given `dw (n, k)` (allocated on the GPU's stream; the GPU
/// tests pass a NaN-poisoned one, so an element the kernel misses shows). Returns the
/// scratch tensors to keep until the GPU's stream is ordered after `stream`.
pub fn grad_weight_into(
    gpu: &Gpu,
    precision: Precision,
    stream: &Arc<CudaStream>,
    dz: &DeviceTensor,
    x: &DeviceTensor,
    dw: &mut DeviceTensor,
) -> Result<Vec<DeviceTensor>> {
    let (&[m, n], &[xm, k]) = (&dz.shape[..], &x.shape[..]) else {
        return Err(Error::Shape(format!("dW = dZ^T X: dZ {:?}, X {:?}", dz.shape, x.shape)));
    };
    if xm != m || dw.shape != [n, k] {
        return Err(Error::Shape(format!("dW {:?} = dZ^T X: dZ {:?}, X {:?}", dw.shape, dz.shape, x.shape)));
    }
    // `stream` starts after everything queued on the GPU's stream, `dw`'s allocation included.
    gpu.order(gpu.stream(), stream)?;
    if bf16_transposed_on_tma(precision, m) {
        // `A` = dZ^T (n, m) and `B` = X^T (k, m): rows of the batch, transposed and
        // rounded in one pass where the shapes allow (those copies are freed in
        // `stream`'s order, after the GEMM); else transposed here, rounded by the launcher.
        if [m, n, k].iter().all(|d| d.is_multiple_of(4))
            && let (Some(dzt16), Some(xt16)) =
                (transpose_to_bf16_on(gpu, stream, dz)?, transpose_to_bf16_on(gpu, stream, x)?)
        {
            super::tma::launch_forward_bf16(gpu, stream, (&dzt16, &xt16), (n, k, m), (m, m), None, None, dw, None)?;
            return Ok(Vec::new());
        }
        let (dzt, xt) = (transpose_on(gpu, stream, dz)?, transpose_on(gpu, stream, x)?);
        Gemm::plain(precision, Layout::Nt, (&dzt.buf, &xt.buf), (n, k, m), (m, m)).launch_on(gpu, stream, dw, None)?;
        return Ok(vec![dzt, xt]);
    }
    if backward_on_wgmma(precision, &[m, n]) {
        // `B` = X^T (k, m), `k`-contiguous in the batch.
        let xt = transpose_on(gpu, stream, x)?;
        // `A` = dZ read as stored (a batch of `MIN_K`+ rows: the TMA kernel, `A` through
        // registers; else `gemm_wg`'s `dw`), so dZ is never transposed (M2: 512 MB).
        Gemm::plain(precision, Layout::Tk, (&dz.buf, &xt.buf), (n, k, m), (n, m)).launch_on(gpu, stream, dw, None)?;
        return Ok(vec![xt]);
    }
    Gemm::plain(precision, Layout::Tn, (&dz.buf, &x.buf), (n, k, m), (n, k)).launch_on(gpu, stream, dw, None)?;
    Ok(Vec::new())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Which kernel each precision, layout, pitch and depth gets (assumes
    /// `HOST_GEMM_NO_TMA` is unset, as in CI): the TMA kernels only for 16-byte pitches,
    /// `k >= MIN_K` and no split-K; bf16 on them only as `Nt`.
    #[test]
    fn kernels_are_chosen_by_precision_layout_pitch_and_depth() {
        let name = |p, layout, dims, splits| kernel_name(p, layout, dims, splits);
        let (deep, shallow) = (gemm_tma::MIN_K, gemm_tma::MIN_K / 2);
        assert_eq!(name(Precision::Tf32, Layout::Nt, (deep, deep, deep), 1), "gemm_tma_tf32_nt");
        assert_eq!(name(Precision::Tf32x3, Layout::Nt, (deep, deep, deep), 1), "gemm_tma_tf32x3_nt");
        assert_eq!(name(Precision::Tf32, Layout::Tk, (deep, deep, deep), 1), "gemm_tma_tf32_tk");
        assert_eq!(name(Precision::Tf32, Layout::Nt, (deep, deep, deep), 2), "gemm_wg_tf32_nt_vec4");
        assert_eq!(name(Precision::Tf32, Layout::Nt, (deep, deep, shallow), 1), "gemm_wg_tf32_nt_vec4");
        assert_eq!(name(Precision::Bf16, Layout::Nt, (deep, deep, deep), 1), "gemm_tma_bf16_nt");
        // Pitches of 4 bf16 values (8 bytes), a shallow `k`, split-K, `Tk`: mma.sync.
        assert_eq!(name(Precision::Bf16, Layout::Nt, (deep + 4, deep + 4, deep + 4), 1), "gemm_tc_bf16_nt_vec4");
        assert_eq!(name(Precision::Bf16, Layout::Nt, (deep, deep, shallow), 1), "gemm_tc_bf16_nt_vec4");
        assert_eq!(name(Precision::Bf16, Layout::Nt, (deep, deep, deep), 2), "gemm_tc_bf16_nt_vec4");
        assert_eq!(name(Precision::Bf16, Layout::Tk, (deep, deep, deep), 1), "gemm_tc_bf16_tk_vec4");
        assert_eq!(name(Precision::Fp32, Layout::Nt, (deep, deep, deep), 1), "gemm_f32_nt_vec4");
        assert!(bf16_transposed_on_tma(Precision::Bf16, deep) && !bf16_transposed_on_tma(Precision::Bf16, deep + 4));
        assert!(!bf16_transposed_on_tma(Precision::Tf32, deep));
    }
}

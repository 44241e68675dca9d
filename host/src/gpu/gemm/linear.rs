//! The three GEMMs of a Linear layer — the forward with its fused epilogue
//! ([`Gemm`]), `dX` ([`grad_input`]) and `dW` ([`grad_weight`]) — routed by
//! [`route`] and launched by their family's launcher, after the
//! operand transposes a route asks for.

use super::super::dispatch::{Family, HalfKernels, Layout, Role, Route, Storage, Transposed, dx_grid_splits, route};
use super::super::elementwise::{slice_to_half, transpose_on, transpose_to_half_on};
use super::super::epilogue::DeviceChain;
use super::super::epilogue::lanes::epilogue_split_tiles;
use super::super::{DeviceTensor, Gpu, HalfElement, Tuning, VectorArg};
use super::args::Operands;
use super::fp8::{self, Fp8Matrix, Fp8Weight};
use crate::error::{Error, Result};
use crate::precision::Precision;
use crate::tensor::{Bf16, F16};
use cudarc::driver::CudaStream;
use std::sync::Arc;

/// Checks a Linear layer's `x (m, k)` against its weight `w (n, k)`; returns `(m, n, k)`.
pub fn linear_dims(x: &DeviceTensor, w: &DeviceTensor) -> Result<(usize, usize, usize)> {
    let (m, k) = match x.shape[..] {
        [m, k] => (m, k),
        _ => return Err(Error::tensor("x", format!("expected 2 dimensions, got {:?}", x.shape))),
    };
    match w.shape[..] {
        [n, wk] if wk == k => Ok((m, n, k)),
        _ => Err(Error::tensor("lin.weight", format!("expected shape (out, {k}), got {:?}", w.shape))),
    }
}

/// The forward GEMM of a Linear layer, `y (m, n) = chain(x W^T + bias)` with `x (m, k)`
/// and `w (n, k)`, or with `splits > 1` that many split-K partial products into
/// `y (splits, m, n)` (no bias, no chain, no `save_z`).
pub struct Gemm<'a> {
    pub precision: Precision,
    x: &'a DeviceTensor,
    w: &'a DeviceTensor,
    dims: (usize, usize, usize),
    pub bias: Option<VectorArg<'a>>,
    pub chain: Option<&'a DeviceChain>,
    pub splits: usize,
    /// FP8: `W` already quantised by rows (a block's cached copy), else quantised per call.
    pub w_fp8: Option<&'a Fp8Matrix>,
}

/// The forward GEMM `x (m, k) W^T` with `w (n, k)`: no bias, chain or split yet.
pub fn forward_gemm<'a>(precision: Precision, x: &'a DeviceTensor, w: &'a DeviceTensor) -> Result<Gemm<'a>> {
    let dims = linear_dims(x, w)?;
    Ok(Gemm { precision, x, w, dims, bias: None, chain: None, splits: 1, w_fp8: None })
}

impl Gemm<'_> {
    /// How it runs on a GPU of this `tuning` (see [`route`]).
    pub fn route(&self, tuning: Tuning) -> Route {
        route(self.precision, Role::Forward { splits: self.splits.max(1) }, self.dims, Storage::F32, tuning.tma)
    }

    /// Queues the GEMM. `save_z`, if given, receives `x W^T + bias` before the chain.
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
        if self.precision.is_fp8() {
            return self.launch_fp8(gpu, stream, y, save_z);
        }
        let (m, n, k) = self.dims;
        let (a, b) = (&self.x.buf, &self.w.buf);
        let (bias, chain, splits) = (self.bias, self.chain, self.splits.max(1));
        let op = Operands { a, b, m, n, k, lda: k, ldb: k, bias, chain, splits };
        launch(gpu, stream, &self.route(gpu.tuning()), &op, y, save_z)
    }
}

impl Gemm<'_> {
    /// The FP8 forward: `x` quantised by rows here, `W` by rows (or its cached copy),
    /// then the e4m3 GEMM with the bias and chain.
    fn launch_fp8(
        &self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        y: &mut DeviceTensor,
        save_z: Option<&mut DeviceTensor>,
    ) -> Result<()> {
        if self.splits > 1 {
            return Err(Error::Unsupported("the fp8 GEMM takes no split-K".into()));
        }
        let (_, n, k) = self.dims;
        if let Some(why) = fp8::unsupported(k, n) {
            return Err(Error::Unsupported(why));
        }
        if let Some(w) = self.w_fp8.filter(|w| (w.rows, w.cols) != (n, k)) {
            return Err(Error::Shape(format!("cached fp8 weight is {}x{}, the GEMM's {n}x{k}", w.rows, w.cols)));
        }
        let x = fp8::quantise_rows::<f32>(gpu, stream, self.x, "x")?;
        let made;
        let w = match self.w_fp8 {
            Some(w) => w,
            None => {
                made = fp8::quantise_rows(gpu, stream, self.w, "lin.weight")?;
                &made
            }
        };
        fp8::gemm(gpu, stream, &x, w, self.bias, self.chain, y, save_z)
    }
}

/// `dX (m, k) = dZ (m, n) W (n, k)` in FP8 ([`Fp8Weight`]: `w_q`, a block's cached
/// copy, or `w` quantised here).
pub fn grad_input_fp8(gpu: &Gpu, dz: &DeviceTensor, w: &DeviceTensor, w_q: Option<&Fp8Weight>) -> Result<DeviceTensor> {
    let (&[m, n], &[wn, k]) = (&dz.shape[..], &w.shape[..]) else {
        return Err(Error::Shape(format!("dX = dZ W: dZ {:?}, W {:?}", dz.shape, w.shape)));
    };
    if wn != n {
        return Err(Error::Shape(format!("dX = dZ W: dZ {:?}, W {:?}", dz.shape, w.shape)));
    }
    if let Some(why) = fp8::unsupported(k, n) {
        return Err(Error::Unsupported(why));
    }
    let stream = gpu.stream();
    let made;
    let w_q = match w_q {
        Some(w_q) => w_q,
        None => {
            made = fp8::quantise_weight(gpu, stream, w, "lin.weight")?;
            &made
        }
    };
    let mut dx = gpu.alloc(&[m, k])?;
    fp8::grad_input(gpu, stream, dz, w_q, &mut dx)?;
    Ok(dx)
}

/// `dW (n, k) = dZ^T X` in FP8 on `stream`: `dZ^T` and `X^T` quantised per output and
/// input feature (transposed, the batch padded to a multiple of 16).
fn grad_weight_fp8(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    dz: &DeviceTensor,
    x: &DeviceTensor,
    dw: &mut DeviceTensor,
) -> Result<()> {
    let dzt = fp8::quantise_columns_t::<f32>(gpu, stream, dz, "dz")?;
    let xt = fp8::quantise_columns_t::<f32>(gpu, stream, x, "x")?;
    fp8::gemm(gpu, stream, &dzt, &xt, None, None, dw, None)
}

/// Queues the GEMM `op` as `route` says, on `stream`: checks the output, the operands'
/// extents and the kernels' 32-bit arguments, then hands it to the family's launcher.
fn launch(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    route: &Route,
    op: &Operands,
    y: &mut DeviceTensor,
    save_z: Option<&mut DeviceTensor>,
) -> Result<()> {
    let (m, n, k, splits) = (op.m, op.n, op.k, op.splits.max(1));
    let (rows, cols) = if route.transpose_y { (n, m) } else { (m, n) };
    // A chain ending in a row reduction leaves row partials (`Plan::RowPartials`).
    let partials = op.chain.and_then(|c| c.reduction()).is_some();
    if partials && (route.family != Family::Tma || splits > 1 || route.transpose_y) {
        return Err(Error::Unsupported(format!(
            "`{}`: only the TMA kernels' epilogue ends a chain in a row reduction",
            route.kernel
        )));
    }
    let want: Vec<usize> = match (partials, splits > 1) {
        (true, _) => vec![kernel_abi::epilogue::row_partials(n), m, 2],
        (false, true) => vec![splits, rows, cols],
        (false, false) => vec![rows, cols],
    };
    let tk = route.layout == Layout::Tk;
    if route.transpose_y && (!tk || op.bias.is_some() || op.chain.is_some()) {
        return Err(Error::Shape("a transposed GEMM output takes layout Tk and no bias or chain".into()));
    }
    let tensor_cores = matches!(route.family, Family::Wgmma | Family::Tma);
    if tk && (!tensor_cores || !(op.lda.is_multiple_of(4) && op.ldb.is_multiple_of(4))) {
        return Err(Error::Unsupported("layout Tk runs on tensor cores with 16-byte aligned rows only".into()));
    }
    if route.family == Family::Tma && tk && (save_z.is_some() || splits > 1) {
        return Err(Error::Unsupported(format!("`{}` takes no split-K or saved output for Tk", route.kernel)));
    }
    if splits > 1 && (op.bias.is_some() || op.chain.is_some()) {
        return Err(Error::Unsupported("split-K into partial products takes no bias or chain".into()));
    }
    if y.shape != want {
        return Err(Error::Shape(format!("GEMM output must be {want:?}, got {:?}", y.shape)));
    }
    if save_z.as_ref().is_some_and(|z| z.shape != [m, n]) || (splits > 1 && save_z.is_some()) {
        return Err(Error::Shape(format!("saved GEMM output must be [{m}, {n}] and not split")));
    }
    let (a_len, b_len) = match route.layout {
        Layout::Nt => (m * op.lda, n * op.ldb),
        Layout::Nn => (m * op.lda, k * op.ldb),
        Layout::Tn => (k * op.lda, k * op.ldb),
        Layout::Tk => (k * op.lda, n * op.ldb),
    };
    if op.a.len() < a_len || op.b.len() < b_len || [m, n, k].contains(&0) {
        return Err(Error::Shape(format!("GEMM operands too small for ({m}, {n}, {k})")));
    }
    // The kernels keep 32-bit element offsets into their operands.
    if [m, n, k, op.lda, op.ldb, a_len, b_len].iter().any(|&d| d > u32::MAX as usize) {
        return Err(Error::Shape(format!("GEMM size ({m}, {n}, {k}) exceeds the kernel's 32-bit arguments")));
    }
    match route.family {
        Family::Fma | Family::Mma | Family::Wgmma => {
            super::grid::launch(gpu, stream, route.family, route.kernel, op, y, save_z)
        }
        Family::Tma if tk => super::tma::launch_tk(gpu, stream, route.kernel, op, y),
        Family::Tma => super::tma::launch_forward(gpu, stream, route, op, y, save_z),
        // `dW (n, k) = dZ^T X`: the batch's `k` rows of `dZ` (`A`) and `X` (`B`).
        Family::Dot if route.layout == Layout::Tn && save_z.is_none() && op.bias.is_none() && op.chain.is_none() => {
            let (u, v) = ((op.a, op.lda), (op.b, op.ldb));
            super::super::dot::outer_sum(gpu, stream, u, v, (k, m, n), &mut y.buf)
        }
        Family::Dot => Err(Error::Unsupported(format!("`{}` takes no GEMM's operands here", route.kernel))),
    }
}

/// The route of `dX = dZ W` for these operands on a GPU of this `tuning`, and
/// `(m, n, k)`: `dz (m, n)`, `w (n, k)`.
pub fn grad_input_route(
    precision: Precision,
    tuning: Tuning,
    dz: &DeviceTensor,
    w: &DeviceTensor,
) -> Result<(Route, (usize, usize, usize))> {
    let (&[m, n], &[wn, k]) = (&dz.shape[..], &w.shape[..]) else {
        return Err(Error::Shape(format!("dX = dZ W: dZ {:?}, W {:?}", dz.shape, w.shape)));
    };
    if wn != n {
        return Err(Error::Shape(format!("dX = dZ W: dZ {:?}, W {:?}", dz.shape, w.shape)));
    }
    Ok((route(precision, Role::GradInput, (m, n, k), Storage::F32, tuning.tma), (m, n, k)))
}

/// `dX (m, k) = dZ (m, n) W (n, k)`, as [`route`] says: `dX^T = W^T dZ^T` (`Tk`) reading
/// `W` and `dZ` as stored, bf16 over `W^T` (transposed and rounded in one pass where
/// the shapes allow, else transposed here and rounded by the launcher; freed in stream
/// order after the GEMM), or `Nn` as stored.
pub fn grad_input(gpu: &Gpu, precision: Precision, dz: &DeviceTensor, w: &DeviceTensor) -> Result<DeviceTensor> {
    if precision.is_fp8() {
        return grad_input_fp8(gpu, dz, w, None);
    }
    let (route, (m, n, k)) = grad_input_route(precision, gpu.tuning(), dz, w)?;
    if route.family == Family::Dot {
        return super::super::dot::weighted_rows(gpu, w, dz);
    }
    let mut dx = gpu.alloc(&[m, k])?;
    let stream = gpu.stream();
    let op = |a, b, (lda, ldb)| Operands { a, b, m, n: k, k: n, lda, ldb, bias: None, chain: None, splits: 1 };
    let splits = match route.layout {
        Layout::Tk => dx_grid_splits(m, n, k, gpu.props.multiprocessors, gpu.tuning().split_k),
        _ => 1,
    };
    match (route.layout, route.transposed) {
        (Layout::Nt, Transposed::B) => {
            // `B` = W^T (k, n), rows of `n`.
            let done = if route.kernel == HalfKernels::F16.tma_nt {
                grad_input_half::<F16>(gpu, stream, &route, dz, w, (m, n, k), &mut dx)?
            } else {
                grad_input_half::<Bf16>(gpu, stream, &route, dz, w, (m, n, k), &mut dx)?
            };
            if !done {
                let wt = transpose_on(gpu, stream, w)?;
                launch(gpu, stream, &route, &op(&dz.buf, &wt.buf, (n, n)), &mut dx, None)?;
            }
        }
        // dX^T (k, m) = W^T dZ^T: `A` = W read as stored (row-contiguous), `B` = dZ, the
        // output stored transposed. No transpose of W, which cost up to half the GEMM.
        (Layout::Tk, Transposed::Nothing) => {
            let op =
                Operands { a: &w.buf, b: &dz.buf, m: k, n: m, k: n, lda: k, ldb: n, bias: None, chain: None, splits };
            if splits == 1 {
                launch(gpu, stream, &route, &op, &mut dx, None)?;
            } else {
                // At few rows the depth in ranges, on the table's row without the TMA
                // kernels (they walk whole tiles): `gemm_wgmma`; their FP32 sums added in
                // order.
                let (wgmma, _) = grad_input_route(precision, Tuning { tma: false, ..gpu.tuning() }, dz, w)?;
                let mut parts = gpu.alloc(&[splits, m, k])?;
                launch(gpu, stream, &wgmma, &op, &mut parts, None)?;
                epilogue_split_tiles(gpu, None, &parts, None, &mut dx, None)?;
            }
        }
        (Layout::Nn, Transposed::Nothing) => launch(gpu, stream, &route, &op(&dz.buf, &w.buf, (n, k)), &mut dx, None)?,
        _ => return Err(Error::Unsupported(format!("dX has no operands for the route {route:?}"))),
    }
    Ok(dx)
}

/// `dW (n, k) = dZ (m, n)^T X (m, k)`, queued on `stream` after all the GPU's stream
/// holds so far (its output is allocated there first). The caller orders the GPU's
/// stream after `stream` before using or freeing anything it reads — including the
/// scratch tensors returned beside `dW` (transposed operands), which it must keep
/// until then.
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
/// scratch tensors to keep until the GPU's stream is ordered after `stream`. As
/// [`route`] says: `Tk` reading `dZ` as stored with `X^T`, bf16 over `dZ^T` and `X^T`,
/// or `Tn` as stored.
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
    if precision == Precision::Fp8 {
        grad_weight_fp8(gpu, stream, dz, x, dw)?;
        return Ok(Vec::new());
    }
    // fp8 with dW in bf16 (`Fp8GwBf16`): bf16 operands, as the bf16 precision's.
    let precision = if precision == Precision::Fp8GwBf16 { Precision::Bf16 } else { precision };
    let route = route(precision, Role::GradWeight, (m, n, k), Storage::F32, gpu.tuning().tma);
    let op = |a, b, (lda, ldb)| Operands { a, b, m: n, n: k, k: m, lda, ldb, bias: None, chain: None, splits: 1 };
    match (route.layout, route.transposed) {
        (Layout::Nt, Transposed::Both) => {
            // `A` = dZ^T (n, m) and `B` = X^T (k, m): rows of the batch, transposed and
            // rounded in one pass where the shapes allow (those copies are freed in
            // `stream`'s order, after the GEMM); else transposed here, rounded by the launcher.
            let done = [m, n, k].iter().all(|d| d.is_multiple_of(4))
                && if route.kernel == HalfKernels::F16.tma_nt {
                    grad_weight_half::<F16>(gpu, stream, &route, dz, x, (m, n, k), dw)?
                } else {
                    grad_weight_half::<Bf16>(gpu, stream, &route, dz, x, (m, n, k), dw)?
                };
            if done {
                return Ok(Vec::new());
            }
            let (dzt, xt) = (transpose_on(gpu, stream, dz)?, transpose_on(gpu, stream, x)?);
            launch(gpu, stream, &route, &op(&dzt.buf, &xt.buf, (m, m)), dw, None)?;
            Ok(vec![dzt, xt])
        }
        (Layout::Tk, Transposed::B) => {
            // `B` = X^T (k, m), `k`-contiguous in the batch; `A` = dZ read as stored, so
            // dZ is never transposed (M2: 512 MB).
            let xt = transpose_on(gpu, stream, x)?;
            launch(gpu, stream, &route, &op(&dz.buf, &xt.buf, (n, m)), dw, None)?;
            Ok(vec![xt])
        }
        (Layout::Tn, Transposed::Nothing) => {
            launch(gpu, stream, &route, &op(&dz.buf, &x.buf, (n, k)), dw, None)?;
            Ok(Vec::new())
        }
        _ => Err(Error::Unsupported(format!("dW has no operands for the route {route:?}"))),
    }
}

/// `dX (m, k)` on the 16-bit TMA kernel over `dZ` rounded to `H` and `W^T` transposed
/// and rounded in one pass (freed in stream order after the GEMM); `false` where the
/// shapes do not allow that pass (nothing queued).
fn grad_input_half<H: HalfElement>(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    route: &Route,
    dz: &DeviceTensor,
    w: &DeviceTensor,
    (m, n, k): (usize, usize, usize),
    dx: &mut DeviceTensor,
) -> Result<bool> {
    let Some(wt16) = transpose_to_half_on::<H>(gpu, stream, w)? else { return Ok(false) };
    let dz16 = slice_to_half::<H>(gpu, stream, &dz.buf)?;
    super::tma::launch_half(gpu, stream, route, (&dz16, &wt16), (m, k, n), (n, n), (None, None), dx, None, 1)?;
    Ok(true)
}

/// `dW (n, k)` on the 16-bit TMA kernel over `dZ^T` and `X^T`, each transposed and
/// rounded to `H` in one pass; `false` where the shapes do not allow it (nothing queued).
fn grad_weight_half<H: HalfElement>(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    route: &Route,
    dz: &DeviceTensor,
    x: &DeviceTensor,
    (m, n, k): (usize, usize, usize),
    dw: &mut DeviceTensor,
) -> Result<bool> {
    let (Some(dzt16), Some(xt16)) =
        (transpose_to_half_on::<H>(gpu, stream, dz)?, transpose_to_half_on::<H>(gpu, stream, x)?)
    else {
        return Ok(false);
    };
    super::tma::launch_half(gpu, stream, route, (&dzt16, &xt16), (n, k, m), (m, m), (None, None), dw, None, 1)?;
    Ok(true)
}

//! The candle adapter (`host::candle::FusedLinear`, feature `candle`): forward and every
//! gradient (x and each parameter) through candle's autograd, against the same block
//! written with candle's own ops and against the f64 reference; and its errors.
//!
//! `cargo test --release -p host --features candle --test candle`; with
//! `--no-default-features --features candle-cuda` (docs/RUST.md) the CUDA test builds too.

use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use host::candle::FusedLinear;
use host::{Params, Precision, reference};

/// f32 results (CPU backend, candle) against candle's ops or the f64 reference: the
/// difference may be up to `TOL * max(1, max|reference|)`. The blocks here are small
/// (`in = 32`), so f32 rounding through the GEMM and the epilogue stays near 1e-6;
/// 1e-4 leaves room for GroupNorm's and LayerNorm's division by small deviations.
const TOL: f32 = 1e-4;

fn close(what: &str, got: &Tensor, want: &[f32]) {
    close_within(what, got, want, TOL);
}

/// `got` (any float dtype) against `want`: at most `tol * max(1, max|want|)` apart.
fn close_within(what: &str, got: &Tensor, want: &[f32], tol: f32) {
    let got = got.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(1.0f32, |m, v| m.max(v.abs()));
    let err = got.iter().zip(want).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(err <= tol * scale, "{what}: max |difference| {err:e} > {tol:e} * {scale}");
}

/// A candle tensor (any float dtype) as a host f32 tensor of the same shape.
fn host_tensor(t: &Tensor) -> host::Tensor<f32> {
    let v = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    host::Tensor::new(t.dims(), v).unwrap()
}

/// The f64 reference's `y` and gradients of `block` at the values of `x`, its parameters
/// (`params`, in `param_specs` order) and `dy`, each in f32 for [`close_within`].
fn reference_of(block: &FusedLinear, x: &Tensor, params: &[Tensor], dy: &Tensor) -> (Vec<f32>, Vec<Vec<f32>>) {
    let spec = block.spec();
    let params_h = Params::from_flat(spec, params.iter().map(host_tensor).collect()).unwrap();
    let (y, g) =
        reference::block_backward(spec, &host_tensor(x).to_f64(), &params_h.map(f64::from), &host_tensor(dy).to_f64())
            .unwrap();
    let f32s = |t: &host::Tensor<f64>| t.to_f32().into_data();
    let grads = std::iter::once(f32s(&g.x)).chain(g.params.flat().into_iter().map(f32s)).collect();
    (f32s(&y), grads)
}

/// The block written with candle's own ops, from the same parameters.
fn candle_ops(chain: &str, x: &Tensor, p: &[Tensor]) -> Tensor {
    let z = x.matmul(&p[0].t().unwrap()).unwrap().broadcast_add(&p[1]).unwrap();
    match chain {
        "groupnorm(4),swish" => {
            let gn = candle_nn::GroupNorm::new(p[2].clone(), p[3].clone(), 16, 4, 1e-5).unwrap();
            // candle's GroupNorm wants (N, C, L): L = 1 here.
            let n = gn.forward(&z.unsqueeze(2).unwrap()).unwrap().squeeze(2).unwrap();
            candle_nn::ops::silu(&n).unwrap()
        }
        "gelu" => z.gelu_erf().unwrap(),
        "bias,mul,tanh" => z.broadcast_add(&p[2]).unwrap().broadcast_mul(&p[3]).unwrap().tanh().unwrap(),
        "layernorm,swish" => {
            // Written out: candle_nn::LayerNorm's fused op has no backward.
            let c = z.broadcast_sub(&z.mean_keepdim(1).unwrap()).unwrap();
            let var = c.sqr().unwrap().mean_keepdim(1).unwrap();
            let n = c.broadcast_div(&(var + 1e-5).unwrap().sqrt().unwrap()).unwrap();
            let n = n.broadcast_mul(&p[2]).unwrap().broadcast_add(&p[3]).unwrap();
            candle_nn::ops::silu(&n).unwrap()
        }
        "tanh,sum" => z.tanh().unwrap().sum(1).unwrap(),
        other => panic!("no candle version of {other}"),
    }
}

#[test]
fn forward_and_gradients_match_candle_and_the_reference() {
    check_against_candle_and_the_reference(&Device::Cpu, Precision::Fp32);
}

/// The same on candle's CUDA device: the GPU kernels on candle's stream and buffers, in
/// FP32 and in 3xTF32 (FP32's accuracy, so the same tolerance).
#[cfg(feature = "candle-cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn on_cuda_forward_and_gradients_match_candle_and_the_reference() {
    for precision in [Precision::Fp32, Precision::Tf32x3] {
        check_against_candle_and_the_reference(&Device::new_cuda(0).unwrap(), precision);
    }
}

/// Every chain's block on `dev`: forward and every gradient through candle's autograd
/// against candle's own ops and against the f64 reference.
fn check_against_candle_and_the_reference(dev: &Device, precision: Precision) {
    let dev = dev.clone();
    let (batch, inf, outf) = (8, 32, 16);
    for chain in ["groupnorm(4),swish", "gelu", "bias,mul,tanh", "layernorm,swish", "tanh,sum"] {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
        let block = FusedLinear::from_chain(inf, outf, chain, vb).unwrap().with_precision(precision);
        let chain_name = chain;
        let chain = &format!("{chain_name} ({precision:?})");
        let chain = chain.as_str();
        // Parameters away from their initial ones/zeros so that every gradient matters.
        let names: Vec<String> = block.spec().param_specs().into_iter().map(|s| s.name).collect();
        {
            let data = varmap.data().lock().unwrap();
            for (i, n) in names.iter().enumerate().skip(2) {
                let v = &data[n];
                let shift = Tensor::randn(0f32, 0.5, v.shape(), &dev).unwrap();
                v.set(&(v.as_tensor() + shift).unwrap().affine(1.0, 0.1 * i as f64).unwrap()).unwrap();
            }
        }
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (batch, inf), &dev).unwrap()).unwrap();
        let y = block.forward(x.as_tensor()).unwrap();
        let dy = Tensor::randn(0f32, 1.0, y.shape(), &dev).unwrap();
        let grads = (&y * &dy).unwrap().sum_all().unwrap().backward().unwrap();

        let params: Vec<Tensor> = {
            let data = varmap.data().lock().unwrap();
            names.iter().map(|n| data[n].as_tensor().clone()).collect()
        };
        // candle's own ops.
        let y_c = candle_ops(chain_name, x.as_tensor(), &params);
        let grads_c = (&y_c * &dy).unwrap().sum_all().unwrap().backward().unwrap();
        close(&format!("{chain}: y vs candle"), &y, &y_c.flatten_all().unwrap().to_vec1().unwrap());
        let dx_c = grads_c.get(x.as_tensor()).unwrap_or_else(|| panic!("{chain}: no dx from candle"));
        close(
            &format!("{chain}: dx vs candle"),
            grads.get(x.as_tensor()).unwrap(),
            &dx_c.flatten_all().unwrap().to_vec1().unwrap(),
        );
        for (n, p) in names.iter().zip(&params) {
            let want = grads_c.get(p).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            close(&format!("{chain}: d{n} vs candle"), grads.get(p).expect("a gradient for every parameter"), &want);
        }

        // The f64 reference.
        let (y_ref, g_ref) = reference_of(&block, x.as_tensor(), &params, &dy);
        close(&format!("{chain}: y vs reference"), &y, &y_ref);
        close(&format!("{chain}: dx vs reference"), grads.get(x.as_tensor()).unwrap(), &g_ref[0]);
        for ((n, p), g) in names.iter().zip(&params).zip(&g_ref[1..]) {
            close(&format!("{chain}: d{n} vs reference"), grads.get(p).unwrap(), g);
        }
    }
}

#[test]
fn bf16_runs_through_f32() {
    let dev = Device::Cpu;
    let varmap = VarMap::new();
    let block = FusedLinear::from_chain(32, 16, "gelu", VarBuilder::from_varmap(&varmap, DType::BF16, &dev)).unwrap();
    let x = Tensor::randn(0f32, 1.0, (4, 32), &dev).unwrap().to_dtype(DType::BF16).unwrap();
    let y = block.forward(&x).unwrap();
    assert_eq!((y.dtype(), y.dims()), (DType::BF16, &[4usize, 16][..]));
    let grads = y.to_dtype(DType::F32).unwrap().sum_all().unwrap().backward().unwrap();
    assert!(grads.get(block.weight()).is_some(), "the bf16 weight gets a gradient");
}

fn err_of(r: candle_core::Result<Tensor>) -> String {
    match r {
        Ok(t) => panic!("expected an error, got a tensor of shape {:?}", t.dims()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_dtype_and_shapes_are_clear_errors() {
    let dev = Device::Cpu;
    let varmap = VarMap::new();
    let block =
        FusedLinear::from_chain(32, 16, "groupnorm(4),swish", VarBuilder::from_varmap(&varmap, DType::F32, &dev))
            .unwrap();

    let e = err_of(block.forward(&Tensor::zeros((4, 32), DType::F64, &dev).unwrap()));
    assert!(e.contains("dtype F64"), "{e}");
    let e = err_of(block.forward(&Tensor::zeros((4, 32), DType::U32, &dev).unwrap()));
    assert!(e.contains("dtype U32"), "{e}");
    let e = err_of(block.forward(&Tensor::zeros((4, 32), DType::BF16, &dev).unwrap()));
    assert!(e.contains("lin.weight has dtype F32 but x has BF16"), "{e}");

    let e = err_of(block.forward(&Tensor::zeros((4, 31), DType::F32, &dev).unwrap()));
    assert!(e.contains("shape (batch >= 1, 32)") && e.contains("[4, 31]"), "{e}");
    let e = err_of(block.forward(&Tensor::zeros((2, 4, 32), DType::F32, &dev).unwrap()));
    assert!(e.contains("[2, 4, 32]"), "{e}");
    let e = err_of(block.forward(&Tensor::zeros((0, 32), DType::F32, &dev).unwrap()));
    assert!(e.contains("[0, 32]"), "{e}");

    // A weight file whose tensor has the wrong shape is refused when the block is built.
    let bad = VarMap::new();
    bad.get((16, 30), "lin.weight", candle_nn::Init::Const(0.0), DType::F32, &dev).unwrap();
    let r = FusedLinear::from_chain(32, 16, "gelu", VarBuilder::from_varmap(&bad, DType::F32, &dev));
    assert!(r.is_err(), "a (16, 30) lin.weight for Linear(32, 16)");
    // And a chain that does not parse.
    let r = FusedLinear::from_chain(32, 16, "groupnorm(5)", VarBuilder::from_varmap(&VarMap::new(), DType::F32, &dev));
    assert!(r.unwrap_err().to_string().contains("groupnorm(5)"));
}

#[test]
fn weights_load_from_safetensors_by_pytorch_name() {
    let dev = Device::Cpu;
    let varmap = VarMap::new();
    let block =
        FusedLinear::from_chain(32, 16, "groupnorm(4),swish", VarBuilder::from_varmap(&varmap, DType::F32, &dev))
            .unwrap();
    let path = std::env::temp_dir().join(format!("fused-linear-candle-{}.safetensors", std::process::id()));
    varmap.save(&path).unwrap();
    // SAFETY: the file is written above and not modified while mapped.
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[&path], DType::F32, &dev) }.unwrap();
    let loaded = FusedLinear::from_chain(32, 16, "groupnorm(4),swish", vb).unwrap();
    let x = Tensor::randn(0f32, 1.0, (4, 32), &dev).unwrap();
    let (a, b) = (block.forward(&x).unwrap(), loaded.forward(&x).unwrap());
    std::fs::remove_file(&path).unwrap();
    let mut names: Vec<String> = varmap.data().lock().unwrap().keys().cloned().collect();
    names.sort();
    assert_eq!(names, ["gn.bias", "gn.weight", "lin.bias", "lin.weight"]);
    close("y from the safetensors file", &a, &b.flatten_all().unwrap().to_vec1().unwrap());
}

/// A 16-bit model on CUDA runs in its type: `y` and every gradient come out in it, and
/// agree with the f64 reference computed from the same 16-bit values. The GEMMs' products
/// of 16-bit operands are exact in their FP32 sums; what is left is the rounding of `y`
/// (2^-9 relative in bf16) and of `dz` before the `dX` and `dW` GEMMs, each value off by
/// at most 2^-9: 2e-2 of the largest magnitude leaves room for sums of such errors over
/// 16 rows or 64 features (f16's are 8x finer).
#[cfg(feature = "candle-cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn on_cuda_bf16_and_f16_tensors_run_in_their_type() {
    let dev = Device::new_cuda(0).unwrap();
    let (batch, inf, outf) = (16, 64, 32);
    for dtype in [DType::BF16, DType::F16] {
        for chain in ["groupnorm(4),swish", "gelu", "bias,mul,tanh", "tanh,sum"] {
            let what = format!("{chain} ({dtype:?})");
            let varmap = VarMap::new();
            let block =
                FusedLinear::from_chain(inf, outf, chain, VarBuilder::from_varmap(&varmap, dtype, &dev)).unwrap();
            let names: Vec<String> = block.spec().param_specs().into_iter().map(|s| s.name).collect();
            {
                let data = varmap.data().lock().unwrap();
                for (i, n) in names.iter().enumerate().skip(2) {
                    let v = &data[n];
                    let shift = Tensor::randn(0f32, 0.5, v.shape(), &dev).unwrap().to_dtype(dtype).unwrap();
                    v.set(&(v.as_tensor() + shift).unwrap().affine(1.0, 0.1 * i as f64).unwrap()).unwrap();
                }
            }
            let x = Tensor::randn(0f32, 1.0, (batch, inf), &dev).unwrap().to_dtype(dtype).unwrap();
            let x = Var::from_tensor(&x).unwrap();
            let y = block.forward(x.as_tensor()).unwrap();
            assert_eq!(y.dtype(), dtype, "{what}: y's dtype");
            let dy = Tensor::randn(0f32, 1.0, y.shape(), &dev).unwrap().to_dtype(dtype).unwrap();
            let grads = (&y * &dy).unwrap().sum_all().unwrap().backward().unwrap();
            let params: Vec<Tensor> = {
                let data = varmap.data().lock().unwrap();
                names.iter().map(|n| data[n].as_tensor().clone()).collect()
            };
            let (y_ref, g_ref) = reference_of(&block, x.as_tensor(), &params, &dy);
            close_within(&format!("{what}: y"), &y, &y_ref, 2e-2);
            let dx = grads.get(x.as_tensor()).unwrap();
            assert_eq!(dx.dtype(), dtype, "{what}: dx's dtype");
            close_within(&format!("{what}: dx"), dx, &g_ref[0], 2e-2);
            for ((n, p), g) in names.iter().zip(&params).zip(&g_ref[1..]) {
                let got = grads.get(p).expect("a gradient for every parameter");
                assert_eq!(got.dtype(), dtype, "{what}: d{n}'s dtype");
                close_within(&format!("{what}: d{n}"), got, g, 2e-2);
            }
        }
    }
}

/// An input that tracks no gradient (a first layer's data) on CUDA: the backward skips
/// `dx` (and its GEMM) and gives every parameter the gradient a tracked input gets.
#[cfg(feature = "candle-cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn on_cuda_an_input_without_gradient_keeps_the_parameter_gradients() {
    let dev = Device::new_cuda(0).unwrap();
    for dtype in [DType::F32, DType::BF16] {
        let varmap = VarMap::new();
        let block =
            FusedLinear::from_chain(64, 32, "groupnorm(4),swish", VarBuilder::from_varmap(&varmap, dtype, &dev))
                .unwrap();
        let x = Tensor::randn(0f32, 1.0, (16, 64), &dev).unwrap().to_dtype(dtype).unwrap();
        let dy = Tensor::randn(0f32, 1.0, (16, 32), &dev).unwrap().to_dtype(dtype).unwrap();
        let tracked = Var::from_tensor(&x).unwrap();
        let g_tracked =
            (block.forward(tracked.as_tensor()).unwrap() * &dy).unwrap().sum_all().unwrap().backward().unwrap();
        let g_plain = (block.forward(&x).unwrap() * &dy).unwrap().sum_all().unwrap().backward().unwrap();
        assert!(
            g_tracked.get(tracked.as_tensor()).is_some() && g_plain.get(&x).is_none(),
            "{dtype:?}: dx only where tracked"
        );
        for p in std::iter::once(block.weight()).chain(block.others()) {
            let (a, b) = (g_tracked.get(p).unwrap(), g_plain.get(p).unwrap());
            let d = (a.to_dtype(DType::F32).unwrap() - b.to_dtype(DType::F32).unwrap())
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert_eq!(d, 0.0, "{dtype:?}: a parameter's gradient changed without dx");
        }
    }
}

/// FP8 through candle (`with_precision(Precision::Fp8)`, the weight quantised per call):
/// f32 and bf16 blocks on CUDA, `y` and every gradient against the f64 reference within
/// FP8's norm-wise tolerance (`host::precision::FP8_REL`, docs/NUMERICS.md), and visibly
/// rounded (further from it than 3xTF32).
#[cfg(feature = "candle-cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn on_cuda_fp8_precision_stays_within_its_tolerance() {
    use host::check::compare_f32;
    let dev = Device::new_cuda(0).unwrap();
    for dtype in [DType::F32, DType::BF16] {
        let varmap = VarMap::new();
        let block = FusedLinear::from_chain(64, 32, "gelu", VarBuilder::from_varmap(&varmap, dtype, &dev))
            .unwrap()
            .with_precision(Precision::Fp8);
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (32, 64), &dev).unwrap().to_dtype(dtype).unwrap()).unwrap();
        let y = block.forward(x.as_tensor()).unwrap();
        let dy = Tensor::randn(0f32, 1.0, y.shape(), &dev).unwrap().to_dtype(dtype).unwrap();
        let grads = (&y * &dy).unwrap().sum_all().unwrap().backward().unwrap();
        let params: Vec<Tensor> = std::iter::once(block.weight()).chain(block.others()).cloned().collect();
        let (y_ref, g_ref) = reference_of(&block, x.as_tensor(), &params, &dy);
        let check = |what: &str, got: &Tensor, want: &[f32]| {
            let want: Vec<f64> = want.iter().map(|&v| f64::from(v)).collect();
            let c = compare_f32(host_tensor(got).data(), &want);
            println!("fp8 {dtype:?} {what}: rel {:.2e}", c.rel);
            assert!(c.passes(host::precision::FP8_REL), "fp8 {dtype:?} {what}: {c:?}");
            c.rel
        };
        let rel_y = check("y", &y, &y_ref);
        assert!(rel_y > 1e-3, "fp8 {dtype:?}: y {rel_y:e} from f64, not rounded to e4m3?");
        check("dx", grads.get(x.as_tensor()).unwrap(), &g_ref[0]);
        for (p, g) in params.iter().zip(&g_ref[1..]) {
            check("a parameter's gradient", grads.get(p).unwrap(), g);
        }
    }
}

/// On the GPU the block neither synchronises the host with the device nor copies its
/// inputs or outputs: its forward and its backward (through candle's autograd) return
/// while the stream is still busy with work queued before them, and the memory they take
/// from the device's pool at their peak is what they must hold. The forward: `y` and its
/// workspace (a few `y`-sized buffers, far less than a copy of `x` or `lin.weight`). The
/// backward: `dx` and `dW`, and candle's accumulation of each gradient into its store (a
/// `zeros_like` and the sum, two more buffers of the larger, `x`'s size); a copy of `x` or
/// of `dx` would add another 8 MiB.
#[cfg(feature = "candle-cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn on_cuda_no_synchronisation_and_no_copies() {
    use cudarc::driver::sys;
    let dev = Device::new_cuda(0).unwrap();
    let cuda = dev.as_cuda_device().unwrap().clone();
    let stream = cuda.cuda_stream();
    // x (8 MiB) and lin.weight (2 MiB) much larger than y (64 KiB).
    let (batch, inf, outf) = (256, 8192, 64);
    let varmap = VarMap::new();
    let block =
        FusedLinear::from_chain(inf, outf, "groupnorm(8),swish", VarBuilder::from_varmap(&varmap, DType::F32, &dev))
            .unwrap();
    let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (batch, inf), &dev).unwrap()).unwrap();
    let dy = Tensor::randn(0f32, 1.0, (batch, outf), &dev).unwrap();
    let step = || {
        let y = block.forward(x.as_tensor()).unwrap();
        (&y * &dy).unwrap().sum_all().unwrap().backward().unwrap()
    };
    // Once for the modules, tables and the pool's first growth.
    step();
    dev.synchronize().unwrap();

    // Synchronisation: ~tens of milliseconds of candle matmuls queued first.
    let a = Tensor::randn(0f32, 1.0, (4096, 4096), &dev).unwrap();
    dev.synchronize().unwrap();
    let busy_start = std::time::Instant::now();
    let busy: Vec<Tensor> = (0..16).map(|_| a.matmul(&a).unwrap()).collect();
    let queued = std::time::Instant::now();
    let grads = step();
    let returned = queued.elapsed();
    // SAFETY: candle's live stream; the query only reads its state.
    let status = unsafe { sys::cuStreamQuery(stream.cu_stream()) };
    dev.synchronize().unwrap();
    let drained = busy_start.elapsed();
    println!("forward + backward returned after {returned:?}; the stream drained after {drained:?} ({status:?})");
    assert_eq!(
        status,
        sys::CUresult::CUDA_ERROR_NOT_READY,
        "forward + backward returned after the stream drained: something synchronised the host"
    );
    assert!(grads.get(x.as_tensor()).is_some());
    drop((busy, grads));

    // Copies: the pool's high-water mark over each pass.
    let mut pool = std::ptr::null_mut();
    // SAFETY: device 0's current memory pool, written into `pool`.
    unsafe { sys::cuDeviceGetMemPool(&mut pool, 0) }.result().unwrap();
    let attr = |a: sys::CUmemPool_attribute| {
        let mut v = 0u64;
        // SAFETY: a 64-bit attribute of a live pool.
        unsafe { sys::cuMemPoolGetAttribute(pool, a, (&raw mut v).cast()) }.result().unwrap();
        v
    };
    let reset_high = || {
        let mut zero = 0u64;
        // SAFETY: resetting the high-water mark takes a 64-bit zero.
        unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                (&raw mut zero).cast(),
            )
        }
        .result()
        .unwrap();
    };
    let used = || attr(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT);
    let high = || attr(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH);
    let (x_bytes, w_bytes, y_bytes) = ((batch * inf * 4) as u64, (outf * inf * 4) as u64, (batch * outf * 4) as u64);
    const MIB: u64 = 1 << 20;

    dev.synchronize().unwrap();
    let before = used();
    reset_high();
    let y = block.forward(x.as_tensor()).unwrap();
    dev.synchronize().unwrap();
    let forward_peak = high() - before;
    let loss = (&y * &dy).unwrap().sum_all().unwrap();
    dev.synchronize().unwrap();
    let before = used();
    reset_high();
    let grads = loss.backward().unwrap();
    dev.synchronize().unwrap();
    let backward_peak = high() - before;
    println!(
        "pool peak: forward {forward_peak} bytes, backward {backward_peak} bytes (x {x_bytes}, lin.weight {w_bytes}, \
         y {y_bytes})"
    );
    assert!(
        forward_peak >= y_bytes,
        "the forward's output came from the pool ({forward_peak} bytes): the check sees it"
    );
    assert!(
        forward_peak <= 4 * y_bytes + MIB,
        "the forward took {forward_peak} bytes at its peak: more than y and its workspace"
    );
    let accumulation = 2 * x_bytes.max(w_bytes);
    assert!(
        backward_peak <= x_bytes + w_bytes + accumulation + 8 * y_bytes + 2 * MIB,
        "the backward took {backward_peak} bytes at its peak: more than dx, dW, candle's accumulation of dx \
         ({accumulation} bytes) and a few y-sized buffers"
    );
    drop(grads);
}

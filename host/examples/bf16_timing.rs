//! Development timing of a bf16 model's blocks (`GpuBlock<Bf16>`) at the presets' seed
//! sizes, beside cuBLAS's bf16 GEMM (FP32 output) on the same bf16 operands, in one
//! process: forward, and forward + backward against cuBLAS's three GEMMs; with `--gemms`,
//! the backward's two GEMMs alone at M1's and M2's shapes. `host bench`
//! is the project's benchmark; this is a quick look while kernels change.
//!
//! `cargo run --release -p host --example bf16_timing [-- M1,M3 [--gemms] [--chains] [--phases]]`; with
//! `--chains`, also the forward at M2's shape with no chain and with each of its ops
//! alone (what the epilogue costs); with `--phases`, M2's training step in parts and
//! its chain backward alone (bf16 and FP32 `dy`).

use host::block::random_input;
use host::gpu::block::GpuBlock;
use host::gpu::cublas::Cublas;
use host::gpu::{DeviceTensor, DeviceVector, Gpu};
use host::tensor::Bf16;
use host::{BlockSpec, Params, Preset};
use rand::SeedableRng;
use rand::rngs::StdRng;

fn median(gpu: &Gpu, mut work: impl FnMut() -> host::Result<()>) -> host::Result<f64> {
    for _ in 0..3 {
        work()?;
    }
    gpu.synchronize()?;
    let mut t = (0..15).map(|_| gpu.time_ms(&mut work)).collect::<host::Result<Vec<_>>>()?;
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

fn main() -> host::Result<()> {
    let gpu = Gpu::open(0)?;
    let cublas = Cublas::new(&gpu, false)?;
    let only = std::env::args().nth(1).unwrap_or_default();
    println!("model  fwd ms  cublas  ratio | f+b ms  cublas3  ratio | path");
    for p in Preset::ALL {
        if !only.is_empty() && !only.split(',').any(|m| m == p.to_string()) {
            continue;
        }
        let (b, i, o) = p.seed_shape();
        let spec = BlockSpec::new(i, o, p.chain())?;
        let mut rng = StdRng::seed_from_u64(1);
        let params = Params::init(&spec, &mut rng).map(Bf16::from_f32);
        let block = GpuBlock::new_bf16(&gpu, &spec, &params)?;
        let x = gpu.upload(&random_input(b, i, &mut rng)?.to_bf16())?;
        let out = spec.output_shape(b);
        let dy = gpu.upload(&random_input(1, out.iter().product(), &mut rng)?.reshape(&out)?.to_bf16())?;
        let mut ws = block.workspace_with(&gpu, b, false)?;
        let fwd = median(&gpu, || block.forward_into(&gpu, &x, &mut ws, None))?;
        let fb = median(&gpu, || {
            let (_, saved) = block.forward_train(&gpu, &x, false)?;
            block.backward(&gpu, &x, saved, &dy).map(drop)
        })?;
        let w = &block.params.linear_weight;
        let mut y: DeviceTensor = gpu.alloc(&[b, o])?;
        let dz = gpu.upload(&random_input(b, o, &mut rng)?.to_bf16())?;
        let (mut dx, mut dw): (DeviceTensor, DeviceTensor) = (gpu.alloc(&[b, i])?, gpu.alloc(&[o, i])?);
        let c1 = median(&gpu, || cublas.forward(&x, w, &mut y))?;
        let c3 = median(&gpu, || {
            cublas.forward(&x, w, &mut y)?;
            cublas.grad_input(&dz, w, &mut dx)?;
            cublas.grad_weight(&dz, &x, &mut dw)
        })?;
        let path = block.describe(&gpu, &block.plan(&gpu, b));
        println!("{p}  {fwd:.3}  {c1:.3}  {:.2} | {fb:.3}  {c3:.3}  {:.2} | {path}", fwd / c1, fb / c3);
    }
    if std::env::args().any(|a| a == "--phases") {
        // M2's training step in parts: the forward with and without saving `z`, and the
        // backward (forward+backward less the training forward).
        let (b, i, o) = Preset::M2.seed_shape();
        let spec = BlockSpec::new(i, o, Preset::M2.chain())?;
        let mut rng = StdRng::seed_from_u64(4);
        let params = Params::init(&spec, &mut rng).map(Bf16::from_f32);
        let block = GpuBlock::new_bf16(&gpu, &spec, &params)?;
        let x = gpu.upload(&random_input(b, i, &mut rng)?.to_bf16())?;
        let dy = gpu.upload(&random_input(b, o, &mut rng)?.to_bf16())?;
        let mut ws = block.workspace_with(&gpu, b, false)?;
        let fwd = median(&gpu, || block.forward_into(&gpu, &x, &mut ws, None))?;
        let train = median(&gpu, || block.forward_train(&gpu, &x, false).map(drop))?;
        let fb = median(&gpu, || {
            let (_, saved) = block.forward_train(&gpu, &x, false)?;
            block.backward(&gpu, &x, saved, &dy).map(drop)
        })?;
        println!(
            "M2 phases (ms): forward {fwd:.3}, forward saving z {train:.3}, backward {:.3}, forward+backward {fb:.3}",
            fb - train
        );
        // The chain backward alone (FP32 `z`), on bf16 `dy` / `dz` and on FP32 ones.
        use host::gpu::epilogue::{DeviceChain, lanes::epilogue_tiles_backward};
        let params32 = params.map(Bf16::to_f32);
        let ops = params32
            .ops
            .iter()
            .map(|p| p.iter().map(|t| Ok(gpu.upload(t)?.into())).collect())
            .collect::<host::Result<Vec<_>>>()?;
        let chain = DeviceChain::new(&gpu, &[], &spec.chain.0, &ops)?;
        // The 16-bit kernel reads the model's own bf16 vectors.
        let ops16 = params
            .ops
            .iter()
            .map(|p| p.iter().map(|t| Ok(DeviceVector::Bf16(gpu.upload(t)?))).collect())
            .collect::<host::Result<Vec<_>>>()?;
        let chain16 = DeviceChain::new(&gpu, &[], &spec.chain.0, &ops16)?;
        let z: DeviceTensor = gpu.upload(&random_input(b, o, &mut rng)?)?;
        let dy32: DeviceTensor = gpu.upload(&random_input(b, o, &mut rng)?)?;
        let t16 = median(&gpu, || epilogue_tiles_backward(&gpu, &chain16, &z, &dy, None).map(drop))?;
        let t32 = median(&gpu, || epilogue_tiles_backward(&gpu, &chain, &z, &dy32, None).map(drop))?;
        println!("M2 chain backward alone (ms): bf16 dy and dz {t16:.3}, FP32 {t32:.3}");
    }
    if std::env::args().any(|a| a == "--gemms") {
        // The backward's two GEMMs alone at M1's and M2's shapes, on bf16 tensors as stored.
        use host::gpu::Dtype;
        use host::gpu::dispatch::{Role, Storage, route};
        use host::gpu::gemm::tma::launch_half;
        for p in [Preset::M1, Preset::M2] {
            let (m, k, n) = p.seed_shape();
            let mut rng = StdRng::seed_from_u64(3);
            let up = |r: usize, c: usize, rng: &mut StdRng| gpu.upload(&random_input(r, c, rng)?.to_bf16());
            let (x, w, dz) = (up(m, k, &mut rng)?, up(n, k, &mut rng)?, up(m, n, &mut rng)?);
            let (mut dx, mut dw) = (gpu.alloc_as::<Bf16>(&[m, k])?, gpu.alloc_as::<Bf16>(&[n, k])?);
            let none = (None, None);
            let s = gpu.stream();
            let as_stored =
                |role| route(host::Precision::Bf16, role, (m, n, k), Storage::bf16(Dtype::Bf16, true), true);
            let (dx_route, dw_route) = (as_stored(Role::GradInput), as_stored(Role::GradWeight));
            let t_dx = median(&gpu, || {
                let ab = (&*dz.buf, &*w.buf);
                launch_half(&gpu, s, &dx_route, ab, (m, k, n), (n, k), none, &mut dx, None, 1)
            })?;
            let t_dw = median(&gpu, || {
                let ab = (&*dz.buf, &*x.buf);
                launch_half(&gpu, s, &dw_route, ab, (n, k, m), (n, k), none, &mut dw, None, 1)
            })?;
            let (c_dx, c_dw) = (
                median(&gpu, || cublas.grad_input(&dz, &w, &mut dx))?,
                median(&gpu, || cublas.grad_weight(&dz, &x, &mut dw))?,
            );
            println!(
                "{p} shape, bf16 GEMMs alone (ms): dX ours {t_dx:.3} cuBLAS {c_dx:.3}; dW ours {t_dw:.3} cuBLAS {c_dw:.3}"
            );
        }
    }
    if std::env::args().any(|a| a == "--chains") {
        let (b, i, o) = Preset::M2.seed_shape();
        let mut rng = StdRng::seed_from_u64(2);
        let x = gpu.upload(&random_input(b, i, &mut rng)?.to_bf16())?;
        for chain in ["", "swish", "bias", "groupnorm(64)", "swish,bias,groupnorm(64)"] {
            let spec = BlockSpec::new(i, o, chain.parse()?)?;
            let params = Params::init(&spec, &mut rng).map(Bf16::from_f32);
            let block = GpuBlock::new_bf16(&gpu, &spec, &params)?;
            let mut ws = block.workspace_with(&gpu, b, false)?;
            let fwd = median(&gpu, || block.forward_into(&gpu, &x, &mut ws, None))?;
            println!("M2 shape, chain `{chain}`: forward {fwd:.3} ms");
        }
    }
    Ok(())
}

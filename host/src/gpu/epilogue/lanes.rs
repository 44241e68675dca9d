//! Launchers of the tile-wise chain kernels: `epilogue_tiles_backward`
//! (kernels-gpu/src/epilogue/lanes.rs), the backward of a chain the GEMM's epilogue can
//! fuse, tile by tile, and `epilogue_split_tiles` (kernels-gpu/src/gemm/staged.rs), that
//! chain forward on split-K's partial products.

use super::super::dispatch::{split_sums_kernel, split_tiles_kernel, tiles_backward_kernel};
use super::super::{DeviceElement, DeviceTensor, Dtype, Gpu, VectorArg, VectorWord, launched};
use super::{DeviceChain, Widened};
use crate::error::{Error, Result};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use kernel_abi::epilogue::{TILE_THREADS, TILES_BACKWARD_BLOCKS_PER_SM, tiles_backward_smem_bytes};
use kernel_abi::gemm_fma::{MAX_GRAD_SLOTS, MAX_TILE_OPS};

/// `y = chain(sum_s z[s] + bias)` over split-K's partial products `z (splits, rows, n)`
/// of a chain the GEMM's epilogue can fuse, the sum with the bias into `save_z` if
/// given: 16 rows of 128 columns per block. Without a chain, a bias and `save_z`, the
/// sum alone (a split `dX`), on `split_sums*`.
pub fn epilogue_split_tiles<T: DeviceElement>(
    gpu: &Gpu,
    chain: Option<&DeviceChain>,
    z: &DeviceTensor,
    bias: Option<VectorArg<'_>>,
    y: &mut DeviceTensor<T>,
    save_z: Option<&mut DeviceTensor>,
) -> Result<()> {
    let [splits, rows, n] = z.shape[..] else {
        return Err(Error::Shape(format!("split-K partial products must be 3-D, got {:?}", z.shape)));
    };
    if y.shape != [rows, n]
        || bias.is_some_and(|b| b.len != n)
        || save_z.as_ref().is_some_and(|s| s.shape != [rows, n])
        || rows == 0
        || n == 0
        || z.len() > u32::MAX as usize
    {
        return Err(Error::Shape(format!(
            "split-K sums of {splits} x {rows} x {n} into {:?} with {:?} biases",
            y.shape,
            bias.map(|b| b.len)
        )));
    }
    let plain = chain.is_none() && bias.is_none() && save_z.is_none();
    let kernel = if plain { split_sums_kernel(T::DTYPE) } else { split_tiles_kernel(T::DTYPE) };
    let func = gpu.function(kernel)?;
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(128) as u32, rows.div_ceil(16) as u32, 1),
        block_dim: (TILE_THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let n_ops = chain.map_or(0, |c| c.ops.len()) as u32;
    let (splits, rows, n, null) = (splits as u32, rows as u32, n as u32, 0u64);
    let mut launch = gpu.stream().launch_builder(&func);
    launch.arg(&z.buf).arg(&splits);
    let bias = bias.map_or(VectorWord::NONE, |b| b.word);
    launch.arg(&bias);
    launch.arg(&mut y.buf);
    match save_z {
        Some(s) => launch.arg(&mut s.buf),
        None => launch.arg(&null),
    };
    launch.arg(&rows).arg(&n);
    match chain {
        Some(c) => launch.arg(&c.descs),
        None => launch.arg(&null),
    };
    launch.arg(&n_ops);
    // SAFETY: matches the kernel's signature; z holds splits * rows * n values, y and
    // save_z rows * n, the bias n; the chain is fusable (the caller's plan) and was
    // validated against n.
    launched(kernel, unsafe { launch.launch(cfg) })
}

/// Whether the tile-wise backward can take `chain` (its ops must also be fusable).
pub fn fits(chain: &DeviceChain) -> bool {
    chain.grad_slots <= MAX_GRAD_SLOTS && chain.ops.len() <= MAX_TILE_OPS
}

/// The small gradients' own vectors (the Linear bias's, then each chain parameter's, in
/// slot order) for the tile-wise backward to write its sums into, each rounded once
/// into its own type: with one row block its sums are the gradients, with more
/// `sum_partials_to` adds them there. No launch copies them out of the slots after.
pub struct GradOuts {
    words: [u64; MAX_GRAD_SLOTS],
    count: usize,
    len: usize,
}

impl GradOuts {
    /// The vectors by word and length (`VectorWord::of_f32`, `DeviceVector::word`);
    /// `None` where they differ in length, are empty, or are more than the kernels take.
    ///
    /// # Safety
    /// Each word names a vector of its length, live and written by nothing else until
    /// the stream has run the backward that is given these.
    pub unsafe fn new(vectors: impl IntoIterator<Item = (VectorWord, usize)>) -> Option<GradOuts> {
        let (mut words, mut count, mut len) = ([0; MAX_GRAD_SLOTS], 0, None);
        for (word, l) in vectors {
            if count == MAX_GRAD_SLOTS || len.is_some_and(|len| len != l) || word == VectorWord::NONE {
                return None;
            }
            len = Some(l);
            words[count] = word.0;
            count += 1;
        }
        len.filter(|&l| l > 0).map(|len| GradOuts { words, count, len })
    }
}

/// `dz`, and the parameter-gradient sums `(grad_slots, n)` (slot 0 the Linear bias, then
/// each op parameter in chain order) from the saved chain input `z` and `dy`, both
/// `(rows, n)`; `None` for the sums where `outs` took them (one vector per slot, `n`
/// values each; otherwise `outs` is not used). A 16-bit `dy` takes a chain whose
/// vectors are all stored in its type ([`DeviceChain::params_stored_as`]).
pub fn epilogue_tiles_backward<G: DeviceElement>(
    gpu: &Gpu,
    chain: &DeviceChain,
    z: &DeviceTensor,
    dy: &DeviceTensor<G>,
    outs: Option<&GradOuts>,
) -> Result<(DeviceTensor<G>, Option<DeviceTensor>)> {
    // 16-bit `dy` and `dz` (a 16-bit model's): 8-byte copies of four values.
    let half = G::DTYPE != Dtype::F32;
    let kernel = tiles_backward_kernel(G::DTYPE);
    let [rows, n] = z.shape[..] else {
        return Err(Error::Shape(format!("saved chain input must be 2-D, got {:?}", z.shape)));
    };
    if dy.len() != rows * n
        || !fits(chain)
        || rows == 0
        || n == 0
        || rows * n > u32::MAX as usize
        || (half && n % 4 != 0)
    {
        return Err(Error::Shape(format!("tile-wise backward of {rows} x {n} with dy {:?}", dy.shape)));
    }
    // The FP32 kernel reads FP32 vectors: a 16-bit model's are widened here first (its
    // `dy` widened too: the caller's path where the 16-bit one does not fit). A 16-bit
    // kernel reads its own type's, as stored.
    let widened = if half {
        if !chain.params_stored_as(G::DTYPE) {
            return Err(Error::Unsupported(format!(
                "the {} tile-wise backward of a chain whose vectors are stored otherwise",
                G::NAME
            )));
        }
        None
    } else {
        chain.widened(gpu, n, None)?
    };
    let chain = Widened::chain(&widened, chain);
    // One wave of blocks, each with a long run of rows: its sums and its final
    // reduction are paid once per block. TILES_BACKWARD_BLOCKS_PER_SM fit per SM (launch
    // bounds cap the registers; shared memory allows it while slots + 2 (ops - 1) <= 10,
    // as for M1, M2 and M5); longer chains take more shared memory and fewer blocks per
    // SM, and the grid then runs as more than one wave, which is only slower.
    let col_tiles = n.div_ceil(128);
    let per_wave = TILES_BACKWARD_BLOCKS_PER_SM as usize * gpu.props.multiprocessors;
    let row_blocks = (per_wave / col_tiles).clamp(1, rows.div_ceil(16));
    // Rows per block even: a warp takes rows in pairs.
    let rows_per_block = rows.div_ceil(row_blocks).next_multiple_of(2);
    let row_blocks = rows.div_ceil(rows_per_block);
    let slots = chain.grad_slots;
    let outs = outs.filter(|o| o.count == slots && o.len == n);
    // One row block writes the gradients itself; more write partial sums first.
    let direct = outs.filter(|_| row_blocks == 1);
    let mut partials = if direct.is_some() { None } else { Some(gpu.alloc(&[row_blocks, slots, n])?) };
    let mut dz = gpu.alloc_as::<G>(&[rows, n])?;
    let func = gpu.function(kernel)?;
    let smem = tiles_backward_smem_bytes(slots, chain.ops.len());
    gpu.allow_shared(&func, kernel, smem)?;
    let cfg = LaunchConfig {
        grid_dim: (col_tiles as u32, row_blocks as u32, 1),
        block_dim: (TILE_THREADS as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let args = [rows, n, chain.ops.len(), rows_per_block].map(|v| v as u32);
    let words = direct.map_or([0; MAX_GRAD_SLOTS], |o| o.words);
    let null = 0u64;
    let mut launch = gpu.stream().launch_builder(&func);
    launch.arg(&z.buf).arg(&dy.buf).arg(&mut dz.buf);
    match partials.as_mut() {
        Some(p) => launch.arg(&mut p.buf),
        None => launch.arg(&null),
    };
    launch.arg(&args[0]).arg(&args[1]).arg(&chain.descs).arg(&args[2]).arg(&args[3]).arg(&words);
    // SAFETY: matches the kernel's signature; z, dy and dz hold rows * n; partials
    // row_blocks * slots * n, every entry written by the kernel, or (one row block) the
    // words name `slots` vectors of n values (`GradOuts`, checked above) and partials is
    // not read; the chain is fusable (the caller checked) and validated against n.
    launched(kernel, unsafe { launch.launch(cfg) })?;
    let Some(partials) = partials else { return Ok((dz, None)) };
    if let Some(o) = outs {
        // SAFETY: partials holds row_blocks * slots * n sums; the words as above.
        unsafe { super::rows::sum_partials_to(gpu, &partials, row_blocks, slots, n, &o.words)? };
        return Ok((dz, None));
    }
    let grads = super::rows::sum_partials(gpu, partials, row_blocks, slots * n)?;
    Ok((dz, Some(grads.reshape(&[slots, n])?)))
}

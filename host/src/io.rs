//! safetensors files: inputs (`x`), outputs (`y`), parameters (PyTorch names, see
//! `chain.rs`) and gradients. Tensors are read as f32; F64, F16 and BF16 tensors are
//! converted on reading (as `load_state_dict` copies them into f32 parameters; a BF16
//! value is exact in f32, and the CLI tells which tensors were BF16: a bf16 model's
//! stay bf16 on the GPU), any other dtype is an error naming the tensor. Files are
//! written as F32, or BF16 where the inputs were (`write_typed`).

use crate::error::{Error, Result};
use crate::tensor::{Bf16, Tensor};
use safetensors::{Dtype, SafeTensors, tensor::TensorView};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// What a file says of the block it belongs to, in its safetensors metadata: the chain
/// (canonical form) and the precision it ran in. Written by the CLI's output files and
/// `fused_linear.save`; checked when a weights file is read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockMeta {
    pub chain: String,
    pub precision: String,
}

impl BlockMeta {
    /// The metadata keys.
    pub const CHAIN: &'static str = "fused_linear.chain";
    pub const PRECISION: &'static str = "fused_linear.precision";

    fn to_map(&self) -> HashMap<String, String> {
        HashMap::from([(Self::CHAIN.into(), self.chain.clone()), (Self::PRECISION.into(), self.precision.clone())])
    }
}

/// An opened safetensors file: its bytes, parsed on each lookup.
pub struct TensorFile {
    path: PathBuf,
    bytes: Vec<u8>,
}

impl TensorFile {
    /// Reads and validates the file (header, offsets, sizes); tensors are read on demand.
    pub fn open(path: &Path) -> Result<TensorFile> {
        if path.is_dir() {
            return Err(Error::file(path, "is a directory, not a safetensors file"));
        }
        let bytes = std::fs::read(path).map_err(|e| Error::file(path, format!("cannot read: {e}")))?;
        SafeTensors::deserialize(&bytes)
            .map_err(|e| Error::file(path, format!("not a valid safetensors file: {e}")))?;
        Ok(TensorFile { path: path.to_path_buf(), bytes })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The tensor `name`, which must exist, have `shape` and a floating-point dtype
    /// (converted to f32).
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor<f32>> {
        let st = SafeTensors::deserialize(&self.bytes).expect("validated in open");
        let view = st.tensor(name).map_err(|_| {
            let mut names = st.names();
            names.sort();
            Error::tensor(name, format!("missing from {} (it has: {})", self.path.display(), names.join(", ")))
        })?;
        if view.shape() != shape {
            return Err(Error::tensor(
                name,
                format!("in {} has shape {:?}; expected {:?}", self.path.display(), view.shape(), shape),
            ));
        }
        let data = to_f32(view.dtype(), view.data()).ok_or_else(|| {
            Error::tensor(
                name,
                format!(
                    "in {} has dtype {:?}; expected F32 (or F64, F16, BF16, converted to f32)",
                    self.path.display(),
                    view.dtype()
                ),
            )
        })?;
        Tensor::new(shape, data)
    }

    /// Whether tensor `name` is stored as bf16 (a bf16 model's), if present.
    pub fn is_bf16(&self, name: &str) -> Option<bool> {
        let st = SafeTensors::deserialize(&self.bytes).ok()?;
        st.tensor(name).ok().map(|v| v.dtype() == Dtype::BF16)
    }

    /// The block the file says it belongs to (its metadata), if it says.
    pub fn block_meta(&self) -> Option<BlockMeta> {
        let (_, meta) = SafeTensors::read_metadata(&self.bytes).ok()?;
        let map = meta.metadata().as_ref()?;
        let chain = map.get(BlockMeta::CHAIN)?.clone();
        let precision = map.get(BlockMeta::PRECISION).cloned().unwrap_or_default();
        Some(BlockMeta { chain, precision })
    }

    /// Shape of tensor `name`, if present (to learn a batch size from an input file).
    pub fn shape_of(&self, name: &str) -> Option<Vec<usize>> {
        let st = SafeTensors::deserialize(&self.bytes).ok()?;
        st.tensor(name).ok().map(|v| v.shape().to_vec())
    }
}

/// Little-endian `bytes` of `dtype` as f32 (rounded to nearest for F64), or `None`
/// for a dtype that is not floating point. safetensors checked the length.
fn to_f32(dtype: Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    Some(match dtype {
        Dtype::F32 => bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
        Dtype::F64 => {
            bytes.chunks_exact(8).map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")) as f32).collect()
        }
        Dtype::F16 => bytes.chunks_exact(2).map(|b| f16_to_f32(u16::from_le_bytes([b[0], b[1]]))).collect(),
        // bfloat16 is the upper half of an f32.
        Dtype::BF16 => {
            bytes.chunks_exact(2).map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)).collect()
        }
        _ => return None,
    })
}

/// IEEE half precision to f32 (exact: every f16 is an f32).
fn f16_to_f32(h: u16) -> f32 {
    let sign = if h & 0x8000 != 0 { -1.0f32 } else { 1.0 };
    let exponent = (h >> 10) & 0x1f;
    let mantissa = (h & 0x3ff) as f32;
    match exponent {
        0 => sign * mantissa * 2f32.powi(-24), // zero and subnormals
        0x1f if mantissa == 0.0 => sign * f32::INFINITY,
        0x1f => f32::NAN,
        e => sign * (1.0 + mantissa / 1024.0) * 2f32.powi(e as i32 - 15),
    }
}

/// Refuses an output path that cannot be written, before the work that produces it:
/// a directory, or a file in a directory that does not exist.
pub fn check_output_path(path: &Path) -> Result<()> {
    if path.is_dir() {
        return Err(Error::file(path, "is a directory; give a file name"));
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if !dir.is_dir() {
        return Err(Error::file(path, format!("cannot write: the directory {} does not exist", dir.display())));
    }
    // Writable (permissions, a read-only file system): tried with the file the writer
    // fills first, removed again, so a long computation never ends in a refused write.
    let partial = partial_path(path);
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&partial)
        .map_err(|e| Error::file(path, format!("cannot write here: {e}")))?;
    let _ = std::fs::remove_file(&partial);
    Ok(())
}

/// Where [`write_typed`] writes before renaming over `path`.
fn partial_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".partial");
    name.into()
}

/// Writes named f32 tensors to `path`: into `<path>.partial` first, renamed over
/// `path` only once complete, so a failure never leaves a half-written `path`.
pub fn write(path: &Path, tensors: &[(&str, &Tensor<f32>)]) -> Result<()> {
    let typed: Vec<(&str, &Tensor<f32>, bool)> = tensors.iter().map(|&(n, t)| (n, t, false)).collect();
    write_typed(path, &typed, None)
}

/// [`write()`], each tensor as F32 or, where its flag says, as BF16 (rounded to nearest:
/// exact for values that are bf16 already, as a bf16 model's outputs are), with the
/// block's [`BlockMeta`] in the file's metadata where given.
pub fn write_typed(path: &Path, tensors: &[(&str, &Tensor<f32>, bool)], meta: Option<&BlockMeta>) -> Result<()> {
    check_output_path(path)?;
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|&(_, t, bf16)| match bf16 {
            true => t.data().iter().flat_map(|&v| Bf16::from_f32(v).0.to_le_bytes()).collect(),
            false => t.data().iter().flat_map(|v| v.to_le_bytes()).collect(),
        })
        .collect();
    let mut views = HashMap::new();
    for (&(name, t, bf16), b) in tensors.iter().zip(&bytes) {
        let dtype = if bf16 { Dtype::BF16 } else { Dtype::F32 };
        let view = TensorView::new(dtype, t.shape().to_vec(), b).map_err(|e| Error::tensor(name, e.to_string()))?;
        views.insert(name.to_string(), view);
    }
    let data = safetensors::serialize(views, meta.map(BlockMeta::to_map))
        .map_err(|e| Error::file(path, format!("cannot serialise: {e}")))?;
    let tmp = partial_path(path);
    let written = std::fs::write(&tmp, data)
        .map_err(|e| Error::file(&tmp, format!("cannot write: {e}")))
        .and_then(|()| std::fs::rename(&tmp, path).map_err(|e| Error::file(path, format!("cannot write: {e}"))));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_names_what_is_wrong() {
        let dir = std::env::temp_dir().join(format!("io-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.safetensors");
        let a = Tensor::new(&[2, 3], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.5]).unwrap();
        write(&path, &[("lin.weight", &a)]).unwrap();
        let f = TensorFile::open(&path).unwrap();
        assert_eq!(f.get("lin.weight", &[2, 3]).unwrap(), a);
        let e = f.get("lin.bias", &[3]).unwrap_err().to_string();
        assert!(e.contains("`lin.bias`") && e.contains("missing") && e.contains("lin.weight"), "{e}");
        let e = f.get("lin.weight", &[3, 2]).unwrap_err().to_string();
        assert!(e.contains("shape [2, 3]; expected [3, 2]"), "{e}");
        std::fs::write(&path, b"not a tensor file").unwrap();
        let e = TensorFile::open(&path).err().unwrap().to_string();
        assert!(e.contains("not a valid safetensors file"), "{e}");
        let e = TensorFile::open(&dir).err().unwrap().to_string();
        assert!(e.contains("is a directory"), "{e}");
        let e = write(&dir.join("no-such-dir").join("y.safetensors"), &[("y", &a)]).unwrap_err().to_string();
        assert!(e.contains("no-such-dir does not exist"), "{e}");
        assert!(
            std::fs::read_dir(&dir).unwrap().all(|f| !f.unwrap().file_name().to_string_lossy().ends_with(".partial"))
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn half_precisions_convert_exactly() {
        // 1.0, -2.0, 65504 (largest), 2^-24 (smallest subnormal), 2^-14 (smallest normal), inf.
        let halves = [0x3c00u16, 0xc000, 0x7bff, 0x0001, 0x0400, 0x7c00, 0xfc00];
        let want = [1.0f32, -2.0, 65504.0, 2f32.powi(-24), 2f32.powi(-14), f32::INFINITY, f32::NEG_INFINITY];
        for (h, w) in halves.iter().zip(want) {
            assert_eq!(f16_to_f32(*h), w, "{h:#06x}");
        }
        assert!(f16_to_f32(0x7e00).is_nan());
        assert_eq!(to_f32(Dtype::BF16, &[0x80, 0x3f]).unwrap(), [1.0]);
        assert_eq!(to_f32(Dtype::F64, &0.1f64.to_le_bytes()).unwrap(), [0.1f32]);
        assert!(to_f32(Dtype::I32, &[0; 4]).is_none());
    }
}

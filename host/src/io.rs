//! safetensors files: inputs (`x`), outputs (`y`), parameters (PyTorch names, see
//! `chain.rs`) and, later, gradients. Only f32 tensors, as PyTorch saves them by default.

use crate::error::{Error, Result};
use crate::tensor::Tensor;
use safetensors::{Dtype, SafeTensors, tensor::TensorView};
use std::collections::HashMap;
use std::path::Path;

/// An opened safetensors file: its bytes, parsed on each lookup.
pub struct TensorFile {
    path: std::path::PathBuf,
    bytes: Vec<u8>,
}

impl TensorFile {
    /// Reads and validates the file (header, offsets); tensors are read on demand.
    pub fn open(path: &Path) -> Result<TensorFile> {
        let bytes = std::fs::read(path).map_err(|e| Error::file(path, format!("cannot read: {e}")))?;
        SafeTensors::deserialize(&bytes)
            .map_err(|e| Error::file(path, format!("not a valid safetensors file: {e}")))?;
        Ok(TensorFile { path: path.to_path_buf(), bytes })
    }

    /// The tensor `name`, which must exist, be f32 and have `shape`.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor<f32>> {
        let st = SafeTensors::deserialize(&self.bytes).expect("validated in open");
        let view = st.tensor(name).map_err(|_| {
            let mut names = st.names();
            names.sort();
            Error::tensor(name, format!("missing from {} (it has: {})", self.path.display(), names.join(", ")))
        })?;
        if view.dtype() != Dtype::F32 {
            return Err(Error::tensor(
                name,
                format!("in {} has dtype {:?}; expected F32", self.path.display(), view.dtype()),
            ));
        }
        if view.shape() != shape {
            return Err(Error::tensor(
                name,
                format!("in {} has shape {:?}; expected {:?}", self.path.display(), view.shape(), shape),
            ));
        }
        let data = view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        Tensor::new(shape, data)
    }

    /// Shape of tensor `name`, if present (to learn a batch size from an input file).
    pub fn shape_of(&self, name: &str) -> Option<Vec<usize>> {
        let st = SafeTensors::deserialize(&self.bytes).ok()?;
        st.tensor(name).ok().map(|v| v.shape().to_vec())
    }
}

/// Writes named f32 tensors to `path` (replacing it only once all is serialised).
pub fn write(path: &Path, tensors: &[(&str, &Tensor<f32>)]) -> Result<()> {
    let bytes: Vec<Vec<u8>> =
        tensors.iter().map(|(_, t)| t.data().iter().flat_map(|v| v.to_le_bytes()).collect()).collect();
    let mut views = HashMap::new();
    for ((name, t), b) in tensors.iter().zip(&bytes) {
        let view =
            TensorView::new(Dtype::F32, t.shape().to_vec(), b).map_err(|e| Error::tensor(*name, e.to_string()))?;
        views.insert(name.to_string(), view);
    }
    let data = safetensors::serialize(views, None).map_err(|e| Error::file(path, format!("cannot serialise: {e}")))?;
    let tmp = path.with_extension("safetensors.partial");
    std::fs::write(&tmp, data).map_err(|e| Error::file(&tmp, format!("cannot write: {e}")))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::file(path, format!("cannot write: {e}")))
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
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

//! cuBLAS SGEMM, the yardstick `host bench` times our kernels against in the same process.

use super::{DeviceTensor, Gpu};
use crate::error::{Error, Result};
use cudarc::cublas::sys::{cublasMath_t, cublasOperation_t};
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};

/// A cuBLAS handle on the GPU's stream, in strict FP32 (no TF32 tensor-op math).
pub struct Cublas {
    blas: CudaBlas,
}

impl Cublas {
    pub fn new(gpu: &Gpu) -> Result<Cublas> {
        // SAFETY: only tries to dlopen libcublas under its usual names.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(Error::NoGpu("libcublas was not found (add its folder to LD_LIBRARY_PATH)".into()));
        }
        let blas = std::panic::catch_unwind(|| CudaBlas::new(gpu.stream().clone()))
            .map_err(|_| Error::NoGpu("libcublas lacks functions cudarc needs".into()))?
            .map_err(|e| Error::cuda("creating the cuBLAS handle", e))?;
        // SAFETY: a valid handle; DEFAULT_MATH keeps SGEMM on the FP32 FMA path.
        unsafe { cudarc::cublas::sys::cublasSetMathMode(*blas.handle(), cublasMath_t::CUBLAS_DEFAULT_MATH) }
            .result()
            .map_err(|e| Error::cuda("setting cuBLAS math mode", e))?;
        Ok(Cublas { blas })
    }

    /// `y = x W^T` (no bias): `x (m, k)`, `w (n, k)`, `y (m, n)`, all row-major.
    pub fn sgemm(&self, x: &DeviceTensor, w: &DeviceTensor, y: &mut DeviceTensor) -> Result<()> {
        let (m, k, n) = match (&x.shape[..], &w.shape[..]) {
            ([m, k], [n, _]) => (*m, *k, *n),
            _ => return Err(Error::Shape(format!("sgemm: x {:?} and w {:?} must be 2-D", x.shape, w.shape))),
        };
        if w.shape != [n, k] || y.shape != [m, n] {
            return Err(Error::Shape(format!("sgemm: x {:?}, w {:?}, y {:?}", x.shape, w.shape, y.shape)));
        }
        let (m, n, k) = (cublas_dim(m)?, cublas_dim(n)?, cublas_dim(k)?);
        // Row-major y (m, n) is column-major y^T (n, m) = W x^T: A = w (column-major k x n,
        // transposed), B = x (column-major k x m), C = y (column-major n x m).
        let cfg = GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_T,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: n,
            n: m,
            k,
            alpha: 1.0f32,
            lda: k,
            ldb: k,
            beta: 0.0f32,
            ldc: n,
        };
        // SAFETY: dimensions and leading dimensions match the buffers checked above.
        unsafe { self.blas.gemm(cfg, &w.buf, &x.buf, &mut y.buf) }.map_err(|e| Error::cuda("cublasSgemm", e))
    }
}

/// A dimension as cuBLAS's 32-bit signed `int`, refusing one that would truncate.
fn cublas_dim(d: usize) -> Result<i32> {
    i32::try_from(d).map_err(|_| Error::Shape(format!("sgemm: dimension {d} exceeds cuBLAS's 32-bit int")))
}

#[cfg(test)]
mod tests {
    #[test]
    fn dimensions_beyond_i32_are_refused() {
        assert_eq!(super::cublas_dim(8192).unwrap(), 8192);
        assert!(super::cublas_dim(i32::MAX as usize + 1).unwrap_err().to_string().contains("32-bit int"));
    }
}

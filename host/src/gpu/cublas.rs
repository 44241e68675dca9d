//! cuBLAS SGEMM, the yardstick `host bench` times our kernels against in the same process.

use super::{DeviceTensor, Gpu};
use crate::error::{Error, Result};
use cudarc::cublas::sys::{cublasMath_t, cublasOperation_t};
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::CudaSlice;

const OP_N: cublasOperation_t = cublasOperation_t::CUBLAS_OP_N;
const OP_T: cublasOperation_t = cublasOperation_t::CUBLAS_OP_T;

/// A cuBLAS handle on the GPU's stream: strict FP32, or TF32 tensor-op math.
pub struct Cublas {
    blas: CudaBlas,
}

impl Cublas {
    pub fn new(gpu: &Gpu, tf32: bool) -> Result<Cublas> {
        // SAFETY: only tries to dlopen libcublas under its usual names.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(Error::NoGpu("libcublas was not found (add its folder to LD_LIBRARY_PATH)".into()));
        }
        let blas = std::panic::catch_unwind(|| CudaBlas::new(gpu.stream().clone()))
            .map_err(|_| Error::NoGpu("libcublas lacks functions cudarc needs".into()))?
            .map_err(|e| Error::cuda("creating the cuBLAS handle", e))?;
        // SAFETY: a valid handle. DEFAULT_MATH keeps SGEMM on the FP32 FMA path;
        // TF32_TENSOR_OP_MATH lets it round operands to TF32 on the tensor cores.
        let mode = if tf32 { cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH } else { cublasMath_t::CUBLAS_DEFAULT_MATH };
        unsafe { cudarc::cublas::sys::cublasSetMathMode(*blas.handle(), mode) }
            .result()
            .map_err(|e| Error::cuda("setting cuBLAS math mode", e))?;
        Ok(Cublas { blas })
    }

    /// The forward GEMM `y = x W^T` (no bias): `x (m, k)`, `w (n, k)`, `y (m, n)`, all row-major.
    pub fn forward(&self, x: &DeviceTensor, w: &DeviceTensor, y: &mut DeviceTensor) -> Result<()> {
        let (m, k, n) = match (&x.shape[..], &w.shape[..]) {
            ([m, k], [n, _]) => (*m, *k, *n),
            _ => return Err(Error::Shape(format!("sgemm: x {:?} and w {:?} must be 2-D", x.shape, w.shape))),
        };
        if w.shape != [n, k] || y.shape != [m, n] {
            return Err(Error::Shape(format!("sgemm: x {:?}, w {:?}, y {:?}", x.shape, w.shape, y.shape)));
        }
        // Row-major y (m, n) is column-major y^T (n, m) = W x^T: A = w (column-major k x n,
        // transposed), B = x (column-major k x m), C = y (column-major n x m).
        self.sgemm((OP_T, OP_N), (n, m, k), (&w.buf, k), (&x.buf, k), (&mut y.buf, n))
    }

    /// The backward's `dX = dZ W`: `dz (m, n)`, `w (n, k)`, `dx (m, k)`.
    pub fn grad_input(&self, dz: &DeviceTensor, w: &DeviceTensor, dx: &mut DeviceTensor) -> Result<()> {
        let (m, n, k) = (dz.shape[0], dz.shape[1], w.shape[1]);
        if w.shape != [n, k] || dx.shape != [m, k] {
            return Err(Error::Shape(format!("sgemm: dz {:?}, w {:?}, dx {:?}", dz.shape, w.shape, dx.shape)));
        }
        // Column-major: dX^T (k, m) = W^T (k, n) dZ^T (n, m), both buffers as they are.
        self.sgemm((OP_N, OP_N), (k, m, n), (&w.buf, k), (&dz.buf, n), (&mut dx.buf, k))
    }

    /// The backward's `dW = dZ^T X`: `dz (m, n)`, `x (m, k)`, `dw (n, k)`.
    pub fn grad_weight(&self, dz: &DeviceTensor, x: &DeviceTensor, dw: &mut DeviceTensor) -> Result<()> {
        let (m, n, k) = (dz.shape[0], dz.shape[1], x.shape[1]);
        if x.shape != [m, k] || dw.shape != [n, k] {
            return Err(Error::Shape(format!("sgemm: dz {:?}, x {:?}, dw {:?}", dz.shape, x.shape, dw.shape)));
        }
        // Column-major: dW^T (k, n) = X^T (k, m) dZ (m, n); dZ's buffer is dZ^T, so transposed.
        self.sgemm((OP_N, OP_T), (k, n, m), (&x.buf, k), (&dz.buf, n), (&mut dw.buf, k))
    }

    /// Column-major `C (m, n) = op(A) op(B)` with leading dimensions.
    #[allow(clippy::type_complexity)]
    fn sgemm(
        &self,
        (transa, transb): (cublasOperation_t, cublasOperation_t),
        (m, n, k): (usize, usize, usize),
        (a, lda): (&CudaSlice<f32>, usize),
        (b, ldb): (&CudaSlice<f32>, usize),
        (c, ldc): (&mut CudaSlice<f32>, usize),
    ) -> Result<()> {
        let cfg = GemmConfig {
            transa,
            transb,
            m: cublas_dim(m)?,
            n: cublas_dim(n)?,
            k: cublas_dim(k)?,
            alpha: 1.0f32,
            lda: cublas_dim(lda)?,
            ldb: cublas_dim(ldb)?,
            beta: 0.0f32,
            ldc: cublas_dim(ldc)?,
        };
        // SAFETY: the callers checked the buffers against these dimensions.
        unsafe { self.blas.gemm(cfg, a, b, c) }.map_err(|e| Error::cuda("cublasSgemm", e))
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

//! cuBLAS, the yardstick `host bench` times our kernels against in the same process:
//! SGEMM (strict FP32 or TF32 tensor-op math) on f32 operands, and the bf16 GEMM
//! (`cublasGemmEx`, FP32 accumulation and output) on bf16 copies of them.

use super::{DeviceTensor, Gpu};
use crate::error::{Error, Result};
use crate::tensor::Bf16;
use cudarc::cublas::sys::{cublasMath_t, cublasOperation_t};
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};

const OP_N: cublasOperation_t = cublasOperation_t::CUBLAS_OP_N;
const OP_T: cublasOperation_t = cublasOperation_t::CUBLAS_OP_T;

/// A cuBLAS handle on the GPU's stream: strict FP32, or TF32 tensor-op math.
pub struct Cublas {
    blas: CudaBlas,
    /// The stream the handle runs on (the GPU's), for the raw bf16 call's pointers.
    stream: std::sync::Arc<cudarc::driver::CudaStream>,
}

impl Cublas {
    pub fn new(gpu: &Gpu, tf32: bool) -> Result<Cublas> {
        if !super::cuda_library_present(super::presence_probe!(cublas)) {
            return Err(Error::NoGpu("libcublas was not found (add its folder to LD_LIBRARY_PATH)".into()));
        }
        let stream = gpu.stream().clone();
        let blas = std::panic::catch_unwind(move || CudaBlas::new(stream))
            .map_err(|_| Error::NoGpu("libcublas lacks functions cudarc needs".into()))?
            .map_err(|e| Error::cuda("creating the cuBLAS handle", e))?;
        // SAFETY: a valid handle. DEFAULT_MATH keeps SGEMM on the FP32 FMA path;
        // TF32_TENSOR_OP_MATH lets it round operands to TF32 on the tensor cores.
        let mode = if tf32 { cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH } else { cublasMath_t::CUBLAS_DEFAULT_MATH };
        unsafe { cudarc::cublas::sys::cublasSetMathMode(*blas.handle(), mode) }
            .result()
            .map_err(|e| Error::cuda("setting cuBLAS math mode", e))?;
        Ok(Cublas { blas, stream: gpu.stream().clone() })
    }

    /// The forward GEMM `y = x W^T` (no bias): `x (m, k)`, `w (n, k)`, `y (m, n)`, all row-major.
    pub fn forward<T: Operand, Y: Output>(&self, x: &T, w: &T, y: &mut Y) -> Result<()> {
        let (m, k, n) = match (x.shape(), w.shape()) {
            ([m, k], [n, _]) => (*m, *k, *n),
            _ => return Err(Error::Shape(format!("sgemm: x {:?} and w {:?} must be 2-D", x.shape(), w.shape()))),
        };
        if w.shape() != [n, k] || y.shape() != [m, n] {
            return Err(Error::Shape(format!("sgemm: x {:?}, w {:?}, y {:?}", x.shape(), w.shape(), y.shape())));
        }
        // Row-major y (m, n) is column-major y^T (n, m) = W x^T: A = w (column-major k x n,
        // transposed), B = x (column-major k x m), C = y (column-major n x m).
        self.gemm((OP_T, OP_N), (n, m, k), (w, k), (x, k), (y.out(), n))
    }

    /// The backward's `dX = dZ W`: `dz (m, n)`, `w (n, k)`, `dx (m, k)`.
    pub fn grad_input<T: Operand, Y: Output>(&self, dz: &T, w: &T, dx: &mut Y) -> Result<()> {
        let (&[m, n], &[_, k]) = (dz.shape(), w.shape()) else {
            return Err(Error::Shape(format!("sgemm: dz {:?} and w {:?} must be 2-D", dz.shape(), w.shape())));
        };
        if w.shape() != [n, k] || dx.shape() != [m, k] {
            return Err(Error::Shape(format!("sgemm: dz {:?}, w {:?}, dx {:?}", dz.shape(), w.shape(), dx.shape())));
        }
        // Column-major: dX^T (k, m) = W^T (k, n) dZ^T (n, m), both buffers as they are.
        self.gemm((OP_N, OP_N), (k, m, n), (w, k), (dz, n), (dx.out(), k))
    }

    /// The backward's `dW = dZ^T X`: `dz (m, n)`, `x (m, k)`, `dw (n, k)`.
    pub fn grad_weight<T: Operand, Y: Output>(&self, dz: &T, x: &T, dw: &mut Y) -> Result<()> {
        let (&[m, n], &[_, k]) = (dz.shape(), x.shape()) else {
            return Err(Error::Shape(format!("sgemm: dz {:?} and x {:?} must be 2-D", dz.shape(), x.shape())));
        };
        if x.shape() != [m, k] || dw.shape() != [n, k] {
            return Err(Error::Shape(format!("sgemm: dz {:?}, x {:?}, dw {:?}", dz.shape(), x.shape(), dw.shape())));
        }
        // Column-major: dW^T (k, n) = X^T (k, m) dZ (m, n); dZ's buffer is dZ^T, so transposed.
        self.gemm((OP_N, OP_T), (k, n, m), (x, k), (dz, n), (dw.out(), k))
    }

    /// Column-major `C (m, n) = op(A) op(B)` with leading dimensions, on the operands'
    /// type: SGEMM for f32, the bf16 GEMM for bf16 (into FP32 or bf16).
    #[allow(clippy::type_complexity)]
    fn gemm<T: Operand>(
        &self,
        (transa, transb): (cublasOperation_t, cublasOperation_t),
        (m, n, k): (usize, usize, usize),
        (a, lda): (&T, usize),
        (b, ldb): (&T, usize),
        (c, ldc): (Out<'_>, usize),
    ) -> Result<()> {
        let (a, b, c) = match (a.data(), b.data(), c) {
            (Data::F32(a), Data::F32(b), Out::F32(c)) => (a, b, c),
            (Data::Bf16(a), Data::Bf16(b), c) => {
                return self.gemm_bf16((transa, transb), (m, n, k), (a, lda), (b, ldb), (c, ldc));
            }
            _ => return Err(Error::Unsupported("cuBLAS's SGEMM writes FP32 only".into())),
        };
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

    /// [`Cublas::gemm`] for bf16 operands: `cublasGemmEx`, FP32 compute, FP32 or bf16
    /// output (a bf16 model's).
    #[allow(clippy::type_complexity)]
    fn gemm_bf16(
        &self,
        (transa, transb): (cublasOperation_t, cublasOperation_t),
        (m, n, k): (usize, usize, usize),
        (a, lda): (&CudaSlice<Bf16>, usize),
        (b, ldb): (&CudaSlice<Bf16>, usize),
        (c, ldc): (Out<'_>, usize),
    ) -> Result<()> {
        use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cudaDataType_t};
        let (alpha, beta) = (1.0f32, 0.0f32);
        let stream = &self.stream;
        let (pa, _ra) = a.device_ptr(stream);
        let (pb, _rb) = b.device_ptr(stream);
        let ((pc, _rc), c_type) = match c {
            Out::F32(c) => (c.device_ptr_mut(stream), cudaDataType_t::CUDA_R_32F),
            Out::Bf16(c) => (c.device_ptr_mut(stream), cudaDataType_t::CUDA_R_16BF),
        };
        // SAFETY: the callers checked the buffers against these dimensions; the scalars
        // are host f32 (the handle's default pointer mode) matching COMPUTE_32F.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                transa,
                transb,
                cublas_dim(m)?,
                cublas_dim(n)?,
                cublas_dim(k)?,
                (&alpha) as *const f32 as *const _,
                pa as *const _,
                cudaDataType_t::CUDA_R_16BF,
                cublas_dim(lda)?,
                pb as *const _,
                cudaDataType_t::CUDA_R_16BF,
                cublas_dim(ldb)?,
                (&beta) as *const f32 as *const _,
                pc as *mut _,
                c_type,
                cublas_dim(ldc)?,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| Error::cuda("cublasGemmEx (bf16)", e))
    }
}

/// An operand cuBLAS takes here: an f32 tensor (SGEMM) or its bf16 copy (bf16 GEMM).
pub trait Operand {
    fn shape(&self) -> &[usize];
    fn data(&self) -> Data<'_>;
}

/// The buffer of an [`Operand`].
pub enum Data<'a> {
    F32(&'a CudaSlice<f32>),
    Bf16(&'a CudaSlice<Bf16>),
}

/// An output cuBLAS writes here: FP32, or bf16 (from the bf16 GEMM only).
pub trait Output {
    fn shape(&self) -> &[usize];
    fn out(&mut self) -> Out<'_>;
}

/// The buffer of an [`Output`].
pub enum Out<'a> {
    F32(&'a mut CudaSlice<f32>),
    Bf16(&'a mut CudaSlice<Bf16>),
}

impl Output for DeviceTensor {
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn out(&mut self) -> Out<'_> {
        Out::F32(&mut self.buf)
    }
}

impl Output for DeviceTensor<Bf16> {
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn out(&mut self) -> Out<'_> {
        Out::Bf16(&mut self.buf)
    }
}

impl Operand for DeviceTensor {
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Data<'_> {
        Data::F32(&self.buf)
    }
}

impl Operand for DeviceTensor<Bf16> {
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Data<'_> {
        Data::Bf16(&self.buf)
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

//! A plain host tensor: a shape and a row-major `Vec`. Device tensors live in `gpu`.

use crate::error::{Error, Result};

#[derive(Clone, Debug, PartialEq)]
pub struct Tensor<T> {
    shape: Vec<usize>,
    data: Vec<T>,
}

impl<T: Copy> Tensor<T> {
    /// A tensor of `shape` holding `data` (row-major); the lengths must agree.
    pub fn new(shape: &[usize], data: Vec<T>) -> Result<Self> {
        let expected: usize = shape.iter().product();
        if expected != data.len() {
            return Err(Error::Shape(format!("shape {shape:?} needs {expected} elements, got {}", data.len())));
        }
        Ok(Tensor { shape: shape.to_vec(), data })
    }

    pub fn full(shape: &[usize], value: T) -> Self {
        Tensor { shape: shape.to_vec(), data: vec![value; shape.iter().product()] }
    }

    pub fn from_fn(shape: &[usize], mut f: impl FnMut(usize) -> T) -> Self {
        Tensor { shape: shape.to_vec(), data: (0..shape.iter().product()).map(&mut f).collect() }
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn data(&self) -> &[T] {
        &self.data
    }
    pub fn data_mut(&mut self) -> &mut [T] {
        &mut self.data
    }
    pub fn into_data(self) -> Vec<T> {
        self.data
    }
    pub fn len(&self) -> usize {
        self.data.len()
    }
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Rows of a 2-D tensor (the batch), 1 for a vector.
    pub fn rows(&self) -> usize {
        if self.shape.len() == 2 { self.shape[0] } else { 1 }
    }
    /// Columns of a 2-D tensor (the features), the length of a vector.
    pub fn cols(&self) -> usize {
        *self.shape.last().unwrap_or(&1)
    }
    /// Row `r` of a 2-D tensor.
    pub fn row(&self, r: usize) -> &[T] {
        let c = self.cols();
        &self.data[r * c..(r + 1) * c]
    }

    pub fn map<U: Copy>(&self, f: impl FnMut(T) -> U) -> Tensor<U> {
        Tensor { shape: self.shape.clone(), data: self.data.iter().copied().map(f).collect() }
    }

    /// The same data under another shape of equal size.
    pub fn reshape(self, shape: &[usize]) -> Result<Self> {
        Tensor::new(shape, self.data)
    }
}

impl Tensor<f32> {
    pub fn to_f64(&self) -> Tensor<f64> {
        self.map(f64::from)
    }
}

impl Tensor<f64> {
    pub fn to_f32(&self) -> Tensor<f32> {
        self.map(|v| v as f32)
    }
}

//! The autograd tape: a list of backward closures run in reverse.
//!
//! Backend-agnostic: the tape knows nothing of tensors beyond [`Gradient`], so the
//! CPU reference and the GPU backend record into the same kind of tape. A forward op
//! records one node (the inputs it read, and a closure owning exactly the state its
//! backward needs); [`Tape::backward`] walks the nodes from last to first, hands each
//! the gradient of its output, and accumulates the gradients it returns for its
//! inputs, so a value used twice receives the sum. Each closure is consumed by its
//! call, so saved state is freed as soon as the backward has used it. Inference
//! records nothing and needs no tape.

use crate::error::Result;

/// A gradient value the tape can accumulate (`self += other`).
pub trait Gradient: Sized {
    fn accumulate(&mut self, other: Self) -> Result<()>;
}

/// Handle of a value recorded on a tape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct VarId(usize);

/// A node's backward: given the gradient of its output, the gradients of its inputs
/// in the order they were recorded (`None`: no gradient flows to that input).
pub type Backward<G> = Box<dyn FnOnce(G) -> Result<Vec<Option<G>>>>;

struct Node<G> {
    inputs: Vec<VarId>,
    output: VarId,
    backward: Backward<G>,
}

pub struct Tape<G> {
    nodes: Vec<Node<G>>,
    vars: usize,
}

impl<G: Gradient> Default for Tape<G> {
    fn default() -> Self {
        Tape { nodes: Vec::new(), vars: 0 }
    }
}

impl<G: Gradient> Tape<G> {
    pub fn new() -> Self {
        Self::default()
    }

    /// A new leaf (an input or a parameter) whose gradient the caller wants back.
    pub fn leaf(&mut self) -> VarId {
        self.vars += 1;
        VarId(self.vars - 1)
    }

    /// Records an op that read `inputs`; returns the id of its output.
    pub fn record(&mut self, inputs: &[VarId], backward: impl FnOnce(G) -> Result<Vec<Option<G>>> + 'static) -> VarId {
        let output = self.leaf();
        self.nodes.push(Node { inputs: inputs.to_vec(), output, backward: Box::new(backward) });
        output
    }

    /// Number of recorded ops.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Back-propagates `seed` (the gradient of `output`) through every recorded op.
    pub fn backward(self, output: VarId, seed: G) -> Result<Gradients<G>> {
        let mut grads: Vec<Option<G>> = (0..self.vars).map(|_| None).collect();
        grads[output.0] = Some(seed);
        for node in self.nodes.into_iter().rev() {
            // Ops the output does not depend on get no gradient; their closures just drop.
            let Some(dy) = grads[node.output.0].take() else { continue };
            let dxs = (node.backward)(dy)?;
            assert_eq!(dxs.len(), node.inputs.len(), "a backward returned the wrong number of gradients");
            for (input, dx) in node.inputs.iter().zip(dxs) {
                if let Some(dx) = dx {
                    match &mut grads[input.0] {
                        Some(g) => g.accumulate(dx)?,
                        slot => *slot = Some(dx),
                    }
                }
            }
        }
        Ok(Gradients { grads })
    }
}

/// Gradients of the leaves after [`Tape::backward`].
pub struct Gradients<G> {
    grads: Vec<Option<G>>,
}

impl<G> Gradients<G> {
    /// The gradient of `var`, or `None` if the output does not depend on it.
    pub fn take(&mut self, var: VarId) -> Option<G> {
        self.grads[var.0].take()
    }
}

impl<T: Copy + std::ops::AddAssign> Gradient for crate::tensor::Tensor<T> {
    fn accumulate(&mut self, other: Self) -> Result<()> {
        if self.shape() != other.shape() {
            return Err(crate::Error::Shape(format!(
                "gradient of shape {:?} added to one of shape {:?}",
                other.shape(),
                self.shape()
            )));
        }
        for (a, b) in self.data_mut().iter_mut().zip(other.data()) {
            *a += *b;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Gradient for f64 {
        fn accumulate(&mut self, other: f64) -> Result<()> {
            *self += other;
            Ok(())
        }
    }

    /// y = (a * b) * a: dy/da = 2ab, dy/db = a^2; `a` is used twice.
    #[test]
    fn accumulates_a_value_used_twice() {
        let (a, b) = (3.0, 5.0);
        let mut tape = Tape::<f64>::new();
        let (va, vb) = (tape.leaf(), tape.leaf());
        let vab = tape.record(&[va, vb], move |g| Ok(vec![Some(g * b), Some(g * a)]));
        let vy = tape.record(&[vab, va], move |g| Ok(vec![Some(g * a), Some(g * a * b)]));
        let mut grads = tape.backward(vy, 1.0).unwrap();
        assert_eq!(grads.take(va), Some(2.0 * a * b));
        assert_eq!(grads.take(vb), Some(a * a));
    }

    #[test]
    fn skips_ops_the_output_does_not_depend_on() {
        let mut tape = Tape::<f64>::new();
        let va = tape.leaf();
        let _unused = tape.record(&[va], |_| panic!("must not run"));
        let vy = tape.record(&[va], |g| Ok(vec![Some(4.0 * g)]));
        assert_eq!(tape.backward(vy, 0.5).unwrap().take(va), Some(2.0));
    }
}

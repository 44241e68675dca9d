"""The custom ops under ``torch.library.opcheck`` and a module using FusedLinear under
``torch.compile(fullgraph=True)`` on the CPU."""

import pytest
import torch
import torch.nn as nn

import fused_linear
from chain_ref import make_case
from fused_linear import FusedLinear

# opcheck's tests:
# - test_schema: the schema's mutation/aliasing claims hold (nothing is mutated; outputs
#   alias no input). Applies to both ops.
# - test_autograd_registration: autograd goes through a kernel registered at the Autograd
#   key rather than a CompositeImplicit decomposition. It needs an input that requires grad,
#   so only the forward's samples with requires_grad run it; it does not apply to
#   `backward`, which is not differentiable (no double backward in the contract).
# - test_faketensor: the fake (meta) implementation gives the real outputs' shapes, dtypes
#   and strides: what torch.compile and CUDA-graph tracing rely on. Both ops.
# - test_aot_dispatch_dynamic: AOTAutograd with dynamic shapes gives eager's outputs and,
#   where inputs require grad, eager's gradients (so it exercises `backward` through the
#   forward's autograd formula). Both ops.
ALL = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
NO_GRAD = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")

# (shape = (batch, in, out), ops). The ops take the 2-D x that fused_linear passes them
# (leading batch dimensions are the functional API's business, tested in test_module.py).
SAMPLES = [
    ((3, 5, 16), "groupnorm(4),swish,mul,swish"),
    ((4, 7, 12), "bias,hardtanh(-1,1),mish,groupnorm(3)"),
    ((5, 6, 16), "avgpool(3),gelu,scale(2),max"),
    ((12, 4, 12), "swish,bias,leakyrelu(0.2),mul"),
    # A BatchNorm: the saved state carries its batch statistics as two more rows.
    ((6, 5, 12), "tanh,batchnorm,gelu"),
]


def forward_args(shape, ops, dtype, requires_grad):
    (x, weight, bias), params = make_case(shape, ops, seed=len(ops), dtype=dtype, min_margin=1e-4)
    tensors = [t.requires_grad_(requires_grad) for t in (x, weight, bias, *params)]
    return (tensors[0], tensors[1], tensors[2], tensors[3:], ops, "fp32")


def ids(samples):
    return [f"{'x'.join(map(str, s))}-{o}" for s, o in samples]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("shape,ops", SAMPLES, ids=ids(SAMPLES))
def test_opcheck_forward(shape, ops, dtype):
    op = torch.ops.fused_linear.forward.default
    torch.library.opcheck(op, forward_args(shape, ops, dtype, True), test_utils=ALL)
    torch.library.opcheck(op, forward_args(shape, ops, dtype, False), test_utils=NO_GRAD)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("shape,ops", SAMPLES, ids=ids(SAMPLES))
def test_opcheck_backward(shape, ops, dtype):
    x, weight, bias, params, ops, precision = forward_args(shape, ops, dtype, False)
    y, z = torch.ops.fused_linear.forward(x, weight, bias, params, ops, precision)
    dy = torch.randn(y.shape, dtype=dtype)
    args = (x, weight, bias, params, z, dy, ops, precision)
    torch.library.opcheck(torch.ops.fused_linear.backward.default, args, test_utils=NO_GRAD)


def test_ops_return_documented_structure():
    """docs/PYTHON.md: ``forward(...) -> (y, z)``, ``inference(...) -> y`` and
    ``backward(...) -> [dx, dweight, dbias, *dparams]``, one gradient per chain parameter."""
    x, weight, bias, params, ops, precision = forward_args(*SAMPLES[0], torch.float64, False)
    out = torch.ops.fused_linear.forward(x, weight, bias, params, ops, precision)
    assert len(out) == 2
    y, z = out
    y_inf = torch.ops.fused_linear.inference(x, weight, bias, params, ops, precision)
    assert isinstance(y_inf, torch.Tensor)
    torch.testing.assert_close(y_inf, y, rtol=1e-12, atol=1e-12)
    dy = torch.randn(y.shape, dtype=torch.float64)
    out = torch.ops.fused_linear.backward(x, weight, bias, params, z, dy, ops, precision)
    assert len(out) == 3 + len(params), f"expected [dx, dweight, dbias, *dparams], got {len(out)} tensors"
    assert [g.shape for g in out] == [t.shape for t in (x, weight, bias, *params)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("shape,ops", SAMPLES, ids=ids(SAMPLES))
def test_opcheck_inference(shape, ops, dtype):
    # The inference op is what fused_linear calls when no gradient is wanted; it is not
    # differentiable, so test_autograd_registration does not apply (see ALL above).
    args = forward_args(shape, ops, dtype, False)
    torch.library.opcheck(torch.ops.fused_linear.inference.default, args, test_utils=NO_GRAD)
    y, _ = torch.ops.fused_linear.forward(*args)
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(torch.ops.fused_linear.inference(*args), y, rtol=tol, atol=tol)


def test_no_grad_path_matches_grad_path():
    """Under torch.no_grad (or with no input requiring grad) the output is the same."""
    x, weight, bias, params, ops, _ = forward_args(*SAMPLES[1], torch.float32, True)
    block_in = (x, weight, bias, ops, params)
    y_grad = fused_linear.fused_linear(*block_in)
    assert y_grad.requires_grad
    with torch.no_grad():
        y_nograd = fused_linear.fused_linear(*block_in)
    assert not y_nograd.requires_grad
    plain = [t.detach() for t in (x, weight, bias)]
    y_plain = fused_linear.fused_linear(*plain, ops, [p.detach() for p in params])
    torch.testing.assert_close(y_nograd, y_grad.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y_plain, y_grad.detach(), rtol=1e-6, atol=1e-6)


class Net(nn.Module):
    """A small network with two fused blocks between plain layers."""

    def __init__(self):
        super().__init__()
        self.a = FusedLinear(6, 16, "groupnorm(4),swish,mul,swish")
        self.mid = nn.Linear(16, 12)
        self.b = FusedLinear(12, 24, "bias,hardtanh(-1,1),mish,groupnorm(6)")
        self.head = FusedLinear(24, 8, "avgpool(2),gelu,scale(2),max")

    def forward(self, x):
        return self.head(self.b(torch.tanh(self.mid(self.a(x))))) * 0.5


def _forward_backward(model, x):
    x = x.clone().requires_grad_(True)
    y = model(x)
    grads = torch.autograd.grad(
        (y * torch.arange(y.numel()).reshape(y.shape)).sum(), [x, *model.parameters()]
    )
    return y.detach(), grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_compile_aot_eager_matches_eager(dtype):
    torch._dynamo.reset()
    model = Net().to(dtype)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    names = ["x"] + [n for n, _ in model.named_parameters()]
    # Two batch sizes: the second recompiles (or runs a dynamic graph); both must match.
    for batch in (5, 9):
        x = torch.randn(batch, 6, dtype=dtype)
        y_eager, g_eager = _forward_backward(model, x)
        y_comp, g_comp = _forward_backward(compiled, x)
        assert y_comp.shape == (batch,)
        torch.testing.assert_close(y_comp, y_eager, rtol=1e-6, atol=1e-6)
        for name, a, b in zip(names, g_comp, g_eager):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)
        with torch.no_grad():  # the inference op's path, compiled
            torch.testing.assert_close(compiled(x), y_eager, rtol=1e-6, atol=1e-6)

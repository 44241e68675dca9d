"""Bad input raises the documented Python exception, and the message names the argument
(docs/PYTHON.md, "Errors"); a Rust panic becomes a RuntimeError and the interpreter lives on."""

import re

import pytest
import torch

import fused_linear
from fused_linear import FusedLinear

OPS = "groupnorm(4),swish,mul,swish"  # params: gn.weight, gn.bias, w


def args(n=3, k=5, f=16, dtype=torch.float32):
    """Valid arguments for OPS: (x, weight, bias, params)."""
    x = torch.randn(n, k, dtype=dtype)
    weight = torch.randn(f, k, dtype=dtype)
    bias = torch.randn(f, dtype=dtype)
    params = [torch.ones(f, dtype=dtype), torch.zeros(f, dtype=dtype), torch.randn(f, dtype=dtype)]
    return x, weight, bias, params


def call(x, weight, bias, params, ops=OPS, precision="fp32"):
    return fused_linear.fused_linear(x, weight, bias, ops, params, precision=precision)


def test_valid_arguments_work():
    x, weight, bias, params = args()
    assert call(x, weight, bias, params).shape == (3, 16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int32])
def test_x_dtype(dtype):
    x, weight, bias, params = args()
    with pytest.raises(TypeError, match=r"\bx\b"):
        call(x.to(dtype), weight, bias, params)


def test_x_not_a_tensor():
    x, weight, bias, params = args()
    with pytest.raises(TypeError):
        call(x.tolist(), weight, bias, params)
    with pytest.raises(TypeError):
        call(None, weight, bias, params)


@pytest.mark.parametrize("shape", [(16, 6), (16, 4), (16,), (1, 16, 5)])
def test_weight_shape(shape):
    x, _, bias, params = args()
    with pytest.raises(ValueError, match="weight"):
        call(x, torch.randn(shape), bias, params)


def test_bias_shape():
    x, weight, _, params = args()
    with pytest.raises(ValueError, match="bias"):
        call(x, weight, torch.randn(15), params)


@pytest.mark.parametrize("count", [0, 2, 4])
def test_params_count(count):
    x, weight, bias, params = args()
    params = (params + [torch.randn(16)])[:count]
    with pytest.raises(ValueError, match="params"):
        call(x, weight, bias, params)


@pytest.mark.parametrize("index,name", [(0, "gn.weight"), (1, "gn.bias"), (2, "w")])
def test_param_shape_names_it(index, name):
    x, weight, bias, params = args()
    params[index] = torch.randn(17)
    # The functional op may name a parameter by position or by its module name.
    with pytest.raises(ValueError, match=rf"params\[{index}\]|\b{re.escape(name)}\b"):
        call(x, weight, bias, params)


def test_param_shape_after_avgpool():
    # After avgpool(4) a bias has 16 / 4 = 4 features, not 16.
    x, weight, bias, _ = args()
    with pytest.raises(ValueError, match=r"params\[0\]|\bbias\b"):
        call(x, weight, bias, [torch.randn(16)], ops="avgpool(4),bias")
    assert call(x, weight, bias, [torch.randn(4)], ops="avgpool(4),bias").shape == (3, 4)


@pytest.mark.parametrize("ops", ["groupnorm(5)", "groupnorm(32)", "groupnorm(0)", "avgpool(2),groupnorm(3)"])
def test_groups_that_do_not_divide(ops):
    x, weight, bias, _ = args()
    params = [torch.ones(16), torch.zeros(16)] if ops.startswith("group") else [torch.ones(8), torch.zeros(8)]
    with pytest.raises(ValueError, match="groupnorm"):
        call(x, weight, bias, params, ops=ops)


@pytest.mark.parametrize("ops", ["relu6", "swish,,mish", "scale(1", "groupnorm(x)", "hardtanh(1)", ""])
def test_bad_chains(ops):
    x, weight, bias, params = args()
    if ops == "":
        # An empty chain may be allowed (the plain Linear layer); if so it must be right.
        try:
            y = call(x, weight, bias, [], ops=ops)
        except ValueError:
            return
        torch.testing.assert_close(y, torch.nn.functional.linear(x, weight, bias))
        return
    with pytest.raises(ValueError):
        call(x, weight, bias, params, ops=ops)


def test_unknown_op_is_named():
    x, weight, bias, params = args()
    with pytest.raises(ValueError, match="relu6"):
        call(x, weight, bias, params, ops="groupnorm(4),relu6,mul,swish")


@pytest.mark.parametrize("precision", ["fp4", "FP64", "", "tf32x2"])
def test_unknown_precision(precision):
    x, weight, bias, params = args()
    with pytest.raises(ValueError, match="precision"):
        call(x, weight, bias, params, precision=precision)


@pytest.mark.parametrize("how", ["transposed", "strided"])
def test_non_contiguous_weight(how):
    x, weight, bias, params = args()
    if how == "transposed":
        w = weight.t().contiguous().t()  # same values, column-major
    else:
        w = torch.randn(16, 10)[:, ::2]  # every other column
    assert not w.is_contiguous() and w.shape == weight.shape
    with pytest.raises(ValueError, match="contiguous"):
        call(x, w, bias, params)


def test_non_contiguous_x():
    x, weight, bias, params = args()
    with pytest.raises(ValueError, match="contiguous"):
        call(x.t().contiguous().t(), weight, bias, params)


@pytest.mark.parametrize("which", ["weight", "bias", "params[2]"])
def test_mixed_dtypes(which):
    x, weight, bias, params = args()
    if which == "weight":
        weight = weight.double()
    elif which == "bias":
        bias = bias.double()
    else:
        params[2] = params[2].double()
    with pytest.raises(TypeError, match=re.escape(which)):
        call(x, weight, bias, params)


def test_empty_batch_gives_an_empty_output_and_zero_gradients():
    """As PyTorch's layers: no rows in, no rows out; the parameters' gradients are sums
    over no rows (zeros). Bad arguments are refused as with a full batch."""
    x, weight, bias, params = args()
    leaves = [t.clone().requires_grad_(True) for t in (x[:0], weight, bias, *params)]
    y = call(leaves[0], leaves[1], leaves[2], leaves[3:])
    assert y.shape == (0, 16) and y.dtype == x.dtype
    y.sum().backward()
    assert leaves[0].grad.shape == (0, 5)
    for t in leaves[1:]:
        assert t.grad is not None and t.grad.shape == t.shape and not t.grad.any()
    with torch.no_grad():
        assert call(x[:0], weight, bias, params).shape == (0, 16)
    # A leading batch of shape (2, 0) too.
    assert call(x[:0].reshape(2, 0, 5), weight, bias, params).shape == (2, 0, 16)
    with pytest.raises(ValueError, match="weight"):
        call(x[:0], weight[:, :4], bias, params)
    with pytest.raises(ValueError, match="params"):
        call(x[:0], weight, bias, params[:1])
    with pytest.raises(ValueError, match="ops"):
        fused_linear.fused_linear(x[:0], weight, bias, "groupnorm(5)", params)


def test_module_errors():
    block = FusedLinear(5, 16, OPS)
    with pytest.raises(TypeError, match=r"\bx\b"):
        block(torch.randn(3, 5, dtype=torch.float16))  # float16 x, float32 weight
    with pytest.raises(ValueError):
        block(torch.randn(3, 6))  # in-features do not match the weight
    # A bad precision or chain is refused at construction or, at the latest, on the first call.
    with pytest.raises(ValueError, match="precision"):
        FusedLinear(5, 16, OPS, precision="fp4")(torch.randn(3, 5))
    with pytest.raises(ValueError, match="groupnorm"):
        FusedLinear(5, 16, "groupnorm(5)")(torch.randn(3, 5))


def test_rust_panic_becomes_runtime_error():
    from fused_linear import _native

    with pytest.raises(RuntimeError, match="first"):
        _native._raise_panic("first")
    # The interpreter and the native module live on: a second panic, then real work.
    with pytest.raises(RuntimeError, match="second"):
        _native._raise_panic("second")
    x, weight, bias, params = args()
    assert torch.isfinite(call(x, weight, bias, params)).all()


def test_kernel_image_names_a_cuda_device():
    with pytest.raises(ValueError, match="not a CUDA device"):
        fused_linear.kernel_image("cpu")

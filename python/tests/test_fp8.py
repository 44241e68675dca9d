"""FP8 (`precision="fp8"`, `"fp8_gw_bf16"`): on the CPU, the backend's emulation of Hopper's
row-wise e4m3 recipe (docs/NUMERICS.md, "FP8"); on CUDA, a clear error until its kernels
exist. Compared with float64 PyTorch (chain_ref) at FP8's documented tolerance, and with
the same block in bf16 to show the quantisation happens."""

import re

import pytest
import torch

import fused_linear
from chain_ref import grads_of, reference_grads, rel_err
from fused_linear import PRESETS, FusedLinear

#: host/src/precision.rs's FP8_REL: about 4 standard deviations of one e4m3 product's
#: relative error, norm-wise over a block's outputs and gradients.
FP8_REL = 0.15
#: bf16 operands' bar, for the contrast below.
BF16_REL = 2e-2


def _grads(block, x, dy):
    """y, then the gradients of x, lin.weight, lin.bias and the chain's parameters in order."""
    y, grads = grads_of(block, x, dy)
    return y, [grads[n] for n in ["x", "lin.weight", "lin.bias", *block._param_names]]


@pytest.mark.parametrize("precision", ["fp8", "fp8_gw_bf16"])
@pytest.mark.parametrize("name", ["M1", "M2", "M3", "M5"])
def test_fp8_on_the_cpu_is_near_float64_at_its_tolerance(name, precision):
    torch.manual_seed(0)
    # Groups of 16 channels: fewer cancel (a group of two is all cancellation, and FP8's
    # 4 significant bits of z leave nothing of it).
    ops = re.sub(r"groupnorm\(\d+\)", "groupnorm(8)", PRESETS[name])
    block = FusedLinear(96, 128, ops, precision=precision)
    x = torch.randn(12, 96)
    dy = torch.randn_like(block(x))
    y, grads = _grads(block, x, dy)
    params = block.chain_parameters()
    y64, grads64 = reference_grads(x, block.lin.weight, block.lin.bias, block.ops, params, dy)
    assert rel_err(y, y64) < FP8_REL, rel_err(y, y64)
    if name in ("M3", "M5"):
        # Kinks (LeakyReLU, Hardtanh): a z 4% off takes the other side of some, which moves
        # those gradients by O(1); the Rust tests hold them at the backend's own z.
        return
    for name_, got, want in zip(["x", "lin.weight", "lin.bias", *block._param_names], grads, grads64):
        assert rel_err(got, want) < FP8_REL, (name_, rel_err(got, want))


def test_fp8_quantises_the_operands():
    """fp8's output error is far above bf16's on the same block (an unquantised path would
    be near FP32's), and fp8_gw_bf16 differs from fp8 in the weight's gradient only."""
    torch.manual_seed(1)
    blocks = {p: FusedLinear(64, 64, "swish", precision=p) for p in ("fp8", "fp8_gw_bf16", "bf16")}
    state = blocks["fp8"].state_dict()
    for b in blocks.values():
        b.load_state_dict(state)
    x = torch.randn(16, 64)
    lin = blocks["fp8"].lin
    ref = torch.nn.functional.silu(x.double() @ lin.weight.double().T + lin.bias.double())
    y8, y16 = blocks["fp8"](x).detach(), blocks["bf16"](x).detach()
    # (On the CPU bf16 runs in FP32: the contrast is with FP32 sums of exact operands.)
    assert rel_err(y8, ref) > 10 * rel_err(y16, ref)
    assert rel_err(y8, ref) < FP8_REL
    dy = torch.randn(16, 64)
    _, g8 = _grads(blocks["fp8"], x, dy)
    _, g8w = _grads(blocks["fp8_gw_bf16"], x, dy)
    assert torch.equal(g8[0], g8w[0]) and not torch.equal(g8[1], g8w[1])


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp8", "fp8_gw_bf16"])
def test_fp8_on_cuda_is_refused_with_a_clear_error(precision):
    x = torch.randn(4, 32, device="cuda")
    w, b = torch.randn(16, 32, device="cuda"), torch.randn(16, device="cuda")
    with pytest.raises(RuntimeError, match="fp8 runs on the CPU backend only"):
        fused_linear.fused_linear(x, w, b, "swish", [], precision=precision)

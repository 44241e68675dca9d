"""FP8 (`precision="fp8"`, `"fp8_gw_bf16"`): on the CPU, the backend's emulation of Hopper's
row-wise e4m3 recipe (docs/NUMERICS.md, "FP8"); on CUDA, the e4m3 GEMMs, which quantise to
the emulation's bytes. Compared with float64 PyTorch (chain_ref) at FP8's documented
tolerance, with the same block in bf16 to show the quantisation happens, and on CUDA with
the emulation itself."""

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


#: On CUDA against the CPU emulation of the same block: the same quantised operands, so only
#: the FP32 sums' order and the tensor cores' accumulation differ (a wrong scale or
#: transpose is off by O(1)); a bf16 model's output and dX, dW are also rounded to bf16.
EMULATION_REL = {torch.float32: 1e-2, torch.bfloat16: 2e-2, torch.float16: 1e-2}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("precision", ["fp8", "fp8_gw_bf16"])
def test_fp8_on_cuda_matches_the_emulation_and_float64(precision, dtype):
    torch.manual_seed(2)
    ops = "groupnorm(16),swish,mul,swish"
    cpu = FusedLinear(256, 512, ops, precision=precision)
    gpu = FusedLinear(256, 512, ops, precision=precision).to("cuda", dtype)
    gpu.load_state_dict(cpu.state_dict())
    # The emulation sees the values the GPU block holds (rounded to its dtype).
    cpu.load_state_dict({k: v.to(dtype).float() for k, v in cpu.state_dict().items()})
    x = torch.randn(48, 256).to(dtype).float()
    dy = torch.randn(48, 512).to(dtype).float()
    y, grads = _grads(gpu, x.to("cuda", dtype), dy.to("cuda", dtype))
    y_emu, grads_emu = _grads(cpu, x, dy)
    y64, grads64 = reference_grads(x, cpu.lin.weight, cpu.lin.bias, cpu.ops, cpu.chain_parameters(), dy)
    names = ["x", "lin.weight", "lin.bias", *gpu._param_names]
    assert rel_err(y, y_emu) < EMULATION_REL[dtype], rel_err(y, y_emu)
    assert rel_err(y, y64) < FP8_REL
    for name, got, emu, want in zip(names, grads, grads_emu, grads64):
        assert rel_err(got, emu) < EMULATION_REL[dtype], (name, rel_err(got, emu))
        assert rel_err(got, want) < FP8_REL, (name, rel_err(got, want))


@pytest.mark.gpu
def test_fp8_weight_cache_follows_the_weight():
    """The quantised weight is made once per version of the weight: reused while it
    stands, made again after an in-place change; a ``.data`` write needs clear_fp8_cache."""
    from fused_linear import _FP8_CACHE, clear_fp8_cache

    torch.manual_seed(3)
    block = FusedLinear(128, 64, "swish", precision="fp8").cuda()
    x = torch.randn(32, 128, device="cuda")
    w = block.lin.weight

    def fresh():  # the same weight's value, quantised per call (a new tensor: no cache entry)
        return fused_linear.fused_linear(x, w.detach().clone(), block.lin.bias, "swish", [], precision="fp8")

    with torch.no_grad():
        y = block(x)
        cached = _FP8_CACHE[id(w)][1]
        assert torch.equal(y, fresh())
        assert block(x) is not None and _FP8_CACHE[id(w)][1] is cached, "the cache was made again"
        w.mul_(-2.0)
        y2 = block(x)
        assert _FP8_CACHE[id(w)][1] is not cached and torch.equal(y2, fresh())
        w.data.mul_(0.5)  # unseen by the version counter
        clear_fp8_cache()
        assert torch.equal(block(x), fresh())
    # A training step: the backward uses the forward's copies.
    xg = x.clone().requires_grad_(True)
    block(xg).sum().backward()
    assert xg.grad is not None and torch.isfinite(xg.grad).all()


@pytest.mark.gpu
def test_fp8_on_cuda_refuses_features_not_multiples_of_16():
    x = torch.randn(4, 40, device="cuda")
    w, b = torch.randn(16, 40, device="cuda"), torch.randn(16, device="cuda")
    with pytest.raises(RuntimeError, match="multiples of 16"):
        fused_linear.fused_linear(x, w, b, "swish", [], precision="fp8")


@pytest.mark.gpu
def test_fp8_with_a_leading_avgpool_quantises_the_folded_weight():
    """A chain that starts with an AvgPool folds it into the weight: the block quantises the
    folded weight itself (the cache of the unfolded one is not offered to it)."""
    torch.manual_seed(4)
    cpu = FusedLinear(64, 256, "avgpool(4),gelu,sum", precision="fp8")
    gpu = FusedLinear(64, 256, "avgpool(4),gelu,sum", precision="fp8").cuda()
    gpu.load_state_dict(cpu.state_dict())
    x = torch.randn(32, 64)
    y64, _ = reference_grads(x, cpu.lin.weight, cpu.lin.bias, cpu.ops, [], torch.ones(32))
    with torch.no_grad():
        y = gpu(x.cuda())
    assert rel_err(y, y64) < FP8_REL

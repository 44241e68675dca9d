"""An fp16 model (``x`` and ``weight`` in ``torch.float16``): the block runs on float32 copies
(exact), its output rounded to float16 once, gradients back in each tensor's dtype. The GEMMs
run in TF32 on CUDA by default, exact on fp16 values (their 11 significant bits fit TF32's)."""

import pytest
import torch

import fused_linear

F16 = torch.float16
OPS = "groupnorm(4),swish,mul,swish"


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _case(device="cpu", batch=6, n_in=24, n_out=32):
    block = fused_linear.FusedLinear(n_in, n_out, OPS).to(device)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_()
    x = torch.randn(batch, n_in, device=device)
    return block, x


def _widened_reference(block_h, x_h):
    """The same fp16 values through the float32 block: what the fp16 block must round."""
    ref = fused_linear.FusedLinear(block_h.in_features, block_h.out_features, OPS, precision="fp32")
    ref = ref.to(x_h.device)
    with torch.no_grad():
        for p, q in zip(ref.parameters(), block_h.parameters()):
            p.copy_(q.float())
    xr = x_h.detach().float().requires_grad_(True)
    y = ref(xr)
    return ref, xr, y


def test_fp16_model_on_the_cpu_rounds_the_float32_block_once():
    block, x = _case()
    block = block.half()
    assert block.effective_precision == "fp32"  # on the CPU
    x_h = x.half().requires_grad_(True)
    y = block(x_h)
    assert y.dtype == F16
    ref, xr, y_ref = _widened_reference(block, x_h)
    assert torch.equal(y, y_ref.half())
    dy = torch.randn_like(y_ref)
    y.backward(dy.half())
    y_ref.backward(dy.half().float())
    assert x_h.grad.dtype == F16 and rel(x_h.grad, xr.grad) < 1e-3
    for p, q in zip(block.parameters(), ref.parameters()):
        assert p.grad.dtype == F16 and rel(p.grad, q.grad) < 1e-3


def test_fp16_block_takes_float32_parameters_and_gives_their_gradients_in_float32():
    block, x = _case()
    w = block.lin.weight.detach().half().requires_grad_(True)
    b = block.lin.bias.detach().float().requires_grad_(True)
    params = [p.detach().float().requires_grad_(True) for p in block.chain_parameters()]
    y = fused_linear.fused_linear(x.half(), w, b, OPS, params)
    y.float().sum().backward()
    assert y.dtype == F16 and w.grad.dtype == F16 and b.grad.dtype == torch.float32
    assert all(p.grad.dtype == torch.float32 for p in params)


MIXED = [(F16, torch.float32), (torch.float32, F16), (F16, torch.bfloat16)]


@pytest.mark.parametrize("x_dtype,w_dtype", MIXED)
def test_mixed_x_and_weight_dtypes_are_refused(x_dtype, w_dtype):
    block, x = _case()
    w = block.lin.weight.detach().to(w_dtype)
    b = block.lin.bias.detach()
    with pytest.raises(TypeError, match="dtype"):
        fused_linear.fused_linear(x.to(x_dtype), w, b, OPS, [p.detach() for p in block.chain_parameters()])


def test_bf16_precision_with_fp16_tensors_is_refused():
    block, x = _case()
    block = block.half()
    with pytest.raises(ValueError, match="bf16 would round"):
        fused_linear.fused_linear(
            x.half(), block.lin.weight, block.lin.bias, OPS, block.chain_parameters(), precision="bf16"
        )


def test_fuse_on_an_fp16_model():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Tanh()).half()
    fused = fused_linear.fuse(model)
    x = torch.randn(5, 16).half()
    y, y_ref = fused(x), model(x.float().half())
    assert y.dtype == F16 and rel(y, y_ref) < 2e-3


@pytest.mark.gpu
def test_fp16_model_on_the_gpu_against_pytorch_half_and_float64():
    from fused_linear.bench import PlainBlock

    torch.manual_seed(1)
    block, x = _case("cuda", batch=64, n_in=256, n_out=512)
    block = block.half()
    assert block.effective_precision == "tf32"
    x_h = x.half()
    y = block(x_h)
    assert y.dtype == F16
    # float64 on the same fp16 values (on the CPU), and PyTorch's own fp16 model.
    state = {k: v.float().cpu() for k, v in block.state_dict().items()}
    plain64 = PlainBlock(256, 512, OPS)
    plain64.load_state_dict(state)
    want = plain64.double()(x_h.double().cpu())
    # Ours against float64: the output's fp16 rounding (2^-11) and FP32 sums.
    assert rel(y.cpu(), want) < 1e-3, rel(y.cpu(), want)
    plain = PlainBlock(256, 512, OPS)
    plain.load_state_dict(state)
    plain = plain.cuda().half()
    assert rel(y, plain(x_h)) < 1e-2

"""A bf16 model's blocks (docs/PYTHON.md, "A bf16 model"): bfloat16 ``x`` and weight
stay bfloat16, the output and their gradients come back in bfloat16, the bias's and
the chain parameters' gradients in those parameters' dtypes.

The GPU tests hold ours to PyTorch's own bf16 model (``torch.allclose(atol=rtol=1e-2)``,
KernelBench's bf16 rule) and to float64 computed from the same bf16 values: ours must
be the closer of the two to float64, for the output and every gradient.
"""

import pytest
import torch

import fused_linear
from chain_ref import grads_of, half_pair, reference_grads, rel_err
from fused_linear import PRESETS, FusedLinear, _forward_fake

BF16 = torch.bfloat16


# ---------------------------------------------------------------- CPU


def test_cpu_bf16_runs_on_float32_copies():
    plain, ours = half_pair(16, 32, PRESETS["M1"].replace("256", "4"), "cpu", BF16)
    x = torch.rand(5, 16, dtype=BF16)
    y, grads = grads_of(ours, x, torch.ones(5, 32, dtype=BF16))
    assert y.dtype == BF16 and all(g.dtype == BF16 for g in grads.values())
    wide = FusedLinear(16, 32, PRESETS["M1"].replace("256", "4"))
    wide.load_state_dict({k: v.float() for k, v in ours.state_dict().items()})
    assert torch.equal(y, wide(x.float()).detach().to(BF16))


def test_bf16_weight_with_float32_bias_gives_each_gradient_its_dtype():
    x = torch.rand(4, 8, dtype=BF16, requires_grad=True)
    weight = torch.randn(16, 8, dtype=BF16, requires_grad=True)
    bias = torch.randn(16, requires_grad=True)  # float32
    w = torch.randn(16, dtype=BF16, requires_grad=True)
    y = fused_linear.fused_linear(x, weight, bias, "mul,swish", [w])
    y.sum().backward()
    assert y.dtype == BF16
    assert (x.grad.dtype, weight.grad.dtype, bias.grad.dtype, w.grad.dtype) == (
        BF16,
        BF16,
        torch.float32,
        BF16,
    )


@pytest.mark.parametrize("x_dtype,w_dtype", [(BF16, torch.float32), (torch.float32, BF16)])
def test_mixed_x_and_weight_dtypes_are_refused(x_dtype, w_dtype):
    x, weight, bias = torch.rand(3, 8, dtype=x_dtype), torch.randn(16, 8, dtype=w_dtype), torch.zeros(16)
    with pytest.raises(TypeError, match=r"x and weight both in torch\.bfloat16"):
        fused_linear.fused_linear(x, weight, bias, "swish")


@pytest.mark.parametrize("precision", ["fp32", "tf32", "tf32x3"])
def test_another_precision_with_bf16_tensors_is_refused(precision):
    x, weight, bias = (
        torch.rand(3, 8, dtype=BF16),
        torch.randn(16, 8, dtype=BF16),
        torch.zeros(16, dtype=BF16),
    )
    with pytest.raises(ValueError, match=rf"precision `{precision}` with bfloat16 tensors"):
        fused_linear.fused_linear(x, weight, bias, "swish", precision=precision)
    # Unset, or bf16, is the bf16 model.
    assert fused_linear.fused_linear(x, weight, bias, "swish", precision="bf16").dtype == BF16


def test_a_float16_parameter_of_a_bf16_block_is_refused():
    x, weight = torch.rand(3, 8, dtype=BF16), torch.randn(16, 8, dtype=BF16)
    with pytest.raises(TypeError, match=r"bias has dtype torch\.float16"):
        fused_linear.fused_linear(x, weight, torch.zeros(16, dtype=torch.float16), "swish")


def test_fake_outputs_of_a_bf16_block():
    """Shape inference (torch.compile, export): y in bf16, the saved z in float32."""
    x, weight = torch.empty(4, 8, dtype=BF16, device="meta"), torch.empty(32, 8, dtype=BF16, device="meta")
    y, z = _forward_fake(x, weight, torch.empty(32, device="meta"), [], "avgpool(4),swish", "bf16")
    assert (y.dtype, tuple(y.shape)) == (BF16, (4, 8))
    assert z.dtype == torch.float32 and z.shape[0] == 4


# ---------------------------------------------------------------- GPU

# (batch, in, out) per preset: the seed chains at a moderate size (GroupNorm groups as
# the chain says: 4 channels for M1 and M5, 16 for M2, 2 for M3), then at the seed sizes.
SEED = {"M2": (32768, 1024, 4096)}
CASES = [(name, (256, 1024, 1024)) for name in PRESETS] + [
    (name, SEED.get(name, (1024, 8192, 8192))) for name in PRESETS
]


@pytest.mark.gpu
@pytest.mark.parametrize("name,shape", CASES, ids=[f"{n}-{s[0]}x{s[1]}x{s[2]}" for n, s in CASES])
def test_bf16_model_against_pytorch_bf16_and_float64(name, shape):
    batch, k, n = shape
    ops = PRESETS[name]
    plain, ours = half_pair(k, n, ops, "cuda", BF16)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.rand(batch, k, device="cuda", generator=g).to(BF16)  # KernelBench's inputs
    out = ours(x).shape
    dy = torch.randn(out, device="cuda", generator=g).to(BF16)
    y, grads = grads_of(ours, x, dy)
    y_pt, grads_pt = grads_of(plain, x, dy)
    assert y.dtype == BF16 and grads["x"].dtype == BF16 and grads["lin.weight"].dtype == BF16
    y64, grads64 = reference_grads(x, plain.lin.weight, plain.lin.bias, ops, plain.chain_params(), dy)
    # The reference's order: x, the Linear's weight and bias, the chain's in chain order.
    ref = dict(zip(["x", "lin.weight", "lin.bias", *ours._param_names], grads64))
    rows = []
    for what in ["y", *ref]:
        got, pt, ref_ = (y, y_pt, y64) if what == "y" else (grads[what], grads_pt[what], ref[what])
        assert torch.isfinite(got.float()).all(), f"{name} {what}: non-finite values"
        rows.append(
            (
                what,
                rel_err(got, ref_),
                rel_err(pt, ref_),
                outside(got, ref_),
                outside(pt, ref_),
                outside(got, pt),
            )
        )
    print(
        f"\n{name} {shape}: relative error from float64 (ours, PyTorch bf16); fraction outside "
        "allclose(1e-2) of float64 (ours, PyTorch bf16) and of PyTorch bf16 (ours)"
    )
    for what, e_ours, e_pt, o_ours, o_pt, o_vs_pt in rows:
        print(f"  {what:<12} {e_ours:.2e} {e_pt:.2e}   {o_ours:.2e} {o_pt:.2e}   {o_vs_pt:.2e}")
    for what, e_ours, e_pt, o_ours, o_pt, _ in rows:
        # Closer to float64 than PyTorch's own bf16 model, norm-wise and element by
        # element (KernelBench's allclose against float64). Against PyTorch's bf16 model
        # itself allclose cannot hold where that model is outside it of float64: its
        # parameter gradients sum bf16-rounded terms over the batch (printed above).
        # (Equal where both are float64's value rounded once to bf16: a GroupNorm bias
        # ending the chain gets the batch sum of the bf16 dy.)
        assert e_ours <= e_pt, f"{name} {what}: ours {e_ours:.2e} from float64, PyTorch's bf16 {e_pt:.2e}"
        assert o_ours <= o_pt, (
            f"{name} {what}: {o_ours:.2e} of ours outside allclose of float64, PyTorch {o_pt:.2e}"
        )


def outside(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The fraction of values outside ``allclose(atol=rtol=1e-2)`` of ``ref``."""
    close = torch.isclose(got.double(), ref.double().to(got.device), atol=1e-2, rtol=1e-2)
    return 1.0 - close.double().mean().item()


def output_and_grads(module, params, x, dy):
    """[y, dx, *d params]: one forward and backward of `module` at `x` with output gradient `dy`."""
    xx = x.clone().requires_grad_(True)
    y = module(xx)
    return [y.detach(), *torch.autograd.grad(y, [xx, *params], dy)]


class TwoBlocks(torch.nn.Module):
    """Two fused blocks in a bf16 model; between them an exact scaling only (a PyTorch bf16
    op that inductor rounds otherwise than eager would move the row max's arg-max)."""

    def __init__(self, device=None):
        super().__init__()
        self.a = FusedLinear(32, 64, "groupnorm(4),swish,mul,swish", device=device)
        self.head = FusedLinear(64, 64, "avgpool(4),gelu,scale(2),max", device=device)

    def forward(self, x):
        return self.head(self.a(x) * 0.5)


@pytest.mark.gpu
def test_bf16_no_float32_copy_of_x_or_weight():
    """Forward and backward of a bf16 block allocate less than a float32 copy of ``x`` or of
    the weight would: nothing is widened per call on the bf16-native path.

    The shape keeps the forward off split-K (whose float32 partial sums are a workspace of
    their own), with ``x`` (4096 x 8192) the largest tensor and the weight next: each bound
    allows every buffer the bf16 paths allocate (the output, the saved float32 ``z``, the
    backward's bf16 ``dz``, ``dx``, ``dW``), and a float32 ``x`` (128 MiB) or weight (32 MiB)
    exceeds it."""
    torch.manual_seed(0)
    batch, k, n = 4096, 8192, 1024
    ops = PRESETS["M1"]
    block = FusedLinear(k, n, ops, device="cuda", dtype=BF16)
    x = torch.rand(batch, k, device="cuda").to(BF16).requires_grad_(True)
    mib = 2**20
    y16, y32 = batch * n * 2, batch * n * 4  # a bf16 output; an FP32 one (or z)
    f32_x, f32_w = batch * k * 4, n * k * 4

    def peak(work):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = work()
        torch.cuda.synchronize()
        return out, torch.cuda.max_memory_allocated() - base

    with torch.no_grad():
        y, extra = peak(lambda: block(x))
    assert y.dtype == BF16
    bound = y16 + 4 * mib
    assert bound < f32_w < f32_x
    assert extra < bound, f"inference allocated {extra / mib:.1f} MiB (bound {bound / mib:.0f})"

    small = [block.lin.bias.float()] + [p.float() for p in block.chain_parameters()]
    w = block.lin.weight.detach()
    forward = torch.ops.fused_linear.forward
    (y, z), extra = peak(lambda: forward(x.detach(), w, small[0], small[1:], ops, "bf16"))
    assert (y.dtype, z.dtype) == (BF16, torch.float32)
    bound = y16 + y32 + 4 * mib  # y and the saved z
    assert bound < f32_w
    assert extra < bound, f"forward allocated {extra / mib:.1f} MiB (bound {bound / mib:.0f})"

    y = block(x)
    dy = torch.randn_like(y)
    _, extra = peak(lambda: y.backward(dy))
    assert x.grad.dtype == BF16 and all(p.grad.dtype == BF16 for p in block.parameters())
    # dx, dW and dz in bf16, the parameter-gradient partial sums (small).
    bound = batch * k * 2 + n * k * 2 + y16 + 4 * mib
    assert bound < f32_w + batch * k * 2 + n * k * 2
    assert extra < bound, f"backward allocated {extra / mib:.1f} MiB (bound {bound / mib:.0f})"


@pytest.mark.gpu
def test_bf16_model_compiled_with_inductor_matches_eager():
    """torch.compile(fullgraph=True) of a bf16 model: the same kernels on the same values,
    so eager's bf16 output and gradients bit for bit (the inference op's path too)."""
    torch.manual_seed(0)
    model = TwoBlocks(device="cuda").to(BF16)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="inductor")
    params = list(model.parameters())
    for batch in (33, 130):
        x = torch.rand(batch, 32, device="cuda").to(BF16)
        dy = torch.linspace(-1, 1, batch, device="cuda").to(BF16)
        eager = output_and_grads(model, params, x, dy)
        comp = output_and_grads(compiled, params, x, dy)
        for i, (a, b) in enumerate(zip(comp, eager)):
            assert a.dtype == b.dtype, i
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), eager[0], rtol=0, atol=0)


@pytest.mark.gpu
def test_bf16_training_step_in_a_cuda_graph():
    """A bf16 block's training step captured in a CUDA graph (the bias and chain parameters
    are widened inside the graph) and replayed on new data equals eager."""
    torch.manual_seed(0)
    batch, k, n = 256, 1024, 512
    model = FusedLinear(k, n, "bias,hardtanh(-1,1),mish,groupnorm(128)", device="cuda").to(BF16)
    params = list(model.parameters())
    static_x = torch.rand(batch, k, device="cuda").to(BF16).requires_grad_(True)
    static_dy = torch.randn(batch, n, device="cuda").to(BF16)

    def step():
        for t in [static_x, *params]:
            t.grad = None
        y = model(static_x)
        y.backward(static_dy)
        return y

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        static_y = step().detach()
    data = torch.rand(batch, k, device="cuda").to(BF16)
    with torch.no_grad():
        static_x.copy_(data)
    g.replay()
    torch.cuda.synchronize()
    got = [static_y, static_x.grad] + [p.grad for p in params]
    want = output_and_grads(model, params, data, static_dy)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype, i
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.gpu
def test_bf16_block_is_one_autograd_node():
    """The bf16 bias and chain parameters go to the op as stored (widened inside it), so
    the block's output hangs on one node whose inputs are the leaves themselves: no cast
    node per parameter, no second node for their gradients."""
    torch.manual_seed(0)
    block = FusedLinear(64, 128, "bias,groupnorm(8),swish,mul", device="cuda", dtype=BF16)
    x = torch.randn(16, 64, device="cuda", dtype=BF16, requires_grad=True)
    y = block(x)
    inputs = [type(f).__name__ for f, _ in y.grad_fn.next_functions if f is not None]
    assert inputs and all(name == "AccumulateGrad" for name in inputs), inputs
    y.float().square().sum().backward()
    for name, p in [("x", x), *block.named_parameters()]:
        assert p.grad is not None and p.grad.dtype == p.dtype, name

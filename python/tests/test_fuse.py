"""fused_linear.fuse(model): the KernelBench problems and mixed models, on the CPU backend
against the unfused model (values and every gradient), the parameters shared, not copied."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fused_linear
from chain_ref import kernelbench_problem

PROBLEMS = [
    "p088_gemm_groupnorm_swish_multiply_swish",
    "p037_matmul_swish_sum_groupnorm",
    "p062_matmul_groupnorm_leakyrelu_sum",
    "p098_matmul_avgpool_gelu_scale_max",
    "p094_gemm_biasadd_hardtanh_mish_groupnorm",
]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def check_same(model, fused, x, tol=1e-5):
    """Outputs and the gradients of x and of every parameter agree."""
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    ys = [m(xi) for m, xi in zip((model, fused), xs)]
    assert ys[0].shape == ys[1].shape
    assert rel(ys[1], ys[0]) < tol, rel(ys[1], ys[0])
    dy = torch.randn_like(ys[0])
    grads = []
    # The same parameters in the same order (an optimizer's state lines up).
    names = [n.removeprefix("_orig_mod.") for n, _ in fused.named_parameters()]  # torch.compile's wrapper
    assert [n for n, _ in model.named_parameters()] == names
    for m, xi, y in zip((model, fused), xs, ys):
        params = list(m.parameters())
        grads.append(torch.autograd.grad(y, [xi, *params], dy, allow_unused=True))
    for g0, g1 in zip(*grads):
        if g0 is None:
            assert g1 is None
        else:
            assert rel(g1, g0) < tol, rel(g1, g0)


def kernelbench_case(name, scale, device="cpu"):
    """Problem ``name``'s Model (seeded) and an input, at its seed sizes divided by ``scale``."""
    with kernelbench_problem(name, scale) as problem:
        torch.manual_seed(0)
        return problem.Model(*problem.get_init_inputs()).to(device), problem.get_inputs()[0].to(device)


@pytest.mark.parametrize("name", PROBLEMS)
def test_fuse_kernelbench_problems(name, capsys):
    model, x = kernelbench_case(name, 32)
    fused = fused_linear.fuse(model, verbose=True)
    said = capsys.readouterr().out
    assert "fused with" in said, said
    # The same Parameter objects under the same names: nothing copied.
    assert list(fused.state_dict()) == list(model.state_dict())
    for n, p in model.named_parameters():
        assert fused.get_parameter(n) is p, n
    # One fused call and nothing of the chain left in the graph.
    calls = [n for n in fused.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    assert len(calls) == 1, fused.graph
    check_same(model, fused, x)


class Mixed(nn.Module):
    """Two Linears with chains, a residual through .detach(), things fuse() must leave."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.w = nn.Parameter(torch.randn(32))
        self.b = nn.Linear(32, 24)
        self.c = nn.Linear(24, 12, bias=False)
        self.drop = nn.Dropout(p=0.0)
        self.w2 = nn.Parameter(torch.randn(24, 24))
        self.bias2 = nn.Parameter(torch.randn(24))

    def forward(self, x):
        h = self.a(x)
        h = F.silu(h)
        h = self.drop(h)
        h = torch.clamp(h * self.w, -2.0, 3.0)
        h = h / 4.0
        y = self.b(h)  # its value is used twice: y.detach() and the chain
        r = y.detach()
        z = torch.tanh(F.leaky_relu(y, 0.2))
        z = z + r
        z = F.linear(z, self.w2, self.bias2)
        return F.gelu(z).amax(dim=1, keepdim=True) + torch.softmax(self.c(r), dim=1)[:, :1]


def test_fuse_mixed_model(capsys):
    torch.manual_seed(1)
    model = Mixed()
    fused = fused_linear.fuse(model, verbose=True)
    said = capsys.readouterr().out
    assert "a: fused with `swish,mul,hardtanh(-2.0,3.0),scale(0.25)`" in said, said
    assert "b: left in PyTorch: no chain after it" in said and "used 2 times" in said, said
    assert "linear: fused with `gelu,max`" in said, said
    assert "c: fused with `softmax`" in said, said
    assert list(fused.state_dict()) == list(model.state_dict())
    check_same(model, fused, torch.randn(5, 16))


def test_fused_model_refuses_inputs_its_chain_was_not_matched_for():
    model = nn.Sequential(nn.Linear(8, 16), nn.GroupNorm(4, 16))
    fused = fused_linear.fuse(model)
    with pytest.raises(ValueError, match="2-D"):
        fused(torch.randn(2, 3, 8))
    # A pointwise chain takes any leading dimensions, as the Linear does.
    pointwise = nn.Sequential(nn.Linear(8, 16), nn.SiLU())
    check_same(pointwise, fused_linear.fuse(pointwise), torch.randn(2, 3, 8))


def test_fused_model_under_torch_compile():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(8, 16), nn.GroupNorm(4, 16), nn.Mish())
    fused = fused_linear.fuse(model)
    compiled = torch.compile(fused, backend="aot_eager", fullgraph=True)
    check_same(model, compiled, torch.randn(6, 8))


@pytest.mark.gpu
@pytest.mark.parametrize("name", PROBLEMS)
def test_fuse_kernelbench_problems_on_the_gpu(name):
    """The same on CUDA (strict FP32 on both sides, TF32 off), at a quarter of the seed sizes."""
    model, x = kernelbench_case(name, 4, "cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    check_same(model, fused_linear.fuse(model), x, tol=1e-4)


class Arithmetic(nn.Module):
    """The arithmetic of KernelBench's chains: numbers and parameters added, subtracted,
    multiplied and divided on either side, ReLU and ReLU6."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(12, 20)
        self.shift = nn.Parameter(torch.randn(20))
        self.div = nn.Parameter(torch.rand(20) + 0.5)

    def forward(self, x):
        h = torch.relu(self.lin(x) - 0.25)
        h = (h + 1.5) / self.div
        h = 2.0 - h
        h = F.relu6(h * 3.0 - self.shift)
        return h / 2.0


def test_fuse_arithmetic_and_relu(capsys):
    torch.manual_seed(3)
    model = Arithmetic()
    fused = fused_linear.fuse(model, verbose=True)
    said = capsys.readouterr().out
    assert (
        "lin: fused with `bias,leakyrelu(0.0),bias,mul,scale(-1.0),bias,"
        "scale(3.0),bias,hardtanh(0.0,6.0),scale(0.5)`" in said
    ), said
    calls = [n for n in fused.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    # One fused call, plus the vectors it takes: three constants, -shift and 1/div.
    assert (
        sum(n.target is torch.neg for n in calls) == 1
        and sum(n.target is torch.reciprocal for n in calls) == 1
    )
    assert list(fused.state_dict()) == list(model.state_dict())
    check_same(model, fused, torch.randn(7, 12))


class BiasFree(nn.Module):
    """Linears without bias: a bias-free nn.Linear and x @ W.T (KernelBench's matmul form)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(10, 16, bias=False)
        self.weight = nn.Parameter(torch.randn(8, 16))

    def forward(self, x):
        h = F.gelu(self.a(x))
        return torch.tanh(torch.matmul(h, self.weight.T) / 2.0)


def test_fuse_linears_without_bias(capsys):
    torch.manual_seed(4)
    model = BiasFree()
    fused = fused_linear.fuse(model, verbose=True)
    said = capsys.readouterr().out
    assert "a: fused with `gelu`" in said and "matmul: fused with `scale(0.5),tanh`" in said, said
    calls = [n for n in fused.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    assert not [n for n in calls if n.target in ("t", getattr)], fused.graph  # the transpose is gone
    check_same(model, fused, torch.randn(5, 10))


class Offset(nn.Module):
    """A Linear without bias (a constant zero bias for the op) and a number subtracted
    (a constant vector too)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(10, 8, bias=False)

    def forward(self, x):
        return torch.relu(self.lin(x) - 0.25)


def test_constant_vectors_are_made_once_and_serve_training_after_inference(monkeypatch):
    """Constant vectors (a missing bias, a number added in the chain) are made once: plain
    eager calls reuse one tensor each (no fill per call); one first made under
    inference_mode still serves a training call (it is not an inference tensor); values
    and gradients stay the model's."""
    torch.manual_seed(5)
    model = Offset()
    fused = fused_linear.fuse(model)
    x = torch.randn(6, 10)
    made = []
    real_full = torch.full

    def counting_full(*args, **kwargs):
        made.append(args[0])
        return real_full(*args, **kwargs)

    monkeypatch.setattr(torch, "full", counting_full)
    with torch.inference_mode():
        first = fused(x)
    count = len(made)
    second = fused(x)
    assert len(made) == count, made  # the second call made no vector
    monkeypatch.undo()
    assert torch.equal(first, second)
    check_same(model, fused, x)

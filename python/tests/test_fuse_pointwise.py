"""fused_linear.fuse(model) on sigmoid, GELU's tanh form, eval-mode BatchNorm1d and
``h * s + h.detach()``: each spelling recognised, on the CPU backend against the unfused
model (values and every gradient), the parameters shared (``state_dict`` keys unchanged),
under ``torch.compile(fullgraph=True)``, and what stays PyTorch's with the reason."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fused_linear
from fused_linear.fuse import _batch_norm_affine


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def check_same(model, fused, x, tol=1e-5):
    """Outputs and the gradients of x and of every parameter agree; the parameters are the
    model's, in its order."""
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    ys = [m(xi) for m, xi in zip((model, fused), xs)]
    assert ys[0].shape == ys[1].shape
    assert rel(ys[1], ys[0]) < tol, rel(ys[1], ys[0])
    names = [n.removeprefix("_orig_mod.") for n, _ in fused.named_parameters()]  # torch.compile's wrapper
    assert [n for n, _ in model.named_parameters()] == names
    dy = torch.randn_like(ys[0])
    grads = [
        torch.autograd.grad(y, [xi, *m.parameters()], dy, allow_unused=True)
        for m, xi, y in zip((model, fused), xs, ys)
    ]
    for name, g0, g1 in zip(["x", *names], *grads):
        assert g0 is not None and g1 is not None, name
        assert rel(g1, g0) < tol, (name, rel(g1, g0))


def fused_chains(model, capsys):
    """``fuse(model, verbose=True)`` and what it said, one line per Linear."""
    fused = fused_linear.fuse(model, verbose=True)
    return fused, capsys.readouterr().out


class Sigmoids(nn.Module):
    """Every spelling of sigmoid after a Linear, and ``x * sigmoid(x)`` (swish) both ways."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(6, 8) for _ in range(4))
        self.e, self.f, self.g = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.sig = nn.Sigmoid()

    def forward(self, x):
        h = self.sig(self.a(x)) + torch.sigmoid(self.b(x)) + F.sigmoid(self.c(x)) * 2.0
        h = h + self.d(x).sigmoid()
        z = self.e(h)
        h = z * torch.sigmoid(z)  # swish
        z = self.f(h)
        h = self.sig(z) * z  # swish, through the module
        return torch.sigmoid(self.g(h) * 0.5)


def test_fuse_sigmoid_in_every_spelling(capsys):
    torch.manual_seed(5)
    model = Sigmoids()
    fused, said = fused_chains(model, capsys)
    for name in "abd":
        assert f"{name}: fused with `sigmoid`" in said, said
    assert "c: fused with `sigmoid,scale(2.0)`" in said, said
    assert "e: fused with `swish`" in said and "f: fused with `swish`" in said, said
    assert "g: fused with `scale(0.5),sigmoid`" in said, said
    assert list(fused.state_dict()) == list(model.state_dict())
    check_same(model, fused, torch.randn(5, 6))


class Gelus(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 10), nn.Linear(10, 10), nn.Linear(10, 4)
        self.gelu = nn.GELU(approximate="tanh")

    def forward(self, x):
        h = self.gelu(self.a(x))
        h = F.gelu(self.b(h), approximate="tanh")
        return F.gelu(self.c(h))  # the erf form


def test_fuse_gelu_tanh_form(capsys):
    torch.manual_seed(6)
    model = Gelus()
    fused, said = fused_chains(model, capsys)
    assert "a: fused with `gelu_tanh`" in said and "b: fused with `gelu_tanh`" in said, said
    assert "c: fused with `gelu`" in said, said
    assert list(fused.state_dict()) == list(model.state_dict())
    # Far into both tails too, where 1 + tanh(u) cancels and x^3 is large.
    check_same(model, fused, torch.randn(7, 6) * 4)


def batch_norm_model(affine=True, track=True):
    torch.manual_seed(7)
    model = nn.Sequential(
        nn.Linear(12, 16), nn.BatchNorm1d(16, eps=1e-3, affine=affine, track_running_stats=track), nn.Mish()
    )
    norm = model[1]
    with torch.no_grad():
        if affine:
            norm.weight.copy_(torch.randn(16))
            norm.bias.copy_(torch.randn(16))
        if track:
            norm.running_mean.copy_(torch.randn(16))
            norm.running_var.copy_(torch.rand(16) * 2 + 0.1)
    return model


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no-affine"])
def test_fuse_batch_norm_in_eval_mode_as_a_per_channel_affine(affine, capsys):
    """Fused as `batchnorm`, which in eval mode runs as the affine of the running statistics,
    ``mul(p),bias(q)``, computed at each call from the module's tensors (gradients reach them)."""
    model = batch_norm_model(affine).eval()
    fused, said = fused_chains(model, capsys)
    assert "0: fused with `batchnorm(0.001),mish`" in said, said
    assert list(fused.state_dict()) == list(model.state_dict())  # running stats, num_batches_tracked
    check_same(model, fused, torch.randn(9, 12))
    # Inputs with more dimensions: BatchNorm1d would normalise another dimension.
    with pytest.raises(ValueError, match="2-D"):
        fused(torch.randn(2, 3, 12))


def test_fused_batch_norm_follows_train_and_eval():
    model = batch_norm_model().eval()
    fused = fused_linear.fuse(model)
    fused.train()
    model.train()
    x = torch.randn(4, 12)
    assert rel(fused(x), model(x)) < 1e-6
    fused.eval()
    model.eval()
    check_same(model, fused, torch.randn(4, 12))


def test_batch_norm_after_a_row_op_is_the_affine_in_eval_mode_only(capsys):
    """Where `batchnorm` cannot go (after a softmax), an eval-mode BatchNorm1d is still fused as
    its affine, and the fused model refuses training mode."""
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(12, 16), nn.Softmax(dim=1), nn.BatchNorm1d(16)).eval()
    fused, said = fused_chains(model, capsys)
    assert "fused with `softmax,mul,bias`" in said, said
    assert sum(n.target is _batch_norm_affine for n in fused.graph.nodes) == 2
    check_same(model, fused, torch.randn(9, 12))
    fused.train()
    with pytest.raises(RuntimeError, match="BatchNorm1d `2` was fused in eval mode"):
        fused(torch.randn(4, 12))


@pytest.mark.parametrize("track", [True, False], ids=["training-mode", "no-running-stats"])
def test_batch_norm_on_batch_statistics_is_fused(track, capsys):
    model = batch_norm_model(track=track)
    if track:
        model.train()
    else:
        model.eval()  # without running statistics it normalises by the batch's even in eval
    fused, said = fused_chains(model, capsys)
    assert "0: fused with `batchnorm(0.001),mish`" in said, said
    y0, y1 = model(torch.ones(5, 12).cumsum(0) ** 1.5), fused(torch.ones(5, 12).cumsum(0) ** 1.5)
    assert rel(y1, y0) < 1e-5


class Everything(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)
        self.b = nn.Linear(16, 8)

    def forward(self, x):
        h = F.gelu(self.norm(self.a(x)), approximate="tanh")
        return self.b(h).sigmoid() * 3.0


def test_fused_pointwise_ops_under_torch_compile(capsys):
    torch.manual_seed(8)
    model = Everything()
    with torch.no_grad():
        model.norm.running_mean.copy_(torch.randn(16))
        model.norm.running_var.copy_(torch.rand(16) + 0.5)
    model.eval()
    fused, said = fused_chains(model, capsys)
    assert (
        "a: fused with `batchnorm(1e-05),gelu_tanh`" in said and "b: fused with `sigmoid,scale(3.0)`" in said
    ), said
    compiled = torch.compile(fused, backend="aot_eager", fullgraph=True)
    check_same(model, compiled, torch.randn(6, 8))


@pytest.mark.gpu
def test_fuse_pointwise_ops_on_the_gpu():
    """The models above on CUDA (strict FP32 on both sides, TF32 off)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    for model, x in [
        (Sigmoids(), torch.randn(65, 6)),
        (Gelus(), torch.randn(65, 6) * 4),
        (batch_norm_model().eval(), torch.randn(65, 12)),
        (batch_norm_model(affine=False).eval(), torch.randn(65, 12)),
        (Everything().eval(), torch.randn(65, 8)),
        (Residuals(), torch.randn(65, 6)),
    ]:
        model, x = model.cuda(), x.cuda()
        check_same(model, fused_linear.fuse(model), x, tol=1e-4)


class Residuals(nn.Module):
    """The Linear's output used again after the chain. KernelBench 70: ``sigmoid(z) * s + z``
    (the ``residual`` op adds the chain's input back); 40: ``z * s + z.detach()``, value
    ``(1 + s) z`` with the gradient of ``z * s`` alone (fused, up to the sum)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 5)
        self.shift = nn.Parameter(torch.randn(5))

    def forward(self, x):
        z = self.a(x)
        h = torch.sigmoid(z) * 2.0 + z
        z = self.b(h)
        h = z * 0.5 + z.clone().detach()
        g = F.gelu(self.c(h) + self.shift)
        return torch.tanh(g.detach() + 3 * g) + 1.0


def test_a_residual_of_the_linear_output(capsys):
    model = Residuals()
    fused, said = fused_chains(model, capsys)
    assert "a: fused with `sigmoid,scale(2.0),residual`" in said, said
    assert "b: fused with `scale(1.5)`; the chain ends" in said and "s times" in said, said
    # Parameters before the sum get the gradient of `3 g` alone; the tanh after it is PyTorch's.
    assert "c: fused with `bias,gelu,scale(4.0)`; the chain ends" in said, said
    assert list(fused.state_dict()) == list(model.state_dict())
    check_same(model, fused, torch.randn(5, 6))
    compiled = torch.compile(fused, backend="aot_eager", fullgraph=True)
    check_same(model, compiled, torch.randn(5, 6))


class ResidualForms(nn.Module):
    """``z + f(z)`` in the other order and through ``torch.add``, and sums the
    ``residual`` op cannot take: after a pool (another width), of another Linear's
    output, and a second use of ``z`` besides the sum."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(6, 8) for _ in range(4))
        self.e = nn.Linear(8, 8)

    def forward(self, x):
        za = self.a(x)
        ha = torch.add(za, F.gelu(za * 0.5 - 1.0))
        zb = self.b(x)
        hb = F.max_pool1d(zb.unsqueeze(1), 2).squeeze(1).repeat(1, 2) + zb
        zc, zd = self.c(x), self.d(x)
        hc = zd + torch.tanh(zc)
        ze = self.e(ha)
        he = torch.sigmoid(ze) + ze + ze.sum(1, keepdim=True)
        return ha.sum(1) + hb.sum(1) + hc.sum(1) + he.sum(1)


def test_the_residual_op_takes_the_linear_output_back(capsys):
    model = ResidualForms()
    fused, said = fused_chains(model, capsys)
    assert "a: fused with `scale(0.5),bias,gelu,residual`" in said, said
    assert "b: left in PyTorch" in said, said  # the pool leaves another width: repeat() is PyTorch's
    assert "c: fused with `tanh`" in said, said  # the sum adds d's output, not c's
    assert "e: left in PyTorch" in said, said  # z has three users
    assert list(fused.state_dict()) == list(model.state_dict())
    check_same(model, fused, torch.randn(7, 6))


class NegatedResidual(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 8)

    def forward(self, x):
        z = self.a(x)
        return z.detach() + z * -1


def test_a_detached_residual_that_cancels_stays_pytorchs(capsys):
    model = NegatedResidual()
    fused, said = fused_chains(model, capsys)
    assert "a: left in PyTorch" in said and "no scale gives both" in said, said
    check_same(model, fused, torch.randn(5, 6))


class Extremes(nn.Module):
    """Elementwise min and max of the Linear's output with a parameter (0-d, (1,), (F,)) or a
    number, in each spelling, and a subtraction of a 0-d parameter (KernelBench 68)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(6, 8) for _ in range(4))
        self.c0 = nn.Parameter(torch.tensor(0.3))
        self.c1 = nn.Parameter(torch.tensor([-0.2]))
        self.cf = nn.Parameter(torch.linspace(-0.5, 0.5, 8))

    def forward(self, x):
        h = torch.min(self.a(x), self.c0) - self.c0
        h = h + torch.maximum(self.b(x), self.cf)
        h = h + self.c(x).clamp(max=self.c1) + self.d(x).clamp(min=0.1)
        return h


def test_elementwise_min_and_max_with_parameters_fuse(capsys):
    torch.manual_seed(5)
    model = Extremes()
    fused, said = fused_chains(model, capsys)
    assert said.count("fused") >= 4 and "left in PyTorch" not in said, said
    check_same(model, fused, torch.randn(64, 6))
    compiled = torch.compile(fused, fullgraph=True)
    check_same(model, compiled, torch.randn(64, 6))

"""fuse() on the whole-row ops: row reductions (sum, mean, min, max, logsumexp, with and
without keepdim, chained), softmax, MaxPool1d, LayerNorm and RMSNorm, against the unfused
model (values and every gradient) on the CPU backend, and on the GPU where there is one."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fused_linear
from fused_linear.fuse import _fused_call


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def fused_chains(gm):
    """The chains of the fused calls in ``gm``'s graph."""
    return [n.args[3] for n in gm.graph.nodes if n.op == "call_function" and n.target is _fused_call]


def check_same(model, x, tol=1e-5):
    """fuse(model) gives the model's output and the gradients of x and of every parameter."""
    fused = fused_linear.fuse(model)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    ys = [m(xi) for m, xi in zip((model, fused), xs)]
    assert ys[0].shape == ys[1].shape, (ys[0].shape, ys[1].shape)
    assert rel(ys[1], ys[0]) < tol, rel(ys[1], ys[0])
    dy = torch.randn_like(ys[0])
    grads = []
    for m, xi, y in zip((model, fused), xs, ys):
        grads.append(torch.autograd.grad(y, [xi, *m.parameters()], dy, allow_unused=True))
    for i, (g0, g1) in enumerate(zip(*grads)):
        if g0 is None:
            assert g1 is None, i
        else:
            assert rel(g1, g0) < tol, (i, rel(g1, g0))
    return fused_chains(fused)


class Lin(nn.Module):
    """A Linear followed by ``tail(self, h)``; ``modules`` registered after the Linear."""

    def __init__(self, tail, n_in=24, n_out=40, **modules):
        super().__init__()
        self.lin = nn.Linear(n_in, n_out)
        for name, m in modules.items():
            setattr(self, name, m)
        self.tail = tail

    def forward(self, x):
        return self.tail(self, self.lin(x))


def _randomize(model):
    """Norm weights and biases drawn from randn, so that they matter."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith("lin."):
                p.copy_(torch.randn_like(p))
    return model


REDUCTIONS = {
    # KernelBench-shaped chains: reductions after reductions (keepdim), ops on one value a row.
    "sum,max,mean,logsumexp,logsumexp": lambda m, h: torch.logsumexp(
        torch.logsumexp(
            torch.mean(
                torch.max(torch.sum(h, dim=1, keepdim=True), dim=1, keepdim=True)[0], dim=1, keepdim=True
            ),
            dim=1,
            keepdim=True,
        ),
        dim=1,
        keepdim=True,
    ),
    "logsumexp,leakyrelu(0.01),gelu": lambda m, h: F.gelu(
        F.leaky_relu(torch.logsumexp(h, dim=1, keepdim=True), 0.01)
    ),
    "sum,tanh,scale(2.0)": lambda m, h: torch.tanh(h.sum(1)) * 2,
    "mean,swish": lambda m, h: F.silu(h.mean(-1)),
    "min": lambda m, h: torch.min(h, dim=1).values,
    "min,scale(-1.0)": lambda m, h: torch.amin(h, 1, keepdim=True) * -1,
    "max,mean": lambda m, h: h.max(dim=1, keepdim=True)[0].mean(dim=1),
    "swish,min,mish": lambda m, h: F.mish(F.silu(h).min(1)[0]),
    "logsumexp": lambda m, h: h.logsumexp(dim=-1),
}


@pytest.mark.parametrize("ops", list(REDUCTIONS))
def test_fuse_row_reductions(ops):
    torch.manual_seed(1)
    assert check_same(Lin(REDUCTIONS[ops]), torch.randn(9, 24)) == [ops]


def test_reduction_then_its_own_mean():
    """max -> x - x.mean(keepdim) -> gelu (KernelBench's Gemm_Max_Subtract_GELU): on one value
    per row the difference is 0 * x; before a reduction the value used twice ends the chain."""

    def tail(m, h):
        h = torch.max(h, dim=1, keepdim=True).values
        return F.gelu(h - h.mean(dim=1, keepdim=True))

    assert check_same(Lin(tail), torch.randn(7, 24)) == ["max,scale(0.0),gelu"]
    model = Lin(lambda m, h: F.gelu(h - h.mean(dim=1, keepdim=True)))
    assert check_same(model, torch.randn(7, 24)) == []
    # Without keepdim the mean over dim -1 of (N,) is the batch's: left to PyTorch.
    model = Lin(lambda m, h: (lambda v: v - v.mean(-1, keepdim=True))(h.max(1).values))
    assert check_same(model, torch.randn(7, 24)) == ["max"]


def test_no_parameter_or_number_is_added_after_a_reduction():
    """A (1,) parameter or a number added after a reduction stays PyTorch's."""
    torch.manual_seed(2)
    model = Lin(lambda m, h: torch.sum(h, 1, keepdim=True) + m.b, b=nn.Parameter(torch.randn(1)))
    assert check_same(model, torch.randn(5, 24)) == ["sum"]
    assert check_same(Lin(lambda m, h: F.gelu(h.mean(1) - 0.5)), torch.randn(5, 24)) == ["mean"]
    # Without keepdim a second reduction would be over the batch: left to PyTorch.
    assert check_same(Lin(lambda m, h: h.sum(1).logsumexp(-1)), torch.randn(5, 24)) == ["sum"]


def test_a_chain_with_a_parameter_after_a_reduction_is_refused():
    with pytest.raises(ValueError, match="after `sum`"):
        fused_linear.FusedLinear(8, 16, "sum,gelu,bias")


SOFTMAXES = {
    "module": (lambda m, h: m.sm(h), {"sm": nn.Softmax(dim=1)}),
    "torch.softmax": (lambda m, h: torch.softmax(h, -1) * 3, {}),
    "F.softmax": (lambda m, h: F.softmax(F.gelu(h), dim=1), {}),
    "method": (lambda m, h: h.softmax(dim=-1).max(1).values, {}),
}


@pytest.mark.parametrize("name", list(SOFTMAXES))
def test_fuse_softmax(name):
    tail, modules = SOFTMAXES[name]
    chains = check_same(Lin(tail, **modules), torch.randn(6, 24))
    assert len(chains) == 1 and "softmax" in chains[0]


def test_softmax_over_another_dim_stays_pytorchs():
    assert (
        check_same(Lin(lambda m, h: torch.softmax(h.view(2, -1, 40), dim=1).view(-1, 40)), torch.randn(6, 24))
        == []
    )


POOLS = {
    "nn.MaxPool1d(4)": (
        lambda m, h: m.pool(h.unsqueeze(1)).squeeze(1),
        {"pool": nn.MaxPool1d(4)},
        "maxpool(4)",
    ),
    "F.max_pool1d": (lambda m, h: F.gelu(F.max_pool1d(h.unsqueeze(1), 5).squeeze(1)), {}, "maxpool(5),gelu"),
    "maxpool,sum": (
        lambda m, h: m.pool(h.unsqueeze(1)).squeeze(1).sum(1),
        {"pool": nn.MaxPool1d(kernel_size=2, stride=2)},
        "maxpool(2),sum",
    ),
}


@pytest.mark.parametrize("name", list(POOLS))
def test_fuse_max_pool(name):
    tail, modules, want = POOLS[name]
    assert check_same(Lin(tail, **modules), torch.randn(6, 24)) == [want]


def test_max_pool_with_another_stride_stays_pytorchs():
    model = Lin(lambda m, h: m.pool(h.unsqueeze(1)).squeeze(1), pool=nn.MaxPool1d(4, stride=2))
    assert check_same(model, torch.randn(6, 24)) == []


NORMS = {
    "layernorm": (lambda m, h: F.gelu(m.ln(h)), {"ln": nn.LayerNorm(40)}, "layernorm(1e-05),gelu"),
    "layernorm without bias": (
        lambda m, h: m.ln(h),
        {"ln": nn.LayerNorm(40, eps=1e-3, bias=False)},
        "layernorm(0.001)",
    ),
    "layernorm without affine": (
        lambda m, h: m.ln(h),
        {"ln": nn.LayerNorm(40, elementwise_affine=False)},
        "layernorm(1e-05)",
    ),
    "rmsnorm eps None": (
        lambda m, h: m.rms(h),
        {"rms": nn.RMSNorm(40)},
        f"rmsnorm({torch.finfo(torch.float32).eps!r})",
    ),
    "rmsnorm,softmax": (
        lambda m, h: m.rms(h).softmax(1),
        {"rms": nn.RMSNorm([40], eps=1e-6)},
        "rmsnorm(1e-06),softmax",
    ),
    "rmsnorm without affine": (
        lambda m, h: m.rms(h),
        {"rms": nn.RMSNorm(40, elementwise_affine=False)},
        None,
    ),
}


@pytest.mark.parametrize("name", list(NORMS))
def test_fuse_norms(name):
    tail, modules, want = NORMS[name]
    chains = check_same(_randomize(Lin(tail, **modules)), torch.randn(6, 24))
    assert len(chains) == 1 and (want is None or chains[0] == want), chains


def test_a_norm_over_other_features_stays_pytorchs():
    model = Lin(lambda m, h: m.ln(h.view(-1, 4, 10)).view(-1, 40), ln=nn.LayerNorm(10))
    assert check_same(model, torch.randn(6, 24)) == []


def test_the_registry_lists_the_whole_row_ops():
    names = {op["name"]: op for op in fused_linear._native.ops()}
    for name in ("sum", "mean", "min", "logsumexp", "softmax", "maxpool", "layernorm", "rmsnorm"):
        assert name in names and not names[name]["per_element"], name
    assert names["min"]["kink"] and names["maxpool"]["kink"] and not names["softmax"]["kink"]
    assert names["layernorm"]["params"] == ["ln.weight", "ln.bias"]
    assert fused_linear._native.parse_chain("sum,maxpool(2),rmsnorm,lse")[1:] == [
        ("maxpool", [2.0]),
        ("rmsnorm", [1.1920929e-07]),  # FP32's machine epsilon, as its shortest decimal
        ("logsumexp", []),
    ]


def test_rows_too_wide_for_the_gpu_stay_pytorchs(capsys):
    # 20000 features: more than the row-wise kernels hold in shared memory on sm_90
    # (forward and backward), so a whole-row op there and what follows stay PyTorch's;
    # the per-element ops before it do not need whole rows and are fused (KernelBench 55
    # and 56 at 32768 features).
    wide = Lin(lambda m, h: torch.sigmoid(h * 2.0).sum(1) * 0.5, n_in=8, n_out=20000)
    fused = fused_linear.fuse(wide, verbose=True)
    out = capsys.readouterr().out
    assert fused_chains(fused) == ["scale(2.0),sigmoid"] and "cannot run whole on the GPU" in out, out
    x = torch.randn(3, 8, requires_grad=True)
    torch.testing.assert_close(fused(x), wide(x))
    # dX sums 20000 products, in another order than PyTorch's.
    grads = [torch.autograd.grad(m(x).sum(), x)[0] for m in (fused, wide)]
    torch.testing.assert_close(*grads, atol=1e-4, rtol=1e-4)
    # A first op that needs whole rows (MaxPool too, in the GPU's tiles) leaves it all.
    softmax = lambda m, h: torch.softmax(h, 1)  # noqa: E731
    pool_sum = lambda m, h: F.max_pool1d(h.unsqueeze(1), 2).squeeze(1).sum(1)  # noqa: E731
    for first in (softmax, pool_sum):
        model = Lin(first, n_in=8, n_out=20000)
        fused = fused_linear.fuse(model, verbose=True)
        assert fused_chains(fused) == [] and "cannot run on the GPU" in capsys.readouterr().out
        torch.testing.assert_close(fused(x), model(x))
    narrow = Lin(lambda m, h: torch.sigmoid(h), n_in=8, n_out=20000)
    assert fused_chains(fused_linear.fuse(narrow)) == ["sigmoid"]


def _resized(modules, features):
    """The norms among ``modules`` made anew over ``features`` (eps and affine kept)."""
    out = {}
    for name, m in modules.items():
        if isinstance(m, nn.LayerNorm):
            m = nn.LayerNorm(features, m.eps, m.elementwise_affine, bias=m.bias is not None)
        elif isinstance(m, nn.RMSNorm):
            m = nn.RMSNorm(features, m.eps, m.elementwise_affine)
        out[name] = m
    return out


@pytest.mark.gpu
@pytest.mark.parametrize(
    "tail,modules",
    [
        (REDUCTIONS["sum,max,mean,logsumexp,logsumexp"], {}),
        (REDUCTIONS["swish,min,mish"], {}),
        (SOFTMAXES["F.softmax"][0], {}),
        (POOLS["maxpool,sum"][0], POOLS["maxpool,sum"][1]),
        (NORMS["layernorm"][0], NORMS["layernorm"][1]),
        (NORMS["rmsnorm,softmax"][0], NORMS["rmsnorm,softmax"][1]),
    ],
)
def test_fuse_whole_row_ops_on_the_gpu(tail, modules):
    torch.manual_seed(3)
    model = _randomize(Lin(tail, n_in=256, n_out=384, **_resized(modules, 384))).cuda()
    assert len(check_same(model, torch.randn(300, 256, device="cuda"), tol=1e-4)) == 1


# ---------------------------------------------------------------- the op against the reference

# Every whole-row op, through fused_linear.fused_linear against chain_ref's float64 PyTorch
# reference (values and every gradient).
ROW_CHAINS = [
    "sum,max,mean,logsumexp,logsumexp",
    "bias,min,swish,scale(-2)",
    "logsumexp,leakyrelu(0.01),gelu",
    "softmax,scale(3),mul,maxpool(3),layernorm,gelu",
    "layernorm(1e-3),mul,rmsnorm,bias,softmax,logsumexp",
    "rmsnorm(1e-6),maxpool(4),softmax,max",
    "mish,mean,tanh",
]


def _check_op(shape, ops, dtype, tol, device="cpu", precision=None, seed=0):
    from chain_ref import make_case, reference_grads, rel_err

    (x, weight, bias), params = make_case(shape, ops, seed, dtype, device=device, min_margin=1e-4)
    leaves = [t.clone().requires_grad_(True) for t in (x, weight, bias, *params)]
    y = fused_linear.fused_linear(leaves[0], leaves[1], leaves[2], ops, leaves[3:], precision)
    dy = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    y_ref, grads_ref = reference_grads(x.cpu(), weight.cpu(), bias.cpu(), ops, [p.cpu() for p in params], dy)
    grads = torch.autograd.grad(y, leaves, dy.to(dtype).to(device))
    names = ["y", "x", "weight", "bias"] + [f"params[{i}]" for i in range(len(params))]
    errs = {n: rel_err(a, b) for n, a, b in zip(names, [y, *grads], [y_ref, *grads_ref])}
    bad = {n: e for n, e in errs.items() if not e < tol}
    assert not bad, f"{ops} at {shape}: relative errors above {tol:g}: {bad}"


@pytest.mark.parametrize("ops", ROW_CHAINS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_whole_row_ops_match_the_reference_on_the_cpu(ops, dtype):
    _check_op((5, 13, 36), ops, dtype, 1e-5 if dtype == torch.float32 else 1e-10)


@pytest.mark.gpu
@pytest.mark.parametrize("ops", ROW_CHAINS)
@pytest.mark.parametrize("precision", ["fp32", "tf32"])
def test_whole_row_ops_match_the_reference_on_the_gpu(ops, precision):
    # A chain with a max, min or MaxPool needs inputs whose every pick is clear of a tie
    # by the margin: few enough rows and windows that such inputs come by.
    tied = {op.split("(")[0] for op in ops.split(",")} & {"max", "min", "maxpool"}
    shape = (16, 520, 48) if tied else (300, 520, 384)
    _check_op(shape, ops, torch.float32, {"fp32": 1e-4, "tf32": 5e-3}[precision], "cuda", precision)

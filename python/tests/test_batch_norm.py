"""BatchNorm1d in training mode as the ``batchnorm`` chain op: float64 gradcheck, and
``fuse()`` on KernelBench's BatchNorm problems (33, 39, 84, 41, 97) at small sizes against
PyTorch: output, every gradient, the running statistics and ``num_batches_tracked`` over
training steps, ``.train()``/``.eval()`` switching at call time, ``momentum=None``.

Gradients are compared as test_kernelbench36 does (``NOISE``): the Linear bias ahead of a
training-mode BatchNorm gets a gradient of exactly zero in exact arithmetic, which float32
rounds to noise in any summation order.
"""

import copy

import pytest
import torch
from torch import nn

import fused_linear
from chain_ref import kernelbench_problem
from fused_linear.fuse import _fused_call

PROBLEMS = (
    "p033_gemm_scale_batchnorm",
    "p039_gemm_scale_batchnorm",
    "p084_gemm_batchnorm_scaling_softmax",
    "p041_gemm_batchnorm_gelu_relu",
    "p097_matmul_batchnorm_biasadd_divide_swish",
)
TOL = 1e-5
NOISE = 4.0


def _gradcheck(ops, shape=(6, 5, 7), seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    n, k, f = shape
    make = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(device).requires_grad_(True)  # noqa: E731
    x, w, b = make(n, k), make(f, k), make(f)
    _, _, _, _, specs = fused_linear._describe(k, f, ops)
    params = [make(*shape) for _, shape, _ in specs]

    def fn(x, w, b, *p):
        return fused_linear.fused_linear(x, w, b, ops, list(p))

    assert torch.autograd.gradcheck(fn, (x, w, b, *params), eps=1e-6, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "ops",
    ["swish,batchnorm", "batchnorm(1e-3),scale(2.0),softmax", "tanh,mul,batchnorm,gelu", "bn,bias,swish"],
)
def test_gradcheck_float64(ops):
    _gradcheck(ops)


def test_one_row_is_refused_as_pytorch_refuses_it():
    x, w, b = torch.randn(1, 4), torch.randn(3, 4), torch.randn(3)
    with pytest.raises(ValueError, match="more than 1 row"):
        fused_linear.fused_linear(x, w, b, "batchnorm", [torch.ones(3), torch.zeros(3)])


def test_batchnorm_after_a_row_op_is_refused():
    with pytest.raises(ValueError, match="per-element ops only"):
        fused_linear.fused_linear(torch.randn(4, 4), torch.randn(3, 4), torch.randn(3), "softmax,bn", [])


def _problem(name, scale=32):
    with kernelbench_problem(name, scale) as problem:
        torch.manual_seed(0)
        model = problem.Model(*problem.get_init_inputs())
        xs = [problem.get_inputs()[0] for _ in range(3)]
    return model, xs


def _step(model, x, seed):
    xg = x.detach().clone().requires_grad_(True)
    y = model(xg)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=y.dtype).to(y.device)
    names, params = zip(*model.named_parameters())
    grads = torch.autograd.grad(y, [xg, *params], dy)
    return y.detach(), dict(zip(("x", *names), grads))


def _close(name, new, ref, ref64):
    err = (new - ref).double().norm().item()
    bar = TOL * ref.double().norm().item() + NOISE * (ref.double() - ref64).norm().item()
    assert err <= bar, f"{name}: ||fused - model|| = {err:.3e} > {bar:.3e}"


def _check_buffers(fused, model):
    for (name, mine), (_, theirs) in zip(fused.named_buffers(), model.named_buffers()):
        if mine.dtype == torch.long:
            assert torch.equal(mine, theirs), name
        else:
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("name", PROBLEMS)
def test_fuse_takes_the_whole_problem_in_training_mode(name):
    model, xs = _problem(name)
    ref = copy.deepcopy(model)
    ref64 = copy.deepcopy(model).double()
    fused = fused_linear.fuse(model)
    calls = [n for n in fused.graph.nodes if n.op == "call_function" and n.target is _fused_call]
    assert len(calls) == 1 and "batchnorm" in calls[0].args[3]
    left = [n for n in fused.graph.nodes if n.op == "call_module"]
    assert not left, f"left to PyTorch: {left}"
    for step, x in enumerate(xs):
        y_new, g_new = _step(fused, x, step)
        y_ref, g_ref = _step(ref, x, step)
        y_64, g_64 = _step(ref64, x.double(), step)
        _close("y", y_new, y_ref, y_64)
        for n in g_ref:
            _close(n, g_new[n], g_ref[n], g_64[n])
        _check_buffers(fused, ref)
    # Eval mode uses the running statistics (the affine), and training again the batch's.
    fused.eval()
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(fused(xs[0]), ref(xs[0]), rtol=1e-5, atol=1e-6)
    _check_buffers(fused, ref)
    fused.train()
    ref.train()
    with torch.no_grad():  # running statistics move under no_grad as well
        torch.testing.assert_close(fused(xs[1]), ref(xs[1]), rtol=1e-5, atol=1e-5)
    _check_buffers(fused, ref)


def test_an_eval_model_fused_then_trained():
    """A model fused in eval mode gets the same switching call: training later works."""
    model = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.GELU()).eval()
    ref = copy.deepcopy(model)
    fused = fused_linear.fuse(model)
    x = torch.randn(9, 6)
    torch.testing.assert_close(fused(x), ref(x))
    fused.train()
    ref.train()
    torch.testing.assert_close(fused(x), ref(x), rtol=1e-5, atol=1e-5)
    _check_buffers(fused, ref)


@pytest.mark.parametrize("momentum", [None, 0.3])
@pytest.mark.parametrize("affine", [True, False])
def test_momentum_and_affine(momentum, affine):
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.BatchNorm1d(5, momentum=momentum, affine=affine))
    ref = copy.deepcopy(model)
    fused = fused_linear.fuse(model)
    for seed in range(3):
        x = torch.randn(7, 6, generator=torch.Generator().manual_seed(seed))
        y_new, g_new = _step(fused, x, seed)
        y_ref, g_ref = _step(ref, x, seed)
        torch.testing.assert_close(y_new, y_ref, rtol=1e-5, atol=1e-5)
        for n in g_ref:
            torch.testing.assert_close(g_new[n], g_ref[n], rtol=1e-4, atol=1e-5, msg=n)
        _check_buffers(fused, ref)


def test_without_running_statistics():
    """track_running_stats=False: batch statistics in both modes, no buffers to update."""
    model = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5, track_running_stats=False), nn.ReLU())
    ref = copy.deepcopy(model)
    fused = fused_linear.fuse(model)
    x = torch.randn(8, 6)
    for mode in (True, False):
        fused.train(mode)
        ref.train(mode)
        torch.testing.assert_close(fused(x), ref(x), rtol=1e-5, atol=1e-5)


def test_a_second_batchnorm_is_left_to_pytorch(capsys):
    model = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Softmax(dim=1), nn.BatchNorm1d(5))
    fused = fused_linear.fuse(model, verbose=True)
    out = capsys.readouterr().out
    assert "must follow per-element ops only" in out
    ref = copy.deepcopy(model)
    x = torch.randn(8, 6)
    torch.testing.assert_close(fused(x), ref(x), rtol=1e-5, atol=1e-5)


def test_training_under_torch_compile():
    """The call-time mode switch and the running statistics' update trace into one graph."""
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.GELU())
    ref = copy.deepcopy(model)
    fused = fused_linear.fuse(model)
    compiled = torch.compile(fused, backend="aot_eager", fullgraph=True)
    for seed in range(2):
        x = torch.randn(10, 8, generator=torch.Generator().manual_seed(seed))
        y_ref, g_ref = _step(ref, x, seed)
        xg = x.clone().requires_grad_(True)
        y = compiled(xg)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed))
        grads = torch.autograd.grad(y, [xg, *fused.parameters()], dy)
        torch.testing.assert_close(y.detach(), y_ref, rtol=1e-5, atol=1e-5)
        for n, g in zip(("x", *(n for n, _ in fused.named_parameters())), grads):
            torch.testing.assert_close(g, g_ref[n], rtol=1e-4, atol=1e-5, msg=n)
        _check_buffers(fused, ref)


def test_fused_linear_module_with_a_batchnorm(tmp_path):
    """FusedLinear's `batchnorm` is an nn.BatchNorm1d `bn`: parameters and running statistics
    named as the plain model's, trained and evaluated as it is, saved and loaded whole."""
    torch.manual_seed(0)
    block = fused_linear.FusedLinear(6, 8, "swish,batchnorm(1e-3),gelu")
    assert list(block.state_dict()) == [
        "lin.weight",
        "lin.bias",
        "bn.weight",
        "bn.bias",
        "bn.running_mean",
        "bn.running_var",
        "bn.num_batches_tracked",
    ]
    ref = nn.Sequential(nn.Linear(6, 8), nn.SiLU(), nn.BatchNorm1d(8, eps=1e-3), nn.GELU())
    ref[0].load_state_dict(block.lin.state_dict())
    for seed in range(2):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(block(x), ref(x), rtol=1e-5, atol=1e-6)
    _check_buffers(block.bn, ref[2])
    path = tmp_path / "bn.safetensors"
    block.save(path)
    again = fused_linear.FusedLinear.load(path)
    _check_buffers(again.bn, ref[2])
    block.eval()
    again.eval()
    ref.eval()
    x = torch.randn(3, 6)
    torch.testing.assert_close(again(x), ref(x), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(block(x), ref(x), rtol=1e-5, atol=1e-6)


def test_fused_linear_module_makes_its_norms():
    block = fused_linear.FusedLinear(4, 8, "layernorm(1e-3),rmsnorm,groupnorm(2,1e-4)")
    assert isinstance(block.ln, nn.LayerNorm) and block.ln.eps == 1e-3
    assert isinstance(block.rms, nn.RMSNorm) and isinstance(block.gn, nn.GroupNorm)
    assert block.gn.num_groups == 2 and block.gn.eps == 1e-4
    ref = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8, eps=1e-3), nn.RMSNorm(8, eps=torch.finfo().eps))
    ref.append(nn.GroupNorm(2, 8, eps=1e-4))
    ref[0].load_state_dict(block.lin.state_dict())
    x = torch.randn(5, 4)
    torch.testing.assert_close(block(x), ref(x), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- GPU

# Chains with a nonlinear op before the BatchNorm (so the Linear bias has a gradient: straight
# after the Linear the BatchNorm removes it), at shapes for the small-batch kernel (6 rows),
# split-K (few rows, deep k), the fused GEMM and ragged widths. Not 2 rows: there each output
# is about +-gamma and the input's gradient cancels to ~eps (a GroupNorm of two channels' case).
GPU_CASES = [
    ((6, 300, 512), "tanh,batchnorm,gelu,leakyrelu(0.0)"),
    ((33, 4104, 130), "swish,bn,bias,scale(0.5),swish"),
    ((1024, 256, 1000), "gelu,batchnorm,scale(1.5),softmax"),
    ((130, 517, 1024), "bias,mish,bn,mul,groupnorm(8),max"),
    ((3, 64, 96), "sigmoid,bn(1e-3),mul,gelu_tanh"),
]
# bf16 only where no kink follows the BatchNorm: the kink refinement covers the ops before it,
# and bf16's rounding of z puts some values after it on the other side of a ReLU or a row max
# than float64's (FP32-accurate precisions: about one in a million values).
GPU_PARITY = [(s, o, p) for s, o in GPU_CASES for p in ("fp32", "tf32x3")]
GPU_PARITY += [(s, o, "bf16") for s, o in GPU_CASES if "leakyrelu" not in o and "max" not in o]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape,ops,precision", GPU_PARITY, ids=[f"{p}-{'x'.join(map(str, s))}-{o}" for s, o, p in GPU_PARITY]
)
def test_gpu_parity_float64(shape, ops, precision):
    from test_gpu import check_against_float64

    check_against_float64(shape, ops, precision, seed=sum(shape))


@pytest.mark.gpu
@pytest.mark.parametrize("name", PROBLEMS)
def test_fuse_on_the_gpu(name):
    """KernelBench's BatchNorm problems on CUDA (at 1/8 of the seed size), fused against the
    CUDA Model with TF32 off: output, every gradient, running statistics, eval switching."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model, xs = _problem(name, scale=8)
    model, xs = model.cuda(), [x.cuda() for x in xs]
    ref = copy.deepcopy(model)
    ref64 = copy.deepcopy(model).double()
    fused = fused_linear.fuse(model)
    assert not [n for n in fused.graph.nodes if n.op == "call_module"]
    for step, x in enumerate(xs):
        y_new, g_new = _step(fused, x, step)
        y_ref, g_ref = _step(ref, x, step)
        y_64, g_64 = _step(ref64, x.double(), step)
        bar = {"y": (y_new, y_ref, y_64), **{n: (g_new[n], g_ref[n], g_64[n]) for n in g_ref}}
        for n, (new, r, r64) in bar.items():
            err = (new - r).double().norm().item()
            limit = 1e-4 * r.double().norm().item() + NOISE * (r.double() - r64).norm().item()
            assert err <= limit, f"{name} {n}: {err:.3e} > {limit:.3e}"
        for (b, mine), (_, theirs) in zip(fused.named_buffers(), ref.named_buffers()):
            if mine.dtype == torch.long:
                assert torch.equal(mine, theirs), b
            else:
                torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5, msg=b)
    fused.eval()
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(fused(xs[0]), ref(xs[0]), rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_model_on_the_gpu_fuses_it(dtype):
    """A bf16 or fp16 model's BatchNorm in training mode is fused (its own 16-bit kernels,
    the statistics in FP32): output and gradients nearer float64 than PyTorch's own 16-bit
    model by the 16-bit tolerance, running statistics as PyTorch's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.GELU()).cuda().to(dtype)
    ref = copy.deepcopy(model)
    ref64 = copy.deepcopy(model).double()
    fused = fused_linear.fuse(model)
    assert not [n for n in fused.graph.nodes if n.op == "call_module"]
    x = torch.randn(16, 64, device="cuda", dtype=dtype)
    y, y_ref, y_64 = fused(x), ref(x), ref64(x.double())
    assert y.dtype == dtype
    err, err_ref = (y.double() - y_64).norm().item(), (y_ref.double() - y_64).norm().item()
    assert err <= 2 * err_ref + 1e-2 * y_64.norm().item(), (err, err_ref)
    y.float().square().sum().backward()
    y_64.square().sum().backward()
    g, g_64 = model[0].weight.grad.double(), ref64[0].weight.grad
    assert (g - g_64).norm().item() <= 2e-2 * g_64.norm().item()
    for (name, mine), (_, theirs) in zip(model[1].named_buffers(), ref[1].named_buffers()):
        if mine.dtype == torch.long:
            assert torch.equal(mine, theirs), name
        else:
            torch.testing.assert_close(mine.float(), theirs.float(), rtol=2e-2, atol=2e-2, msg=name)
    # The functional op takes the same path.
    for ops in ("batchnorm", "bn"):  # the alias too: the chain is read in canonical form
        y2 = fused_linear.fused_linear(x, ref[0].weight, ref[0].bias, ops, [ref[1].weight, ref[1].bias])
        assert y2.dtype == dtype and y2.shape == (16, 32)

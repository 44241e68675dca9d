"""fuse(Model) on all 36 Linear problems of KernelBench level 2 (examples/kernelbench), against
the unfused model: the output and the gradients of the input and of every parameter.

Whatever fuse() fuses in a problem (all of it, part, nothing: that grows as the op learns more),
the fused model must compute the Model's function; these tests check that, not how much is fused.
What is fused is informational: ``examples/kernelbench/run.py --coverage`` prints it from fuse()'s
own report, and ``test_coverage_report_matches_the_fused_graph`` checks that report against the
graph.

Tolerance (float32, CPU backend): ``||fused - ref|| <= TOL * ||ref|| + NOISE * ||ref - ref64||``
where ``ref`` is the Model in float32 and ``ref64`` the same Model in float64. The first term is
the bar for any value with a norm of its own (strict FP32 lands near 1e-7 relative here); the
second admits the rounding noise of a value that cancels to nothing -- the Linear's bias ahead of a
training-mode BatchNorm gets a gradient of exactly zero in exact arithmetic, and float32 PyTorch's
own is noise that no other float32 summation order reproduces.
"""

import copy
import importlib
import importlib.util
import json

import pytest
import torch
from torch import nn

import fused_linear
from chain_ref import KERNELBENCH, kernelbench_problem
from fused_linear.fuse import _fused_call

#: KernelBench level 2's problems whose Model is a Linear (nn.Linear or a matmul with a
#: weight) followed by other ops.
LINEAR_PROBLEMS = (9, 12, 14, 18, 22, 29, 30, 33, 37, 39, 40, 41, 45, 51, 53, 55, 56, 59)
LINEAR_PROBLEMS += (62, 63, 64, 66, 68, 70, 75, 76, 80, 81, 84, 86, 88, 94, 95, 97, 98, 99)
TOL = 1e-5
NOISE = 4.0
TOL_GPU = 1e-4  # strict FP32 on the GPU (TF32 off), at larger sizes

pytestmark = pytest.mark.skipif(not KERNELBENCH.is_dir(), reason="examples/kernelbench is not here")


def _run_py():
    """examples/kernelbench/run.py as a module (its problem list and fuse report)."""
    spec = importlib.util.spec_from_file_location("kernelbench_run", KERNELBENCH / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RUN = _run_py() if KERNELBENCH.is_dir() else None
NAMES = sorted(RUN.PROBLEMS.values()) if RUN else []


def problem_case(name, device="cpu", scale=None):
    """Problem ``name``'s Model (seeded) and input at ``scale`` (default: its SMALL_SCALE; a
    callable gets the problem's module)."""
    with kernelbench_problem(name, scale or RUN.small_scale) as problem:
        torch.manual_seed(0)
        model = problem.Model(*problem.get_init_inputs())
        torch.manual_seed(1)
        (x,) = problem.get_inputs()
        return model.to(device), x.to(device)


def norm(t):
    return t.double().norm().item()


def outputs_and_grads(model, x, seed=2):
    """The output and the gradients of x and of every parameter (None where one gets none), the
    RNG reseeded first so that a Dropout draws the same mask in every model."""
    xg = x.detach().clone().requires_grad_(True)
    torch.manual_seed(seed)
    y = model(xg)
    g = torch.Generator().manual_seed(3)
    dy = torch.randn(y.shape, generator=g, dtype=torch.float64).to(y.device, y.dtype)
    params = [p for _, p in model.named_parameters()]
    grads = torch.autograd.grad(y, [xg, *params], dy, allow_unused=True)
    names = ["x"] + [n for n, _ in model.named_parameters()]
    return y.detach(), dict(zip(names, grads))


def check_against_model(model, fused, x, tol):
    """``fused`` computes ``model``'s function: output and every gradient within the bar."""
    y_ref, g_ref = outputs_and_grads(model, x)
    y_new, g_new = outputs_and_grads(fused, x)
    model64 = copy.deepcopy(model).double()  # a copy: fused shares model's parameters
    y_64, g_64 = outputs_and_grads(model64, x.double())
    assert list(g_new) == list(g_ref), "the fused model's parameters differ from the model's"
    pairs = [("y", y_new, y_ref, y_64)] + [(n, g_new[n], g_ref[n], g_64[n]) for n in g_ref]
    for name, new, ref, ref64 in pairs:
        assert (new is None) == (ref is None), f"{name}: a gradient in one model only"
        if ref is None:
            continue
        assert new.shape == ref.shape and new.dtype == ref.dtype, name
        assert torch.isfinite(new).all() == torch.isfinite(ref).all(), name
        err = norm(new - ref)
        bar = tol * norm(ref) + NOISE * norm(ref - ref64)
        assert err <= bar, f"{name}: ||fused - model|| = {err:.3e} > {bar:.3e} (||model|| {norm(ref):.3e})"


def test_all_36_problems_are_here():
    assert sorted(RUN.PROBLEMS) == sorted(LINEAR_PROBLEMS)
    for pid, name in RUN.PROBLEMS.items():
        assert name.startswith(f"p{pid:03d}_") and name == name.lower(), name


@pytest.mark.parametrize("name", NAMES)
def test_fused_model_computes_the_model(name):
    model, x = problem_case(name)
    fused = fused_linear.fuse(model)
    # The model's own parameters, not copies: the same weights by construction.
    assert list(fused.state_dict()) == list(model.state_dict())
    for n, p in model.named_parameters():
        assert fused.get_parameter(n) is p, n
    check_against_model(model, fused, x, TOL)


@pytest.mark.parametrize("name", NAMES)
def test_coverage_report_matches_the_fused_graph(name):
    """run.py's report (fuse()'s verbose lines and graph) against the fused graph itself: a
    `whole` problem has fused calls and nothing of the model left, `none` has no fused call."""
    model, _ = problem_case(name)
    fused, report = RUN.fuse_with_report(model)
    calls = [n for n in fused.graph.nodes if n.op == "call_function" and n.target is _fused_call]
    assert report["chains"] == [n.args[3] for n in calls]
    assert report["linears"], "fuse() found no Linear in the problem"
    assert len([line for line in report["linears"] if "fused with" in line]) == len(calls)
    assert report["status"] == ("none" if not calls else "partly" if report["left"] else "whole")
    assert set(report["left"]) <= set(report["ops"])
    linears = sum(isinstance(m, nn.Linear) for m in model.modules()) or 1
    assert len(report["linears"]) == linears


@pytest.mark.parametrize("pid", [33, 39, 41, 84, 97])
def test_batch_norm_problems_fuse_whole(pid):
    """The problems with a training-mode BatchNorm1d fuse whole (the `batchnorm` op)."""
    model, _ = problem_case(RUN.PROBLEMS[pid])
    _, report = RUN.fuse_with_report(model)
    assert report["status"] == "whole", report
    assert len(report["chains"]) == 1 and "batchnorm" in report["chains"][0], report


def test_run_py_on_the_cpu(capsys):
    assert RUN.main(["--device", "cpu", "--trials", "1", "--problems", "9,66,88,33"]) == 0
    out = capsys.readouterr().out
    assert "fuse: whole" in out and "hand-written" in out and "all correct" in out
    assert RUN.main(["--coverage"]) == 0
    table = capsys.readouterr().out
    assert sum(line.split()[0].isdigit() for line in table.splitlines() if line.strip()) == 36
    with pytest.raises(SystemExit):
        RUN.main(["--device", "cpu", "--problems", "7"])


def test_run_py_sets_both_against_float64(tmp_path, capsys):
    """--f64: ours and PyTorch's FP32 Model against the Model in float64, output and
    gradients; a bias's gradient that a BatchNorm cancels is left out, a drawing Dropout
    skipped."""
    out = tmp_path / "r.json"
    argv = ["--device", "cpu", "--trials", "1", "--problems", "70,33,66", "--fuse", "--backward", "--f64"]
    assert RUN.main([*argv, "--json", str(out)]) == 0
    rows = {(r["problem"], r["pass"]): r for r in json.loads(out.read_text())["results"]}
    for pid in (70, 33):
        row = rows[(pid, "fwd")]
        # FP32 sums in both: within a few FP32 roundings of float64 (a few 1e-7 here).
        assert row["f64_rel_err_ours"] < 1e-5 and row["f64_rel_err_fp32"] < 1e-5, row
        assert row["f64_grad_rel_err_ours"] < 1e-5 and row["f64_grad_rel_err_fp32"] < 1e-5, row
    assert rows[(33, "fwd")]["f64_grads_left_out"] == ["gemm.bias"]
    assert "Dropout" in rows[(66, "fwd")]["f64_note"]
    assert "vs float64" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_fused_model_computes_the_model_on_the_gpu(name):
    """The same on CUDA (strict FP32 on both sides, TF32 off), at 4x each problem's CPU sizes."""
    model, x = problem_case(name, "cuda", lambda problem: max(1, RUN.small_scale(problem) // 4))
    torch.backends.cuda.matmul.allow_tf32 = False
    check_against_model(model, fused_linear.fuse(model), x, TOL_GPU)

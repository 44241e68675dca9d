"""KernelBench's protocol for the 36 Linear problems of KernelBench level 2.

Each `pNNN_*.py` here is one problem: its `Model`, sizes, `get_inputs()` and `get_init_inputs()`.
Five (#88, #37, #62, #98, #94: the project's M1..M5) also have a hand-written `ModelNew`, one
fused op; for the others, and for all of them with `--fuse`, `ModelNew` is
`fused_linear.fuse(Model(...))`: the fused graph calls the op on the Model's own parameters, so
both have the same weights by construction (no copy), and what fuse() cannot fuse stays PyTorch.

For each problem and precision: build `Model` and `ModelNew` from `get_init_inputs()` under the
same `torch.manual_seed(seed)` (a hand-written ModelNew must come out with the same weights;
checked), then for each of `--trials` seeds draw the inputs with `get_inputs()` and compare
`ModelNew(x)` with `Model(x)` -- plain PyTorch in strict FP32, TF32 off -- with
`torch.allclose(atol, rtol)`, reporting the largest absolute difference and the relative error
||new - ref|| / ||ref||. That is how KernelBench decides correctness. The models stay in
training mode, as KernelBench runs them (BatchNorm on batch statistics, Dropout on); the RNG is
reseeded before each forward, so that a Dropout draws the same mask in both.

Then, in the same process, the timing: ModelNew's forward against eager `Model` and
`torch.compile(Model)` (and with `--backward` forward+backward of each, against a fixed random
output gradient, after a gradient check), timed with CUDA events, after warm-up, with the L2
cache flushed before every timed run (by writing a buffer larger than L2, 256 MB at least, as
KernelBench does) so that no run finds the weights already on chip; the median of `--iters` runs
is reported. Forward timings run under `torch.no_grad()`, as inference does.

Tolerances (atol and rtol), KernelBench's: 1e-4 for fp32 and tf32x3 (FP32-accurate), 1e-2 for
bf16 and fp16. `fp16` is an fp16 model: ModelNew is a copy of Model in float16 (`.half()`, fused
or hand-written), fed float16 inputs, its output widened for the comparison (KernelBench's peer
is PyTorch's `Model.half()`). tf32 is no KernelBench precision (it runs FP32
tensors, which it holds to 1e-4); its operand rounding (2^-11) alone misses 1e-4 at these
reduction lengths, so it gets 2e-2. `--atol/--rtol` override them.

`--coverage` prints, from fuse()'s own report and graph, what fuse(Model) does with each
problem: fused whole, partly (and which ops stayed PyTorch) or not at all.

Usage (from the repository root, on a GPU machine with fused_linear installed):
    python examples/kernelbench/run.py                                  # all 36, fp32
    python examples/kernelbench/run.py --problems hand --precision fp32,tf32x3 --backward
    python examples/kernelbench/run.py --problems 88,37 --fuse          # fuse(Model) for those too
    python examples/kernelbench/run.py --small --no-compile --json out.json
    python examples/kernelbench/run.py --device cpu --trials 2          # correctness only, small shapes
    python examples/kernelbench/run.py --coverage                       # what fuse() fuses, no runs
Exit status: 0 when every problem and precision passes every trial, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import io
import json
import math
import operator
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import fx, nn

import fused_linear
from fused_linear.fuse import _fused_call

HERE = Path(__file__).resolve().parent


def _discover() -> dict[int, str]:
    """KernelBench problem id -> module name, from the `pNNN_*.py` files of this folder."""
    found = {}
    for path in sorted(HERE.glob("p[0-9][0-9][0-9]_*.py")):
        found[int(path.stem[1:4])] = path.stem
    return found


PROBLEMS: dict[int, str] = _discover()
#: The problems with a hand-written ModelNew, and the project's names for them.
MODEL_NAMES = {88: "M1", 37: "M2", 62: "M3", 98: "M4", 94: "M5"}
PRECISIONS = ("fp32", "tf32x3", "tf32", "bf16", "fp16")
DEFAULT_TOL = {"fp32": 1e-4, "tf32x3": 1e-4, "tf32": 2e-2, "bf16": 1e-2, "fp16": 1e-2}
#: --small and the CPU: each problem's own SMALL_SCALE, else this (e.g. 1024 x 8192 -> 32 x 256).
SMALL_SCALE = 32
FLUSH_BYTES_MIN = 256 << 20


# ---------------------------------------------------------------- arguments


def comma_list(values: list[str] | None) -> list[str]:
    """`--x a,b --x c` -> [a, b, c]."""
    return [v.strip() for item in values or [] for v in item.split(",") if v.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument(
        "--problems",
        action="append",
        help="KernelBench ids, e.g. 88,37; `hand`: the five with a hand-written ModelNew; default all 36",
    )
    p.add_argument(
        "--fuse", action="store_true", help="ModelNew is fuse(Model) for every problem, hand-written or not"
    )
    p.add_argument(
        "--coverage",
        action="store_true",
        help="print what fuse(Model) fuses in each problem (whole, partly, not) and exit",
    )
    p.add_argument(
        "--precision", action="append", help=f"repeatable or comma list of {', '.join(PRECISIONS)}"
    )
    p.add_argument("--trials", type=int, default=5, help="correctness trials, one input seed each (5)")
    p.add_argument("--seed", type=int, default=42, help="seed for the weights and the trial seeds (42)")
    p.add_argument(
        "--atol", type=float, help="absolute tolerance (default 1e-4 fp32/tf32x3, 2e-2 tf32, 1e-2 bf16)"
    )
    p.add_argument("--rtol", type=float, help="relative tolerance (same defaults)")
    scale = p.add_mutually_exclusive_group()
    scale.add_argument("--shape-scale", type=int, help="divide every problem's sizes by this")
    scale.add_argument(
        "--small", action="store_true", help="each problem at its SMALL_SCALE (the default on the CPU)"
    )
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu: correctness only, small shapes")
    p.add_argument(
        "--iters", type=int, default=20, help="timed runs per measurement; the median is kept (20)"
    )
    p.add_argument("--warmup", type=int, default=5, help="untimed runs before timing (5)")
    p.add_argument("--backward", action="store_true", help="also check gradients and time forward+backward")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile(Model)")
    p.add_argument("--no-timing", action="store_true", help="correctness only")
    p.add_argument(
        "--cpu-timing", action="store_true", help="with --device cpu: time by wall clock (a smoke test)"
    )
    p.add_argument(
        "--baseline-tf32",
        action="store_true",
        help="time eager/compile with TF32 matmuls allowed (the correctness reference stays strict FP32)",
    )
    p.add_argument(
        "--f64",
        action="store_true",
        help="also set ours and PyTorch's FP32 Model against Model in float64 (gradients with --backward)",
    )
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)

    picked: list[int] = []
    for item in comma_list(args.problems):
        if item in ("hand", "all"):
            picked += list(MODEL_NAMES) if item == "hand" else list(PROBLEMS)
        elif item.isdigit() and int(item) in PROBLEMS:
            picked.append(int(item))
        else:
            p.error(f"unknown problem {item!r}; known: hand, all, {', '.join(map(str, PROBLEMS))}")
    args.problems = list(dict.fromkeys(picked)) or list(PROBLEMS)
    args.precision = comma_list(args.precision) or ["fp32"]
    bad = [x for x in args.precision if x not in PRECISIONS]
    if bad:
        p.error(f"unknown precision(s) {bad}; known: {', '.join(PRECISIONS)}")
    args.device = torch.device(args.device)
    if args.shape_scale is None:  # None: each problem's own small scale
        args.shape_scale = None if args.small or args.device.type == "cpu" or args.coverage else 1
    elif args.shape_scale < 1:
        p.error("--shape-scale must be at least 1")
    if args.device.type == "cpu" and not args.cpu_timing:
        args.no_timing = True  # CUDA events and L2 flushing mean nothing there
    elif args.device.type == "cuda" and not torch.cuda.is_available() and not args.coverage:
        p.error("no CUDA device here; use --device cpu for a correctness smoke test")
    if args.trials < 1 or args.iters < 1 or args.warmup < 0:
        p.error("--trials and --iters must be at least 1, --warmup at least 0")
    return args


# ---------------------------------------------------------------- the problems


def load_problem(pid: int, scale: int | None) -> ModuleType:
    """The problem's module, with its sizes divided by `scale` (None: its SMALL_SCALE)."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    mod = importlib.import_module(PROBLEMS[pid])
    mod.set_shape_scale(small_scale(mod) if scale is None else scale)  # 1 restores the seed sizes
    return mod


def small_scale(mod: ModuleType) -> int:
    return int(getattr(mod, "SMALL_SCALE", SMALL_SCALE))


def uses_fuse(mod: ModuleType, args: argparse.Namespace) -> bool:
    """Whether ModelNew is fuse(Model): always with --fuse, else where the file has none."""
    return args.fuse or not hasattr(mod, "ModelNew")


def set_seed(seed: int) -> None:
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)


def strict_fp32(on: bool = True) -> None:
    """Plain FP32 matmuls (TF32 off) for the reference; `on=False` allows TF32."""
    torch.set_float32_matmul_precision("highest" if on else "high")


def build_models(
    mod: ModuleType, precision: str, seed: int, device: torch.device, fuse: bool
) -> tuple[nn.Module, nn.Module, dict[str, Any]]:
    """Model and ModelNew from the same seed, as KernelBench builds them (on the CPU, then moved),
    and what fuse() reported (empty for a hand-written ModelNew). With `fuse`, ModelNew is
    fuse(Model): the same parameters, so the same weights by construction."""
    set_seed(seed)
    init_inputs = mod.get_init_inputs()
    if precision == "fp16":
        # A float16 copy (fuse() shares parameters: converting them in place would change
        # Model), its own default precision; a hand-written ModelNew's weights checked first.
        if fuse:
            set_seed(seed)
            ref = mod.Model(*init_inputs).to(device)
            new, report = fuse_with_report(copy.deepcopy(ref).half(), None)
        else:
            ref, _, report = build_models(mod, "fp32", seed, device, fuse)
            set_seed(seed)
            new = mod.ModelNew(*init_inputs).half().to(device)
        return ref, Half(new), report
    if fuse:
        set_seed(seed)
        ref = mod.Model(*init_inputs).to(device)
        new, report = fuse_with_report(ref, precision)
        return ref, new, report
    with torch.no_grad():
        set_seed(seed)
        ref = mod.Model(*init_inputs)
        set_seed(seed)
        new = mod.ModelNew(*init_inputs, precision=precision)
    ref_state, new_state = ref.state_dict(), new.state_dict()
    if list(ref_state) != list(new_state) or any(
        not torch.equal(ref_state[k], new_state[k]) for k in ref_state
    ):
        raise AssertionError("ModelNew's parameters differ from Model's under the same seed")
    return ref.to(device), new.to(device), {}


class Half(nn.Module):
    """An fp16 model behind float32 inputs and outputs: the inputs rounded to float16 on the
    way in, the output widened on the way out (exactly), for the comparison with Model."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *inputs: Any) -> torch.Tensor:
        half = [t.half() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs]
        return self.model(*half).float()

    def named_parameters(self, *args: Any, **kwargs: Any):  # the model's names, not `model.`-prefixed
        return self.model.named_parameters(*args, **kwargs)


# ---------------------------------------------------------------- what fuse() fused


def _op_name(gm: fx.GraphModule, node: fx.Node) -> str:
    if node.op == "call_module":
        return type(gm.get_submodule(node.target)).__name__
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))


def _ops(gm: fx.GraphModule) -> dict[str, tuple[str, Any]]:
    """The graph's ops by node name: (readable name, target). `.values` and `[0]` (the picks of
    a max or min) are left out: they are part of the op before them."""
    return {
        n.name: (_op_name(gm, n), n.target)
        for n in gm.graph.nodes
        if n.op in ("call_module", "call_function", "call_method")
        and not (n.op == "call_function" and n.target in (getattr, operator.getitem))
    }


def fuse_with_report(model: nn.Module, precision: str | None = None) -> tuple[fx.GraphModule, dict[str, Any]]:
    """fuse(model) and what it did, read from fuse()'s own verbose report and the graph it
    returned: `linears` (each Linear's line), `chains` (the fused calls' ops), `ops` (the
    model's ops in order), `left` (those still in the fused graph: PyTorch's) and `status`:
    `whole` (nothing left), `partly` or `none` (no fused call)."""
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        fused = fused_linear.fuse(model, precision, verbose=True)
    linears = [line[len("fuse: ") :] for line in said.getvalue().splitlines() if line.startswith("fuse: ")]
    # A fresh trace of the model: fx names nodes deterministically, so an op of the model that
    # fuse() left in place has the same name (and target) in the fused graph.
    mine, theirs = _ops(fx.symbolic_trace(model)), _ops(fused)
    left = [what for name, (what, target) in mine.items() if name in theirs and theirs[name][1] is target]
    chains = [n.args[3] for n in fused.graph.nodes if n.op == "call_function" and n.target is _fused_call]
    status = "none" if not chains else "partly" if left else "whole"
    report = {"status": status, "chains": chains, "ops": [w for w, _ in mine.values()], "left": left}
    report["linears"] = linears
    return fused, report


def coverage(problems: list[int], scale: int | None) -> list[dict[str, Any]]:
    """fuse(Model)'s report for each problem, built on the CPU at a small size."""
    rows = []
    for pid in problems:
        mod = load_problem(pid, scale)
        set_seed(0)
        _, report = fuse_with_report(mod.Model(*mod.get_init_inputs()))
        rows.append({"problem": pid, "name": PROBLEMS[pid], **report})
    return rows


def print_coverage(rows: list[dict[str, Any]]) -> None:
    lines = [["problem", "ops", "fused", "fused chains", "left in PyTorch"]]
    for r in rows:
        lines.append(
            [
                str(r["problem"]),
                " ".join(r["ops"]),
                r["status"],
                " + ".join(r["chains"]) or "-",
                " ".join(r["left"]) or "-",
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    for n, line in enumerate(lines):
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))
    counts = {s: sum(r["status"] == s for r in rows) for s in ("whole", "partly", "none")}
    print(f"fused whole: {counts['whole']}, partly: {counts['partly']}, not at all: {counts['none']}")


def trial_seeds(seed: int, n: int) -> list[int]:
    """One input seed per trial, drawn from `seed` (KernelBench's scheme)."""
    torch.manual_seed(seed)
    return [int(torch.randint(0, 2**32 - 1, (1,)).item()) for _ in range(n)]


def inputs_for(mod: ModuleType, seed: int, device: torch.device) -> list[Any]:
    set_seed(seed)
    return [x.to(device) if isinstance(x, torch.Tensor) else x for x in mod.get_inputs()]


def seeded_forward(model: Callable, inputs: list[Any], seed: int) -> torch.Tensor:
    """model(*inputs) from a fixed RNG state: a Dropout draws the same mask in every model."""
    set_seed(seed)
    return model(*inputs)


def compare(new: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |new - ref|, ||new - ref|| / ||ref||), in float64."""
    diff = new.double() - ref.double()
    max_abs = diff.abs().max().item() if diff.numel() else 0.0
    denom = ref.double().norm().item()
    rel = diff.norm().item() / denom if denom > 0 else diff.norm().item()
    return max_abs, rel


def check_correctness(
    mod: ModuleType, ref: nn.Module, new: nn.Module, args: argparse.Namespace, atol: float, rtol: float
) -> dict[str, Any]:
    """KernelBench's trials: every one must pass allclose; each trial's differences and the
    worst are kept."""
    passed, worst_abs, worst_rel, error = 0, 0.0, 0.0, None
    per_trial: list[dict[str, Any]] = []
    with torch.no_grad():
        for seed in trial_seeds(args.seed, args.trials):
            inputs = inputs_for(mod, seed, args.device)
            expected = seeded_forward(ref, inputs, seed)
            try:
                got = seeded_forward(new, inputs, seed)
            except Exception as e:  # noqa: BLE001 -- a failure is a result, not the end of the run
                error = f"{type(e).__name__}: {e}"
                break
            if got.shape != expected.shape:
                error = f"shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
                break
            max_abs, rel = compare(got, expected)
            worst_abs, worst_rel = max(worst_abs, max_abs), max(worst_rel, rel)
            close = bool(torch.allclose(got, expected, atol=atol, rtol=rtol))
            passed += close
            per_trial.append({"seed": seed, "max_abs": max_abs, "rel_err": rel, "allclose": close})
    return {
        "passed": passed,
        "per_trial": per_trial,
        "trials": args.trials,
        "max_abs": worst_abs,
        "rel_err": worst_rel,
        "error": error,
    }


def check_gradients(
    mod: ModuleType, ref: nn.Module, new: nn.Module, args: argparse.Namespace
) -> dict[str, Any]:
    """One trial's gradients (x and every parameter) against the reference's; reported, not a
    bar. Where the reference gradient cancels to rounding noise (a bias before a training-mode
    BatchNorm has none), its relative error is large for any implementation."""
    seed = trial_seeds(args.seed, 1)[0]
    (x,) = inputs_for(mod, seed, args.device)
    grads = []
    for model in (ref, new):
        xg = x.clone().requires_grad_(True)
        names, params = zip(*model.named_parameters())
        y = seeded_forward(model, [xg], seed)
        got = torch.autograd.grad(y, [xg, *params], fixed_grad(y), allow_unused=True)
        grads.append(dict(zip(("x", *names), got)))
    worst_name, worst_abs, worst_rel = "", 0.0, 0.0
    for name, g_ref in grads[0].items():
        g_new = grads[1].get(name)
        if (g_ref is None) != (g_new is None):
            return {"grad_error": f"a gradient for {name} in one model only"}
        if g_ref is None:
            continue
        max_abs, rel = compare(g_new, g_ref)
        worst_abs = max(worst_abs, max_abs)
        if rel >= worst_rel:
            worst_name, worst_rel = name, rel
    return {"grad_max_abs": worst_abs, "grad_rel_err": worst_rel, "grad_worst": worst_name}


def errors_vs_float64(
    mod: ModuleType, ref: nn.Module, new: nn.Module, args: argparse.Namespace
) -> dict[str, Any]:
    """Ours (`new`) and PyTorch's FP32 Model (`ref`) against a float64 copy of Model, on the
    first trial's input: the output's relative error and, with --backward, the worst
    gradient's (x and every parameter; the float64 copy starts from Model's state, running
    statistics included; a gradient the float64 Model gives as nothing, 1e-8 of the largest
    or less, as a bias's before a training-mode BatchNorm, is left out: its relative error
    is rounding noise over nothing for any implementation). A Model whose Dropout draws
    (p > 0, training) is left out: the float64 copy would draw another mask."""
    if any(isinstance(m, nn.Dropout) and m.p > 0 and m.training for m in ref.modules()):
        return {"f64_note": "a Dropout draws: no float64 comparison"}
    ref64 = copy.deepcopy(ref).double()
    seed = trial_seeds(args.seed, 1)[0]
    (x,) = inputs_for(mod, seed, args.device)
    runs = {}
    for key, model in (("f64", ref64), ("fp32", ref), ("ours", new)):
        xg = (x.double() if key == "f64" else x).clone().requires_grad_(args.backward)
        with torch.set_grad_enabled(args.backward):
            y = seeded_forward(model, [xg], seed)
        grads = {}
        if args.backward:
            names, params = zip(*model.named_parameters())
            dy = fixed_grad(y.float()).to(y.dtype)
            got = torch.autograd.grad(y, [xg, *params], dy, allow_unused=True)
            grads = {name: g for name, g in zip(("x", *names), got) if g is not None}
        runs[key] = (y.detach(), grads)
    out: dict[str, Any] = {}
    y64, g64 = runs["f64"]
    largest = max((g.norm().item() for g in g64.values()), default=0.0)
    kept = {n: g for n, g in g64.items() if g.norm().item() > 1e-8 * largest}
    if len(kept) < len(g64):
        out["f64_grads_left_out"] = sorted(set(g64) - set(kept))
    for key in ("ours", "fp32"):
        y, grads = runs[key]
        out[f"f64_rel_err_{key}"] = compare(y, y64)[1]
        errors = [(compare(grads[n], g)[1], n) for n, g in kept.items() if n in grads]
        if errors:
            out[f"f64_grad_rel_err_{key}"], out[f"f64_grad_worst_{key}"] = max(errors)
    return out


def fixed_grad(y: torch.Tensor) -> torch.Tensor:
    """A random output gradient that is the same for every model (its own generator)."""
    g = torch.Generator().manual_seed(1234)
    return torch.randn(y.shape, generator=g, dtype=y.dtype).to(y.device)


# ---------------------------------------------------------------- timing


class Timer:
    """CUDA-event timing with the L2 cache flushed before every run (wall clock on the CPU)."""

    def __init__(self, device: torch.device, warmup: int, iters: int) -> None:
        self.cuda = device.type == "cuda"
        self.warmup, self.iters = warmup, iters
        self.flush = None
        if self.cuda:
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
            self.flush = torch.empty(max(FLUSH_BYTES_MIN, 4 * l2), dtype=torch.uint8, device=device)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def median_ms(self, fn: Callable[[], None], before: Callable[[], None] | None = None) -> float:
        for _ in range(self.warmup):
            if before:
                before()
            fn()
        self.sync()
        times = []
        for i in range(self.iters):
            if before:
                before()
            if not self.cuda:  # --cpu-timing: a smoke test of this code, not a benchmark
                t0 = time.perf_counter()
                fn()
                times.append(1e3 * (time.perf_counter() - t0))
                continue
            self.flush.fill_(i & 0xFF)  # evict weights and inputs from L2
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)


def time_model(
    model: Callable, params: list[torch.Tensor], x: torch.Tensor, timer: Timer, backward: bool
) -> float:
    """Median ms of model(x) under no_grad, or of model(x).backward(dy) with fresh gradients."""
    if not backward:

        def forward() -> None:
            with torch.no_grad():
                model(x)

        return timer.median_ms(forward)

    xg = x.clone().requires_grad_(True)  # the input's gradient too, as inside a network
    with torch.no_grad():
        dy = fixed_grad(model(x))

    def clear() -> None:
        xg.grad = None
        for p in params:
            p.grad = None

    def step() -> None:
        model(xg).backward(dy)

    return timer.median_ms(step, clear)


def time_all(mod: ModuleType, ref: nn.Module, news: dict[str, nn.Module], args: argparse.Namespace) -> dict:
    """{(name, pass): ms} for ModelNew per precision, eager Model and compiled Model."""
    timer = Timer(args.device, args.warmup, args.iters)
    (x,) = inputs_for(mod, args.seed, args.device)
    passes = ["fwd", "fwd+bwd"] if args.backward else ["fwd"]
    out: dict[tuple[str, str], float | None] = {}
    for prec, new in news.items():
        for pas in passes:
            out[(prec, pas)] = time_model(new, list(new.parameters()), x, timer, pas != "fwd")
    strict_fp32(not args.baseline_tf32)
    try:
        ref_params = list(ref.parameters())
        for pas in passes:
            out[("eager", pas)] = time_model(ref, ref_params, x, timer, pas != "fwd")
        if not args.no_compile:
            compiled = torch.compile(ref)
            for pas in passes:
                try:
                    out[("compile", pas)] = time_model(compiled, ref_params, x, timer, pas != "fwd")
                except Exception as e:  # noqa: BLE001 -- no Triton, an Inductor bug: report and go on
                    print(f"  torch.compile failed ({pas}): {type(e).__name__}: {e}", file=sys.stderr)
                    out[("compile", pas)] = None
            torch._dynamo.reset()
    finally:
        strict_fp32(True)
    return out


# ---------------------------------------------------------------- report


def fmt(v: float | None, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def print_table(rows: list[dict[str, Any]]) -> None:
    head = ["problem", "ModelNew", "prec", "pass", "correct", "max_abs", "rel_err"]
    head += ["ours ms", "eager ms", "compile ms"]
    head += ["x eager", "x compile"]
    lines = [head]
    for r in rows:
        ours, eager, comp = r.get("ours_ms"), r.get("eager_ms"), r.get("compile_ms")
        lines.append(
            [
                f"{r['problem']} ({r['model']})" if r["model"] else str(r["problem"]),
                r["modelnew"],
                r["precision"],
                r["pass"],
                r["correct"],
                fmt(r.get("max_abs"), ".2e"),
                fmt(r.get("rel_err"), ".2e"),
                fmt(ours, ".3f"),
                fmt(eager, ".3f"),
                fmt(comp, ".3f"),
                fmt(eager / ours if ours and eager else None, ".2f"),
                fmt(comp / ours if ours and comp else None, ".2f"),
            ]
        )
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    for n, line in enumerate(lines):
        print(
            "  ".join(
                str(c).rjust(w) if i >= 4 else str(c).ljust(w) for i, (c, w) in enumerate(zip(line, widths))
            )
        )
        if n == 0:
            print("  ".join("-" * w for w in widths))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    strict_fp32(True)
    scale_text = "each problem's SMALL_SCALE" if args.shape_scale is None else f"1/{args.shape_scale}"
    if args.coverage:
        print(f"fuse(Model) of each problem, at {scale_text} of its seed sizes (fuse()'s own report)\n")
        print_coverage(coverage(args.problems, args.shape_scale))
        return 0
    device_name = (
        torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else platform.processor()
    )
    print(
        f"device {args.device} ({device_name or 'cpu'}), torch {torch.__version__}, shape scale {scale_text}"
    )

    rows: list[dict[str, Any]] = []
    all_ok = True
    for pid in args.problems:
        name, model_name = PROBLEMS[pid], MODEL_NAMES.get(pid, "")
        try:
            mod = load_problem(pid, args.shape_scale)
        except ValueError as e:  # a --shape-scale this problem's sizes do not divide
            print(f"\n#{pid} {name}: SKIPPED: {e}")
            all_ok = False
            continue
        fuse = uses_fuse(mod, args)
        shape = f"x {tuple(mod.get_inputs()[0].shape)}, init {mod.get_init_inputs()}"
        label = f" ({model_name})" if model_name else ""
        print(f"\n#{pid} {name}{label}: {shape}")
        ref, news, results = None, {}, {}
        for prec in args.precision:
            atol = args.atol if args.atol is not None else DEFAULT_TOL[prec]
            rtol = args.rtol if args.rtol is not None else DEFAULT_TOL[prec]
            t0 = time.perf_counter()
            try:
                ref, new, report = build_models(mod, prec, args.seed, args.device, fuse)
            except Exception as e:  # noqa: BLE001 -- fuse() or a ModelNew refusing the model is a result
                print(f"  {prec:7s} ERROR building ModelNew: {type(e).__name__}: {e}")
                results[prec] = {"error": f"{type(e).__name__}: {e}", "passed": 0, "trials": args.trials}
                all_ok = False
                continue
            if prec == args.precision[0]:
                if fuse:
                    for line in report["linears"]:
                        print(f"  fuse: {line}")
                    left = " ".join(report["left"]) or "nothing"
                    print(f"  ModelNew = fuse(Model): fused {report['status']}; left in PyTorch: {left}")
                else:
                    print("  ModelNew: hand-written, one fused op")
            res = check_correctness(mod, ref, new, args, atol, rtol)
            res.update(atol=atol, rtol=rtol)
            res["modelnew"] = f"fuse: {report['status']}" if fuse else "hand-written"
            res["left_in_pytorch"] = report.get("left", [])
            if args.backward and res["error"] is None:
                try:
                    res.update(check_gradients(mod, ref, new, args))
                except Exception as e:  # noqa: BLE001 -- reported in the row
                    res["grad_error"] = f"{type(e).__name__}: {e}"
            if args.f64 and res["error"] is None:
                try:
                    res.update(errors_vs_float64(mod, ref, new, args))
                except Exception as e:  # noqa: BLE001 -- reported in the row
                    res["f64_error"] = f"{type(e).__name__}: {e}"
            ok = res["error"] is None and res["passed"] == res["trials"]
            all_ok &= ok
            msg = f"  {prec:7s} {res['passed']}/{res['trials']} allclose({atol:g}, {rtol:g})"
            msg += f"  max_abs {res['max_abs']:.3e}  rel_err {res['rel_err']:.3e}"
            if "grad_rel_err" in res:
                msg += f"  grad rel_err {res['grad_rel_err']:.3e} ({res['grad_worst']})"
            if "f64_rel_err_ours" in res:
                y_ours, y_fp32 = res["f64_rel_err_ours"], res["f64_rel_err_fp32"]
                msg += f"  vs float64: y {y_ours:.2e} (PyTorch FP32 {y_fp32:.2e})"
            if "f64_grad_rel_err_ours" in res:
                msg += (
                    f", grads {res['f64_grad_rel_err_ours']:.2e} ({res['f64_grad_worst_ours']}; "
                    f"PyTorch FP32 {res['f64_grad_rel_err_fp32']:.2e})"
                )
            for key in ("error", "grad_error", "f64_error", "f64_note"):
                if res.get(key):
                    msg += f"  {key.upper()}: {res[key]}"
            print(msg + f"  [{time.perf_counter() - t0:.1f} s]")
            for n, tr in enumerate(res.get("per_trial", [])):
                verdict = "ok" if tr["allclose"] else "NOT allclose"
                print(f"    trial {n}: max_abs {tr['max_abs']:.3e}  rel_err {tr['rel_err']:.3e}  {verdict}")
            results[prec] = res
            if ok and ref is not None:
                news[prec] = new  # only correct ones are timed
            else:
                del new

        timings: dict = {}
        if not args.no_timing and ref is not None:
            timings = time_all(mod, ref, news, args)
        for prec in args.precision:
            res = results[prec]
            for pas in ["fwd", "fwd+bwd"] if args.backward else ["fwd"]:
                row: dict[str, Any] = {
                    "problem": pid,
                    "model": model_name,
                    "name": name,
                    "modelnew": res.get("modelnew", "-"),
                    "precision": prec,
                    "pass": pas,
                    "shape_scale": args.shape_scale,
                    "correct": f"{res['passed']}/{res['trials']}" if pas == "fwd" else "grads",
                    "max_abs": None,
                    "rel_err": None,
                    "ours_ms": timings.get((prec, pas)),
                    "eager_ms": timings.get(("eager", pas)),
                    "compile_ms": timings.get(("compile", pas)),
                }
                if pas == "fwd":
                    row.update({k: v for k, v in res.items() if not k.startswith("grad")})
                else:  # the fwd+bwd row shows the gradients' differences
                    row.update(max_abs=res.get("grad_max_abs"), rel_err=res.get("grad_rel_err"))
                    row.update({k: v for k, v in res.items() if k.startswith("grad")})
                rows.append(row)
        del ref, news
        if args.device.type == "cuda":
            torch.cuda.empty_cache()

    print()
    print_table(rows)
    if args.no_timing:
        print(
            "(timing skipped"
            + (": CPU run; --cpu-timing times by wall clock)" if args.device.type == "cpu" else ")")
        )
    elif args.device.type == "cpu":
        print("(CPU wall-clock timings: a smoke test of this script, not a benchmark)")
    elif args.baseline_tf32:
        print("(eager and compile timed with TF32 matmuls allowed)")
    if args.json:
        meta = {"device": device_name, "torch": torch.__version__, "argv": sys.argv[1:]}
        args.json.write_text(json.dumps({"meta": meta, "results": rows}, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    print("all correct" if all_ok else "SOME PROBLEMS FAILED")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""KernelBench's protocol for the five level-2 problems that `fused_linear` fuses.

For each problem and precision: build `Model` and `ModelNew` from `get_init_inputs()` under the
same `torch.manual_seed(seed)` (so both get the same weights; checked), then for each of
`--trials` seeds draw the inputs with `get_inputs()` and compare `ModelNew(x)` with `Model(x)` --
plain PyTorch in strict FP32, TF32 off -- with `torch.allclose(atol, rtol)`, reporting the
largest absolute difference and the relative error ||new - ref|| / ||ref||. That is how
KernelBench decides correctness (its own fp32 tolerance is 1e-4 on both).

Then, in the same process, the timing: ModelNew's forward against eager `Model` and
`torch.compile(Model)` (and with `--backward` forward+backward of each, against a fixed random
output gradient, after a gradient check), timed with CUDA events, after warm-up, with the L2
cache flushed before every timed run (by writing a buffer larger than L2, 256 MB at least, as
KernelBench does) so that no run finds the weights already on chip; the median of `--iters` runs
is reported. Forward timings run under `torch.no_grad()`, as inference does.

Tolerances: 1e-4 (atol and rtol) for fp32 and tf32x3, which are FP32-accurate; 2e-2 for tf32 and
bf16, whose operand rounding (2^-11, 2^-8) alone misses 1e-4 at these reduction lengths.
`--atol/--rtol` override both.

Usage (from the repository root, on a GPU machine with fused_linear installed):
    python examples/kernelbench/run.py                                  # all five, fp32
    python examples/kernelbench/run.py --problems 88,37 --precision tf32x3,tf32 --backward
    python examples/kernelbench/run.py --small --no-compile --json out.json
    python examples/kernelbench/run.py --device cpu                     # correctness only, small shapes
Exit status: 0 when every problem and precision passes every trial, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

HERE = Path(__file__).resolve().parent

# KernelBench problem id -> (module in this folder, the project's model name).
PROBLEMS: dict[int, tuple[str, str]] = {
    88: ("p088_gemm_groupnorm_swish_multiply_swish", "M1"),
    37: ("p037_matmul_swish_sum_groupnorm", "M2"),
    62: ("p062_matmul_groupnorm_leakyrelu_sum", "M3"),
    98: ("p098_matmul_avgpool_gelu_scale_max", "M4"),
    94: ("p094_gemm_biasadd_hardtanh_mish_groupnorm", "M5"),
}
PRECISIONS = ("fp32", "tf32x3", "tf32", "bf16")
DEFAULT_TOL = {"fp32": 1e-4, "tf32x3": 1e-4, "tf32": 2e-2, "bf16": 2e-2}
SMALL_SCALE = 32  # --small: seed sizes / 32 (e.g. 32 x 256 -> 256), channels per group kept
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
        "--problems", action="append", help="KernelBench ids, e.g. 88,37 (default: 88,37,62,98,94)"
    )
    p.add_argument(
        "--precision", action="append", help=f"repeatable or comma list of {', '.join(PRECISIONS)}"
    )
    p.add_argument("--trials", type=int, default=5, help="correctness trials, one input seed each (5)")
    p.add_argument("--seed", type=int, default=42, help="seed for the weights and the trial seeds (42)")
    p.add_argument("--atol", type=float, help="absolute tolerance (default 1e-4 fp32/tf32x3, 2e-2 tf32/bf16)")
    p.add_argument("--rtol", type=float, help="relative tolerance (same defaults)")
    scale = p.add_mutually_exclusive_group()
    scale.add_argument("--shape-scale", type=int, help="divide batch, in, out and groups by this")
    scale.add_argument("--small", action="store_true", help=f"same as --shape-scale {SMALL_SCALE}")
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
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)

    args.problems = [int(x) for x in comma_list(args.problems)] or list(PROBLEMS)
    unknown = [x for x in args.problems if x not in PROBLEMS]
    if unknown:
        p.error(f"unknown problem(s) {unknown}; known: {', '.join(map(str, PROBLEMS))}")
    args.precision = comma_list(args.precision) or ["fp32"]
    bad = [x for x in args.precision if x not in PRECISIONS]
    if bad:
        p.error(f"unknown precision(s) {bad}; known: {', '.join(PRECISIONS)}")
    args.device = torch.device(args.device)
    if args.small:
        args.shape_scale = SMALL_SCALE
    if args.shape_scale is None:
        args.shape_scale = SMALL_SCALE if args.device.type == "cpu" else 1
    if args.device.type == "cpu" and not args.cpu_timing:
        args.no_timing = True  # CUDA events and L2 flushing mean nothing there
    elif args.device.type == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device here; use --device cpu for a correctness smoke test")
    if args.trials < 1 or args.iters < 1 or args.warmup < 0:
        p.error("--trials and --iters must be at least 1, --warmup at least 0")
    return args


# ---------------------------------------------------------------- the problems


def load_problem(pid: int, scale: int) -> ModuleType:
    """The problem's module, with its sizes divided by `scale`."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    mod = importlib.import_module(PROBLEMS[pid][0])
    mod.set_shape_scale(scale)  # scale 1 restores the seed sizes
    return mod


def set_seed(seed: int) -> None:
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)


def strict_fp32(on: bool = True) -> None:
    """Plain FP32 matmuls (TF32 off) for the reference; `on=False` allows TF32."""
    torch.set_float32_matmul_precision("highest" if on else "high")


def build_models(
    mod: ModuleType, precision: str, seed: int, device: torch.device
) -> tuple[nn.Module, nn.Module]:
    """Model and ModelNew from the same seed, as KernelBench builds them (on the CPU, then moved)."""
    set_seed(seed)
    init_inputs = mod.get_init_inputs()
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
    return ref.to(device), new.to(device)


def trial_seeds(seed: int, n: int) -> list[int]:
    """One input seed per trial, drawn from `seed` (KernelBench's scheme)."""
    torch.manual_seed(seed)
    return [int(torch.randint(0, 2**32 - 1, (1,)).item()) for _ in range(n)]


def inputs_for(mod: ModuleType, seed: int, device: torch.device) -> list[Any]:
    set_seed(seed)
    return [x.to(device) if isinstance(x, torch.Tensor) else x for x in mod.get_inputs()]


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
    """KernelBench's trials: every one must pass allclose; the worst differences are kept."""
    passed, worst_abs, worst_rel, error = 0, 0.0, 0.0, None
    with torch.no_grad():
        for seed in trial_seeds(args.seed, args.trials):
            inputs = inputs_for(mod, seed, args.device)
            expected = ref(*inputs)
            try:
                got = new(*inputs)
            except Exception as e:  # noqa: BLE001 -- a failure is a result, not the end of the run
                error = f"{type(e).__name__}: {e}"
                break
            if got.shape != expected.shape:
                error = f"shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
                break
            max_abs, rel = compare(got, expected)
            worst_abs, worst_rel = max(worst_abs, max_abs), max(worst_rel, rel)
            passed += bool(torch.allclose(got, expected, atol=atol, rtol=rtol))
    return {
        "passed": passed,
        "trials": args.trials,
        "max_abs": worst_abs,
        "rel_err": worst_rel,
        "error": error,
    }


def check_gradients(
    mod: ModuleType, ref: nn.Module, new: nn.Module, args: argparse.Namespace
) -> dict[str, Any]:
    """One trial's gradients (x and every parameter) against the reference's; reported, not a bar."""
    (x,) = inputs_for(mod, trial_seeds(args.seed, 1)[0], args.device)
    grads = []
    for model in (ref, new):
        model.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_(True)
        y = model(xg)
        y.backward(fixed_grad(y))
        grads.append({"x": xg.grad, **{n: p.grad for n, p in model.named_parameters()}})
    worst_name, worst_abs, worst_rel = "", 0.0, 0.0
    for name, g_ref in grads[0].items():
        g_new = grads[1][name]
        if g_new is None:
            return {"grad_error": f"no gradient for {name}"}
        max_abs, rel = compare(g_new, g_ref)
        worst_abs = max(worst_abs, max_abs)
        if rel >= worst_rel:
            worst_name, worst_rel = name, rel
    ref.zero_grad(set_to_none=True)
    new.zero_grad(set_to_none=True)
    return {"grad_max_abs": worst_abs, "grad_rel_err": worst_rel, "grad_worst": worst_name}


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
    head = ["problem", "prec", "pass", "correct", "max_abs", "rel_err", "ours ms", "eager ms", "compile ms"]
    head += ["x eager", "x compile"]
    lines = [head]
    for r in rows:
        ours, eager, comp = r.get("ours_ms"), r.get("eager_ms"), r.get("compile_ms")
        lines.append(
            [
                f"{r['problem']} ({r['model']})",
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
                str(c).rjust(w) if i >= 3 else str(c).ljust(w) for i, (c, w) in enumerate(zip(line, widths))
            )
        )
        if n == 0:
            print("  ".join("-" * w for w in widths))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    strict_fp32(True)
    device_name = (
        torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else platform.processor()
    )
    print(
        f"device {args.device} ({device_name or 'cpu'}), torch {torch.__version__}, "
        f"shape scale 1/{args.shape_scale}"
    )

    rows: list[dict[str, Any]] = []
    all_ok = True
    for pid in args.problems:
        mod = load_problem(pid, args.shape_scale)
        name, model_name = PROBLEMS[pid]
        shape = f"x {tuple(mod.get_inputs()[0].shape)}, init {mod.get_init_inputs()}"
        print(f"\n#{pid} {name} ({model_name}): {shape}")
        ref, news, results = None, {}, {}
        for prec in args.precision:
            atol = args.atol if args.atol is not None else DEFAULT_TOL[prec]
            rtol = args.rtol if args.rtol is not None else DEFAULT_TOL[prec]
            t0 = time.perf_counter()
            ref, new = build_models(mod, prec, args.seed, args.device)
            res = check_correctness(mod, ref, new, args, atol, rtol)
            res.update(atol=atol, rtol=rtol)
            if args.backward and res["error"] is None:
                try:
                    res.update(check_gradients(mod, ref, new, args))
                except Exception as e:  # noqa: BLE001 -- reported in the row
                    res["grad_error"] = f"{type(e).__name__}: {e}"
            ok = res["error"] is None and res["passed"] == res["trials"]
            all_ok &= ok
            msg = f"  {prec:7s} {res['passed']}/{res['trials']} allclose({atol:g}, {rtol:g})"
            msg += f"  max_abs {res['max_abs']:.3e}  rel_err {res['rel_err']:.3e}"
            if "grad_rel_err" in res:
                msg += f"  grad rel_err {res['grad_rel_err']:.3e} ({res['grad_worst']})"
            for key in ("error", "grad_error"):
                if res.get(key):
                    msg += f"  {key.upper()}: {res[key]}"
            print(msg + f"  [{time.perf_counter() - t0:.1f} s]")
            results[prec] = res
            if ok:
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
                    "precision": prec,
                    "pass": pas,
                    "shape_scale": args.shape_scale,
                    "correct": f"{res['passed']}/{res['trials']}" if pas == "fwd" else "grads",
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

#!/usr/bin/env python3
"""PyTorch parity: the `host` binary against PyTorch on the same weights and inputs.

For every reference model M1..M5 (at small shapes) and a set of seeded random chains
and shapes, this builds the block in plain PyTorch (`fused_linear.bench.PlainBlock`, the
chain read by the op registry's parser), with random parameters (GroupNorm's too), saves its
state dict under the project's names (lin.weight, lin.bias, gn.weight, gn.bias, w,
bias, gn2.weight, bias2, w2, ...) and a random input `x` as safetensors, runs

    host forward --device DEV --weights W --input X --output Y [--model M --groups G | --ops CHAIN] --check-rows 0

and compares `y` with the module's output in float64 (the reference) and float32
(the module as users run it): max abs error, relative error ||a-b||/||b|| and
torch.allclose(atol=1e-2, rtol=1e-2). With a binary that has `host backward`, the
gradients (`grad.x`, `grad.<parameter>`) are compared with autograd's `y.backward(dy)`
the same way; without one, backward is skipped and the script says so.

A row fails when shapes differ, NaN/Inf sit in different places, allclose fails (not
for `--precision tf32` or `bf16`, whose rounding alone misses it), or the relative error
against float64 exceeds --rel-tol (default: the precision's; 1e-4 for strict f32).

`--seed-sizes` runs the five presets at their seed sizes instead (docs: models.md), with
the PyTorch modules on the GPU (float64 there takes seconds), and `--precision P` passes
the GEMM precision to the host, the tolerance following it (fp32 and tf32x3 1e-4, tf32
2e-3, bf16 2e-2): the only check of the parameter gradients at seed size, which the
host's own `--check-rows` cannot afford on the CPU. There the float32 rows are reported
but decide nothing, and rows `t32` give PyTorch's float32 module against float64: at
these sizes its own `z` rounding takes kinks (LeakyReLU, Hardtanh) on the wrong side, and
its gradients are 5e-4..2e-3 from the exact ones. Every row also reports the largest
`|got - ref| / (1e-4 + 1e-4 |ref|)` against float64 (`allclose(1e-4, 1e-4)` holds at 1;
reported, not a pass/fail rule).

Usage (on the GPU machine, from the repository root; python3 with torch, safetensors, numpy):
    python3 scripts/parity.py --host device-carry/host
    python3 scripts/parity.py --host device-carry/host --seed-sizes --precision tf32x3
    python3 scripts/parity.py --host target/release/host --device cpu --no-backward
Exit status: 0 when every row passes, 1 when any fails, 2 when the run cannot start.
"""
import argparse
import copy
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile

try:
    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file

    from fused_linear import _native
    from fused_linear.bench import PlainBlock, randomize_affine
except ImportError as e:  # say what is missing rather than a traceback
    sys.exit(f"parity.py needs torch, safetensors, numpy and fused_linear (the chain syntax's parser and the plain block): {e}")

PRESETS = {
    "M1": "groupnorm(256),swish,mul,swish",
    "M2": "swish,bias,groupnorm(64)",
    "M3": "groupnorm(512),leakyrelu(0.01),scale(2)",
    "M4": "avgpool(16),gelu,scale(2),max",
    "M5": "bias,hardtanh(-1,1),mish,groupnorm(256)",
}
# Presets at a small shape, with group counts that divide `out` into groups of 8..32
# channels (M3's 512 groups of 512 channels would be groups of one: output = beta).
PRESET_SHAPE = (64, 256, 512)
PRESET_GROUPS = {"M1": 32, "M2": 16, "M3": 64, "M4": None, "M5": 32}
# The seed sizes (batch, in, out), with the presets' own group counts.
SEED_SHAPES = {"M1": (1024, 8192, 8192), "M2": (32768, 1024, 4096), "M3": (1024, 8192, 8192),
               "M4": (1024, 8192, 8192), "M5": (1024, 8192, 8192)}
# Relative-error tolerance against float64 per `--precision` (host/src/check.rs).
PRECISION_TOL = {"fp32": 1e-4, "tf32x3": 1e-4, "tf32": 2e-3, "bf16": 2e-2}


# ---------------------------------------------------------------- chains


def parse_chain(text):
    """The chain as tuples `(kind, *args)`, by the op registry's own parser
    (`fused_linear._native.parse_chain`: aliases resolved, defaults filled in)."""
    ops = []
    for kind, args in _native.parse_chain(text):
        if kind in ("groupnorm", "avgpool"):
            args = [int(args[0]), *args[1:]]
        ops.append((kind, *args))
    return ops


def op_text(op):
    """One parsed op back in the chain syntax."""
    kind, args = op[0], op[1:]
    return f"{kind}({','.join(f'{a:g}' for a in args)})" if args else kind


def with_groups(text, groups):
    """The chain with every groupnorm's group count replaced (the `--groups` flag)."""
    if groups is None:
        return text
    return ",".join(op_text(("groupnorm", groups, op[2]) if op[0] == "groupnorm" else op) for op in parse_chain(text))


def random_chain(rng, out):
    """1..5 random ops valid for `out` features, sometimes ending in max."""
    ops, f = [], out
    n = rng.randint(1, 5)
    for i in range(n):
        r = rng.randrange(10)
        if r == 0:
            tok = "bias"
        elif r == 1:
            tok = "mul"
        elif r == 2:
            tok = f"scale({rng.choice([-1.5, 0.5, 2, 3.25])})"
        elif r in (3, 4, 5):
            tok = ["swish", "mish", "gelu"][r - 3]
        elif r == 6:
            tok = f"leakyrelu({rng.choice([0.01, 0.2, 0])})"
        elif r == 7:
            tok = "hardtanh({},{})".format(*rng.choice([(-1, 1), (-0.5, 0.7), (-2, 3)]))
        elif r == 8 and f >= 2 and i + 1 < n:
            k = rng.randint(2, min(4, f))
            tok, f = f"avgpool({k})", f // k
        else:
            g = rng.choice([d for d in range(1, f + 1) if f % d == 0])
            tok = f"groupnorm({g})" if rng.random() < 0.7 else f"groupnorm({g},1e-3)"
        ops.append(tok)
    if rng.random() < 0.2:
        ops.append("max")
    return ",".join(ops)


# ---------------------------------------------------------------- cases


class Case:
    def __init__(self, name, chain, shape, flags, x_transform=None, backward=True, note=""):
        self.name, self.chain, self.shape, self.flags = name, chain, shape, flags
        self.x_transform, self.backward, self.note = x_transform, backward, note


def inject_nonfinite(x):
    """NaN in row 1, +Inf in row 2, -Inf in row 3 (one element each)."""
    x = x.clone()
    x[1, 3], x[2, 0], x[3, 5] = float("nan"), float("inf"), -float("inf")
    return x


def cases(args):
    out = []
    if args.seed_sizes:
        for m, text in PRESETS.items():
            out.append(Case(m, text, SEED_SHAPES[m], ["--model", m]))
        return out
    for m, text in PRESETS.items():
        g = PRESET_GROUPS[m]
        flags = ["--model", m] + (["--groups", str(g)] if g else [])
        out.append(Case(m, with_groups(text, g), PRESET_SHAPE, flags))
    for m in ("M1", "M5"):  # odd sizes: groups of 24 channels, k not a multiple of 4
        out.append(Case(f"{m} odd", with_groups(PRESETS[m], 4), (33, 77, 96), ["--model", m, "--groups", "4"]))
    rng = random.Random(args.seed)
    for i in range(args.random):
        shape = (rng.choice([1, 3, 17, 64, 130]), rng.choice([5, 16, 77, 300]),
                 rng.choice([24, 48, 96, 100, 130, 256]))
        text = random_chain(rng, shape[2])
        out.append(Case(f"random {i}", text, shape, ["--ops", text]))
    # NaN/Inf must propagate as in PyTorch. Chains without GELU: torch's own CPU GELU
    # gives NaN for +Inf on its vectorised path and Inf on its scalar one.
    for name, text in [("M1 nan/inf", with_groups(PRESETS["M1"], 32)),
                       ("M5 nan/inf", with_groups(PRESETS["M5"], 32)),
                       ("clamp nan/inf", "leakyrelu(0.2),hardtanh(-2,2),mish,max")]:
        out.append(Case(name, text, (16, 64, 128), ["--ops", text], inject_nonfinite, backward=False,
                        note="backward not compared with NaN/Inf inputs"))
    # Large inputs: activations far into saturation (sigmoid, softplus, erf tails).
    text = "swish,mish,bias,gelu,groupnorm(8)"
    out.append(Case("large x", text, (32, 64, 128), ["--ops", text], lambda x: 30.0 * x))
    return out


# ---------------------------------------------------------------- comparison


def compare(got, ref, rel_tol, strict, need_close=True):
    """One table row's numbers: max abs, rel err over finite entries, allclose, pass.
    `strict`: the relative error must be within `rel_tol`; `need_close`: allclose must hold."""
    row = {}
    if tuple(got.shape) != tuple(ref.shape):
        row.update(max_abs=float("nan"), rel=float("nan"), allclose=False, close4=float("nan"), ok=False,
                   why=f"shape {list(got.shape)} vs {list(ref.shape)}")
        return row
    a, b = got.detach().double().cpu().numpy(), ref.detach().double().cpu().numpy()
    same_nan = np.array_equal(np.isnan(a), np.isnan(b))
    inf = np.isinf(b)
    same_inf = np.array_equal(np.isinf(a), inf) and np.array_equal(a[inf], b[inf])
    fin = np.isfinite(a) & np.isfinite(b)
    d = a[fin] - b[fin]
    max_abs = float(np.abs(d).max()) if d.size else 0.0
    norm = float(np.linalg.norm(b[fin]))
    rel = float(np.linalg.norm(d)) / norm if norm > 0 else float(np.linalg.norm(d))
    close = bool(torch.allclose(torch.from_numpy(a), torch.from_numpy(b), atol=1e-2, rtol=1e-2, equal_nan=True))
    # allclose(1e-4, 1e-4) as a ratio (at most 1 where it holds), reported only.
    close4 = float((np.abs(d) / (1e-4 + 1e-4 * np.abs(b[fin]))).max()) if d.size else 0.0
    why = []
    if not (same_nan and same_inf):
        why.append("NaN/Inf in different places")
    if not close and need_close:
        why.append("allclose fails")
    if strict and rel > rel_tol:
        why.append(f"rel err above {rel_tol:g}")
    row.update(max_abs=max_abs, rel=rel, allclose=close, close4=close4, ok=not why, why="; ".join(why))
    return row


# ---------------------------------------------------------------- running


def run_host(cmd, timeout):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"exit {p.returncode}: {' | '.join(tail)}")
    return p


def has_backward(host):
    try:
        return subprocess.run([host, "backward", "--help"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def run_case(case, idx, args, work, backward):
    """Runs one case; returns table rows (dicts)."""
    b, i, o = case.shape
    torch.manual_seed(args.seed * 1000 + idx)
    # The block in plain PyTorch, named as the CLI's files name it, GroupNorm affine drawn at random.
    m32 = randomize_affine(PlainBlock(i, o, case.chain), args.seed * 1000 + idx)
    x = torch.randn(b, i)
    if case.x_transform:
        x = case.x_transform(x)
    dev = args.torch_device
    m64 = copy.deepcopy(m32).double().to(dev)
    m32 = m32.to(dev)
    with torch.no_grad():
        y32, y64 = m32(x.to(dev)).cpu(), m64(x.double().to(dev)).cpu()
    dy = torch.randn(y64.shape)

    d = os.path.join(work, f"case{idx}")
    os.makedirs(d, exist_ok=True)
    files = {k: os.path.join(d, f"{k}.safetensors") for k in ("w", "x", "y", "dy", "g", "y2")}
    save_file({k: v.detach().cpu().contiguous() for k, v in m32.state_dict().items()}, files["w"])
    save_file({"x": x.contiguous()}, files["x"])
    save_file({"dy": dy.float().contiguous()}, files["dy"])
    common = ["--device", args.device, "--weights", files["w"], "--input", files["x"], "--check-rows", "0",
              "--precision", args.precision]
    base = {"case": case.name, "chain": case.chain, "shape": "x".join(map(str, case.shape))}
    rows = []

    def add(tensor, got, ref64, ref32):
        for vs, ref, strict in (("f64", ref64, True), ("f32", ref32, False)):
            # TF32 and bf16: held to their relative tolerance only, in every row
            # (allclose(1e-2, 1e-2) is the field's bar for float32 results; their
            # rounding alone misses it), as the module's docstring says.
            need_close = args.precision not in ("tf32", "bf16")
            r = compare(got, ref, args.rel_tol, strict, need_close)
            if args.seed_sizes and vs == "f32":
                # At seed size PyTorch's float32 is itself far from float64 where `z`'s
                # rounding flips kinks (the `t32` row): reported, not a pass/fail.
                r.update(ok=True, why="")
            rows.append(dict(base, tensor=tensor, vs=vs, **r))
        if args.seed_sizes:
            # How far PyTorch's own float32 module is from float64.
            rows.append(dict(base, tensor=tensor, vs="t32", **dict(compare(ref32, ref64, args.rel_tol, False),
                                                                  ok=True, why="")))

    def failed(tensor, why):
        rows.append(dict(base, tensor=tensor, vs="-", max_abs=float("nan"), rel=float("nan"),
                         allclose=False, ok=False, why=why))

    try:
        run_host([args.host, "forward"] + common + ["--output", files["y"]] + case.flags, args.timeout)
        add("y", load_file(files["y"])["y"], y64, y32)
    except (RuntimeError, subprocess.TimeoutExpired, KeyError, OSError) as e:
        failed("y", f"host forward: {e}")

    if backward and case.backward:
        grads = {}
        for name, model, xx, dd in (("f64", m64, x.double(), dy.double()), ("f32", m32, x, dy.float())):
            xg = xx.to(dev).requires_grad_(True)
            model.zero_grad()
            model(xg).backward(dd.to(dev))
            g = {"grad.x": xg.grad.cpu()}
            g.update({f"grad.{n}": p.grad.cpu() for n, p in model.named_parameters()})
            grads[name] = g
        try:
            run_host([args.host, "backward"] + common + ["--grad-output", files["dy"], "--grads", files["g"],
                                                         "--output", files["y2"]] + case.flags, args.timeout)
            got = load_file(files["g"])
            for name in grads["f64"]:
                if name not in got:
                    failed(name, f"missing from host's gradients (it wrote: {', '.join(sorted(got))})")
                else:
                    add(name, got[name], grads["f64"][name], grads["f32"][name])
        except (RuntimeError, subprocess.TimeoutExpired, OSError) as e:
            failed("grad.*", f"host backward: {e}")
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="device-carry/host", help="the host binary (default: device-carry/host)")
    p.add_argument("--device", choices=["cpu", "gpu"], default="gpu", help="passed to host (default: gpu)")
    p.add_argument("--backward", action=argparse.BooleanOptionalAction, default=True,
                   help="also compare gradients (skipped if the binary has no `backward`)")
    p.add_argument("--random", type=int, default=12, help="random chains besides the presets (default 12)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rel-tol", type=float, help="max relative error vs float64 (default: the precision's)")
    p.add_argument("--precision", choices=sorted(PRECISION_TOL), default="fp32", help="passed to host (default fp32)")
    p.add_argument("--seed-sizes", action="store_true", help="only the presets, at their seed sizes (torch on cuda)")
    p.add_argument("--timeout", type=int, default=300, help="seconds per host call")
    p.add_argument("--json", help="also write the rows and a summary to this file")
    p.add_argument("--keep", help="keep the safetensors files in this folder")
    args = p.parse_args()
    if args.rel_tol is None:
        args.rel_tol = PRECISION_TOL[args.precision]
    args.torch_device = "cuda" if args.seed_sizes and torch.cuda.is_available() else "cpu"
    if args.seed_sizes and args.torch_device == "cpu":
        print("note: no CUDA for torch; the seed-size references run on the CPU (slow)")

    if not (os.path.isfile(args.host) and os.access(args.host, os.X_OK)):
        print(f"error: host binary `{args.host}` not found or not executable (give --host PATH)", file=sys.stderr)
        return 2
    backward = args.backward and has_backward(args.host)
    print(f"parity: {args.host} --device {args.device} --precision {args.precision} vs torch {torch.__version__} "
          f"(float64 and float32 modules on {args.torch_device}; tolerance {args.rel_tol:g} against float64)")
    if args.backward and not backward:
        print("backward: SKIPPED: `host backward --help` fails, this binary has no backward command; "
              "comparing the forward only")
    elif not args.backward:
        print("backward: not compared (--no-backward)")

    work = args.keep or tempfile.mkdtemp(prefix="parity-")
    os.makedirs(work, exist_ok=True)
    rows = []
    try:
        for idx, case in enumerate(cases(args)):
            rows.extend(run_case(case, idx, args, work, backward))
            if case.note and backward:
                print(f"note: {case.name}: {case.note}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    head = (f"{'case':<14} {'chain':<44} {'shape':<16} {'tensor':<16} {'vs':<3} {'max abs':>9} {'rel err':>9} "
            f"{'allclose':<8} {'1e-4':>7} result")
    print(head)
    print("-" * len(head))
    for r in rows:
        chain = r["chain"] if len(r["chain"]) <= 44 else r["chain"][:41] + "..."
        close4 = r.get("close4", float("nan"))
        print(f"{r['case']:<14} {chain:<44} {r['shape']:<16} {r['tensor']:<16} {r['vs']:<3} "
              f"{r['max_abs']:>9.2e} {r['rel']:>9.2e} {str(r['allclose']):<8} {close4:>7.2f} "
              f"{'ok' if r['ok'] else 'FAILED: ' + r['why']}")
    failed = [r for r in rows if not r["ok"]]
    n_cases = len({r["case"] for r in rows})
    summary = {"host": args.host, "device": args.device, "precision": args.precision,
               "torch": torch.__version__, "backward": backward,
               "cases": n_cases, "rows": len(rows), "failed": len(failed), "rel_tol": args.rel_tol}
    print(f"\n{n_cases} cases, {len(rows)} comparisons, {len(failed)} failed"
          f"{'' if backward else ' (forward only)'}")
    if args.json:
        # JSON has no NaN: a missing number (a failed run) is null.
        clean = [{k: (None if isinstance(v, float) and v != v else v) for k, v in r.items()} for r in rows]
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "rows": clean}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

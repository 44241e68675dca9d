"""Train a small MLP of fused blocks side by side with the same MLP in plain PyTorch.

Why: the fused op has its own backward (the GEMMs for dX and dW, the chain's derivatives, GroupNorm's
statistics), and a training run is the end-to-end test that it is right: two models that start
from equal weights and see equal batches must keep equal losses, step after step, and the loss
must fall.

The MLP (in -> hidden -> hidden -> out):
    l1: Linear + "groupnorm(G),swish"    (lin.weight, lin.bias, gn.weight, gn.bias)
    l2: Linear + "bias,mish"             (lin.weight, lin.bias, bias)
    l3: Linear, empty chain              (lin.weight, lin.bias)
The plain twin is nn.Linear + nn.GroupNorm + F.silu ... with the same parameter names, and the
fused one gets its weights by `load_state_dict`, so both start equal. The task is a synthetic
regression: y = tanh(x A) B + noise for a fixed random teacher (A, B), x ~ N(0, 1). Both models
step with AdamW on the same batches.

Tolerance on |loss_fused - loss_plain| / loss_plain, every step (`--tol` overrides):
    fp32, tf32x3: 1e-4. The first step's losses differ only by summation order (~1e-7); after
        that the two runs drift apart slowly (AdamW divides each update by the gradient's own
        size, so rounding differences in small gradients become differences of about lr in the
        weights), and over tens of steps the loss gap stays well under 1e-4.
    tf32: 2e-2, fp16: 2e-2, bf16: 5e-2. The reference is strict FP32, so these carry their
        operands' rounding (2^-11 and 2^-8 relative) in every forward and gradient.
    fp8, fp8_gw_bf16: 0.15, FP8's tolerance (e4m3 keeps 4 significant bits). Their real bar
        is the other one: the same MLP fused in bf16 is trained beside them on the same
        batches, and the fp8 run's last loss must be within 2% of the bf16 run's (`--fp8-tol`).
The final parameters are compared too (max over tensors of ||p_fused - p_plain|| / ||p_plain||);
`--check-params` makes that a bar at 10x the loss tolerance, else it is only reported.

Usage:
    python examples/train.py --steps 50 --device cuda --precision fp32
    python examples/train.py --device cpu --steps 30
Exit status 0 when the losses agree at every step and the loss fell; 1 otherwise.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

import fused_linear

DEFAULT_TOL = {
    "fp32": 1e-4,
    "tf32x3": 1e-4,
    "tf32": 2e-2,
    "fp16": 2e-2,
    "bf16": 5e-2,
    "fp8": 0.15,
    "fp8_gw_bf16": 0.15,
}


# ---------------------------------------------------------------- the two MLPs


class GroupNormSwish(nn.Module):
    """Plain twin of FusedLinear(in, out, "groupnorm(G),swish")."""

    def __init__(self, in_features: int, out_features: int, groups: int) -> None:
        super().__init__()
        self.lin = nn.Linear(in_features, out_features)
        self.gn = nn.GroupNorm(groups, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.gn(self.lin(x)))


class BiasMish(nn.Module):
    """Plain twin of FusedLinear(in, out, "bias,mish")."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.lin = nn.Linear(in_features, out_features)
        self.bias = nn.Parameter(0.1 * torch.randn(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.mish(self.lin(x) + self.bias)


class PlainLinear(nn.Module):
    """Plain twin of FusedLinear(in, out, ""): a Linear, under the name `lin`."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.lin = nn.Linear(in_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class MLP(nn.Module):
    """Three blocks in a row; the same class holds the plain and the fused blocks."""

    def __init__(self, l1: nn.Module, l2: nn.Module, l3: nn.Module) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = l1, l2, l3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(self.l2(self.l1(x)))


def plain_mlp(d_in: int, hidden: int, d_out: int, groups: int) -> MLP:
    return MLP(GroupNormSwish(d_in, hidden, groups), BiasMish(hidden, hidden), PlainLinear(hidden, d_out))


def fused_mlp(d_in: int, hidden: int, d_out: int, groups: int, precision: str, device: torch.device) -> MLP:
    def block(i: int, o: int, ops: str) -> nn.Module:
        return fused_linear.FusedLinear(i, o, ops, precision=precision, device=device)

    return MLP(
        block(d_in, hidden, f"groupnorm({groups}),swish"),
        block(hidden, hidden, "bias,mish"),
        block(hidden, d_out, ""),
    )


# ---------------------------------------------------------------- data and progress


def batches(args: argparse.Namespace) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (x, y) batches of the teacher task, drawn on the CPU (the same on every device)."""
    g = torch.Generator().manual_seed(args.seed + 1)
    teacher_a = torch.randn(args.in_features, 32, generator=g) / args.in_features**0.5
    teacher_b = torch.randn(32, args.out_features, generator=g)
    while True:
        x = torch.randn(args.batch, args.in_features, generator=g)
        y = torch.tanh(x @ teacher_a) @ teacher_b + 0.01 * torch.randn(
            args.batch, args.out_features, generator=g
        )
        yield x.to(args.device), y.to(args.device)


class TextBar:
    """A minimal stand-in for tqdm: one line, redrawn in place."""

    def __init__(self, total: int, width: int = 30) -> None:
        self.total, self.width, self.n, self.note = total, width, 0, ""

    def __iter__(self) -> Iterator[int]:
        for i in range(self.total):
            yield i
            self.n = i + 1
            done = self.width * self.n // self.total
            bar = "#" * done + "." * (self.width - done)
            line = f"[{bar}] {self.n}/{self.total} {self.note}"
            print(f"\r{line:<100}", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)

    def set_postfix_str(self, note: str) -> None:
        self.note = note


def progress(total: int) -> Iterable[int]:
    try:
        from tqdm import tqdm
    except ImportError:
        return TextBar(total)
    return tqdm(range(total), desc="train", unit="step")


# ---------------------------------------------------------------- training


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def param_diff(fused: nn.Module, plain: nn.Module) -> tuple[float, str]:
    """The largest ||p_fused - p_plain|| / ||p_plain|| over the parameters, and its name."""
    ref = dict(plain.named_parameters())
    worst, name = 0.0, ""
    for n, p in fused.named_parameters():
        q = ref[n].detach().double()
        d = (p.detach().double() - q).norm().item() / max(q.norm().item(), 1e-30)
        if d >= worst:
            worst, name = d, n
    return worst, name


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--precision", default="fp32", choices=fused_linear.PRECISIONS)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--in-features", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--out-features", type=int, default=16)
    p.add_argument("--groups", type=int, default=8, help="GroupNorm groups in the first block (8)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tol", type=float, help="loss tolerance (default: 1e-4 fp32/tf32x3, 2e-2 tf32, 5e-2 bf16)"
    )
    p.add_argument(
        "--check-params", action="store_true", help="fail when the final weights differ > 10x --tol"
    )
    p.add_argument(
        "--min-drop", type=float, default=0.5, help="the last loss must be < (1 - this) x the first"
    )
    p.add_argument(
        "--fp8-tol",
        type=float,
        default=0.02,
        help="fp8: the last loss within this of a bf16 twin's, relative (0.02)",
    )
    args = p.parse_args(argv)
    args.device = torch.device(args.device)
    if args.tol is None:
        args.tol = DEFAULT_TOL[args.precision]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_float32_matmul_precision("highest")  # the plain twin in strict FP32
    torch.manual_seed(args.seed)
    plain = plain_mlp(args.in_features, args.hidden, args.out_features, args.groups).to(args.device)
    fused = fused_mlp(
        args.in_features, args.hidden, args.out_features, args.groups, args.precision, args.device
    )
    fused.load_state_dict(plain.state_dict())  # strict: the parameter names must match too
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    opt_fused = torch.optim.AdamW(fused.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    # fp8: a bf16 twin of the fused MLP, trained on the same batches (its last loss is fp8's bar).
    twins = []
    if args.precision.startswith("fp8"):
        bf16 = fused_mlp(args.in_features, args.hidden, args.out_features, args.groups, "bf16", args.device)
        bf16.load_state_dict(plain.state_dict())
        opt = torch.optim.AdamW(bf16.parameters(), lr=args.lr, weight_decay=args.weight_decay)
        twins.append((bf16, opt, []))
    print(
        f"MLP {args.in_features} -> {args.hidden} -> {args.hidden} -> {args.out_features}, "
        f"batch {args.batch}, {args.device}, precision {args.precision}, loss tolerance {args.tol:g}"
    )

    losses_fused, losses_plain, worst, worst_step = [], [], 0.0, 0
    data = batches(args)
    bar = progress(args.steps)
    for step in bar:
        x, y = next(data)
        for model, opt, losses in (
            (fused, opt_fused, losses_fused),
            (plain, opt_plain, losses_plain),
            *twins,
        ):
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        d = rel_diff(losses_fused[-1], losses_plain[-1])
        if d >= worst:
            worst, worst_step = d, step
        bar.set_postfix_str(f"loss {losses_fused[-1]:.4f} / {losses_plain[-1]:.4f}, rel diff {d:.1e}")
        if not (math.isfinite(losses_fused[-1]) and math.isfinite(losses_plain[-1])):
            break

    pdiff, pname = param_diff(fused, plain)
    print(
        f"fused loss {losses_fused[0]:.6f} -> {losses_fused[-1]:.6f} | plain loss {losses_plain[0]:.6f} -> "
        f"{losses_plain[-1]:.6f} | max rel loss diff {worst:.2e} (step {worst_step}, tol {args.tol:g}) | "
        f"final params max rel diff {pdiff:.2e} ({pname})"
    )
    failures = []
    if not worst <= args.tol:  # also catches NaN
        failures.append(f"the losses diverged: {worst:.2e} > {args.tol:g} at step {worst_step}")
    if len(losses_fused) < args.steps:
        failures.append(f"a loss was not finite at step {len(losses_fused) - 1}")
    for name, losses in (("fused", losses_fused), ("plain", losses_plain)):
        if not losses[-1] < (1 - args.min_drop) * losses[0]:
            failures.append(
                f"the {name} loss did not fall by {args.min_drop:.0%}: {losses[0]:.4g} -> {losses[-1]:.4g}"
            )
    for _, _, losses_bf16 in twins:
        gap = rel_diff(losses_fused[-1], losses_bf16[-1])
        print(
            f"bf16 twin loss {losses_bf16[0]:.6f} -> {losses_bf16[-1]:.6f} | {args.precision} last loss "
            f"{gap:.2%} from it (tol {args.fp8_tol:.0%})"
        )
        if not gap <= args.fp8_tol:
            failures.append(
                f"the {args.precision} loss is {gap:.2%} from the bf16 twin's (> {args.fp8_tol:.0%})"
            )
    if args.check_params and not pdiff <= 10 * args.tol:
        failures.append(f"the final parameters differ: {pdiff:.2e} > {10 * args.tol:g} ({pname})")
    for f in failures:
        print(f"FAIL: {f}")
    print("OK" if not failures else "FAILED")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())

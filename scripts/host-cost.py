"""Host time per call of a small block, ours against eager PyTorch, and a loop to profile.

Each call is timed alone on the CPU (synchronize, perf_counter, call, perf_counter), so the
GPU never holds the host back; the median of `--calls` is printed in microseconds, eager,
ours and the empty node taking turns in three rounds (the H100 machine's host drifts by up
to a third between runs). With `--loop fwd|step` it instead runs that call back to back
for `--seconds` (for a sampling profiler; `scripts/host-profile.py` profiles one itself).

    python3 scripts/host-cost.py [--shape 64,1024,1024] [--ops M1] [--dtypes bf16,fp32]
"""

import argparse
import statistics
import time

import torch
from torch import nn

import fused_linear as fl


def plain_m1(i: int, o: int, groups: int, dtype) -> nn.Module:
    """M1's chain in plain PyTorch with FusedLinear's parameter names."""

    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(i, o)
            self.gn = nn.GroupNorm(groups, o)
            self.w = nn.Parameter(torch.randn(o))

        def forward(self, x):
            h = self.gn(self.lin(x))
            h = h * torch.sigmoid(h)
            h = h * self.w
            return h * torch.sigmoid(h)

    return Plain().to("cuda", dtype)


def per_call_us(fns, calls: int, rounds: int = 3) -> list:
    """The median host time of one call of each of ``fns``, in microseconds: the functions
    take turns, ``calls / rounds`` single calls each per round (the first rotating), so
    that a drift of the host's speed falls on all of them alike."""
    for fn in fns:
        for _ in range(20):
            fn()
    samples = [[] for _ in fns]
    for r in range(rounds):
        for i in [(r + j) % len(fns) for j in range(len(fns))]:
            for _ in range(max(1, calls // rounds)):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fns[i]()
                samples[i].append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return [statistics.median(s) * 1e6 for s in samples]


def calls(block: nn.Module, x: torch.Tensor):
    dy = torch.randn_like(block(x))
    xg = x.detach().clone().requires_grad_(True)

    def fwd():
        with torch.no_grad():
            block(x)

    def step():
        block.zero_grad(set_to_none=True)
        xg.grad = None
        block(xg).backward(dy)

    return fwd, step


class _Floor(torch.autograd.Function):
    """One autograd node that launches nothing: its forward and backward only allocate
    their outputs. What PyTorch alone costs for a block that is one node."""

    @staticmethod
    def forward(ctx, x, weight, bias, *params):
        ctx.save_for_backward(x, weight, bias, *params)
        return x.new_empty((x.shape[0], weight.shape[0]))

    @staticmethod
    def backward(ctx, dy):
        return tuple(torch.empty_like(t) for t in ctx.saved_tensors)


class FloorBlock(nn.Module):
    """The same parameters as a FusedLinear block, through :class:`_Floor`."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x):
        b = self.block
        return _Floor.apply(x, b.lin.weight, b.lin.bias, *b.chain_parameters())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="64,1024,1024")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--loop", choices=["fwd", "step"])
    p.add_argument("--dtype", default="bf16", help="the dtype of --loop")
    p.add_argument("--seconds", type=float, default=8.0)
    a = p.parse_args()
    b, i, o = (int(v) for v in a.shape.split(","))
    groups = o // 32
    ops = f"groupnorm({groups}),swish,mul,swish"
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    if a.loop:
        dtype = dtypes[a.dtype]
        block = fl.FusedLinear(i, o, ops, device="cuda", dtype=dtype)
        x = torch.randn(b, i, device="cuda", dtype=dtype)
        fwd, step = calls(block, x)
        fn = fwd if a.loop == "fwd" else step
        end = time.perf_counter() + a.seconds
        n = 0
        while time.perf_counter() < end:
            for _ in range(100):
                fn()
            torch.cuda.synchronize()
            n += 100
        print(f"{a.loop} {a.dtype}: {n} calls, {a.seconds / n * 1e6:.1f} us per call back to back")
        return
    print(f"host us per call, {b}x{i}x{o}, chain {ops}")
    print("| dtype | call | eager | ours | eager / ours | one empty autograd node |")
    print("|---|---|---|---|---|---|")
    for name in a.dtypes.split(","):
        dtype = dtypes[name]
        torch.manual_seed(0)
        ours = fl.FusedLinear(i, o, ops, device="cuda", dtype=dtype)
        plain = plain_m1(i, o, groups, dtype)
        plain.load_state_dict(ours.state_dict())
        x = torch.randn(b, i, device="cuda", dtype=dtype)
        floor = FloorBlock(ours)
        for label, e, f, fl0 in zip(
            ("forward", "train step"), calls(plain, x), calls(ours, x), calls(floor, x)
        ):
            te, tf, t0 = per_call_us([e, f, fl0], a.calls)
            print(f"| {name} | {label} | {te:.1f} | {tf:.1f} | {te / tf:.2f} | {t0:.1f} |")


if __name__ == "__main__":
    main()

"""Where the host time of one training step of the op goes (GPU machine): allocations
through PyTorch counted and timed, and cProfile's top entries.

    python3 scripts/py-profile.py [--shape 64,1024,1024] [--precision tf32] [--ops M1]
"""

import argparse
import cProfile
import pstats
import time

import torch

import fused_linear as fl
from fused_linear import _native, _stream


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="64,1024,1024")
    p.add_argument("--precision", default="tf32")
    p.add_argument("--ops", default="groupnorm(32),swish,mul,swish")
    p.add_argument("--steps", type=int, default=200)
    a = p.parse_args()
    b, i, o = (int(v) for v in a.shape.split(","))
    ops = fl.PRESETS.get(a.ops, a.ops)
    torch.manual_seed(0)
    m = fl.FusedLinear(i, o, ops, a.precision, device="cuda")
    x = torch.randn(b, i, device="cuda", requires_grad=True)
    inputs = [x, *m.parameters()]

    def step():
        y = m(x)
        torch.autograd.grad(y, inputs, torch.ones_like(y))

    for _ in range(5):
        step()
    torch.cuda.synchronize()

    # Allocations of one forward and one backward, and their host cost.
    count, spent = [0], [0.0]

    def allocate(numel: int, kind: int):
        t0 = time.perf_counter()
        t = torch.empty(numel, dtype=torch.float32 if kind == 0 else torch.uint8, device=x.device)
        spent[0] += time.perf_counter() - t0
        count[0] += 1
        return t

    w, bias, params = m.lin.weight.detach(), m.lin.bias.detach(), [q.detach() for q in m.chain_parameters()]
    xd = x.detach()
    stream = _stream(xd)
    t0 = time.perf_counter()
    y, z = _native.forward(xd, w, bias, params, ops, a.precision, stream, allocate)
    t_fwd = time.perf_counter() - t0
    print(f"forward: {count[0]} allocations ({spent[0] * 1e6:.1f} us of {t_fwd * 1e6:.1f} us)")
    count[0], spent[0] = 0, 0.0
    dy = torch.ones_like(y)
    t0 = time.perf_counter()
    _native.backward(xd, w, bias, params, z, dy, ops, a.precision, stream, allocate)
    t_bwd = time.perf_counter() - t0
    print(f"backward: {count[0]} allocations ({spent[0] * 1e6:.1f} us of {t_bwd * 1e6:.1f} us)")
    torch.cuda.synchronize()

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.steps):
        step()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()

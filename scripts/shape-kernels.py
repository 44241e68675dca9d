"""The kernels one forward runs at given shapes (GPU machine): ours (``FusedLinear``) and
eager PyTorch (``bench.PlainBlock``) side by side, under ``no_grad``, each kernel's GPU time
from the profiler averaged over ``--iters`` calls, and the `graph` protocol's time of both
(a CUDA graph of one call, replayed back to back). With ``--backward``, a training step
instead: forward and ``backward`` of every gradient, ``x``'s included.

    python3 scripts/shape-kernels.py [--shapes 64x4096x4096,256x8192x8192] [--configs bf16,tf32] \
        [--backward] [--compile]

With ``--compile``, ``torch.compile`` of the eager block (default mode, static shapes) as a
third.

A diagnostic for where a small shape's time goes, not a benchmark (no L2 flush, no compile).
"""

import argparse
import functools
import importlib.util
from pathlib import Path

import torch

from fused_linear.bench import (
    DEFAULT_SWEEP_CHAIN,
    Shape,
    build_pair,
    canonical,
    make_input,
    sweep_chain,
    tf32_allowed,
)

# The profiler's per-kernel times, as scripts/kb-kernels.py takes them.
_spec = importlib.util.spec_from_file_location("kb_kernels", Path(__file__).with_name("kb-kernels.py"))
_kb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_kb)
kernels = _kb.kernels


def graph_ms(fn, iters: int) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / iters)
    return sorted(times)[1]


def step(block: torch.nn.Module, x: torch.Tensor) -> None:
    """One training step's GPU work: the forward, then every gradient from a ones ``dy``."""
    x = x.detach().requires_grad_(True)
    for p in block.parameters():
        p.grad = None
    y = block(x)
    y.backward(torch.ones_like(y))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="64x4096x4096,256x4096x4096,256x8192x8192,1024x1024x1024")
    p.add_argument("--configs", default="bf16,tf32")
    p.add_argument("--chain", default=DEFAULT_SWEEP_CHAIN)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--top", type=int, default=6)
    p.add_argument("--backward", action="store_true", help="time forward + backward, not the forward")
    p.add_argument("--compile", action="store_true", help="also torch.compile of the eager block")
    a = p.parse_args()
    device = torch.device("cuda")
    for config in a.configs.split(","):
        for spec in a.shapes.split(","):
            rows, fin, fout = (int(v) for v in spec.split("x"))
            shape = Shape("sweep", canonical(fin, fout, sweep_chain(a.chain, fout)), rows, fin, fout)
            pair = build_pair(shape, config, device, 0)
            x = make_input(shape, config, device, 0)
            with tf32_allowed(config == "tf32"), torch.set_grad_enabled(a.backward):
                blocks = [("ours", pair.ours), ("eager", pair.plain)]
                if a.compile:
                    blocks.append(("compile", torch.compile(pair.plain)))
                for name, block in blocks:
                    call = functools.partial(step, block, x) if a.backward else functools.partial(block, x)
                    ks = kernels(call, a.iters)
                    g = graph_ms(call, a.iters)
                    total = sum(ks.values())
                    print(f"{config} {spec} {name}: graph {g:.4f} ms, kernels {total:.4f} ms")
                    for k, v in sorted(ks.items(), key=lambda kv: -kv[1])[: a.top]:
                        print(f"    {v:.4f}  {k[:110]}")


if __name__ == "__main__":
    main()

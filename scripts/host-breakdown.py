"""Where the host time of one `FusedLinear` call goes, layer by layer.

Times, on the CPU, one call at a time (synchronize, call, stop the clock; the median of
`--calls`, the entries taking turns in three rounds as in `scripts/host-cost.py`):

- the forward under `no_grad` through each layer of the package: the module, the
  function `fused_linear()`, `_run_forward` and the native call alone (its stream and
  allocator fetched beforehand), and what PyTorch itself costs for comparison (one
  `torch.empty`, one small elementwise op, eager's whole chain);
- the training step and its parts: `zero_grad`, the forward with a gradient wanted,
  the native backward alone (on a saved `z` and `dy`), eager's step and an autograd
  node that launches nothing;
- the step's forward and `backward()` timed apart within each step (a synchronize
  between them), as a training loop runs them: each call follows the other's code, not
  a hundred copies of itself, so less of it is in the CPU's caches.

A layer's own cost is its time minus the next layer's. With `--count` it also counts the
allocations the native calls make through PyTorch.

    python3 scripts/host-breakdown.py [--shape 64,1024,1024] [--dtypes bf16,fp32]
"""

import argparse
import importlib.util
import os
import statistics
import time

import torch

import fused_linear as fl

_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("host_cost", os.path.join(_here, "host-cost.py"))
host_cost = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(host_cost)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="64,1024,1024")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--count", action="store_true", help="count the native calls' allocations")
    a = p.parse_args()
    b, i, o = (int(v) for v in a.shape.split(","))
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
    ops = f"groupnorm({o // 32}),swish,mul,swish"
    print(f"host us per call, {b}x{i}x{o}, chain {ops}, torch {torch.__version__}")
    for name in a.dtypes.split(","):
        measure(name, dtypes[name], (b, i, o), ops, a.calls, a.count)


def measure(name: str, dtype: torch.dtype, shape: tuple, ops: str, calls: int, count: bool) -> None:
    """Prints the tables of one dtype for M1's chain `ops` (see the module)."""
    b, i, o = shape
    groups = o // 32
    torch.manual_seed(0)
    block = fl.FusedLinear(i, o, ops, device="cuda", dtype=dtype)
    plain = host_cost.plain_m1(i, o, groups, dtype)
    plain.load_state_dict(block.state_dict())
    floor = host_cost.FloorBlock(block)
    x = torch.randn(b, i, device="cuda", dtype=dtype)
    lin = block.lin
    w, bias, params = lin.weight, lin.bias, block.chain_parameters()
    precision = block.effective_precision
    stream, allocate = fl._stream(x), fl._allocator(x.device, x.dtype)
    small = torch.empty(b, o, device="cuda", dtype=dtype)

    def native_fwd():
        fl._native.forward(x, w, bias, params, ops, precision, stream, allocate, save=False)

    def run_fwd():
        fl._run_forward(x, w, bias, params, ops, precision, False)

    def function():
        fl.fused_linear(x, w, bias, ops, params, precision)

    def module():
        block(x)

    def eager():
        plain(x)

    def empty():
        torch.empty((b, o), device="cuda", dtype=dtype)

    def sigmoid():
        torch.sigmoid(small)

    fwd_fns = {
        "module": module,
        "fused_linear()": function,
        "_run_forward": run_fwd,
        "native forward": native_fwd,
        "torch.empty": empty,
        "torch.sigmoid": sigmoid,
        "eager chain": eager,
    }
    with torch.no_grad():
        times = host_cost.per_call_us(list(fwd_fns.values()), calls)
    print(f"\n{name}, forward under no_grad:")
    for label, t in zip(fwd_fns, times):
        print(f"  {label:18s} {t:7.1f}")

    y, z = fl._native.forward(x, w, bias, params, ops, precision, stream, allocate, save=True)
    dy = torch.randn_like(y)
    xg = x.detach().clone().requires_grad_(True)

    def native_bwd():
        fl._native.backward(x, w, bias, params, z, dy, ops, precision, stream, allocate)

    def zero():
        block.zero_grad(set_to_none=True)

    def fwd_grad():
        block(xg)

    def step():
        block.zero_grad(set_to_none=True)
        xg.grad = None
        block(xg).backward(dy)

    def eager_step():
        plain.zero_grad(set_to_none=True)
        xg.grad = None
        plain(xg).backward(dy)

    def floor_step():
        block.zero_grad(set_to_none=True)
        xg.grad = None
        floor(xg).backward(dy)

    step_fns = {
        "step": step,
        "zero_grad": zero,
        "forward, grad": fwd_grad,
        "native backward": native_bwd,
        "eager step": eager_step,
        "empty-node step": floor_step,
    }
    times = host_cost.per_call_us(list(step_fns.values()), calls)
    print(f"{name}, training step:")
    for label, t in zip(step_fns, times):
        print(f"  {label:18s} {t:7.1f}")
    print(f"{name}, step's forward / backward() timed apart (us):")
    for label, m in (("ours", block), ("eager", plain), ("empty node", floor)):
        fw, bw = [], []
        for it in range(calls + 30):
            m.zero_grad(set_to_none=True)
            xg.grad = None
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = m(xg)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            out.backward(dy)
            t3 = time.perf_counter()
            if it >= 30:
                fw.append(t1 - t0)
                bw.append(t3 - t2)
        fwd_us, bwd_us = statistics.median(fw) * 1e6, statistics.median(bw) * 1e6
        print(f"  {label:18s} {fwd_us:7.1f} / {bwd_us:7.1f}")
    if count:
        made = []

        def counting(shape, kind):
            made.append((tuple(shape) if not isinstance(shape, int) else (shape,), kind))
            return allocate(shape, kind)

        fl._native.forward(x, w, bias, params, ops, precision, stream, counting, save=False)
        n_fwd = len(made)
        fl._native.forward(x, w, bias, params, ops, precision, stream, counting, save=True)
        n_save = len(made) - n_fwd
        fl._native.backward(x, w, bias, params, z, dy, ops, precision, stream, counting)
        n_bwd = len(made) - n_fwd - n_save
        torch.cuda.synchronize()
        print(f"  allocations through PyTorch: forward {n_fwd}, saving forward {n_save}, backward {n_bwd}")
        print(f"  {made}")


if __name__ == "__main__":
    main()

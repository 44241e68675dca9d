"""The kernels each KernelBench problem runs (GPU machine): ours (``fuse(Model)``) and
``torch.compile(Model)`` side by side, one forward under ``no_grad`` (or a training step with
``--backward``), each kernel's GPU time from the profiler, summed over ``--iters`` calls.

    python3 scripts/kb-kernels.py [--problems 30,84] [--dtype bf16] [--backward] [--no-compile]

Prints one block per problem: the total GPU time per call of each, then its kernels, longest
first. A diagnostic for where a problem's time goes, not a benchmark (no L2 flush).
"""

import argparse
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from fused_linear import fuse
from fused_linear.bench import load_problem, problem_files, problem_number


def kernels(fn, iters: int) -> dict:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    times: dict = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            times[e.name] = times.get(e.name, 0.0) + e.device_time / iters / 1e3
    return times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--folder", type=Path, default=Path("examples/kernelbench"))
    p.add_argument("--problems", default="", help="comma list of problem numbers (default all)")
    p.add_argument("--dtype", choices=("bf16", "fp32", "tf32", "tf32x3"), default="bf16")
    p.add_argument("--backward", action="store_true")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--top", type=int, default=6)
    a = p.parse_args()
    wanted = {int(v) for v in a.problems.split(",") if v}
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    precision = None if a.dtype == "bf16" else a.dtype
    torch.backends.cuda.matmul.allow_tf32 = a.dtype == "tf32"
    for path in problem_files(a.folder, True):
        if wanted and problem_number(path) not in wanted:
            continue
        module = load_problem(path)
        torch.manual_seed(0)
        plain = module.Model(*module.get_init_inputs()).to("cuda", dtype)
        ours = fuse(plain, precision)
        x = module.get_inputs()[0].to("cuda", dtype)
        peers = {"ours": ours}
        if not a.no_compile:
            torch._dynamo.reset()
            peers["compile"] = torch.compile(plain)
        print(f"# {path.stem}  x {tuple(x.shape)}  {a.dtype}{' fwd+bwd' if a.backward else ' fwd'}")
        for name, m in peers.items():
            if a.backward:
                xg = x.detach().requires_grad_()
                y = m(xg)
                dy = torch.randn_like(y)

                def step(m=m, xg=xg, dy=dy, plain=plain):
                    for q in plain.parameters():
                        q.grad = None
                    xg.grad = None
                    m(xg).backward(dy)

                fn = step
            else:

                def fn(m=m, x=x):
                    with torch.no_grad():
                        m(x)

            try:
                t = kernels(fn, a.iters)
            except Exception as e:  # a diagnostic: report and go on
                print(f"  {name}: {type(e).__name__}: {str(e)[:200]}")
                continue
            print(f"  {name}: {sum(t.values()):.4f} ms GPU, {len(t)} kernels")
            for k, v in sorted(t.items(), key=lambda kv: -kv[1])[: a.top]:
                print(f"    {v:8.4f}  {k[:110]}")


if __name__ == "__main__":
    main()

"""Where a small block's host time goes: cProfile over back-to-back calls of one
`FusedLinear` (M1's chain), forward under `no_grad` or a whole training step.

The native calls show as `{built-in method fused_linear._native.forward}` / `backward`
(their own time, without the Python callbacks they make: each allocation through PyTorch
is `allocate` below them), the autograd engine as `run_backward`.

    python3 scripts/host-profile.py [--shape 64,1024,1024] [--dtype bf16] [--call step]
                                    [--precision fp8]

With `--api`, instead: the CUDA API calls one call makes (the driver's and the runtime's,
as PyTorch's profiler records them: count and host time per call) and the kernels it runs.
"""

import argparse
import cProfile
import pstats

import torch

import fused_linear as fl


def api_calls(fn, call: str, dtype: str, shape: str, calls: int = 20, title: str = "") -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    api: dict = {}
    gpu: dict = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            n, t = gpu.get(e.name, (0, 0.0))
            gpu[e.name] = (n + 1, t + e.device_time)
        elif e.name.startswith(("cu", "cuda")) and not e.name.startswith("cudaDeviceSynchronize"):
            n, t = api.get(e.name, (0, 0.0))
            api[e.name] = (n + 1, t + e.cpu_time_total)
    print(f"{call} {dtype}{title} {shape}: CUDA API calls per call (count, us each, us in all)")
    for name, (n, t) in sorted(api.items(), key=lambda kv: -kv[1][1]):
        print(f"{n / calls:6.1f} {t / n:8.1f} {t / calls:8.1f}  {name}")
    print("kernels per call (count, us of GPU time each)")
    for name, (n, t) in sorted(gpu.items(), key=lambda kv: -kv[1][1]):
        print(f"{n / calls:6.1f} {t / n:8.1f}  {name[:110]}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="64,1024,1024")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--call", default="step", choices=["fwd", "step"])
    p.add_argument("--precision", default=None, help="the block's precision (default: its dtype's)")
    p.add_argument(
        "--requantise",
        action="store_true",
        help="fp8: quantise the weight again in every step, as after an optimizer step",
    )
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--api", action="store_true")
    a = p.parse_args()
    b, i, o = (int(v) for v in a.shape.split(","))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    ops = f"groupnorm({o // 32}),swish,mul,swish"
    block = fl.FusedLinear(i, o, ops, precision=a.precision, device="cuda", dtype=dtype)
    x = torch.randn(b, i, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(b, o, device="cuda", dtype=dtype)

    def step():
        block.zero_grad(set_to_none=True)
        x.grad = None
        if a.requantise:
            fl.clear_fp8_cache()
        block(x).backward(dy)

    def fwd():
        with torch.no_grad():
            block(x)

    fn = step if a.call == "step" else fwd
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    if a.api:
        title = (f" {a.precision}" if a.precision else "") + (" requantised" if a.requantise else "")
        api_calls(fn, a.call, a.dtype, a.shape, title=title)
        return
    prof = cProfile.Profile()
    prof.enable()
    for n in range(a.calls):
        fn()
        if n % 50 == 49:
            torch.cuda.synchronize()  # keep the GPU's queue short
    prof.disable()
    torch.cuda.synchronize()
    print(f"{a.call} {a.dtype} {a.shape}: {a.calls} calls; times below are per call (us)")
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, name), (_cc, nc, tt, ct, _) in stats.stats.items():
        rows.append((tt, ct, nc, f"{file.rsplit('/', 1)[-1]}:{line}({name})"))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    print(f"total {total / a.calls * 1e6:.1f} us per call")
    print(f"{'own us':>8} {'cum us':>8} {'calls/call':>10}  function")
    for tt, ct, nc, name in rows[: a.top]:
        print(f"{tt / a.calls * 1e6:8.1f} {ct / a.calls * 1e6:8.1f} {nc / a.calls:10.1f}  {name}")


if __name__ == "__main__":
    main()

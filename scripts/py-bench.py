"""Times the PyTorch op against `host bench` in the same process's GPU, same shapes.

Usage (GPU machine, fused_linear importable):
    python3 scripts/py-bench.py --host device-carry/host [--precisions fp32,tf32x3] [--models M1,M3]
                                [--repeat 20] [--json out.json]

For each preset at its seed size and each precision: the op's forward (`torch.no_grad`) and
forward+backward (`torch.autograd.grad`, so nothing accumulates into `.grad`; eagerly, and
replayed from a CUDA graph, which leaves out the host's time), median of
`--repeat` runs timed with CUDA events exactly as `host bench` times its own (no L2 flush,
back to back), then `host bench` (and `--backward`) for the same models, and the ratio.
The Python and launch overhead is measured at a small shape (64x1024x1024): host wall
time per call against the GPU time of the same call.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

import fused_linear as fl

SEED = {"M2": (32768, 1024, 4096)}
IDLE_S = 2.0
DEFAULT = (1024, 8192, 8192)


def median_ms(fn, repeat: int, warm: int = 3) -> float:
    """Median GPU milliseconds of `fn`, as `host bench` measures its own: an event pair
    around each run, the runs queued back to back (the host runs ahead; no sync between).
    Starts from an idle GPU, as each `host bench` process does: under sustained 3xTF32
    load the H100's clocks fall within a fraction of a second (M3's forward 1.045 ms ->
    1.18 ms over ~130 runs, back to 1.046 after 5 s idle)."""
    time.sleep(IDLE_S)
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        events.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in events)


def host_us(fn, calls: int = 300) -> float:
    """Host microseconds per call of `fn`, back to back (the GPU may lag behind)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return t


def block(model: str, precision: str, shape=None):
    b, i, o = shape or SEED.get(model, DEFAULT)
    torch.manual_seed(1)
    m = fl.FusedLinear(i, o, fl.PRESETS[model], precision, device="cuda")
    x = torch.randn(b, i, device="cuda", requires_grad=True)
    return m, x


def time_op(model: str, precision: str, repeat: int):
    m, x = block(model, precision)
    with torch.no_grad():
        fwd = median_ms(lambda: m(x), repeat)
        # (No autograd graph may outlive a step: its nodes would pin the capture's streams.)
        dy = torch.randn_like(m(x))
    inputs = [x, *m.parameters()]

    def step():
        out = m(x)
        torch.autograd.grad(out, inputs, dy)

    both = median_ms(step, max(repeat // 2, 5))
    # The same step captured in a CUDA graph: the GPU's work alone, without the host's.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    replay = median_ms(graph.replay, max(repeat // 2, 5))
    del graph
    return fwd, both, replay


def overhead(precision: str):
    """Where the host time of one small call goes, layer by layer (64x1024x1024, M1's chain
    with 32 groups): GPU milliseconds of a call, and host microseconds per call of each layer."""
    from fused_linear import _allocator, _native, _stream

    torch.manual_seed(1)
    ops = "groupnorm(32),swish,mul,swish"
    m = fl.FusedLinear(1024, 1024, ops, precision, device="cuda")
    x = torch.randn(64, 1024, device="cuda", requires_grad=True)
    params = m.chain_parameters()
    w, b = m.lin.weight, m.lin.bias
    inputs = [x, *m.parameters()]
    alloc = _allocator(x.device, x.dtype)

    def train_step():
        y = m(x)
        torch.autograd.grad(y, inputs, torch.ones_like(y))

    with torch.no_grad():
        layers = {
            "torch.empty (one allocation)": lambda: torch.empty(64 * 1024, device="cuda"),
            "_native.describe (a PyO3 call)": lambda: _native.describe(1024, 1024, ops),
            "_native.forward, no save": lambda: _native.forward(
                x, w, b, params, ops, precision, _stream(x), alloc, save=False
            ),
            "torch.ops.fused_linear.inference": lambda: torch.ops.fused_linear.inference(
                x, w, b, params, ops, precision
            ),
            "FusedLinear forward (no grad)": lambda: m(x),
        }
        out = {name: host_us(fn) for name, fn in layers.items()}
        out["gpu ms, forward"] = median_ms(lambda: m(x), 50)
    out["FusedLinear forward+backward"] = host_us(train_step, 100)
    out["gpu ms, forward+backward"] = median_ms(train_step, 50)
    return out


def host_bench(host: str, precision: str, models: str, backward: bool, repeat: int):
    cmd = [
        host,
        "bench",
        "--precision",
        precision,
        "--models",
        models,
        "--repeat",
        str(repeat),
        "--json",
        "/tmp/hb.json",
    ]
    if backward:
        cmd.append("--backward")
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open("/tmp/hb.json") as f:
        return {r["model"]: r["ours_ms"] for r in json.load(f)["results"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", required=True)
    p.add_argument("--precisions", default="fp32,tf32x3,tf32,bf16")
    p.add_argument("--models", default="M1,M2,M3,M4,M5")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    rows = []
    for precision in a.precisions.split(","):
        hb_f = host_bench(a.host, precision, a.models, False, a.repeat)
        hb_b = host_bench(a.host, precision, a.models, True, max(a.repeat // 2, 5))
        ops = {model: time_op(model, precision, a.repeat) for model in a.models.split(",")}
        # `host bench` again after the op: each side gets its fastest of two, so neither is
        # timed only at the end of a long run of work (the GPU's clocks fall as it warms).
        for model, ms in host_bench(a.host, precision, a.models, False, a.repeat).items():
            hb_f[model] = min(hb_f[model], ms)
        for model, ms in host_bench(a.host, precision, a.models, True, max(a.repeat // 2, 5)).items():
            hb_b[model] = min(hb_b[model], ms)
        for model in a.models.split(","):
            fwd, both, replay = ops[model]
            rows.append(
                {
                    "model": model,
                    "precision": precision,
                    "op_fwd_ms": fwd,
                    "host_fwd_ms": hb_f[model],
                    "op_fwdbwd_ms": both,
                    "host_fwdbwd_ms": hb_b[model],
                    "op_fwdbwd_graph_ms": replay,
                }
            )
            hf, hb = hb_f[model], hb_b[model]
            print(
                f"{model} {precision:7s} fwd op {fwd:.3f} host {hf:.3f} ({fwd / hf:.3f}x)"
                f"  fwd+bwd op {both:.3f} host {hb:.3f} ({both / hb:.3f}x)",
                flush=True,
            )
    small = {prec: overhead(prec) for prec in a.precisions.split(",")[:2]}
    print("\nop / host bench, seed sizes, CUDA events, same process")
    heads = ("fwd op", "fwd host", "ratio", "f+b op", "f+b host", "ratio", "f+b graph", "ratio")
    print(f"{'model':6} {'precision':9} " + " ".join(f"{h:>9}" for h in heads))
    for r in rows:
        print(
            f"{r['model']:6} {r['precision']:9} {r['op_fwd_ms']:9.3f} {r['host_fwd_ms']:9.3f} "
            f"{r['op_fwd_ms'] / r['host_fwd_ms']:9.3f} {r['op_fwdbwd_ms']:9.3f} {r['host_fwdbwd_ms']:9.3f} "
            f"{r['op_fwdbwd_ms'] / r['host_fwdbwd_ms']:9.3f} {r['op_fwdbwd_graph_ms']:9.3f} "
            f"{r['op_fwdbwd_graph_ms'] / r['host_fwdbwd_ms']:9.3f}"
        )
    print("\nPython + launch overhead at 64x1024x1024 (host us per call, back to back; GPU ms per call)")
    for prec, d in small.items():
        for label, v in d.items():
            print(f"  {prec:7s} {label:36s} {v:9.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "overhead": small}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""cuBLAS's FP8 GEMM (rowwise scales, bf16 out: `torch._scaled_mm`) and ours (a bf16 model's
`FusedLinear` with a bias, `precision="fp8"`, the weight quantised once) at one shape, one
after the other: a process to run Nsight Compute on (`ncu --kernel-name
regex:'gemm|e4m3|sm90' --launch-skip 6 --launch-count 4 ... python3
scripts/fp8-gemm-pair.py --calls 3`: the first 6 launches are the warm-up's), and
CUDA-event times of each call (median; ours includes `x`'s quantisation).

    python3 scripts/fp8-gemm-pair.py [--shape 1024,8192,8192] [--calls 5]
"""

import argparse

import torch

import fused_linear as fl


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="1024,8192,8192")
    p.add_argument("--calls", type=int, default=5)
    a = p.parse_args()
    b, i, o = (int(v) for v in a.shape.split(","))
    x = torch.randn(b, i, device="cuda", dtype=torch.bfloat16)
    block = fl.FusedLinear(i, o, "bias", precision="fp8", device="cuda", dtype=torch.bfloat16)
    w = block.lin.weight.detach()
    x8, w8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    sa = torch.ones(b, 1, device="cuda")
    sb = torch.ones(1, o, device="cuda")

    def cublas():
        return torch._scaled_mm(x8, w8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

    def ours():
        with torch.no_grad():
            return block(x)

    for f in (cublas, ours):
        for _ in range(3):
            f()
    torch.cuda.synchronize()
    for name, f in (("cuBLAS _scaled_mm", cublas), ("ours, bias", ours)):
        times = []
        for _ in range(a.calls):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            f()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        times.sort()
        print(f"{name}: {times[len(times) // 2]:.4f} ms (median of {a.calls} single calls)")


if __name__ == "__main__":
    main()

"""Names and times of the kernels cuBLAS picks for the seed GEMMs (TF32 and FP32), so
our tile shapes and cluster sizes can be compared with its choice. Run on the device."""
import torch
from torch.profiler import ProfilerActivity, profile

shapes = {"M1/M3/M5": (1024, 8192, 8192), "M2": (32768, 1024, 4096)}
for tf32 in (True, False):
    torch.backends.cuda.matmul.allow_tf32 = tf32
    for name, (b, i, o) in shapes.items():
        x = torch.randn(b, i, device="cuda")
        w = torch.randn(o, i, device="cuda")
        bias = torch.randn(o, device="cuda")
        for _ in range(3):
            torch.nn.functional.linear(x, w, bias)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                torch.nn.functional.linear(x, w, bias)
            torch.cuda.synchronize()
        for ev in prof.key_averages():
            if ev.device_type.name == "CUDA" if hasattr(ev, "device_type") else True:
                t = getattr(ev, "device_time", None) or getattr(ev, "cuda_time", 0)
                print(f"{'tf32' if tf32 else 'fp32'} {name}: {ev.key[:150]}  {t / 1000:.3f} ms x{ev.count}")

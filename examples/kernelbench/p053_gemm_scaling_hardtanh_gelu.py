"""KernelBench level 2, problem 53: Gemm -> Scaling -> Hardtanh -> GELU.

The Hardtanh's bounds are the integers -2 and 2, as in the problem.

`Model` is the plain PyTorch block, its modules and parameters created in the problem's order so
that one seed gives the same weights. No hand-written `ModelNew`: run.py checks and times
`fused_linear.fuse(Model(...))` (`run.py --coverage` lists what it fuses).
"""

from __future__ import annotations

import torch
from torch import nn


class Model(nn.Module):
    """Linear -> x * s -> Hardtanh(lo, hi) -> GELU (erf)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        scaling_factor: float,
        hardtanh_min: float,
        hardtanh_max: float,
    ) -> None:
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.scaling_factor = scaling_factor
        self.hardtanh = nn.Hardtanh(min_val=hardtanh_min, max_val=hardtanh_max)
        self.gelu = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gemm(x)
        x = x * self.scaling_factor
        x = self.hardtanh(x)
        return self.gelu(x)


batch_size = 2048
in_features = 8192
out_features = 8192
scaling_factor = 0.5
hardtanh_min = -2
hardtanh_max = 2

SEED_SIZES = (batch_size, in_features, out_features)
SMALL_SCALE = 32  # the CPU runs' scale: 64 x 256 -> 256


def get_inputs() -> list[torch.Tensor]:
    return [torch.rand(batch_size, in_features)]


def get_init_inputs() -> list:
    return [in_features, out_features, scaling_factor, hardtanh_min, hardtanh_max]


def set_shape_scale(scale: int) -> None:
    """Divide the seed sizes by `scale` (run.py --shape-scale; 1 restores them)."""
    global batch_size, in_features, out_features
    if scale < 1 or any(n % scale for n in SEED_SIZES):
        raise ValueError(f"shape scale {scale} must divide every seed size {SEED_SIZES}")
    batch_size, in_features, out_features = (n // scale for n in SEED_SIZES)

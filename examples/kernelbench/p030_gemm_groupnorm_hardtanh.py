"""KernelBench level 2, problem 30: Gemm -> GroupNorm -> Hardtanh.

`Model` is the plain PyTorch block, its modules and parameters created in the problem's order so
that one seed gives the same weights. No hand-written `ModelNew`: run.py checks and times
`fused_linear.fuse(Model(...))` (`run.py --coverage` lists what it fuses).
"""

from __future__ import annotations

import torch
from torch import nn


class Model(nn.Module):
    """Linear -> GroupNorm -> Hardtanh(lo, hi)."""

    def __init__(
        self, in_features: int, out_features: int, num_groups: int, hardtanh_min: float, hardtanh_max: float
    ) -> None:
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.group_norm = nn.GroupNorm(num_groups, out_features)
        self.hardtanh = nn.Hardtanh(min_val=hardtanh_min, max_val=hardtanh_max)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gemm(x)
        x = self.group_norm(x)
        return self.hardtanh(x)


batch_size = 1024
in_features = 8192
out_features = 8192
num_groups = 16
hardtanh_min = -2.0
hardtanh_max = 2.0

SEED_SIZES = (batch_size, in_features, out_features)
SMALL_SCALE = 32  # the CPU runs' scale: 32 x 256 -> 256, 16 groups of 16


def get_inputs() -> list[torch.Tensor]:
    return [torch.rand(batch_size, in_features)]


def get_init_inputs() -> list:
    return [in_features, out_features, num_groups, hardtanh_min, hardtanh_max]


def set_shape_scale(scale: int) -> None:
    """Divide batch, in and out by `scale` (run.py --shape-scale; 1 restores them). The 16 groups
    stay 16: 512 channels each at the seed size, 16 at scale 32."""
    global batch_size, in_features, out_features
    if scale < 1 or any(n % scale for n in SEED_SIZES) or (SEED_SIZES[2] // scale) % num_groups:
        raise ValueError(f"shape scale {scale} must divide {SEED_SIZES} and leave out a multiple of 16")
    batch_size, in_features, out_features = (n // scale for n in SEED_SIZES)

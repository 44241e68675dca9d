"""KernelBench level 2, problem 40: Matmul -> Scaling -> ResidualAdd.

The residual is `x.clone().detach()` of the Linear's output: the output is `(s + 1) * x` in
value, but its gradient flows only through the scaled branch (`s` times the Linear's).

`Model` is the plain PyTorch block, its modules and parameters created in the problem's order so
that one seed gives the same weights. No hand-written `ModelNew`: run.py checks and times
`fused_linear.fuse(Model(...))` (`run.py --coverage` lists what it fuses).
"""

from __future__ import annotations

import torch
from torch import nn


class Model(nn.Module):
    """Linear -> r = x.clone().detach() -> x * s -> x + r."""

    def __init__(self, in_features: int, out_features: int, scaling_factor: float) -> None:
        super().__init__()
        self.matmul = nn.Linear(in_features, out_features)
        self.scaling_factor = scaling_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.matmul(x)
        original_x = x.clone().detach()
        x = x * self.scaling_factor
        return x + original_x


batch_size = 16384
in_features = 4096
out_features = 4096
scaling_factor = 0.5

SEED_SIZES = (batch_size, in_features, out_features)
SMALL_SCALE = 32  # the CPU runs' scale: 512 x 128 -> 128


def get_inputs() -> list[torch.Tensor]:
    return [torch.rand(batch_size, in_features)]


def get_init_inputs() -> list:
    return [in_features, out_features, scaling_factor]


def set_shape_scale(scale: int) -> None:
    """Divide the seed sizes by `scale` (run.py --shape-scale; 1 restores them)."""
    global batch_size, in_features, out_features
    if scale < 1 or any(n % scale for n in SEED_SIZES):
        raise ValueError(f"shape scale {scale} must divide every seed size {SEED_SIZES}")
    batch_size, in_features, out_features = (n // scale for n in SEED_SIZES)

"""KernelBench level 2, problem 68: Matmul -> Min -> Subtract.

`constant` is a 0-d parameter: `torch.min(x, c)` is the elementwise minimum with it (a clamp
from above whose bound is trained), then `c` is subtracted.

`Model` is the plain PyTorch block, its modules and parameters created in the problem's order so
that one seed gives the same weights. No hand-written `ModelNew`: run.py checks and times
`fused_linear.fuse(Model(...))` (`run.py --coverage` lists what it fuses).
"""

from __future__ import annotations

import torch
from torch import nn


class Model(nn.Module):
    """Linear -> min(x, c) -> x - c, with c a 0-d parameter."""

    def __init__(self, in_features: int, out_features: int, constant: float) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.constant = nn.Parameter(torch.tensor(constant))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        x = torch.min(x, self.constant)
        return x - self.constant


batch_size = 128
in_features = 16384
out_features = 16384
constant = 2.0

SEED_SIZES = (batch_size, in_features, out_features)
SMALL_SCALE = 16  # the CPU runs' scale: 8 x 1024 -> 1024


def get_inputs() -> list[torch.Tensor]:
    return [torch.rand(batch_size, in_features)]


def get_init_inputs() -> list:
    return [in_features, out_features, constant]


def set_shape_scale(scale: int) -> None:
    """Divide the seed sizes by `scale` (run.py --shape-scale; 1 restores them)."""
    global batch_size, in_features, out_features
    if scale < 1 or any(n % scale for n in SEED_SIZES):
        raise ValueError(f"shape scale {scale} must divide every seed size {SEED_SIZES}")
    batch_size, in_features, out_features = (n // scale for n in SEED_SIZES)

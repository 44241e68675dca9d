"""KernelBench level 2, problem 55: Matmul -> MaxPool -> Sum -> Scale.

MaxPool1d(k) over the features (`pool(x.unsqueeze(1)).squeeze(1)`), then the row sum: the
output is one number per row, `(batch,)`.

`Model` is the plain PyTorch block, its modules and parameters created in the problem's order so
that one seed gives the same weights. No hand-written `ModelNew`: run.py checks and times
`fused_linear.fuse(Model(...))` (`run.py --coverage` lists what it fuses).
"""

from __future__ import annotations

import torch
from torch import nn


class Model(nn.Module):
    """Linear -> MaxPool1d(k) over features -> row sum -> * s."""

    def __init__(self, in_features: int, out_features: int, kernel_size: int, scale_factor: float) -> None:
        super().__init__()
        self.matmul = nn.Linear(in_features, out_features)
        self.max_pool = nn.MaxPool1d(kernel_size)
        self.scale_factor = scale_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.matmul(x)
        x = self.max_pool(x.unsqueeze(1)).squeeze(1)
        x = torch.sum(x, dim=1)
        return x * self.scale_factor


batch_size = 128
in_features = 32768
out_features = 32768
kernel_size = 2
scale_factor = 0.5

SEED_SIZES = (batch_size, in_features, out_features)
SMALL_SCALE = 16  # the CPU runs' scale: 8 x 2048 -> 2048 (the pool kernel stays 2)


def get_inputs() -> list[torch.Tensor]:
    return [torch.rand(batch_size, in_features)]


def get_init_inputs() -> list:
    return [in_features, out_features, kernel_size, scale_factor]


def set_shape_scale(scale: int) -> None:
    """Divide the seed sizes by `scale` (run.py --shape-scale; 1 restores them)."""
    global batch_size, in_features, out_features
    if scale < 1 or any(n % scale for n in SEED_SIZES):
        raise ValueError(f"shape scale {scale} must divide every seed size {SEED_SIZES}")
    batch_size, in_features, out_features = (n // scale for n in SEED_SIZES)

"""KernelBench level 2, problem 86: Matmul -> Divide -> GELU.

`Model` is the plain PyTorch block, its modules and parameters created in the problem's order so
that one seed gives the same weights. No hand-written `ModelNew`: run.py checks and times
`fused_linear.fuse(Model(...))` (`run.py --coverage` lists what it fuses).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Model(nn.Module):
    """Linear -> / d -> GELU (erf)."""

    def __init__(self, input_size: int, output_size: int, divisor: float) -> None:
        super().__init__()
        self.linear = nn.Linear(input_size, output_size)
        self.divisor = divisor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        x = x / self.divisor
        return F.gelu(x)


batch_size = 1024
input_size = 8192
output_size = 8192
divisor = 10.0

SEED_SIZES = (batch_size, input_size, output_size)
SMALL_SCALE = 32  # the CPU runs' scale: 32 x 256 -> 256


def get_inputs() -> list[torch.Tensor]:
    return [torch.rand(batch_size, input_size)]


def get_init_inputs() -> list:
    return [input_size, output_size, divisor]


def set_shape_scale(scale: int) -> None:
    """Divide the seed sizes by `scale` (run.py --shape-scale; 1 restores them)."""
    global batch_size, input_size, output_size
    if scale < 1 or any(n % scale for n in SEED_SIZES):
        raise ValueError(f"shape scale {scale} must divide every seed size {SEED_SIZES}")
    batch_size, input_size, output_size = (n // scale for n in SEED_SIZES)

"""KernelBench level 2, problem 22: Matmul -> Scale -> ResidualAdd -> Clamp -> LogSumExp -> Mish.

The "residual add" is `x + x`, and the last step is `x * mish(x)` on the `(batch, 1)` logsumexp.

`Model` is the plain PyTorch block, its modules and parameters created in the problem's order so
that one seed gives the same weights. No hand-written `ModelNew`: run.py checks and times
`fused_linear.fuse(Model(...))` (`run.py --coverage` lists what it fuses).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Model(nn.Module):
    """Linear -> x * s -> x + x -> clamp(lo, hi) -> row logsumexp (keepdim) -> x * mish(x)."""

    def __init__(
        self, input_size: int, hidden_size: int, scale_factor: float, clamp_min: float, clamp_max: float
    ) -> None:
        super().__init__()
        self.matmul = nn.Linear(input_size, hidden_size)
        self.scale_factor = scale_factor
        self.clamp_min = clamp_min
        self.clamp_max = clamp_max

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.matmul(x)
        x = x * self.scale_factor
        x = x + x
        x = torch.clamp(x, self.clamp_min, self.clamp_max)
        x = torch.logsumexp(x, dim=1, keepdim=True)
        return x * F.mish(x)


batch_size = 1024
input_size = 8192
hidden_size = 8192
scale_factor = 2.0
clamp_min = -10.0
clamp_max = 10.0

SEED_SIZES = (batch_size, input_size, hidden_size)
SMALL_SCALE = 32  # the CPU runs' scale: 32 x 256 -> 256


def get_inputs() -> list[torch.Tensor]:
    return [torch.rand(batch_size, input_size)]


def get_init_inputs() -> list:
    return [input_size, hidden_size, scale_factor, clamp_min, clamp_max]


def set_shape_scale(scale: int) -> None:
    """Divide the seed sizes by `scale` (run.py --shape-scale; 1 restores them)."""
    global batch_size, input_size, hidden_size
    if scale < 1 or any(n % scale for n in SEED_SIZES):
        raise ValueError(f"shape scale {scale} must divide every seed size {SEED_SIZES}")
    batch_size, input_size, hidden_size = (n // scale for n in SEED_SIZES)

"""KernelBench level 2, problem 51: Gemm -> Subtract -> GlobalAvgPool -> LogSumExp -> GELU -> ResidualAdd.

The residual is the block's input, `x.clone().detach()` (so no gradient reaches x through it);
the `(batch, 1)` result broadcasts over it, and the output is `(batch, in_features)`.

`Model` is the plain PyTorch block, its modules and parameters created in the problem's order so
that one seed gives the same weights. No hand-written `ModelNew`: run.py checks and times
`fused_linear.fuse(Model(...))` (`run.py --coverage` lists what it fuses).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Model(nn.Module):
    """r = x.clone().detach(); Linear -> x - p[c] -> row mean -> logsumexp -> GELU -> x + r."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features, bias=bias)
        self.subtract = nn.Parameter(torch.randn(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        original_x = x.clone().detach()
        x = self.gemm(x)
        x = x - self.subtract
        x = torch.mean(x, dim=1, keepdim=True)
        x = torch.logsumexp(x, dim=1, keepdim=True)
        x = F.gelu(x)
        return x + original_x


batch_size = 2048
in_features = 8192
out_features = 8192

SEED_SIZES = (batch_size, in_features, out_features)
SMALL_SCALE = 32  # the CPU runs' scale: 64 x 256 -> 256


def get_inputs() -> list[torch.Tensor]:
    return [torch.rand(batch_size, in_features)]


def get_init_inputs() -> list:
    return [in_features, out_features]


def set_shape_scale(scale: int) -> None:
    """Divide the seed sizes by `scale` (run.py --shape-scale; 1 restores them)."""
    global batch_size, in_features, out_features
    if scale < 1 or any(n % scale for n in SEED_SIZES):
        raise ValueError(f"shape scale {scale} must divide every seed size {SEED_SIZES}")
    batch_size, in_features, out_features = (n // scale for n in SEED_SIZES)

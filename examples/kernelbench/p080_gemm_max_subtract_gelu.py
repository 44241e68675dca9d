"""KernelBench level 2, problem 80: Gemm -> Max -> Subtract -> GELU.

The row max is `(batch, 1)`, so subtracting its own mean over dim 1 leaves zeros: the output is
GELU(0) = 0 everywhere and every gradient is zero. That is the problem as written.

`Model` is the plain PyTorch block, its modules and parameters created in the problem's order so
that one seed gives the same weights. No hand-written `ModelNew`: run.py checks and times
`fused_linear.fuse(Model(...))` (`run.py --coverage` lists what it fuses).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Model(nn.Module):
    """Linear -> max over dim (keepdim) -> x - x.mean(1) -> GELU (erf)."""

    def __init__(self, in_features: int, out_features: int, max_dim: int) -> None:
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.max_dim = max_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gemm(x)
        x = torch.max(x, dim=self.max_dim, keepdim=True).values
        x = x - x.mean(dim=1, keepdim=True)
        return F.gelu(x)


batch_size = 1024
in_features = 8192
out_features = 8192
max_dim = 1

SEED_SIZES = (batch_size, in_features, out_features)
SMALL_SCALE = 32  # the CPU runs' scale: 32 x 256 -> 256


def get_inputs() -> list[torch.Tensor]:
    return [torch.rand(batch_size, in_features)]


def get_init_inputs() -> list:
    return [in_features, out_features, max_dim]


def set_shape_scale(scale: int) -> None:
    """Divide the seed sizes by `scale` (run.py --shape-scale; 1 restores them)."""
    global batch_size, in_features, out_features
    if scale < 1 or any(n % scale for n in SEED_SIZES):
        raise ValueError(f"shape scale {scale} must divide every seed size {SEED_SIZES}")
    batch_size, in_features, out_features = (n // scale for n in SEED_SIZES)

"""KernelBench level 2, problem 66: Matmul -> Dropout -> Softmax.

The model stays in training mode, as KernelBench runs it, so the Dropout (p = 0.2) draws a
random mask on every call; run.py and the tests reseed before each forward, so that Model and
its fused form draw the same one.

`Model` is the plain PyTorch block, its modules and parameters created in the problem's order so
that one seed gives the same weights. No hand-written `ModelNew`: run.py checks and times
`fused_linear.fuse(Model(...))` (`run.py --coverage` lists what it fuses).
"""

from __future__ import annotations

import torch
from torch import nn


class Model(nn.Module):
    """Linear -> Dropout(p) -> softmax over features."""

    def __init__(self, in_features: int, out_features: int, dropout_p: float) -> None:
        super().__init__()
        self.matmul = nn.Linear(in_features, out_features)
        self.dropout = nn.Dropout(dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.matmul(x)
        x = self.dropout(x)
        return torch.softmax(x, dim=1)


batch_size = 128
in_features = 16384
out_features = 16384
dropout_p = 0.2

SEED_SIZES = (batch_size, in_features, out_features)
SMALL_SCALE = 16  # the CPU runs' scale: 8 x 1024 -> 1024


def get_inputs() -> list[torch.Tensor]:
    return [torch.rand(batch_size, in_features)]


def get_init_inputs() -> list:
    return [in_features, out_features, dropout_p]


def set_shape_scale(scale: int) -> None:
    """Divide the seed sizes by `scale` (run.py --shape-scale; 1 restores them)."""
    global batch_size, in_features, out_features
    if scale < 1 or any(n % scale for n in SEED_SIZES):
        raise ValueError(f"shape scale {scale} must divide every seed size {SEED_SIZES}")
    batch_size, in_features, out_features = (n // scale for n in SEED_SIZES)

"""KernelBench level 2, problem 75: Gemm -> GroupNorm -> Min -> BiasAdd.

As in the problem, the bias has shape `(1, out_features, 1, 1)`: added to the `(batch, 1)` row
minimum it broadcasts, and the output is `(1, out_features, batch, 1)`.

`Model` is the plain PyTorch block, its modules and parameters created in the problem's order so
that one seed gives the same weights. No hand-written `ModelNew`: run.py checks and times
`fused_linear.fuse(Model(...))` (`run.py --coverage` lists what it fuses).
"""

from __future__ import annotations

import torch
from torch import nn


class Model(nn.Module):
    """Linear -> GroupNorm -> row min (keepdim) -> + bias (broadcast to 4-D)."""

    def __init__(
        self, in_features: int, out_features: int, num_groups: int, bias_shape: tuple[int, ...]
    ) -> None:
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.group_norm = nn.GroupNorm(num_groups, out_features)
        self.bias = nn.Parameter(torch.randn(bias_shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gemm(x)
        x = self.group_norm(x)
        x = torch.min(x, dim=1, keepdim=True)[0]
        return x + self.bias


batch_size = 1024
in_features = 8192
out_features = 8192
num_groups = 512
bias_shape = (1, out_features, 1, 1)

SEED_SIZES = (batch_size, in_features, out_features, num_groups)
SMALL_SCALE = 32  # the CPU runs' scale: 32 x 256 -> 256, 16 groups


def get_inputs() -> list[torch.Tensor]:
    return [torch.rand(batch_size, in_features)]


def get_init_inputs() -> list:
    return [in_features, out_features, num_groups, bias_shape]


def set_shape_scale(scale: int) -> None:
    """Divide the seed sizes by `scale` (run.py --shape-scale); channels per group stay 16."""
    global batch_size, in_features, out_features, num_groups, bias_shape
    if scale < 1 or any(n % scale for n in SEED_SIZES):
        raise ValueError(f"shape scale {scale} must divide every seed size {SEED_SIZES}")
    batch_size, in_features, out_features, num_groups = (n // scale for n in SEED_SIZES)
    bias_shape = (1, out_features, 1, 1)

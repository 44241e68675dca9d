"""KernelBench level 2, problem 64: Gemm -> LogSumExp -> LeakyReLU -> LeakyReLU -> GELU -> GELU.

The logsumexp comes first, so the four activations act on one number per row, `(batch, 1)`.

`Model` is the plain PyTorch block, its modules and parameters created in the problem's order so
that one seed gives the same weights. No hand-written `ModelNew`: run.py checks and times
`fused_linear.fuse(Model(...))` (`run.py --coverage` lists what it fuses).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Model(nn.Module):
    """Linear -> row logsumexp (keepdim) -> LeakyReLU(0.01) twice -> GELU (erf) twice."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        x = torch.logsumexp(x, dim=1, keepdim=True)
        x = F.leaky_relu(x, negative_slope=0.01)
        x = F.leaky_relu(x, negative_slope=0.01)
        x = F.gelu(x)
        return F.gelu(x)


batch_size = 1024
in_features = 8192
out_features = 8192

SEED_SIZES = (batch_size, in_features, out_features)
SMALL_SCALE = 32  # the CPU runs' scale: 32 x 256 -> 256


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

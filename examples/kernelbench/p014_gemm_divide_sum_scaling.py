"""KernelBench level 2, problem 14: Gemm -> Divide -> Sum -> Scaling.

The GEMM is `torch.matmul(x, weight.T)` on a bare `(hidden, input)` weight drawn from randn (no
bias), as in the problem; the output is one number per row, `(batch, 1)`.

`Model` is the plain PyTorch block, its modules and parameters created in the problem's order so
that one seed gives the same weights. No hand-written `ModelNew`: run.py checks and times
`fused_linear.fuse(Model(...))` (`run.py --coverage` lists what it fuses).
"""

from __future__ import annotations

import torch
from torch import nn


class Model(nn.Module):
    """x @ W.T -> / 2 -> row sum (keepdim) -> * s."""

    def __init__(self, input_size: int, hidden_size: int, scaling_factor: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden_size, input_size))
        self.scaling_factor = scaling_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.matmul(x, self.weight.T)
        x = x / 2
        x = torch.sum(x, dim=1, keepdim=True)
        return x * self.scaling_factor


batch_size = 1024
input_size = 8192
hidden_size = 8192
scaling_factor = 1.5

SEED_SIZES = (batch_size, input_size, hidden_size)
SMALL_SCALE = 32  # the CPU runs' scale: 32 x 256 -> 256


def get_inputs() -> list[torch.Tensor]:
    return [torch.rand(batch_size, input_size)]


def get_init_inputs() -> list:
    return [input_size, hidden_size, scaling_factor]


def set_shape_scale(scale: int) -> None:
    """Divide the seed sizes by `scale` (run.py --shape-scale; 1 restores them)."""
    global batch_size, input_size, hidden_size
    if scale < 1 or any(n % scale for n in SEED_SIZES):
        raise ValueError(f"shape scale {scale} must divide every seed size {SEED_SIZES}")
    batch_size, input_size, hidden_size = (n // scale for n in SEED_SIZES)

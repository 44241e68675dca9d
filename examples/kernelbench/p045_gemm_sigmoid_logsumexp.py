"""KernelBench level 2, problem 45: Gemm -> Sigmoid -> Gemm -> LogSumExp.

Two Linears: `linear1` (input -> hidden) then a sigmoid, `linear2` (hidden -> output) then a
logsumexp over the features; the output is one number per row, `(batch,)`.

`Model` is the plain PyTorch block, its modules and parameters created in the problem's order so
that one seed gives the same weights. No hand-written `ModelNew`: run.py checks and times
`fused_linear.fuse(Model(...))` (`run.py --coverage` lists what it fuses).
"""

from __future__ import annotations

import torch
from torch import nn


class Model(nn.Module):
    """Linear -> sigmoid -> Linear -> row logsumexp."""

    def __init__(self, input_size: int, hidden_size: int, output_size: int) -> None:
        super().__init__()
        self.linear1 = nn.Linear(input_size, hidden_size)
        self.linear2 = nn.Linear(hidden_size, output_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear1(x)
        x = torch.sigmoid(x)
        x = self.linear2(x)
        return torch.logsumexp(x, dim=1)


batch_size = 16384
input_size = 2048
hidden_size = 4096
output_size = 1024

SEED_SIZES = (batch_size, input_size, hidden_size, output_size)
SMALL_SCALE = 32  # the CPU runs' scale: 512 x 64 -> 128 -> 32


def get_inputs() -> list[torch.Tensor]:
    return [torch.rand(batch_size, input_size)]


def get_init_inputs() -> list:
    return [input_size, hidden_size, output_size]


def set_shape_scale(scale: int) -> None:
    """Divide the seed sizes by `scale` (run.py --shape-scale; 1 restores them)."""
    global batch_size, input_size, hidden_size, output_size
    if scale < 1 or any(n % scale for n in SEED_SIZES):
        raise ValueError(f"shape scale {scale} must divide every seed size {SEED_SIZES}")
    batch_size, input_size, hidden_size, output_size = (n // scale for n in SEED_SIZES)

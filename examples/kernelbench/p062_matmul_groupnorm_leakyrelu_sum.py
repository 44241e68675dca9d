"""KernelBench level 2, problem 62: Matmul -> GroupNorm -> LeakyReLU -> x + x (the project's M3).

`Model` is the plain PyTorch block; `ModelNew` creates the same submodules in the same order
(fc, gn, leaky_relu), so one seed gives both the same weights, and computes the block with one
`fused_linear.fused_linear` call. The final `x + x` is the chain's `double`.

The file stands alone, so a KernelBench-style harness can take it as is; see run.py.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

import fused_linear


class Model(nn.Module):
    """Linear -> GroupNorm(eps) -> LeakyReLU(negative_slope) -> x + x."""

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_groups: int,
        eps: float = 1e-5,
        negative_slope: float = 0.01,
    ) -> None:
        super().__init__()
        self.fc = nn.Linear(input_size, hidden_size)
        self.gn = nn.GroupNorm(num_groups=num_groups, num_channels=hidden_size, eps=eps)
        self.leaky_relu = nn.LeakyReLU(negative_slope=negative_slope)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc(x)
        x = self.gn(x)
        x = self.leaky_relu(x)
        return x + x


class ModelNew(nn.Module):
    """The same block as one fused op; `precision` picks the GEMM arithmetic on the GPU
    (default: the tensors' own, fp32 or, after `.to(torch.bfloat16)`, bf16)."""

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_groups: int,
        eps: float = 1e-5,
        negative_slope: float = 0.01,
        precision: Optional[str] = None,
    ) -> None:
        super().__init__()
        if precision is not None and precision not in fused_linear.PRECISIONS:
            raise ValueError(f"precision must be one of {fused_linear.PRECISIONS}, got {precision!r}")
        # Created exactly as in Model, so that the same seed gives the same weights.
        self.fc = nn.Linear(input_size, hidden_size)
        self.gn = nn.GroupNorm(num_groups=num_groups, num_channels=hidden_size, eps=eps)
        self.leaky_relu = nn.LeakyReLU(negative_slope=negative_slope)
        self.precision = precision
        slope = float(self.leaky_relu.negative_slope)
        self.ops = f"groupnorm({self.gn.num_groups},{self.gn.eps!r}),leakyrelu({slope!r}),double"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = [self.gn.weight, self.gn.bias]
        return fused_linear.fused_linear(
            x, self.fc.weight, self.fc.bias, self.ops, params, precision=self.precision
        )


batch_size = 1024
input_size = 8192
hidden_size = 8192
num_groups = 512

SEED_SIZES = (batch_size, input_size, hidden_size, num_groups)


def get_inputs() -> list[torch.Tensor]:
    return [torch.rand(batch_size, input_size)]


def get_init_inputs() -> list:
    # As in KernelBench: eps and negative_slope keep their defaults (1e-5, 0.01).
    return [input_size, hidden_size, num_groups]


def set_shape_scale(scale: int) -> None:
    """Divide the seed sizes by `scale` (run.py --shape-scale); channels per group stay 16."""
    global batch_size, input_size, hidden_size, num_groups
    if scale < 1 or any(n % scale for n in SEED_SIZES):
        raise ValueError(f"shape scale {scale} must divide every seed size {SEED_SIZES}")
    batch_size, input_size, hidden_size, num_groups = (n // scale for n in SEED_SIZES)

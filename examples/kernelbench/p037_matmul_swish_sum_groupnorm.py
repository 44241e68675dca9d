"""KernelBench level 2, problem 37: Matmul -> Swish -> + bias -> GroupNorm (the project's M2).

`Model` is the plain PyTorch block; `ModelNew` creates the same submodules and parameters in the
same order (matmul, bias, group_norm), so one seed gives both the same weights, and computes the
block with one `fused_linear.fused_linear` call. The extra `bias` is a parameter of its own,
added after the Swish, not the Linear's bias.

The file stands alone, so a KernelBench-style harness can take it as is; see run.py.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

import fused_linear


class Model(nn.Module):
    """Linear -> x * sigmoid(x) -> x + bias[c] -> GroupNorm."""

    def __init__(
        self, in_features: int, out_features: int, num_groups: int, bias_shape: tuple[int, ...]
    ) -> None:
        super().__init__()
        self.matmul = nn.Linear(in_features, out_features)
        self.bias = nn.Parameter(torch.randn(bias_shape))
        self.group_norm = nn.GroupNorm(num_groups, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.matmul(x)
        x = torch.sigmoid(x) * x
        x = x + self.bias
        return self.group_norm(x)


class ModelNew(nn.Module):
    """The same block as one fused op; `precision` picks the GEMM arithmetic on the GPU
    (default: the tensors' own, fp32 or, after `.to(torch.bfloat16)`, bf16)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        num_groups: int,
        bias_shape: tuple[int, ...],
        precision: Optional[str] = None,
    ) -> None:
        super().__init__()
        if precision is not None and precision not in fused_linear.PRECISIONS:
            raise ValueError(f"precision must be one of {fused_linear.PRECISIONS}, got {precision!r}")
        # Created exactly as in Model, so that the same seed gives the same weights.
        self.matmul = nn.Linear(in_features, out_features)
        self.bias = nn.Parameter(torch.randn(bias_shape))
        self.group_norm = nn.GroupNorm(num_groups, out_features)
        self.precision = precision
        gn = self.group_norm
        self.ops = f"swish,bias,groupnorm({gn.num_groups},{gn.eps!r})"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gn = self.group_norm
        params = [self.bias, gn.weight, gn.bias]
        return fused_linear.fused_linear(
            x, self.matmul.weight, self.matmul.bias, self.ops, params, precision=self.precision
        )


batch_size = 32768
in_features = 1024
out_features = 4096
num_groups = 64
bias_shape = (out_features,)

SEED_SIZES = (batch_size, in_features, out_features, num_groups)


def get_inputs() -> list[torch.Tensor]:
    return [torch.rand(batch_size, in_features)]


def get_init_inputs() -> list:
    return [in_features, out_features, num_groups, bias_shape]


def set_shape_scale(scale: int) -> None:
    """Divide the seed sizes by `scale` (run.py --shape-scale); channels per group stay 64."""
    global batch_size, in_features, out_features, num_groups, bias_shape
    if scale < 1 or any(n % scale for n in SEED_SIZES):
        raise ValueError(f"shape scale {scale} must divide every seed size {SEED_SIZES}")
    batch_size, in_features, out_features, num_groups = (n // scale for n in SEED_SIZES)
    bias_shape = (out_features,)

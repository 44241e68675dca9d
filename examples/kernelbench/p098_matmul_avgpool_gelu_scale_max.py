"""KernelBench level 2, problem 98: Matmul -> AvgPool -> GELU -> Scale -> Max (the project's M4).

`Model` is the plain PyTorch block; `ModelNew` creates the same submodules in the same order
(matmul, avg_pool; scale_factor is a plain attribute), so one seed gives both the same weights,
and computes the block with one `fused_linear.fused_linear` call. The output is one number per
row, `(batch,)`: the fused kernel never writes the `(batch, out)` activations at all.

The file stands alone, so a KernelBench-style harness can take it as is; see run.py.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

import fused_linear


class Model(nn.Module):
    """Linear -> AvgPool1d(k) over features -> GELU (exact) -> * scale -> max over features."""

    def __init__(
        self, in_features: int, out_features: int, pool_kernel_size: int, scale_factor: float
    ) -> None:
        super().__init__()
        self.matmul = nn.Linear(in_features, out_features)
        self.avg_pool = nn.AvgPool1d(kernel_size=pool_kernel_size)
        self.scale_factor = scale_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.matmul(x)
        x = self.avg_pool(x.unsqueeze(1)).squeeze(1)
        x = torch.nn.functional.gelu(x)
        x = x * self.scale_factor
        return torch.max(x, dim=1).values


class ModelNew(nn.Module):
    """The same block as one fused op; `precision` picks the GEMM arithmetic on the GPU
    (default: the tensors' own, fp32 or, after `.to(torch.bfloat16)`, bf16)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        pool_kernel_size: int,
        scale_factor: float,
        precision: Optional[str] = None,
    ) -> None:
        super().__init__()
        if precision is not None and precision not in fused_linear.PRECISIONS:
            raise ValueError(f"precision must be one of {fused_linear.PRECISIONS}, got {precision!r}")
        # Created exactly as in Model, so that the same seed gives the same weights.
        self.matmul = nn.Linear(in_features, out_features)
        self.avg_pool = nn.AvgPool1d(kernel_size=pool_kernel_size)
        self.scale_factor = scale_factor
        self.precision = precision
        # AvgPool1d keeps its kernel size as a 1-tuple; the chain's avgpool(k) has stride k and
        # no padding, which is AvgPool1d's default (stride = kernel, padding 0, floor mode).
        pool = self.avg_pool
        if pool.stride != pool.kernel_size or pool.padding != (0,) or pool.ceil_mode:
            raise ValueError("the fused avgpool(k) takes stride k, no padding and floor mode only")
        self.ops = f"avgpool({pool.kernel_size[0]}),gelu,scale({float(scale_factor)!r}),max"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_linear.fused_linear(
            x, self.matmul.weight, self.matmul.bias, self.ops, [], precision=self.precision
        )


batch_size = 1024
in_features = 8192
out_features = 8192
pool_kernel_size = 16
scale_factor = 2.0

SEED_SIZES = (batch_size, in_features, out_features)


def get_inputs() -> list[torch.Tensor]:
    return [torch.rand(batch_size, in_features)]


def get_init_inputs() -> list:
    return [in_features, out_features, pool_kernel_size, scale_factor]


def set_shape_scale(scale: int) -> None:
    """Divide batch, in and out by `scale` (run.py --shape-scale); the pool kernel stays 16."""
    global batch_size, in_features, out_features
    if scale < 1 or any(n % scale for n in SEED_SIZES) or SEED_SIZES[2] // scale < pool_kernel_size:
        raise ValueError(f"shape scale {scale} must divide {SEED_SIZES} and leave out >= {pool_kernel_size}")
    batch_size, in_features, out_features = (n // scale for n in SEED_SIZES)

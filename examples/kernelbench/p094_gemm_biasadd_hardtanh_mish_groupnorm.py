"""KernelBench level 2, problem 94: Gemm -> BiasAdd -> Hardtanh -> Mish -> GroupNorm (the project's M5).

`Model` is the plain PyTorch block; `ModelNew` creates the same submodules and parameters in the
same order (gemm, bias, hardtanh, mish, groupnorm), so one seed gives both the same weights, and
computes the block with one `fused_linear.fused_linear` call. The extra `bias` is a parameter of
its own, added after the Linear (which has its own bias too).

The file stands alone, so a KernelBench-style harness can take it as is; see run.py.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

import fused_linear


class Model(nn.Module):
    """Linear -> x + bias[c] -> Hardtanh(-1, 1) -> Mish -> GroupNorm."""

    def __init__(
        self, in_features: int, out_features: int, bias_shape: tuple[int, ...], num_groups: int
    ) -> None:
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.bias = nn.Parameter(torch.randn(bias_shape))
        self.hardtanh = nn.Hardtanh()
        self.mish = nn.Mish()
        self.groupnorm = nn.GroupNorm(num_groups=num_groups, num_channels=out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gemm(x)
        x = x + self.bias
        x = self.hardtanh(x)
        x = self.mish(x)
        return self.groupnorm(x)


class ModelNew(nn.Module):
    """The same block as one fused op; `precision` picks the GEMM arithmetic on the GPU
    (default: the tensors' own, fp32 or, after `.to(torch.bfloat16)`, bf16)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias_shape: tuple[int, ...],
        num_groups: int,
        precision: Optional[str] = None,
    ) -> None:
        super().__init__()
        if precision is not None and precision not in fused_linear.PRECISIONS:
            raise ValueError(f"precision must be one of {fused_linear.PRECISIONS}, got {precision!r}")
        # Created exactly as in Model, so that the same seed gives the same weights.
        self.gemm = nn.Linear(in_features, out_features)
        self.bias = nn.Parameter(torch.randn(bias_shape))
        self.hardtanh = nn.Hardtanh()
        self.mish = nn.Mish()
        self.groupnorm = nn.GroupNorm(num_groups=num_groups, num_channels=out_features)
        self.precision = precision
        lo, hi = float(self.hardtanh.min_val), float(self.hardtanh.max_val)
        gn = self.groupnorm
        self.ops = f"bias,hardtanh({lo!r},{hi!r}),mish,groupnorm({gn.num_groups},{gn.eps!r})"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gn = self.groupnorm
        params = [self.bias, gn.weight, gn.bias]
        return fused_linear.fused_linear(
            x, self.gemm.weight, self.gemm.bias, self.ops, params, precision=self.precision
        )


batch_size = 1024
in_features = 8192
out_features = 8192
bias_shape = (out_features,)
num_groups = 256

SEED_SIZES = (batch_size, in_features, out_features, num_groups)


def get_inputs() -> list[torch.Tensor]:
    return [torch.rand(batch_size, in_features)]


def get_init_inputs() -> list:
    return [in_features, out_features, bias_shape, num_groups]


def set_shape_scale(scale: int) -> None:
    """Divide the seed sizes by `scale` (run.py --shape-scale); channels per group stay 32."""
    global batch_size, in_features, out_features, bias_shape, num_groups
    if scale < 1 or any(n % scale for n in SEED_SIZES):
        raise ValueError(f"shape scale {scale} must divide every seed size {SEED_SIZES}")
    batch_size, in_features, out_features, num_groups = (n // scale for n in SEED_SIZES)
    bias_shape = (out_features,)

"""KernelBench level 2, problem 88: Gemm -> GroupNorm -> Swish -> Multiply -> Swish (the project's M1).

`Model` is the plain PyTorch block, written from the problem's semantics; `ModelNew` takes the
same constructor arguments and creates the same submodules and parameters in the same order
(gemm, group_norm, multiply_weight), so one `torch.manual_seed` gives both the same weights, and
computes the whole block with one `fused_linear.fused_linear` call: the GEMM and its epilogue
chain in one kernel instead of five PyTorch ops that each round-trip the activations through
memory.

The file stands alone (no import from this folder), so it can be handed to a KernelBench-style
harness as is; `run.py` next to it runs the correctness and timing protocol.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

import fused_linear


class Model(nn.Module):
    """Linear -> GroupNorm -> x * sigmoid(x) -> x * w[c] -> x * sigmoid(x)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        num_groups: int,
        multiply_weight_shape: tuple[int, ...],
    ) -> None:
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.group_norm = nn.GroupNorm(num_groups, out_features)
        self.multiply_weight = nn.Parameter(torch.randn(multiply_weight_shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gemm(x)
        x = self.group_norm(x)
        x = x * torch.sigmoid(x)
        x = x * self.multiply_weight
        return x * torch.sigmoid(x)


class ModelNew(nn.Module):
    """The same block as one fused op; `precision` picks the GEMM arithmetic on the GPU
    (default: the tensors' own, fp32 or, after `.to(torch.bfloat16)`, bf16)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        num_groups: int,
        multiply_weight_shape: tuple[int, ...],
        precision: Optional[str] = None,
    ) -> None:
        super().__init__()
        if precision is not None and precision not in fused_linear.PRECISIONS:
            raise ValueError(f"precision must be one of {fused_linear.PRECISIONS}, got {precision!r}")
        # Created exactly as in Model, so that the same seed gives the same weights.
        self.gemm = nn.Linear(in_features, out_features)
        self.group_norm = nn.GroupNorm(num_groups, out_features)
        self.multiply_weight = nn.Parameter(torch.randn(multiply_weight_shape))
        self.precision = precision
        # The chain is read off the modules, so other group counts and eps follow.
        gn = self.group_norm
        self.ops = f"groupnorm({gn.num_groups},{gn.eps!r}),swish,mul,swish"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gn = self.group_norm
        params = [gn.weight, gn.bias, self.multiply_weight]
        return fused_linear.fused_linear(
            x, self.gemm.weight, self.gemm.bias, self.ops, params, precision=self.precision
        )


batch_size = 1024
in_features = 8192
out_features = 8192
num_groups = 256
multiply_weight_shape = (out_features,)

SEED_SIZES = (batch_size, in_features, out_features, num_groups)


def get_inputs() -> list[torch.Tensor]:
    return [torch.rand(batch_size, in_features)]


def get_init_inputs() -> list:
    return [in_features, out_features, num_groups, multiply_weight_shape]


def set_shape_scale(scale: int) -> None:
    """Divide the seed sizes by `scale` (run.py --shape-scale); channels per group stay 32."""
    global batch_size, in_features, out_features, num_groups, multiply_weight_shape
    if scale < 1 or any(n % scale for n in SEED_SIZES):
        raise ValueError(f"shape scale {scale} must divide every seed size {SEED_SIZES}")
    batch_size, in_features, out_features, num_groups = (n // scale for n in SEED_SIZES)
    multiply_weight_shape = (out_features,)

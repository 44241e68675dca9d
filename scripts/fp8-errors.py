"""FP8's error against float64 (GPU machine): the presets' blocks as bf16 models, ours in fp8 and
fp8_gw_bf16, torchao's float8 training recipes (tensorwise, rowwise; where torchao is
installed) on the same plain block, and bf16 itself, each against the block in float64 from
the same bf16 weights and input. Relative error (norm-wise) of the output and of the gradients
of x and the Linear weight, one random output gradient.

    python3 scripts/fp8-errors.py [--models M1,M3,M5] [--rows 1024] [--features 8192]

A diagnostic table, not a test: FP8's bar is docs/NUMERICS.md's; this sets ours beside
torchao's on the same inputs (the issue's "no worse than torchao rowwise" target).
"""

import argparse
import copy

import torch

from fused_linear import PRESETS, FusedLinear
from fused_linear.bench import SEED_SIZES, PlainBlock, scale_chain


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return ((got - want).norm() / want.norm()).item()


def run(block: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, weight) -> tuple:
    """(y, dx, dW) of one forward and backward; `weight` finds the Linear weight in `block`."""
    xg = x.detach().clone().requires_grad_(True)
    y = block(xg)
    y.backward(dy.to(y.dtype))
    return y.detach(), xg.grad, weight(block).grad


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="M1,M3,M5")
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--features", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", help="cpu: ours only, as the emulation (a smoke test)")
    a = p.parse_args()
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        convert_to_float8_training = None
    f = a.features
    print(f"rows {a.rows}, {f} -> {f}, bf16 models; relative error against float64: y / dx / dW")
    for name in a.models.split(","):
        chain = scale_chain(PRESETS[name], SEED_SIZES[name][2], f)
        torch.manual_seed(a.seed)
        ours = FusedLinear(f, f, chain, device=a.device)
        plain = PlainBlock(f, f, chain, device=a.device)
        plain.load_state_dict(ours.state_dict())
        ours, plain = ours.to(torch.bfloat16), plain.to(torch.bfloat16)
        x = torch.randn(a.rows, f, device=a.device).to(torch.bfloat16)
        ref = copy.deepcopy(plain).double()
        y64 = ref(x.double())
        dy = torch.randn_like(y64)
        want = run(ref, x.double(), dy, lambda m: m.lin.weight)
        rows = {"bf16 (eager)": run(plain, x, dy, lambda m: m.lin.weight)}
        for precision in ("fp8", "fp8_gw_bf16"):
            block = copy.deepcopy(ours)
            block.precision = precision
            rows[f"ours {precision}"] = run(block, x, dy, lambda m: m.lin.weight)
        if convert_to_float8_training is not None and a.device != "cpu":
            for recipe in ("tensorwise", "rowwise"):
                model = convert_to_float8_training(
                    copy.deepcopy(plain), config=Float8LinearConfig.from_recipe_name(recipe)
                )
                rows[f"torchao {recipe} + compile"] = run(torch.compile(model), x, dy, lambda m: m.lin.weight)
        print(f"{name} ({chain})")
        for label, got in rows.items():
            print(f"  {label:<30} " + " / ".join(f"{rel(g, w):.2e}" for g, w in zip(got, want)))


if __name__ == "__main__":
    main()

"""Plain-PyTorch references for a Linear layer followed by an epilogue chain.

Written from the math of docs/PYTHON.md and docs/MODELS.md with torch functional
ops, independent of the package's kernels and host (the chain syntax alone is read by
the package's parser, ``_native.parse_chain``): ``reference()`` (float64),
``PlainBlock`` (an ``nn.Module`` whose parameters carry the project's names), a seeded
random chain generator, helpers that keep inputs away from kinks, and the relative
error ``||a - b|| / ||b||``.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from fused_linear import _native

# The five reference models (docs/MODELS.md), at their full sizes.
SPEC_PRESETS = {
    "M1": "groupnorm(256),swish,mul,swish",
    "M2": "swish,bias,groupnorm(64)",
    "M3": "groupnorm(512),leakyrelu(0.01),scale(2)",
    "M4": "avgpool(16),gelu,scale(2),max",
    "M5": "bias,hardtanh(-1,1),mish,groupnorm(256)",
}

# Ops whose derivative jumps (finite differences and low-precision `z` misbehave near
# them), and ops after which a row's largest values can tie in float32: the registry's.
KINKED = tuple(op["name"] for op in _native.ops() if op["kink"])
SATURATING = tuple(op["name"] for op in _native.ops() if op["saturates"])


@dataclass(frozen=True)
class Op:
    # bias, mul, scale, swish, mish, gelu, gelu_tanh, tanh, sigmoid, leakyrelu, hardtanh,
    # groupnorm, avgpool, max, min, sum, mean, logsumexp, softmax, maxpool, layernorm, rmsnorm
    kind: str
    args: tuple = ()

    def __str__(self) -> str:
        if self.kind == "groupnorm":
            g, eps = self.args
            return f"groupnorm({g})" if eps == 1e-5 else f"groupnorm({g},{eps:g})"
        if self.args:
            return f"{self.kind}({','.join(f'{a:g}' for a in self.args)})"
        return self.kind


def parse_chain(text: str) -> list[Op]:
    """The chain syntax as a list of ``Op``, by the op registry's own parser
    (``fused_linear._native.parse_chain``: aliases resolved, defaults filled in). The
    syntax is the package's; what each op computes is written here from the math."""
    ops = []
    for kind, args in _native.parse_chain(text):
        if kind == "groupnorm":
            args = (int(args[0]), args[1])
        elif kind in ("avgpool", "maxpool"):
            args = (int(args[0]),)
        ops.append(Op(kind, tuple(args)))
    return ops


def chain_to_str(ops: list[Op]) -> str:
    return ",".join(map(str, ops))


# The row reductions: one value per row after them.
REDUCTIONS = ("max", "min", "sum", "mean", "logsumexp")
# Parameter base names of the ops with parameters, and the fields of the norms'.
BASES = {
    "bias": "bias",
    "mul": "w",
    "groupnorm": "gn",
    "layernorm": "ln",
    "rmsnorm": "rms",
    "batchnorm": "bn",
}
NORM_FIELDS = {
    "groupnorm": ("weight", "bias"),
    "layernorm": ("weight", "bias"),
    "rmsnorm": ("weight",),
    "batchnorm": ("weight", "bias"),
}


def param_specs(ops, out_features: int) -> list[tuple[str, int]]:
    """(name, length) of every chain parameter in chain order, named as FusedLinear names
    them: ``bias``, ``w``, ``gn.weight``, ``gn.bias``, ``ln.weight``, ``ln.bias``,
    ``rms.weight``; a repeat gets a number (``bias2``, ``w2``, ``gn2.weight``)."""
    if isinstance(ops, str):
        ops = parse_chain(ops)
    specs, counts, f = [], {}, out_features
    for op in ops:
        if op.kind in BASES:
            base = BASES[op.kind]
            counts[base] = counts.get(base, 0) + 1
            name = base if counts[base] == 1 else f"{base}{counts[base]}"
            if op.kind in NORM_FIELDS:
                specs += [(f"{name}.{field}", f) for field in NORM_FIELDS[op.kind]]
            else:
                specs.append((name, f))
        elif op.kind in ("avgpool", "maxpool"):
            f //= op.args[0]
        elif op.kind in REDUCTIONS:
            f = 1
    return specs


def out_shape(batch_shape: tuple, ops, out_features: int) -> tuple:
    """The output shape for inputs of shape ``(*batch_shape, in)``."""
    if isinstance(ops, str):
        ops = parse_chain(ops)
    f = out_features
    for op in ops:
        if op.kind in ("avgpool", "maxpool"):
            f //= op.args[0]
        elif op.kind in REDUCTIONS:
            return tuple(batch_shape)
    return (*batch_shape, f)


def apply_chain(h: torch.Tensor, ops, params, trace=None) -> torch.Tensor:
    """The chain on a 2-D ``(N, F)`` tensor in its own dtype (a 1-D ``(N,)`` one: one value
    per row, as after a reduction). ``trace``, when a list, receives ``(op, input)`` for
    every kinked op (for ``kink_margin``). A reduction leaves ``(N,)``."""
    if isinstance(ops, str):
        ops = parse_chain(ops)
    params = list(params)
    reduced = h.dim() == 1
    if reduced:
        h = h.unsqueeze(1)
    z = h
    for op in ops:
        if trace is not None and op.kind in KINKED:
            trace.append((op, h.detach()))
        k = op.kind
        if k == "residual":
            h = h + z
        elif k == "bias":
            h = h + params.pop(0)
        elif k == "mul":
            h = h * params.pop(0)
        elif k == "scale":
            h = op.args[0] * h
        elif k == "swish":
            h = F.silu(h)
        elif k == "mish":
            h = F.mish(h)
        elif k == "gelu":
            h = F.gelu(h)  # exact erf form
        elif k == "tanh":
            h = torch.tanh(h)
        elif k == "sigmoid":
            h = torch.sigmoid(h)
        elif k == "gelu_tanh":
            h = F.gelu(h, approximate="tanh")
        elif k == "leakyrelu":
            h = F.leaky_relu(h, op.args[0])
        elif k == "hardtanh":
            h = F.hardtanh(h, op.args[0], op.args[1])
        elif k == "groupnorm":
            gw, gb = params.pop(0), params.pop(0)
            h = F.group_norm(h, op.args[0], gw, gb, op.args[1])
        elif k == "avgpool":
            h = F.avg_pool1d(h.unsqueeze(1), op.args[0]).squeeze(1)
        elif k == "max":
            h = h.max(dim=1, keepdim=True).values
        elif k == "min":
            h = h.min(dim=1, keepdim=True).values
        elif k == "sum":
            h = h.sum(dim=1, keepdim=True)
        elif k == "mean":
            h = h.mean(dim=1, keepdim=True)
        elif k == "logsumexp":
            h = torch.logsumexp(h, dim=1, keepdim=True)
        elif k == "softmax":
            h = torch.softmax(h, dim=1)
        elif k == "maxpool":
            h = F.max_pool1d(h.unsqueeze(1), op.args[0]).squeeze(1)
        elif k == "layernorm":
            lw, lb = params.pop(0), params.pop(0)
            h = F.layer_norm(h, (h.shape[1],), lw, lb, op.args[0])
        elif k == "rmsnorm":
            h = F.rms_norm(h, (h.shape[1],), params.pop(0), op.args[0])
        elif k == "batchnorm":  # training mode: the batch's statistics, no running ones
            bw, bb = params.pop(0), params.pop(0)
            h = F.batch_norm(h, None, None, bw, bb, training=True, eps=op.args[0])
        else:  # pragma: no cover
            raise ValueError(k)
        reduced = reduced or k in REDUCTIONS
    assert not params, "more params than the chain takes"
    return h.squeeze(1) if reduced else h


def reference(x, weight, bias, ops, params, trace=None) -> torch.Tensor:
    """y = chain(x @ weight^T + bias) in float64, for x of shape (*, in). Differentiable:
    pass float64 leaves that require grad to get reference gradients."""
    x, weight, bias = x.double(), weight.double(), bias.double()
    params = [p.double() for p in params]
    lead = x.shape[:-1]
    z = F.linear(x.reshape(-1, x.shape[-1]), weight, bias)
    y = apply_chain(z, ops, params, trace)
    return y.reshape(tuple(lead) + tuple(y.shape[1:]))


def kink_margin(x, weight, bias, ops, params) -> float:
    """How far (relative to the scale of the values) the inputs of the chain's kinked ops
    sit from their kinks: LeakyReLU's 0, Hardtanh's bounds, a row max's runner-up."""
    trace = []
    with torch.no_grad():
        reference(x, weight, bias, ops, params, trace)
    margin = math.inf
    for op, h in trace:
        scale = max(h.abs().max().item(), 1e-30)
        if op.kind == "leakyrelu":
            d = h.abs()
        elif op.kind == "hardtanh":
            d = torch.minimum((h - op.args[0]).abs(), (h - op.args[1]).abs())
            scale = max(scale, abs(op.args[0]), abs(op.args[1]))
        else:  # max, min, maxpool: the gap between the two largest (smallest) of a row or window
            h = h.unsqueeze(1) if h.dim() == 1 else h
            if op.kind == "maxpool":
                k = op.args[0]
                h = h[:, : h.shape[1] // k * k].reshape(-1, k)
            elif op.kind == "min":
                h = -h
            if h.shape[1] < 2:
                continue
            top = h.topk(2, dim=1).values
            d = top[:, 0] - top[:, 1]
        margin = min(margin, d.min().item() / scale)
    return margin


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| in float64 (the absolute norm when ref is all zeros)."""
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    assert got.shape == ref.shape, f"shape {tuple(got.shape)} vs reference {tuple(ref.shape)}"
    assert torch.isfinite(got).all() == torch.isfinite(ref).all(), "non-finite values differ"
    diff = (got - ref).norm().item()
    norm = ref.norm().item()
    return diff / norm if norm > 0 else diff


# ---------------------------------------------------------------- chains


def small_preset(text: str, out_features: int, group_size: int = 4, pool: int = 4) -> str:
    """A full-size preset at a small feature count: every GroupNorm gets groups of
    ``group_size`` channels, every AvgPool kernel ``pool``."""
    ops = []
    for op in parse_chain(text):
        if op.kind == "groupnorm":
            assert out_features % group_size == 0
            op = Op("groupnorm", (out_features // group_size, op.args[1]))
        elif op.kind == "avgpool":
            op = Op("avgpool", (pool,))
        ops.append(op)
    return chain_to_str(ops)


def random_chain(
    rng: random.Random, features: int, max_ops: int = 5, kinks: bool = True, min_group: int = 4
) -> str:
    """A seeded random chain of 1..max_ops ops valid for ``features`` Linear outputs:
    GroupNorm group counts that divide the features entering it, AvgPool kernels that
    divide them or not, MaxPool the same, softmax, LayerNorm and RMSNorm (over 4 features or
    more), and a row reduction only last but for ops without a parameter after it.
    ``kinks=False`` leaves out LeakyReLU, Hardtanh, MaxPool, max and min.

    GroupNorm groups have at least ``min_group`` channels (fewer where the features allow
    no such divisor): a group of one is constant, and in a group of two the gradient is
    all cancellation (only eps keeps it from zero), beyond float32's reach at 1e-5."""
    ops, f = [], features
    n = rng.randint(1, max_ops)
    for i in range(n):
        choices = "bias mul scale swish mish gelu gelu_tanh tanh sigmoid groupnorm softmax".split()
        if kinks:
            choices += ["leakyrelu", "hardtanh"]
        if f >= 4:
            choices += ["layernorm", "rmsnorm"]
        if f >= 4 and i + 1 < n:
            choices.append("avgpool")
            if kinks and not any(op.kind in SATURATING for op in ops):
                choices.append("maxpool")
        kind = rng.choice(choices)
        if kind == "softmax" and ops[-1:] == [Op("softmax")]:
            continue  # a softmax of a softmax is nearly uniform: its gradients are noise
        if kind == "scale":
            ops.append(Op("scale", (rng.choice([-1.5, 0.5, 2.0, 3.25]),)))
        elif kind == "leakyrelu":
            slope = rng.choice([0.01, 0.2, 0.0])
            # Not right after a ReLU: its exact zeros would all sit on this one's kink.
            if ops[-1:] != [Op("leakyrelu", (0.0,))]:
                ops.append(Op("leakyrelu", (slope,)))
        elif kind == "hardtanh":
            ops.append(Op("hardtanh", rng.choice([(-1.0, 1.0), (-0.5, 0.7), (-2.0, 3.0)])))
        elif kind == "groupnorm":
            divisors = [g for g in range(1, f + 1) if f % g == 0 and f // g >= min_group] or [1]
            eps = 1e-5 if rng.random() < 0.7 else 1e-3
            ops.append(Op("groupnorm", (rng.choice(divisors), eps)))
        elif kind in ("avgpool", "maxpool"):
            k = rng.randint(2, min(5, f // 2))
            ops.append(Op(kind, (k,)))
            f //= k
        elif kind == "layernorm":
            ops.append(Op("layernorm", (rng.choice([1e-5, 1e-3]),)))
        elif kind == "rmsnorm":
            ops.append(Op("rmsnorm", (rng.choice([1e-5, 1e-6]),)))
        else:
            ops.append(Op(kind))
    # No row max after a saturating op (tanh, sigmoid, hardtanh): where a row's largest
    # values saturate they are equal in float32 (tanh 1.0, the clamp's bound), so float32's
    # arg-max is one of several, while float64 tells them apart (docs/NUMERICS.md).
    saturated = any(op.kind in SATURATING for op in ops)
    # After a softmax only the max: a softmax row's sum, mean or logsumexp is (nearly) a
    # constant, whose gradients are zero in exact arithmetic and cancellation in any other,
    # and its min, exp(v_min - lse), turns the absolute error of v_min - lse into a
    # relative one (host/src/cli/check.rs has the same rule). After a reduction, no
    # saturating op: a row's sum or logsumexp is large, and tanh's derivative there,
    # 1 - tanh^2 of a value near 1, keeps few of float32's bits.
    softmax = any(op.kind == "softmax" for op in ops)
    last = [] if softmax else ["sum", "mean", "logsumexp"]
    if kinks and not saturated:
        last += ["max"] if softmax else ["max", "min"]
    if rng.random() < 0.3 and last:
        ops.append(Op(rng.choice(last)))
        if rng.random() < 0.3:
            ops.append(Op(rng.choice(["swish", "gelu"])))
    return chain_to_str(ops)


# ---------------------------------------------------------------- tensors


def make_params(
    ops, out_features: int, dtype=torch.float64, device="cpu", generator=None
) -> list[torch.Tensor]:
    """Random chain parameters (GroupNorm's affine too, so it matters), in chain order."""
    return [
        torch.randn(n, dtype=dtype, device=device, generator=generator)
        for _, n in param_specs(ops, out_features)
    ]


def make_case(
    shape,
    ops,
    seed: int,
    dtype=torch.float64,
    device="cpu",
    min_margin: float = 0.0,
    tries: int = 200,
):
    """Seeded inputs ``(x, weight, bias, params)`` for ``x`` of shape ``(*batch, in)``
    and ``out`` features: ``shape = (*batch, in, out)``. With ``min_margin > 0`` inputs are
    redrawn (deterministically) until every kinked op's inputs are at least that far, relative
    to their scale, from the kink."""
    *batch, k, n = shape
    g = torch.Generator().manual_seed(seed)
    for _ in range(tries):
        x = torch.randn(*batch, k, dtype=torch.float64, generator=g)
        bound = 1 / math.sqrt(k)
        weight = (torch.rand(n, k, dtype=torch.float64, generator=g) * 2 - 1) * bound
        bias = (torch.rand(n, dtype=torch.float64, generator=g) * 2 - 1) * bound
        params = make_params(ops, n, generator=g)
        # The chain in the tensors' dtype (so f32 inputs are checked as rounded).
        cast = [t.to(dtype) for t in (x, weight, bias, *params)]
        if min_margin <= 0 or kink_margin(*cast[:3], ops, cast[3:]) >= min_margin:
            return tuple(t.to(device) for t in cast[:3]), [t.to(device) for t in cast[3:]]
    raise AssertionError(
        f"no inputs for {ops!r} at {shape} within {tries} tries keep {min_margin} from kinks"
    )


def reference_grads(x, weight, bias, ops, params, dy):
    """(y, [dx, dweight, dbias, *dparams]) of the float64 reference for ``y.backward(dy)``."""
    leaves = [t.detach().double().requires_grad_(True) for t in (x, weight, bias, *params)]
    y = reference(leaves[0], leaves[1], leaves[2], ops, leaves[3:])
    grads = torch.autograd.grad(y, leaves, dy.double())
    return y.detach(), list(grads)


# ---------------------------------------------------------------- modules


class PlainBlock(nn.Module):
    """``Linear(in, out)`` then a chain, with plain PyTorch modules and parameters named as
    the project names them (``lin.weight``, ``lin.bias``, ``gn.weight``, ``gn.bias``, ``w``,
    ``bias``; repeats ``bias2``, ``w2``, ``gn2.weight``). Extra parameters are ``randn``,
    GroupNorm's ones/zeros as PyTorch initialises them (``randomize_affine()`` changes that)."""

    def __init__(self, in_features: int, out_features: int, ops, device=None, dtype=None):
        super().__init__()
        self.ops = parse_chain(ops) if isinstance(ops, str) else list(ops)
        kw = {"device": device, "dtype": dtype}
        self.lin = nn.Linear(in_features, out_features, **kw)
        self._names = []  # per op: the attribute holding its parameters, or None
        counts, f = {}, out_features
        for op in self.ops:
            name = None
            if op.kind in BASES:
                base = BASES[op.kind]
                counts[base] = counts.get(base, 0) + 1
                name = base if counts[base] == 1 else f"{base}{counts[base]}"
                if op.kind == "groupnorm":
                    self.add_module(name, nn.GroupNorm(op.args[0], f, eps=op.args[1], **kw))
                elif op.kind == "layernorm":
                    self.add_module(name, nn.LayerNorm(f, eps=op.args[0], **kw))
                elif op.kind == "rmsnorm":
                    self.add_module(name, nn.RMSNorm(f, eps=op.args[0], **kw))
                elif op.kind == "batchnorm":
                    self.add_module(name, nn.BatchNorm1d(f, eps=op.args[0], **kw))
                else:
                    self.register_parameter(name, nn.Parameter(torch.randn(f, **kw)))
            elif op.kind in ("avgpool", "maxpool"):
                f //= op.args[0]
            elif op.kind in REDUCTIONS:
                f = 1
            self._names.append(name)

    def randomize_affine(self, generator=None):
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, (nn.GroupNorm, nn.LayerNorm, nn.RMSNorm, nn.BatchNorm1d)):
                    m.weight.copy_(torch.randn(m.weight.shape, generator=generator))
                    if getattr(m, "bias", None) is not None:
                        m.bias.copy_(torch.randn(m.bias.shape, generator=generator))
        return self

    def chain_params(self) -> list[torch.Tensor]:
        """The chain's parameters in chain order (the op's ``params`` argument)."""
        out = []
        for op, name in zip(self.ops, self._names):
            if op.kind in NORM_FIELDS:
                m = getattr(self, name)
                out += [getattr(m, field) for field in NORM_FIELDS[op.kind]]
            elif name is not None:
                out.append(getattr(self, name))
        return out

    def forward(self, x):
        lead = x.shape[:-1]
        h = self.lin(x.reshape(-1, x.shape[-1]))
        for op, name in zip(self.ops, self._names):
            if op.kind in NORM_FIELDS:
                h = getattr(self, name)(h)
            elif op.kind == "bias":
                h = h + getattr(self, name)
            elif op.kind == "mul":
                h = h * getattr(self, name)
            else:
                h = apply_chain(h, [op], [])
        return h.reshape(*lead, *h.shape[1:])


def half_pair(in_features, out_features, ops, device, dtype, seed=0):
    """PyTorch's model of a chain in a 16-bit ``dtype`` and our block with the same parameters."""
    from fused_linear import FusedLinear

    torch.manual_seed(seed)
    plain = PlainBlock(in_features, out_features, ops).randomize_affine().to(device=device, dtype=dtype)
    ours = FusedLinear(in_features, out_features, ops).to(device=device, dtype=dtype)
    ours.load_state_dict(plain.state_dict())
    return plain, ours


def grads_of(module, x, dy):
    """The output and the gradients by name (``x`` and each parameter's)."""
    x = x.clone().requires_grad_(True)
    y = module(x)
    y.backward(dy)
    return y.detach(), {"x": x.grad, **{n: p.grad for n, p in module.named_parameters()}}


#: The repository's KernelBench problem files (examples/kernelbench).
KERNELBENCH = Path(__file__).resolve().parents[2] / "examples" / "kernelbench"


@contextlib.contextmanager
def kernelbench_problem(name, scale):
    """Problem ``name``'s module, its sizes divided by ``scale`` while the block runs (a
    callable ``scale`` gets the module first), restored to its seed sizes after."""
    sys.path.insert(0, str(KERNELBENCH))
    try:
        problem = importlib.import_module(name)
    finally:
        sys.path.remove(str(KERNELBENCH))
    problem.set_shape_scale(scale(problem) if callable(scale) else scale)
    try:
        yield problem
    finally:
        problem.set_shape_scale(1)

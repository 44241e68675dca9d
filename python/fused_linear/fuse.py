"""``fuse(model)``: every ``Linear`` followed by a chain the op supports, fused.

A ``torch.fx`` pass. It traces the model (modules, torch functions and tensor methods
alike), and for each ``nn.Linear`` (or ``F.linear`` on parameters) walks forward while the
value has a single consumer that is an op of the chain syntax, or the two nodes of
``x * sigmoid(x)``. The walk is replaced by one ``fused_linear.fused_linear`` call whose
tensors are ``get_attr`` nodes of the model's own parameters: nothing is copied, the
modules stay where they were, ``state_dict`` keys do not change, and an optimizer built on
``model.parameters()`` before or after trains the fused model. Everything else stays
PyTorch's.

Recognised, in order after the Linear: ``nn.GroupNorm`` (affine), SiLU and ``x *
sigmoid(x)``, Sigmoid (module, ``torch.sigmoid``, ``F.sigmoid``, ``x.sigmoid()``), Mish,
GELU (erf and ``approximate="tanh"`` forms), Tanh, LeakyReLU, Hardtanh and ``clamp(min,
max)``, ReLU (as LeakyReLU(0)) and ReLU6 (as Hardtanh(0, 6)), ``nn.BatchNorm1d`` after
per-element ops only, once (the op ``batchnorm``, its module's mode read at each call: batch
statistics and the running statistics' update in training mode, the per-channel affine
``mul(p),bias(q)`` of the running statistics in eval mode, ``p = weight / sqrt(running_var +
eps)``, ``q = bias - running_mean * p``; elsewhere an eval-mode one is that affine alone,
computed in the graph, and the fused model refuses training mode; a training-mode one there
stays PyTorch's), addition, subtraction, multiplication and
division by a number or by a parameter of the features' length or of one element (expanded;
subtracted and divided ones computed in the graph: ``-p``, ``1 / p``; a 0-d one likewise),
the elementwise minimum or maximum with such a parameter or a number (``torch.min(x, p)``,
``torch.minimum``, the ``max`` forms, ``clamp`` with one bound: ``p + min(x - p, 0)`` and
``p + relu(x - p)`` as ``bias`` and ``leakyrelu(0)`` ops; a tie gives ``p`` the whole
gradient, PyTorch half), ``x + x``, ``nn.Dropout(p=0)``, AvgPool1d over features
(``pool(x.unsqueeze(1)).squeeze(1)``) and MaxPool1d the same way (kernel and stride
equal, no padding), ``nn.LayerNorm`` over the features (with or without weight and bias),
``nn.RMSNorm`` (``eps=None``: the dtype's machine epsilon), softmax over the features
(``torch.softmax``, ``F.softmax``, ``x.softmax``, ``nn.Softmax``; ``dim`` 1 or -1), and the
row reductions over ``dim`` 1 or -1: max (``torch.max(x, 1)``, ``x.max(dim=1)``, ``amax``;
``.values`` or ``[0]``), min (the same with ``min``, ``amin``), ``sum``, ``mean`` and
``logsumexp`` (functions or methods), each with or without ``keepdim``. After a reduction the
chain goes on with ops on one value per row: per-element ops, and (after one with
``keepdim=True``) more reductions and softmax; a parameter or a number added there ends
it; ``x - x.mean(1, keepdim=True)`` there is ``0 * x``. ``z + f(z)`` (either order,
``torch.add`` too), ``z`` the Linear's output and ``f`` a chain that keeps its width, is
``f`` then the ``residual`` op, which ends the chain (KernelBench 70). A value used twice
otherwise (another residual, a ``.detach()``) ends the chain there, but for
``h * s + h.detach()`` (``s`` a
number, KernelBench 40's form), taken as ``scale(1 + s)`` whose output gradient is scaled
by ``s / (1 + s)`` on the way back, which ends the chain after it. Where the chain cannot
run whole on the GPU (an op that needs whole rows, over rows wider than the row-wise
kernels hold), the ops before that op are fused and the rest stays PyTorch's.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field, replace
from typing import Any, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch._C._functorch import peek_interpreter_stack as _functorch_level
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode

__all__ = ["fuse"]


@dataclass
class _Chain:
    """What a walk from one Linear found."""

    linear: fx.Node
    x: Any
    weight: str
    bias: Any  # an attribute path, or ("const", 0.0, features) for a Linear without bias
    features: int
    in_features: int
    ops: List[str] = field(default_factory=list)
    params: List[Any] = field(default_factory=list)  # attribute paths (str) or get_attr nodes
    nodes: List[fx.Node] = field(default_factory=list)  # the chain's nodes after the Linear
    keepdim: bool = False
    reduced: bool = False  # a row reduction ran: one value per row (kept as (N, 1) with keepdim)
    shape_sensitive: bool = False
    stopped: str = ""
    # `h * s + h.detach()` ends the chain: the fused call computes `(1 + s) h` and its
    # output's gradient is scaled by this factor, `s / (1 + s)`, on the way back.
    gradient_factor: Optional[float] = None
    out_features: int = 0  # the Linear's (``features`` moves with a pool)
    # A BatchNorm1d fused as `batchnorm`: (module, its index in `ops`, its weight's in `params`).
    batch_norm: Optional[Tuple[str, int, int]] = None
    # `z + f(z)` with `z` the Linear's output (KernelBench 70): the sum's node, which the
    # walk from the Linear leaves aside until its other operand is the chain's value.
    residual: Optional[fx.Node] = None

    def __post_init__(self) -> None:
        self.out_features = self.features


def _target_module(gm: fx.GraphModule, node: fx.Node) -> Optional[nn.Module]:
    return gm.get_submodule(node.target) if node.op == "call_module" else None


def _is_fn(node: fx.Node, *fns) -> bool:
    return node.op == "call_function" and node.target in fns


def _is_method(node: fx.Node, *names) -> bool:
    return node.op == "call_method" and node.target in names


def _attr(gm: fx.GraphModule, node: Any) -> Optional[torch.Tensor]:
    """The tensor a ``get_attr`` node reads, if ``node`` is one."""
    if isinstance(node, fx.Node) and node.op == "get_attr":
        obj: Any = gm
        for part in node.target.split("."):
            obj = getattr(obj, part)
        return obj if isinstance(obj, torch.Tensor) else None
    return None


def _arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _linear(gm: fx.GraphModule, node: fx.Node) -> Optional[_Chain]:
    """The start of a chain if ``node`` is a Linear layer on parameters (``nn.Linear``,
    ``F.linear``, or ``x @ W.T`` / ``torch.matmul(x, W.t())`` with ``W`` a 2-D parameter),
    else None. A Linear without bias gets a bias of zeros (a constant: no gradient)."""
    module = _target_module(gm, node)
    if isinstance(module, nn.Linear):
        out, inp = module.out_features, module.in_features
        bias = f"{node.target}.bias" if module.bias is not None else ("const", 0.0, out)
        return _Chain(node, node.args[0], f"{node.target}.weight", bias, out, inp)
    if _is_fn(node, F.linear):
        weight, bias = _arg(node, 1, "weight"), _arg(node, 2, "bias")
        w = _attr(gm, weight)
        if w is None or w.dim() != 2:
            return None
        if bias is None:
            b_spec: Any = ("const", 0.0, w.shape[0])
        elif _attr(gm, bias) is not None:
            b_spec = bias.target
        else:
            return None
        return _Chain(node, node.args[0], weight.target, b_spec, w.shape[0], w.shape[1])
    if (_is_fn(node, torch.matmul, operator.matmul) or _is_method(node, "matmul")) and len(node.args) == 2:
        x, wt = node.args
        transposed = isinstance(wt, fx.Node) and (
            _is_method(wt, "t")
            or (_is_fn(wt, getattr) and wt.args[1] == "T")
            or (_is_method(wt, "transpose") and set(wt.args[1:]) in ({0, 1}, {-1, -2}))
        )
        w = _attr(gm, wt.args[0]) if transposed else None
        if w is None or w.dim() != 2:
            return None
        return _Chain(node, x, wt.args[0].target, ("const", 0.0, w.shape[0]), w.shape[0], w.shape[1])
    return None


def _detached_residual(cur: fx.Node, users: List[fx.Node], chain: _Chain) -> Optional[fx.Node]:
    """``h * s + h.detach()`` (``h.clone().detach()``, ``h.detach().clone()``; either
    order, ``s`` a number): the value ``(1 + s) h``, with the gradient of ``h * s`` alone.
    Taken as ``scale(1 + s)`` with the output's gradient scaled by ``s / (1 + s)`` (the
    chain's backward is linear in it), which is exact for everything before it and
    nothing after it: the chain ends there. Returns the sum's node, or None."""
    mul = next((u for u in users if _is_fn(u, operator.mul, torch.mul) or _is_method(u, "mul")), None)
    other = next((u for u in users if u is not mul), None)
    if mul is None or other is None or mul.kwargs or len(mul.args) != 2 or cur not in mul.args[:2]:
        return None
    factor = mul.args[1] if mul.args[0] is cur else mul.args[0]
    detached, node = [], other
    while node is not None and (
        _is_method(node, "detach", "clone") or _is_fn(node, torch.detach, torch.clone)
    ):
        detached.append(node)
        node = _only_user(node) if len(node.args) == 1 and not node.kwargs else None
    if not any(_is_method(n, "detach") or _is_fn(n, torch.detach) for n in detached):
        return None
    add = _only_user(mul)
    if (
        add is None
        or node is not add
        or not (_is_fn(add, operator.add, torch.add) or _is_method(add, "add"))
        or add.kwargs
        or set(add.args) != {mul, detached[-1]}
    ):
        return None
    if not _number(factor):
        return None
    if factor == -1:
        chain.stopped = f"`{add.name}`: h * -1 + h.detach() (0, with gradient -1: no scale gives both)"
        return None
    chain.ops.append(f"scale({1.0 + factor!r})")
    chain.nodes += [mul, *detached, add]
    chain.gradient_factor = factor / (1.0 + factor)
    chain.stopped = f"`{add.name}`: h * s + h.detach() ends the chain (the gradient is s times, not 1 + s)"
    return add


class _GradientScale(torch.autograd.Function):
    """The identity, its gradient multiplied by ``factor``."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return dy * ctx.factor, None


def _scale_gradient(y: torch.Tensor, factor: float) -> torch.Tensor:
    return _GradientScale.apply(y, factor)


@functools.lru_cache(maxsize=1)
def _per_element() -> frozenset:
    """The chain syntax's per-element ops (names and aliases), from the registry."""
    from . import _native

    return frozenset(n for op in _native.ops() if op["per_element"] for n in (op["name"], *op["aliases"]))


def _is_sigmoid(gm: fx.GraphModule, node: fx.Node) -> bool:
    return (
        isinstance(_target_module(gm, node), nn.Sigmoid)
        or _is_fn(node, torch.sigmoid, F.sigmoid)
        or _is_method(node, "sigmoid")
    )


def _elementwise_extreme(u: fx.Node, cur: fx.Node) -> Optional[Tuple[str, Any]]:
    """``("min" | "max", other)`` where ``u`` is an elementwise minimum or maximum of
    ``cur`` with ``other`` (``torch.min(cur, other)``, ``torch.minimum``, ``cur.min(other)``,
    the max forms, ``clamp`` with only ``max=`` or only ``min=``), else None. A row
    reduction (``torch.min(x, 1)``) is not one: its second argument is a dimension."""
    if u.kwargs.keys() - {"min", "max", "other"}:
        return None
    for kind, fns, methods in (
        ("min", (torch.min, torch.minimum), ("min", "minimum")),
        ("max", (torch.max, torch.maximum), ("max", "maximum")),
    ):
        if _is_fn(u, *fns) or _is_method(u, *methods):
            other = _arg(u, 1, "other")
            if len(u.args) + len(u.kwargs) == 2 and u.args[0] is cur and isinstance(other, fx.Node):
                return kind, other
    if _is_fn(u, torch.clamp) or _is_method(u, "clamp", "clip"):
        lo, hi = _arg(u, 1, "min"), _arg(u, 2, "max")
        if u.args[0] is cur and (lo is None) != (hi is None):
            return ("min", hi) if lo is None else ("max", lo)
    return None


def _only_user(node: fx.Node) -> Optional[fx.Node]:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _step(gm: fx.GraphModule, chain: _Chain, cur: fx.Node) -> Optional[fx.Node]:
    """Extends ``chain`` by the op consuming ``cur``; returns the node whose value the
    chain now ends in, or None (``chain.stopped`` says why)."""
    if chain.ops and chain.ops[-1] == "residual":
        chain.stopped = "`residual` is the chain's last op"
        return None
    users = [u for u in cur.users if not (cur is chain.linear and u is chain.residual)]
    # x * sigmoid(x): the value's two users are the sigmoid and the product.
    if len(users) == 2:
        sig = next((u for u in users if _is_sigmoid(gm, u)), None)
        prod = next((u for u in users if u is not sig), None)
        if (
            sig is not None
            and _only_user(sig) is prod
            and (_is_fn(prod, operator.mul, torch.mul) or _is_method(prod, "mul"))
            and set(prod.args[:2]) == {cur, sig}
        ):
            chain.ops.append("swish")
            chain.nodes += [sig, prod]
            return prod
        # x - x.mean(1, keepdim=True) on one value per row (after a reduction with keepdim):
        # x - x, which is 0 * x (the same value, NaN and Inf included, and derivative).
        mean = next((u for u in users if _is_fn(u, torch.mean) or _is_method(u, "mean")), None)
        diff = next((u for u in users if u is not mean), None)
        if (
            chain.reduced
            and chain.keepdim
            and mean is not None
            and _arg(mean, 1, "dim") in (1, -1, (1,), (-1,), [1], [-1])
            and _arg(mean, 2, "keepdim", False)
            and _only_user(mean) is diff
            and (_is_fn(diff, operator.sub, torch.sub) or _is_method(diff, "sub"))
            and tuple(diff.args[:2]) == (cur, mean)
            and not diff.kwargs
        ):
            chain.ops.append("scale(0.0)")
            chain.nodes += [mean, diff]
            return diff
        end = _detached_residual(cur, users, chain)
        if end is not None:
            return end
        if not chain.stopped:
            chain.stopped = f"`{cur.name}` is used {len(users)} times (a residual or a second branch)"
        return None
    if len(users) != 1:
        chain.stopped = (
            "the chain's value is the model's output" if not users else f"`{cur.name}` has {len(users)} users"
        )
        return None
    u = users[0]
    if u.op == "output":
        chain.stopped = "its value is the model's output"
        return None
    if u is chain.residual:
        if cur is chain.linear or set(u.args[:2]) != {cur, chain.linear}:
            chain.stopped = f"`{u.name}` adds the Linear's output to another value"
            return None
        chain.ops.append("residual")
        chain.nodes.append(u)
        return u
    module = _target_module(gm, u)
    f = chain.features
    # After a reduction without keepdim the value is (N,): a `dim=-1` would be the batch's.
    flat = chain.reduced and not chain.keepdim

    def take(op: str, *params: Any) -> fx.Node:
        chain.ops.append(op)
        chain.params += params
        chain.nodes.append(u)
        return u

    if isinstance(module, nn.GroupNorm):
        if not module.affine:
            chain.stopped = f"{u.target}: a GroupNorm without affine parameters"
            return None
        chain.shape_sensitive = True
        return take(
            f"groupnorm({module.num_groups},{module.eps!r})", f"{u.target}.weight", f"{u.target}.bias"
        )
    if isinstance(module, nn.SiLU) or _is_fn(u, F.silu):
        return take("swish")
    if isinstance(module, nn.Mish) or _is_fn(u, F.mish):
        return take("mish")
    if isinstance(module, nn.Tanh) or _is_fn(u, torch.tanh, F.tanh) or _is_method(u, "tanh"):
        return take("tanh")
    if _is_sigmoid(gm, u):
        return take("sigmoid")
    if isinstance(module, nn.ReLU) or _is_fn(u, torch.relu, F.relu) or _is_method(u, "relu"):
        return take("leakyrelu(0.0)")  # the same function, value and derivative (0 at 0)
    if isinstance(module, nn.ReLU6) or _is_fn(u, F.relu6):
        return take("hardtanh(0.0,6.0)")
    if isinstance(module, nn.GELU) or _is_fn(u, F.gelu):
        approximate = module.approximate if module is not None else _arg(u, 1, "approximate", "none")
        if approximate not in ("none", "tanh"):
            chain.stopped = f"`{u.name}`: GELU with approximate={approximate!r}"
            return None
        return take("gelu" if approximate == "none" else "gelu_tanh")
    if isinstance(module, nn.BatchNorm1d):
        if module.num_features != f:
            chain.stopped = f"{u.target}: BatchNorm1d over {module.num_features} features, not {f}"
            return None
        tracked = (
            module.track_running_stats and module.running_mean is not None and module.running_var is not None
        )
        # The `batchnorm` op (batch statistics) follows per-element ops only, once.
        before = [op.split("(")[0] for op in chain.ops]
        fits = chain.batch_norm is None and not chain.reduced and all(op in _per_element() for op in before)
        if fits:
            # (N, C) only: on (N, C, L) it would normalise over another dimension.
            chain.shape_sensitive = True
            chain.batch_norm = (u.target, len(chain.ops), len(chain.params))
            weight = f"{u.target}.weight" if module.weight is not None else ("const", 1.0, f)
            bias = f"{u.target}.bias" if module.bias is not None else ("const", 0.0, f)
            return take(f"batchnorm({module.eps!r})", weight, bias)
        if module.training or not tracked:
            why = "a BatchNorm on batch statistics must follow per-element ops only, once"
            chain.stopped = f"{u.target}: BatchNorm1d in training mode or without running statistics ({why})"
            return None
        # Eval mode with running statistics: the per-channel affine it is (the fused model
        # refuses to run once the module is put back in training mode).
        chain.shape_sensitive = True
        chain.ops.append("mul")
        return take("bias", ("bn_scale", u.target), ("bn_shift", u.target))
    if isinstance(module, nn.LeakyReLU) or _is_fn(u, F.leaky_relu):
        slope = module.negative_slope if module is not None else _arg(u, 1, "negative_slope", 0.01)
        return take(f"leakyrelu({slope!r})")
    if isinstance(module, nn.Hardtanh) or _is_fn(u, F.hardtanh):
        lo = module.min_val if module is not None else _arg(u, 1, "min_val", -1.0)
        hi = module.max_val if module is not None else _arg(u, 2, "max_val", 1.0)
        return take(f"hardtanh({lo!r},{hi!r})")
    if _is_fn(u, torch.clamp) or _is_method(u, "clamp", "clip"):
        lo, hi = _arg(u, 1, "min"), _arg(u, 2, "max")
        if _number(lo) and _number(hi) and lo <= hi:
            return take(f"hardtanh({float(lo)!r},{float(hi)!r})")
        if (lo is None) == (hi is None):
            chain.stopped = f"`{u.name}`: a clamp with two bounds that are not numbers, or none"
            return None
        # One bound: an elementwise max or min (below).
    if isinstance(module, nn.Dropout) and module.p == 0:
        chain.nodes.append(u)
        return u
    if isinstance(module, nn.Identity):
        chain.nodes.append(u)
        return u
    # min(x, p) / max(x, p) with a parameter or a number p (elementwise: torch.min(x, p),
    # torch.minimum, their max twins, clamp with one bound): p + min(x - p, 0) and
    # p + relu(x - p), ops the chain has. (At a tie, x == p exactly, the gradient goes
    # all to p where PyTorch splits it in halves.)
    extreme = _elementwise_extreme(u, cur)
    if extreme is not None:
        kind, other = extreme
        t = _attr(gm, other)
        if chain.reduced:
            chain.stopped = f"`{u.name}`: an elementwise {kind} after a row reduction"
            return None
        if not _number(other) and not (t is not None and (t.dim() == 0 or tuple(t.shape) in ((1,), (f,)))):
            chain.stopped = f"`{u.name}`: an elementwise {kind} with neither a number nor a parameter"
            return None
        if _number(other):
            down, up = ("const", -float(other), f), ("const", float(other), f)
        else:
            vector = other if t.dim() == 1 and t.shape[0] == f else ("expand", other, f)
            down, up = ("neg", vector), vector
        chain.ops.append("bias")
        chain.params.append(down)
        chain.ops += ["scale(-1.0)", "leakyrelu(0.0)", "scale(-1.0)"] if kind == "min" else ["leakyrelu(0.0)"]
        return take("bias", up)
    binary = _is_fn(
        u,
        operator.mul,
        torch.mul,
        operator.add,
        torch.add,
        operator.sub,
        torch.sub,
        operator.truediv,
        torch.div,
    )
    binary = binary or _is_method(u, "mul", "add", "sub", "div")
    if binary and len(u.args) >= 2 and not u.kwargs:
        a, b = u.args[0], u.args[1]
        other = b if a is cur else a
        name = u.target if isinstance(u.target, str) else u.target.__name__
        kind = {"iadd": "add", "isub": "sub", "truediv": "div", "imul": "mul"}.get(name, name)
        cur_first = a is cur
        t = _attr(gm, other)
        vector = t is not None and t.dim() == 1 and t.shape[0] == f and not chain.reduced
        one = t is not None and (t.dim() == 0 or (t.dim() == 1 and t.shape[0] == 1 and f > 1))
        if one and not chain.reduced:
            # A (1,) or 0-d parameter broadcast over the features (KernelBench 97's bias,
            # 68's constant): the op's (F,) parameter is its expansion, whose gradient
            # autograd sums back.
            vector, other = True, ("expand", other, f)
        if (
            chain.reduced
            and not (kind == "add" and a is cur and b is cur)
            and not (kind in ("mul", "div") and _number(other))
        ):
            chain.stopped = f"`{u.name}`: {name} after a row reduction (the op takes no parameter there)"
            return None
        if kind == "add" and a is cur and b is cur:
            return take("scale(2.0)")
        if kind == "mul" and (_number(other) or vector):
            return take(f"scale({float(other)!r})") if _number(other) else take("mul", other)
        if kind == "div" and cur_first and (_number(other) or vector):
            # x / c as x * (1 / c); a parameter's reciprocal is computed in the graph,
            # so its gradient reaches the parameter through it.
            return take(f"scale({1.0 / other!r})") if _number(other) else take("mul", ("reciprocal", other))
        if kind in ("add", "sub") and (_number(other) or vector):
            negate = kind == "sub" and cur_first
            if not cur_first and kind == "sub":
                chain.ops.append("scale(-1.0)")  # c - x = -x + c
            if _number(other):
                return take("bias", ("const", -float(other) if negate else float(other), f))
            return take("bias", ("neg", other) if negate else other)
        chain.stopped = f"`{u.name}`: {name} by something other than a number or a ({f},) parameter"
        return None
    if flat:
        chain.stopped = f"`{u.name}` after a reduction without keepdim (the value is (N,))"
        return None
    # AvgPool1d and MaxPool1d over features: pool(x.unsqueeze(1)).squeeze(1).
    if (_is_method(u, "unsqueeze") or _is_fn(u, torch.unsqueeze)) and _arg(u, 1, "dim") == 1:
        pool = _only_user(u)
        squeeze = _only_user(pool) if pool is not None else None
        pool_module = _target_module(gm, pool) if pool is not None else None
        k, kind = None, "avgpool"
        if isinstance(pool_module, (nn.AvgPool1d, nn.MaxPool1d)):
            one = lambda v: v[0] if isinstance(v, tuple) else v  # noqa: E731
            ks, st = one(pool_module.kernel_size), one(pool_module.stride)
            plain = st == ks and one(pool_module.padding) == 0 and not pool_module.ceil_mode
            if isinstance(pool_module, nn.MaxPool1d):
                kind = "maxpool"
                plain = plain and one(pool_module.dilation) == 1 and not pool_module.return_indices
            k = ks if plain else None
        elif pool is not None and _is_fn(pool, F.avg_pool1d, F.max_pool1d) and len(pool.args) == 2:
            kind = "maxpool" if pool.target is F.max_pool1d else "avgpool"
            ks = pool.args[1]
            plain = {"stride": (None, ks, (ks,), [ks], ()), "padding": (0, (0,)), "dilation": (1, (1,))}
            plain.update(ceil_mode=(False,), return_indices=(False,))
            if isinstance(ks, int) and all(k in plain and v in plain[k] for k, v in pool.kwargs.items()):
                k = ks
        if (
            k is not None
            and squeeze is not None
            and (_is_method(squeeze, "squeeze") or _is_fn(squeeze, torch.squeeze))
            and _arg(squeeze, 1, "dim") == 1
        ):
            chain.ops.append(f"{kind}({k})")
            chain.nodes += [u, pool, squeeze]
            chain.features = f // k
            chain.shape_sensitive = True
            return squeeze
        chain.stopped = f"`{u.name}`: an unsqueeze that is not an AvgPool1d or MaxPool1d over features"
        return None
    if isinstance(module, nn.LayerNorm):
        if tuple(module.normalized_shape) != (f,):
            chain.stopped = (
                f"{u.target}: a LayerNorm over {tuple(module.normalized_shape)}, not the ({f},) features"
            )
            return None
        chain.shape_sensitive = True
        weight = f"{u.target}.weight" if module.weight is not None else ("const", 1.0, f)
        bias = f"{u.target}.bias" if module.bias is not None else ("const", 0.0, f)
        return take(f"layernorm({module.eps!r})", weight, bias)
    rms_norm = getattr(nn, "RMSNorm", None)
    if rms_norm is not None and isinstance(module, rms_norm):
        if tuple(module.normalized_shape) != (f,):
            chain.stopped = (
                f"{u.target}: an RMSNorm over {tuple(module.normalized_shape)}, not the ({f},) features"
            )
            return None
        eps = module.eps
        if eps is None:
            dtype = module.weight.dtype if module.weight is not None else torch.get_default_dtype()
            eps = torch.finfo(dtype).eps
        chain.shape_sensitive = True
        return take(
            f"rmsnorm({eps!r})", f"{u.target}.weight" if module.weight is not None else ("const", 1.0, f)
        )
    # Softmax over the features.
    if isinstance(module, nn.Softmax) or _is_fn(u, torch.softmax, F.softmax) or _is_method(u, "softmax"):
        dim = module.dim if module is not None else _arg(u, 1, "dim")
        if dim in (1, -1) and _arg(u, 2, "dtype") is None and u.kwargs.get("dtype") is None:
            chain.shape_sensitive = True
            return take("softmax")
        chain.stopped = f"`{u.name}`: a softmax over dim {dim}, or with a dtype"
        return None
    # The row reductions over dim 1 (-1): max and min (torch.max(x, 1) / x.max(dim=1) then
    # .values or [0]; amax, amin), sum, mean, logsumexp.
    dim = _arg(u, 1, "dim")
    over_features = dim in (1, -1, (1,), (-1,), [1], [-1])

    def reduce(op: str, nodes: List[fx.Node], out: fx.Node) -> fx.Node:
        chain.ops.append(op)
        chain.nodes += nodes
        chain.keepdim = bool(_arg(u, 2, "keepdim", False))
        chain.reduced = True
        chain.features = 1
        chain.shape_sensitive = True
        return out

    for op, fn, method, amin_amax in (
        ("max", torch.max, "max", torch.amax),
        ("min", torch.min, "min", torch.amin),
    ):
        if (_is_fn(u, fn) or _is_method(u, method)) and dim in (1, -1):
            pick = _only_user(u)
            picks = pick is not None and (
                (_is_fn(pick, getattr) and pick.args[1] == "values")
                or (_is_fn(pick, operator.getitem) and pick.args[1] == 0)
            )
            if picks:
                return reduce(op, [u, pick], pick)
        if (_is_fn(u, amin_amax) or _is_method(u, amin_amax.__name__)) and over_features:
            return reduce(op, [u], u)
    for op, fn in (("sum", torch.sum), ("mean", torch.mean), ("logsumexp", torch.logsumexp)):
        typed = _arg(u, 3, "dtype") is not None or u.kwargs.get("dtype") is not None
        if (_is_fn(u, fn) or _is_method(u, op)) and over_features and not typed:
            return reduce(op, [u], u)
    chain.stopped = f"`{u.name}` ({u.op} {getattr(u.target, '__name__', u.target)}) is not an op of the chain"
    return None


def _param_node(graph: fx.Graph, p: Any, x: fx.Node) -> fx.Node:
    """A chain parameter as a graph node: a parameter read in place, or computed from one
    (negated, inverted: autograd carries its gradient back) or a constant vector."""
    if isinstance(p, str):
        return graph.get_attr(p)
    if isinstance(p, fx.Node):
        return p
    what, source = p[0], p[1]
    if what == "const":
        return graph.call_function(_constant_vector, (x, p[2], source))
    if what in ("bn_scale", "bn_shift"):
        norm = graph.get_attr(source)
        return graph.call_function(_batch_norm_affine, (norm, x, what == "bn_shift", source))
    if what == "expand":
        expanded = graph.call_method("expand", (_param_node(graph, source, x), p[2]))
        return graph.call_method("contiguous", (expanded,))
    node = _param_node(graph, source, x)
    return graph.call_function(torch.neg if what == "neg" else torch.reciprocal, (node,))


# The constant vectors handed out so far, by (features, value's bits, dtype, device): one
# tensor each, never written (the op only reads its parameters, and these take no
# gradient), so a call does not allocate and fill one anew (a launch per call on CUDA).
_CONSTANTS: dict = {}


def _constant_vector(x: torch.Tensor, features: int, value: float) -> torch.Tensor:
    """``value`` for each of ``features`` channels: a number added to the chain as a bias
    (float32 for a 16-bit model, whose epilogue adds in FP32 as PyTorch does). Plain eager
    calls share one cached tensor per vector; under tracing, fake tensors, functorch or
    CUDA-graph capture (where a fill is recorded, not run) a fresh one."""
    dtype = torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype
    if (
        torch.compiler.is_compiling()
        or type(x) is not torch.Tensor
        or _current_dispatch_mode() is not None
        or _functorch_level() is not None
        or (x.is_cuda and torch.cuda.is_current_stream_capturing())
    ):
        return torch.full((features,), value, dtype=dtype, device=x.device)
    key = (features, float(value).hex(), dtype, x.device)
    vector = _CONSTANTS.get(key)
    if vector is None:
        # Not an inference tensor even when first made under inference_mode: a later
        # training call saves its parameters for the backward.
        with torch.inference_mode(False), torch.no_grad():
            vector = torch.full((features,), value, dtype=dtype, device=x.device)
        _CONSTANTS[key] = vector
    return vector


def _batch_norm_affine(norm: nn.BatchNorm1d, x: torch.Tensor, shift: bool, name: str) -> torch.Tensor:
    """An eval-mode BatchNorm1d as the per-channel affine ``y = p * x + q`` it computes:
    ``p = weight / sqrt(running_var + eps)`` or, with ``shift``, ``q = bias - running_mean * p``
    (weight 1 and bias 0 without affine parameters). Computed here, from the module's
    tensors, on every call, so gradients reach ``weight`` and ``bias`` (in float32 for a
    16-bit model, as PyTorch normalises). The module must still be in eval mode: in
    training mode it would normalise by batch statistics, another function."""
    if norm.training:
        raise RuntimeError(
            f"fuse(): BatchNorm1d `{name}` was fused in eval mode as a per-channel affine over its "
            "running statistics; in training mode it normalises by batch statistics: fuse() the model "
            "again after model.train() (it then leaves the BatchNorm to PyTorch), or call model.eval()"
        )
    dtype = torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype
    p = torch.rsqrt(norm.running_var.to(dtype) + norm.eps)
    if norm.weight is not None:
        p = norm.weight.to(dtype) * p
    if not shift:
        return p
    q = -norm.running_mean.to(dtype) * p
    return q if norm.bias is None else norm.bias.to(dtype) + q


def _fused_call(
    x,
    weight,
    bias,
    ops: str,
    params: List[torch.Tensor],
    precision: Optional[str],
    needs_2d: bool,
    norm: Optional[nn.BatchNorm1d] = None,
    norm_at: Tuple[int, int] = (0, 0),
):
    """The fused chain as the graph calls it. A chain with a norm, a pool, a softmax or a row
    reduction was matched for ``(N, features)`` inputs: other shapes are refused rather than given
    another function than the model's. ``norm``, the BatchNorm1d fused as op ``norm_at[0]``
    (its weight ``params[norm_at[1]]``), decides at each call: in training mode (or without
    running statistics) the ``batchnorm`` op normalises by the batch's statistics and the
    running ones are updated as the module would; in eval mode it is the affine of the
    running statistics, ``mul(p),bias(q)``."""
    from . import _with_batch_stats, fused_linear

    if needs_2d and x.dim() != 2:
        raise ValueError(
            f"fuse(): this chain ({ops}) was fused for 2-D (batch, features) inputs, as its norm, pool, "
            f"softmax or row reduction computes on them; got an input of shape {tuple(x.shape)}"
        )
    if norm is None:
        return fused_linear(x, weight, bias, ops, params, precision)
    tracked = norm.track_running_stats and norm.running_mean is not None and norm.running_var is not None
    if tracked and not norm.training:
        op, p = norm_at
        names = _split_ops(ops)
        names[op : op + 1] = ["mul", "bias"]
        params = list(params)
        params[p : p + 2] = [_batch_norm_affine(norm, x, False, ""), _batch_norm_affine(norm, x, True, "")]
        return fused_linear(x, weight, bias, ",".join(names), params, precision)
    y, stats = _with_batch_stats(x, weight, bias, ops, params, precision)
    if tracked and norm.training:
        _update_running_stats(norm, stats, x.shape[0])
    return y


def _residual_add(linear: fx.Node) -> Optional[fx.Node]:
    """The ``add`` among the two users of ``linear``'s output that takes it and another
    value (``z + f(z)``, either order): a candidate ``residual``, or None."""
    users = list(linear.users)
    if len(users) != 2:
        return None
    for u in users:
        adds = _is_fn(u, operator.add, torch.add) or _is_method(u, "add")
        if adds and not u.kwargs and len(u.args) == 2 and linear in u.args and u.args[0] is not u.args[1]:
            return u
    return None


def _snapshot(chain: _Chain) -> _Chain:
    """A copy of ``chain`` as it stands (its lists copied), which later steps leave alone."""
    copy = replace(chain, ops=list(chain.ops), params=list(chain.params), nodes=list(chain.nodes))
    copy.out_features = chain.out_features  # (`replace` runs __post_init__, which resets it)
    return copy


def _gpu_takes(in_features: int, out_features: int, ops: str) -> bool:
    """Whether ``ops`` after a Linear of these features parses and runs on the GPU."""
    from . import _describe, _native

    try:
        _describe(in_features, out_features, ops)
    except ValueError:
        return False
    return _native.gpu_limit(in_features, out_features, ops) is None


def _split_ops(ops: str) -> List[str]:
    """``ops`` split at the commas outside parentheses."""
    out, depth, start = [], 0, 0
    for i, c in enumerate(ops):
        depth += {"(": 1, ")": -1}.get(c, 0)
        if c == "," and depth == 0:
            out.append(ops[start:i])
            start = i + 1
    return [*out, ops[start:]]


def _update_running_stats(norm: nn.BatchNorm1d, stats: torch.Tensor, rows: int) -> None:
    """One training step's update of ``norm``'s running statistics from the batch's mean and
    biased variance (``stats``, ``(2, C)``), as ``nn.BatchNorm1d`` makes it: the variance
    unbiased by ``N / (N - 1)``, momentum ``None`` a cumulative average. Each statistic moves
    by one ``lerp_`` (``r + f (s - r)``, PyTorch's ``(1 - f) r + f s`` to within a rounding):
    the update was eight tensor ops, 110 us of a KernelBench 33 forward's 190 us of host time
    (H200, build ``0b1fe70``)."""
    with torch.no_grad():
        if norm.num_batches_tracked is not None:
            norm.num_batches_tracked.add_(1)
        if norm.momentum is None:
            factor = 1.0 / float(norm.num_batches_tracked)
        else:
            factor = norm.momentum
        mean, var = stats[0], stats[1] * (rows / (rows - 1))
        if mean.dtype != norm.running_mean.dtype:
            mean, var = mean.to(norm.running_mean.dtype), var.to(norm.running_var.dtype)
        norm.running_mean.lerp_(mean, factor)
        norm.running_var.lerp_(var, factor)


def fuse(model: nn.Module, precision: Optional[str] = None, verbose: bool = False) -> fx.GraphModule:
    """``model`` traced with every Linear + chain the op supports replaced by one fused
    call over the model's own parameters (see the module). ``precision`` is passed to
    every fused call (default: the tensors' own). ``verbose`` prints what was fused and
    why each Linear's chain ended where it did."""
    from . import _describe, _native

    gm = fx.symbolic_trace(model)
    _keep_registration_order(gm, model)
    report: List[Tuple[str, str]] = []
    for node in list(gm.graph.nodes):
        chain = _linear(gm, node)
        if chain is None:
            continue
        chain.residual = _residual_add(node)
        cur = node
        # The chain after each step, for falling back to a prefix the GPU takes.
        steps = [(cur, _snapshot(chain))]
        while chain.gradient_factor is None:
            nxt = _step(gm, chain, cur)
            if nxt is None:
                break
            cur = nxt
            steps.append((cur, _snapshot(chain)))
        if chain.residual is not None and chain.residual not in chain.nodes:
            why = f"its output also goes to `{chain.residual.name}`, which the chain does not reach"
            report.append((node.name, f"left in PyTorch: {why} ({chain.stopped})"))
            continue
        # Trailing ops the op cannot take after the chain's end (none today) and empty chains.
        if not chain.ops:
            report.append((node.name, f"left in PyTorch: no chain after it ({chain.stopped})"))
            continue
        ops = ",".join(chain.ops)
        try:
            _describe(chain.in_features, chain.out_features, ops)
        except ValueError as e:
            report.append((node.name, f"left in PyTorch: `{ops}` does not apply ({e})"))
            continue
        too_wide = _native.gpu_limit(chain.in_features, chain.out_features, ops)
        if too_wide is not None:
            # The longest prefix of whole steps the GPU takes (the ops before the first
            # that needs whole rows); the rest stays PyTorch's, reading its output. None
            # with a residual: the sum needs the Linear's output, which the call replaces.
            candidates = [] if chain.residual is not None else reversed(steps[:-1])
            prefix = next(
                (
                    (at, snap)
                    for at, snap in candidates
                    if snap.ops and _gpu_takes(snap.in_features, snap.out_features, ",".join(snap.ops))
                ),
                None,
            )
            if prefix is None:
                report.append((node.name, f"left in PyTorch: `{ops}` cannot run on the GPU: {too_wide}"))
                continue
            cur, chain = prefix
            chain.stopped = f"`{ops}` cannot run whole on the GPU ({too_wide}); the rest stays PyTorch's"
            ops = ",".join(chain.ops)
        graph = gm.graph
        with graph.inserting_before(cur):
            weight = graph.get_attr(chain.weight)
            bias = _param_node(graph, chain.bias, chain.x)
            params = [_param_node(graph, p, chain.x) for p in chain.params]
            args = (chain.x, weight, bias, ops, params, precision, chain.shape_sensitive)
            if chain.batch_norm is not None:
                target, op, p = chain.batch_norm
                args += (graph.get_attr(target), (op, p))
            fused = graph.call_function(_fused_call, args)
            if chain.gradient_factor is not None:
                fused = graph.call_function(_scale_gradient, (fused, chain.gradient_factor))
            out = graph.call_method("unsqueeze", (fused, -1)) if chain.keepdim else fused
        cur.replace_all_uses_with(out)
        for n in reversed([chain.linear, *chain.nodes]):
            graph.erase_node(n)
        # A transposed weight (x @ W.T) nothing else reads.
        for n in list(graph.nodes):
            if (
                n.op in ("call_method", "call_function")
                and not n.users
                and n.target in ("t", "transpose", getattr)
            ):
                graph.erase_node(n)
        why = f"; the chain ends: {chain.stopped}" if chain.stopped else ""
        report.append((node.name, f"fused with `{ops}`{why}"))
    gm.graph.lint()
    gm.recompile()
    if verbose:
        for name, what in report or [("(model)", "no nn.Linear or F.linear on parameters found")]:
            print(f"fuse: {name}: {what}")
    return gm


def _keep_registration_order(gm: fx.GraphModule, model: nn.Module) -> None:
    """Tracing registers the model's parameters, buffers and submodules in the order the
    forward first uses them; put them back in the model's own order, so that
    ``parameters()`` (an optimizer's state) and ``state_dict()`` line up with the model's."""
    for registry in ("_parameters", "_buffers", "_modules"):
        theirs, ours = getattr(model, registry), getattr(gm, registry)
        for name in list(theirs):
            if name in ours:
                ours[name] = ours.pop(name)

"""Times ``FusedLinear`` against plain PyTorch (eager and ``torch.compile``) on the same block.

For every shape and configuration the same process builds three implementations of one
block, ``chain(x @ lin.weight.T + lin.bias)``, with the same weights: ``ours``
(:class:`fused_linear.FusedLinear`), ``eager`` (:class:`PlainBlock`, the block written with
ordinary torch ops) and ``compile`` (``torch.compile`` of that same ``PlainBlock``). Each is
timed forward under ``torch.no_grad()`` (``fwd``) and as a training step (``fwdbwd``; with
``--modes fwdbwd_nodx`` also one whose input needs no gradient, as a model's first layer's
data: nobody computes ``dX``) through up to four protocols, because no single number says
how fast a block is:

- ``flushed``: KernelBench's protocol (L2 flushed before every timed call; one call between
  CUDA events), the number papers and leaderboards quote.
- ``stream``: calls back to back, what a training loop without CUDA graphs sees; at small
  sizes it measures the host (Python, dispatch, autograd), not the GPU.
- ``graph``: one call captured in a CUDA graph and replayed: the GPU's time alone.
- ``host``: the CPU time of one call, in microseconds.

Configurations: ``fp32`` (float32; ours strict FP32, the peers with TF32 off), ``tf32x3``
(ours 3xTF32, FP32-accurate, against the peers in FP32 with TF32 off), ``tf32`` (ours TF32,
the peers with TF32 allowed), ``bf16`` (a bf16 model: every tensor bfloat16), ``fp16`` (an
fp16 model: every tensor float16).

Shapes: ``seed`` (the presets M1..M5 at their KernelBench seed sizes), ``sweep`` (one chain,
M1's by default, over batch rows and (in, out) sizes), ``all`` (both; the default on CUDA),
``tiny`` (small shapes, the default with ``--device cpu``). ``--kernelbench DIR`` adds the
KernelBench problem files' ``ModelNew`` against their ``Model`` (``fuse(Model)`` for a file
without one, and for every file with ``--fuse``).

Once per shape and configuration the outputs of ours and eager are compared (relative error
``||ours - eager|| / ||eager||`` in float64; for ``fwdbwd`` also the input's and the weight's
gradients): reported, never a reason to stop.

Usage::

    python -m fused_linear.bench                                   # everything (hours: see --help)
    python -m fused_linear.bench --shapes seed --configs bf16,tf32 # the presets, two configs
    python -m fused_linear.bench --shapes sweep --rows 1,64,4096 --features 4096x4096 \\
        --protocols stream,graph --compile-dynamic                 # a batch sweep, one compile per size
    python -m fused_linear.bench --shapes seed --models M1,M4 --compile-mode max-autotune-no-cudagraphs
    python -m fused_linear.bench --kernelbench examples/kernelbench --shapes seed --no-compile
    python -m fused_linear.bench --device cpu --no-compile --iters 3 --warmup 1   # CI smoke test

Results go to ``--json`` (every measurement, with metadata) and ``--markdown`` (one table per
protocol, configuration and mode, then a summary), and the markdown is printed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import functools
import gc
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, TextIO, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import PRESETS, FusedLinear, _native, clear_fp8_cache
from . import __version__ as _fused_linear_version
from .fuse import _fused_call, fuse

# ---------------------------------------------------------------- what can be measured

CONFIGS = ("fp32", "tf32x3", "tf32", "bf16", "fp16", "fp8")
MODES = ("fwd", "fwdbwd", "fwdbwd_nodx")
#: The modes run unless ``--modes`` says otherwise.
DEFAULT_MODES = ("fwd", "fwdbwd")
PROTOCOLS = ("flushed", "stream", "graph", "host")
IMPLS = ("eager", "compile", "ao_tensorwise", "ao_rowwise", "ours")
#: torchao's float8 training recipes under torch.compile: the fp8 configuration's peers
#: beside compile bf16, where torchao is installed.
TORCHAO_IMPLS = {"ao_tensorwise": "tensorwise", "ao_rowwise": "rowwise"}
SHAPE_SETS = ("all", "seed", "sweep", "tiny", "none")
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
CPU_PROTOCOLS = ("stream", "host")  # CUDA events, L2 flushes and CUDA graphs mean nothing on the CPU
CPU_CONFIGS = ("fp32",)  # the CPU backend is FP32 whatever the precision; no bf16 model there

#: The presets' KernelBench level-2 seed sizes (rows, in, out): #88, #37, #62, #98, #94.
SEED_SIZES: Dict[str, Tuple[int, int, int]] = {
    "M1": (1024, 8192, 8192),
    "M2": (32768, 1024, 4096),
    "M3": (1024, 8192, 8192),
    "M4": (1024, 8192, 8192),
    "M5": (1024, 8192, 8192),
}
SWEEP_ROWS = (1, 8, 64, 256, 1024, 4096, 32768)
SWEEP_FEATURES = ((1024, 1024), (4096, 4096), (8192, 8192), (1024, 4096))
#: M1's chain; ``{groups}`` is out / 32, so every group keeps 32 channels at any width.
DEFAULT_SWEEP_CHAIN = "groupnorm({groups}),swish,mul,swish"
SWEEP_CHANNELS_PER_GROUP = 32

#: ``--shapes tiny`` (the CPU default): the sweep chain at these rows and sizes, and each
#: preset at TINY_PRESET's size with its groups scaled (see :func:`scale_chain`).
TINY_ROWS = (1, 8)
TINY_FEATURES = ((64, 64),)
TINY_PRESET = (8, 128, 256)
MIN_CHANNELS_PER_GROUP = 4

#: KernelBench's flush buffer: at least 256 MB, and twice the L2 where that is more.
FLUSH_BYTES_MIN = 256 << 20
#: Back-to-back protocols (stream, graph) time this many batches of --iters calls; the median is kept.
BATCHES = 3
#: Warm-up calls on a side stream before a capture, as torch.cuda.graph asks (at least this many).
GRAPH_SIDE_WARMUP = 3
#: A case is skipped when its estimated peak exceeds this share of the free GPU memory.
MEMORY_HEADROOM = 0.9
ERROR_CHARS = 400  # error strings are cut to this (Dynamo's run to pages)
#: KernelBench problem ids of the presets, to label --kernelbench rows.
KERNELBENCH_MODELS = {88: "M1", 37: "M2", 62: "M3", 98: "M4", 94: "M5"}

PROTOCOL_UNITS = {"flushed": "ms", "stream": "ms", "graph": "ms", "host": "us"}
CONFIG_DEFS = {
    "fp32": "float32 tensors; ours precision fp32 (strict FP32), eager/compile with TF32 off",
    "tf32x3": "float32 tensors; ours precision tf32x3 (3xTF32, FP32 accuracy), eager/compile with TF32 off",
    "tf32": "float32 tensors; ours precision tf32, eager/compile with TF32 allowed (matmul and cuDNN)",
    "bf16": "a bf16 model: parameters and input in bfloat16, ours with its default precision",
    "fp16": "an fp16 model: parameters and input in float16, ours with its default precision (fp16 "
    "operands as stored), the peers on fp16 tensor cores",
    "fp8": "a bf16 model, ours with precision fp8 (e4m3 GEMMs; x and dZ quantised per call, the weight "
    "once per version of it), the peers the bf16 model as in bf16 and, where torchao is installed, "
    "torchao's float8 training recipes (convert_to_float8_training, tensorwise and rowwise: x, W and dY "
    "quantised per call) under torch.compile",
}


# ---------------------------------------------------------------- the plain peer


def parse_op(text: str) -> Tuple[str, Tuple[float, ...]]:
    """One op (``groupnorm(256,1e-5)``, ``hardtanh(-1,1)``, ``swish``) as ``(kind, args)``,
    by the op registry's parser (``_native.parse_chain``): aliases resolved, defaults
    filled in."""
    parsed = _native.parse_chain(text)
    if len(parsed) != 1:
        raise ValueError(f"`{text}` is {len(parsed)} ops, not one")
    kind, args = parsed[0]
    return kind, tuple(args)


#: The norms' PyTorch modules, from their width, parsed arguments and factory kwargs (named
#: as FusedLinear names their parameters: ``gn``, ``ln``, ``rms``, ``bn``, numbered after the first).
_PLAIN_NORMS: Dict[str, Callable[[int, Tuple[float, ...], Dict[str, Any]], nn.Module]] = {
    "groupnorm": lambda f, a, k: nn.GroupNorm(int(a[0]), f, eps=a[1], **k),
    "layernorm": lambda f, a, k: nn.LayerNorm(f, eps=a[0], **k),
    "rmsnorm": lambda f, a, k: nn.RMSNorm(f, eps=a[0], **k),
    "batchnorm": lambda f, a, k: nn.BatchNorm1d(f, eps=a[0], **k),
}
#: The row reductions, keeping the dimension (the block squeezes it at the end).
_PLAIN_REDUCTIONS: Dict[str, Callable[[Tensor], Tensor]] = {
    "max": lambda h: torch.max(h, 1, keepdim=True).values,
    "min": lambda h: torch.min(h, 1, keepdim=True).values,
    "sum": lambda h: h.sum(1, keepdim=True),
    "mean": lambda h: h.mean(1, keepdim=True),
    "logsumexp": lambda h: torch.logsumexp(h, 1, keepdim=True),
}
_PLAIN_OPS = {
    *_PLAIN_NORMS,
    *_PLAIN_REDUCTIONS,
    *("bias", "mul", "scale", "swish", "mish", "gelu", "gelu_tanh", "tanh", "sigmoid"),
    *("leakyrelu", "hardtanh", "softmax", "avgpool", "maxpool", "residual"),
}


class PlainBlock(nn.Module):
    """The block ``FusedLinear`` fuses, written with ordinary torch ops: the peer to beat.

    Built from the chain's canonical ops (``_native.describe``) and holding its parameters
    under exactly FusedLinear's names (``lin.weight``, ``lin.bias``, ``gn.weight``,
    ``gn.bias``, ``w``, ``bias``, ``gn2.*``, ``w2``, ``bias2``), so that
    ``plain.load_state_dict(fused.state_dict())`` gives both the same weights. Each op is
    the idiomatic PyTorch form (one ``F.silu``, not ``x * sigmoid(x)``; ``nn.GroupNorm``),
    so eager is as strong as plain PyTorch gets and ``torch.compile`` sees ordinary code.
    """

    def __init__(
        self, in_features: int, out_features: int, ops: str = "", *, device: Any = None, dtype: Any = None
    ) -> None:
        super().__init__()
        _, _, _, canonical, params = _native.describe(in_features, out_features, ops)
        factory = {"device": device, "dtype": dtype}
        self.in_features, self.out_features = in_features, out_features
        self.ops = ",".join(canonical)
        self.lin = nn.Linear(in_features, out_features, **factory)
        by_op: Dict[int, List[Tuple[str, List[int]]]] = {}
        for name, shape, index in params:
            by_op.setdefault(index, []).append((name, list(shape)))
        # (kind, args, attribute): the attribute names the op's parameter or GroupNorm module.
        self.steps: List[Tuple[str, Tuple[float, ...], str]] = []
        for index, text in enumerate(canonical):
            kind, args = parse_op(text)
            attr = ""
            if kind not in _PLAIN_OPS:
                raise ValueError(f"PlainBlock has no PyTorch form of `{text}`")
            if kind in _PLAIN_NORMS:
                (name, shape), *_ = by_op[index]  # "gn.weight" (then "gn.bias"), "rms.weight", ...
                attr = name.partition(".")[0]
                self.add_module(attr, _PLAIN_NORMS[kind](shape[0], args, factory))
            elif kind in ("bias", "mul"):
                ((attr, shape),) = by_op[index]
                # FusedLinear draws these from randn in chain order: the same seed, the same values.
                self.register_parameter(attr, nn.Parameter(torch.randn(*shape, **factory)))
            self.steps.append((kind, args, attr))

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        h = z = self.lin(x if x.dim() == 2 else x.reshape(-1, self.in_features))
        reduced = False  # a reduction leaves (N, 1) here, (N,) at the end
        for kind, args, attr in self.steps:
            if kind == "residual":
                h = h + z
            elif kind in _PLAIN_NORMS:
                h = getattr(self, attr)(h)
            elif kind in _PLAIN_REDUCTIONS:
                h, reduced = _PLAIN_REDUCTIONS[kind](h), True
            elif kind == "softmax":
                h = torch.softmax(h, 1)
            elif kind == "maxpool":
                h = F.max_pool1d(h.unsqueeze(1), int(args[0])).squeeze(1)
            elif kind == "bias":
                h = h + getattr(self, attr)
            elif kind == "mul":
                h = h * getattr(self, attr)
            elif kind == "scale":
                h = h * args[0]
            elif kind == "swish":
                h = F.silu(h)
            elif kind == "mish":
                h = F.mish(h)
            elif kind == "gelu":
                h = F.gelu(h)  # the exact (erf) form, as the fused op
            elif kind == "gelu_tanh":
                h = F.gelu(h, approximate="tanh")
            elif kind == "tanh":
                h = torch.tanh(h)
            elif kind == "sigmoid":
                h = torch.sigmoid(h)
            elif kind == "leakyrelu":
                h = F.leaky_relu(h, args[0])
            elif kind == "hardtanh":
                h = F.hardtanh(h, args[0], args[1])
            else:  # avgpool (the constructor refused anything else)
                h = F.avg_pool1d(h.unsqueeze(1), int(args[0])).squeeze(1)
        if reduced:
            h = h.squeeze(1)
        return h if x.dim() == 2 else h.reshape(*lead, *h.shape[1:])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, ops='{self.ops}'"


def randomize_affine(block: nn.Module, seed: int = 0) -> nn.Module:
    """Draws every GroupNorm's weight and bias away from 1 and 0 (their initial values), so
    that the correctness check also covers the affine step."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in block.modules():
            if isinstance(m, nn.GroupNorm) and m.affine:
                m.weight.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
                m.bias.copy_(torch.rand(m.bias.shape, generator=g) - 0.5)
    return block


def scale_chain(ops: str, seed_out: int, out: int, seed_in: int = 64) -> str:
    """``ops`` (written for ``seed_out`` channels) made valid at ``out`` channels: each
    GroupNorm keeps its channels per group (at least MIN_CHANNELS_PER_GROUP, and a group count
    that divides ``out``); everything else as it was. Lets the presets run at tiny sizes."""
    _, _, _, canonical, _ = _native.describe(seed_in, seed_out, ops)
    scaled = []
    for text in canonical:
        kind, args = parse_op(text)
        if kind == "groupnorm":
            per_group = max(seed_out // int(args[0]), MIN_CHANNELS_PER_GROUP)
            groups = max(1, out // per_group)
            while out % groups:
                groups -= 1
            text = f"groupnorm({groups},{text[:-1].split(',')[1]})"
        scaled.append(text)
    return ",".join(scaled)


def sweep_chain(template: str, out: int) -> str:
    """The ``--sweep-chain`` template at ``out`` channels: ``{groups}`` is out / 32, ``{out}`` out."""
    return template.format(groups=max(1, out // SWEEP_CHANNELS_PER_GROUP), out=out)


# ---------------------------------------------------------------- shapes


@dataclass(frozen=True)
class Shape:
    """One block at one size: what a table line is about."""

    model: str  # "M1".."M5", "sweep", or "KB88" (a --kernelbench problem)
    chain: str  # canonical, as describe prints it (a KernelBench ModelNew's own `ops`)
    rows: int
    in_features: int
    out_features: int
    source: str = ""  # a KernelBench problem file, else empty
    fused: bool = False  # ours is fuse(Model) rather than the file's ModelNew

    @property
    def group(self) -> Tuple[str, str, int, int, str]:
        """Shapes that share weights (all but the rows): built and compiled once with --compile-dynamic."""
        return (self.model, self.chain, self.in_features, self.out_features, self.source)

    @property
    def label(self) -> str:
        return f"{self.model} {self.rows}x{self.in_features}x{self.out_features}"


def canonical(in_features: int, out_features: int, ops: str) -> str:
    return ",".join(_native.describe(in_features, out_features, ops)[3])


def preset_shapes(models: Sequence[str], tiny: bool) -> List[Shape]:
    """The presets at their seed sizes, or (tiny) at TINY_PRESET with their groups scaled."""
    shapes = []
    for model in models:
        rows, fin, fout = SEED_SIZES[model]
        ops = PRESETS[model]
        if tiny:
            ops = scale_chain(ops, fout, TINY_PRESET[2], fin)
            rows, fin, fout = TINY_PRESET
        shapes.append(Shape(model, canonical(fin, fout, ops), rows, fin, fout))
    return shapes


def sweep_shapes(template: str, rows: Sequence[int], features: Sequence[Tuple[int, int]]) -> List[Shape]:
    return [
        Shape("sweep", canonical(fin, fout, sweep_chain(template, fout)), r, fin, fout)
        for fin, fout in features
        for r in rows
    ]


def load_problem(path: Path, scale: Optional[int] = 1) -> ModuleType:
    """A KernelBench problem file as a module (as examples/kernelbench/run.py loads them), with
    its sizes divided by ``scale`` where the file offers ``set_shape_scale`` (None: the file's
    own ``SMALL_SCALE``, else 32)."""
    name = "fused_linear_bench_" + re.sub(r"\W", "_", path.stem)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for attr in ("Model", "get_inputs", "get_init_inputs"):
        if not hasattr(module, attr):
            raise ImportError(f"{path} has no `{attr}` (not a KernelBench problem file)")
    if scale is None:
        scale = int(getattr(module, "SMALL_SCALE", 32))
    if scale != 1 and hasattr(module, "set_shape_scale"):
        module.set_shape_scale(scale)
    return module


_PROBLEMS: Dict[str, ModuleType] = {}


def problem_files(folder: Path, fused: bool) -> List[Path]:
    """The problem files of ``folder``: this repository's ``p*.py``, or with ``fused`` any
    ``*.py`` holding a ``Model`` (KernelBench's own, ``88_Gemm_...py``, too)."""
    paths = sorted(folder.glob("*.py" if fused else "p*.py"))
    texts = {p: p.read_text(errors="replace") for p in paths}
    return [p for p in paths if "class Model" in texts[p] and "def get_inputs" in texts[p]]


def problem_number(path: Path) -> int:
    """KernelBench's number of a problem file (``p088_...`` or ``88_...``), -1 without one."""
    digits = re.match(r"p?0*(\d+)", path.stem)
    return int(digits.group(1)) if digits else -1


def kernelbench_shapes(
    folder: Path, scale: Optional[int], fused: bool = False, numbers: Optional[Sequence[int]] = None
) -> List[Shape]:
    """One shape per problem file in ``folder`` (those of ``numbers`` only, where given), at its
    own (seed) size divided by ``scale`` (None: each file's small scale). Ours is the file's
    ``ModelNew``, or ``fuse(Model)`` with ``fused`` or where the file has none; the chain column
    says what runs fused."""
    shapes = []
    for path in problem_files(folder, fused):
        if numbers and problem_number(path) not in numbers:
            continue
        module = load_problem(path, scale)
        _PROBLEMS[str(path)] = module
        by_fuse = fused or not hasattr(module, "ModelNew")
        (x,) = module.get_inputs()[:1]
        with torch.device("meta"):  # the sizes and the chain, without allocating the weights
            plain = module.Model(*module.get_init_inputs())
            ours = fuse(plain) if by_fuse else module.ModelNew(*module.get_init_inputs())
        weight = next((m.weight for m in plain.modules() if isinstance(m, nn.Linear)), None)
        if weight is None:
            weight = next((p for p in plain.parameters() if p.dim() == 2), None)
        out_features = int(weight.shape[0]) if weight is not None else 0
        pid = problem_number(path)
        model = f"KB{pid}" + (f"({KERNELBENCH_MODELS[pid]})" if pid in KERNELBENCH_MODELS else "")
        if by_fuse:
            calls = [
                n.args[3] for n in ours.graph.nodes if n.op == "call_function" and n.target is _fused_call
            ]
            chain = " + ".join(calls) if calls else "(nothing fused)"
        else:
            chain = str(getattr(ours, "ops", "?"))
            with contextlib.suppress(ValueError):  # printed as describe prints the presets' chains
                chain = canonical(int(x.shape[-1]), out_features, chain)
        shapes.append(
            Shape(model, chain, int(x.shape[0]), int(x.shape[-1]), out_features, str(path), by_fuse)
        )
    return shapes


# ---------------------------------------------------------------- building a case


@dataclass
class Pair:
    """The two blocks of a case, same weights: ours and the plain peer (eager; compiled from it)."""

    ours: nn.Module
    plain: nn.Module


def dtype_of(config: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}.get(config, torch.float32)


def ours_precision(config: str) -> Optional[str]:
    """A bf16 or fp16 model takes its tensors' own precision (None); float32 ones the
    config's; fp8 a bf16 model quantised to fp8."""
    return None if config in ("bf16", "fp16") else config


def build_pair(shape: Shape, config: str, device: torch.device, seed: int) -> Pair:
    """Ours and the peer with the same weights: FusedLinear is built (seeded), the peer loads
    its state_dict; a KernelBench problem builds Model and ModelNew under one seed and checks
    that their state_dicts agree. A bf16 config converts both with ``.to(torch.bfloat16)``."""
    if shape.source:
        return _build_kernelbench_pair(shape, config, device, seed)
    torch.manual_seed(seed)
    ours = FusedLinear(
        shape.in_features, shape.out_features, shape.chain, ours_precision(config), device=device
    )
    randomize_affine(ours, seed)
    plain = PlainBlock(shape.in_features, shape.out_features, shape.chain, device=device)
    plain.load_state_dict(ours.state_dict())
    return Pair(ours.to(dtype_of(config)), plain.to(dtype_of(config)))


def _build_kernelbench_pair(shape: Shape, config: str, device: torch.device, seed: int) -> Pair:
    module = _PROBLEMS.get(shape.source) or load_problem(Path(shape.source))
    if shape.fused:
        # fuse() calls the op on Model's own parameters: one set of weights, two graphs.
        torch.manual_seed(seed)
        plain = module.Model(*module.get_init_inputs()).to(device, dtype_of(config))
        return Pair(fuse(plain, ours_precision(config)), plain)
    blocks = []
    for cls, extra in ((module.Model, {}), (module.ModelNew, {"precision": ours_precision(config)})):
        torch.manual_seed(seed)
        blocks.append(cls(*module.get_init_inputs(), **extra))
    plain, ours = blocks
    a, b = plain.state_dict(), ours.state_dict()
    if list(a) != list(b) or any(not torch.equal(a[k], b[k]) for k in a):
        raise RuntimeError("ModelNew's parameters differ from Model's under the same seed")
    return Pair(ours.to(device, dtype_of(config)), plain.to(device, dtype_of(config)))


def make_input(shape: Shape, config: str, device: torch.device, seed: int) -> Tensor:
    """The case's input: KernelBench's ``get_inputs()`` for a problem file, else randn."""
    if shape.source:
        module = _PROBLEMS.get(shape.source) or load_problem(Path(shape.source))
        torch.manual_seed(seed)
        return module.get_inputs()[0].to(device, dtype_of(config))
    g = torch.Generator(device=device).manual_seed(seed + shape.rows)
    return torch.randn(shape.rows, shape.in_features, generator=g, device=device, dtype=dtype_of(config))


def fixed_grad(y: Tensor, seed: int) -> Tensor:
    """The output gradient of every fwdbwd step: random, of y's shape and dtype, the same for
    every implementation (its own generator)."""
    g = torch.Generator(device=y.device).manual_seed(seed + 1)
    return torch.randn(y.shape, generator=g, device=y.device, dtype=y.dtype)


def estimate_bytes(shape: Shape, config: str, modes: Sequence[str], protocols: Sequence[str]) -> int:
    """A generous estimate of a case's peak GPU memory: two copies of the weights (ours and the
    peer's) and one weight gradient, the input and its gradient, and the peer's activations
    (about 4 (rows, out) float32 tensors alive in a forward, 12 in a training step), twice over
    when a CUDA graph's private pool holds a captured step beside the live tensors."""
    e = 2 if config in ("bf16", "fp16") else 4
    train = any(m != "fwd" for m in modes)
    graph = "graph" in protocols
    weights = shape.in_features * shape.out_features * e * (2 + (1 + graph if train else 0))
    inputs = shape.rows * shape.in_features * e * (3 if train else 1)
    acts = shape.rows * shape.out_features * 4 * (12 if train else 4) * (2 if graph else 1)
    return weights + inputs + acts + (256 << 20)


# ---------------------------------------------------------------- timing protocols


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _short(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text if len(text) <= ERROR_CHARS else text[: ERROR_CHARS - 3] + "..."


def time_flushed(fn: Callable[[], Any], iters: int, warmup: int, flush: Tensor) -> float:
    """KernelBench's protocol, in milliseconds. Before each timed call a write of ``flush``
    (max(256 MB, 2x L2)) evicts the weights and inputs from L2, so no call finds them on chip,
    and keeps the GPU busy while the host enqueues the call, which hides up to ~0.1 ms of
    launch overhead; then a CUDA event, the call, an event and a synchronize. The median of
    ``iters`` calls after ``warmup``."""
    for _ in range(warmup):
        flush.zero_()
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        del out
    return statistics.median(times)


def stream_batch(fn: Callable[[], Any], iters: int, device: torch.device) -> float:
    """Throughput, in milliseconds per call: ``iters`` calls back to back between two CUDA
    events (the host runs ahead of the GPU as in a training loop without CUDA graphs), divided
    by ``iters``. Where the host is slower than the GPU (small sizes) this is the host's time
    per call. On the CPU: wall clock around the batch. (`stream`: the median of BATCHES such
    batches, the implementations taking turns: :meth:`Bench._interleaved`.)"""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


def time_graph(fn: Callable[[], Any], iters: int, warmup: int) -> float:
    """The GPU's time alone, in milliseconds: one call captured in a ``torch.cuda.CUDAGraph``
    (after warm-up on a side stream, as capture requires: lazy initialisation, cuBLAS
    workspaces and autotuning must not happen inside it), then ``iters`` replays back to back
    between two CUDA events, divided by ``iters``; the median of BATCHES batches. A replay
    launches the whole call at once, so no host overhead is left in the number. ``fn`` must be
    capturable: no host synchronisation, and for training steps ``torch.autograd.grad`` rather
    than ``.backward()`` (nothing accumulated into ``.grad`` in captured memory)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(warmup, GRAPH_SIDE_WARMUP)):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fn()
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(BATCHES):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / iters)
    del graph, static_out  # frees the graph's private memory pool
    return statistics.median(per_call)


def host_calls(fn: Callable[[], Any], calls: int, device: torch.device) -> List[float]:
    """The host's time of each of ``calls`` calls, in microseconds: synchronize (so the call
    starts from an idle queue and never waits on earlier work), ``perf_counter``, the call,
    ``perf_counter``. Python, dispatch, autograd and launch costs: what bounds a step whose
    GPU work is shorter. (`host`: the median of every call of BATCHES turns,
    :meth:`Bench._interleaved`.)"""
    samples = []
    for _ in range(calls):
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        samples.append((t1 - t0) * 1e6)
        del out
    _sync(device)
    return samples


def protocol_definitions(device: torch.device) -> Dict[str, str]:
    """One line per protocol for the report (the CPU variants time by wall clock)."""
    if device.type == "cpu":
        return {
            "stream": "--iters calls back to back, wall clock (perf_counter) around them / --iters; "
            "median of 3 batches, the implementations taking turns. Milliseconds. (CPU: a smoke test "
            "of the code, not a benchmark.)",
            "host": "one call between two perf_counter reads; median of about --iters calls in 3 turns. "
            "Microseconds.",
        }
    return {
        "flushed": "KernelBench's protocol: a write of max(256 MB, 2x L2) before each call, then CUDA "
        "event, call, event; median of --iters calls. Milliseconds.",
        "stream": "--iters calls back to back between two CUDA events / --iters; median of 3 batches, "
        "the implementations taking turns (a batch each per round), so that the host's drift falls "
        "on all alike. What a training loop without CUDA graphs sees (host-bound at small sizes). "
        "Milliseconds.",
        "graph": "one call captured in a CUDA graph, --iters replays back to back between two events "
        "/ --iters; median of 3 batches: the GPU's time alone. Milliseconds.",
        "host": "CPU time of one call: synchronize, perf_counter, call, perf_counter; median of about "
        "--iters calls taken in 3 turns, the implementations alternating. Microseconds.",
    }


@contextlib.contextmanager
def tf32_allowed(on: bool) -> Iterator[None]:
    """TF32 for the peers' float32 matmuls (and cuDNN) on or off, restored on exit, so that no
    setting leaks from one configuration or implementation into the next. Ours picks its own
    arithmetic (``precision``) and runs outside."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul
        torch.backends.cudnn.allow_tf32 = cudnn


@contextlib.contextmanager
def _same_rng(device: torch.device) -> Iterator[None]:
    """A fixed RNG state for one call, the caller's restored after: a training-mode Dropout (a
    KernelBench problem's) draws the same mask in ours and in eager."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(0)
        yield


def rel_err(got: Tensor, ref: Tensor) -> float:
    """``||got - ref|| / ||ref||`` in float64 (the norm of the difference where ref is 0)."""
    diff = (got.detach().double() - ref.detach().double()).norm().item()
    denom = ref.detach().double().norm().item()
    return diff / denom if denom > 0 else diff


def _first_linear_weight(block: nn.Module) -> Tensor:
    """The first nn.Linear's weight, else (a problem's ``x @ W.T``) the first 2-D parameter."""
    linear = next((m for m in block.modules() if isinstance(m, nn.Linear)), None)
    return linear.weight if linear is not None else next(p for p in block.parameters() if p.dim() == 2)


# ---------------------------------------------------------------- progress


def _clock(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """Done/total cases, elapsed time, ETA and the current case, on stderr: one line redrawn
    with ``\\r`` on a terminal; one line per finished case otherwise (logs, CI, pipes), where
    carriage returns would pile up."""

    def __init__(self, total: int, bar: bool, stream: Optional[TextIO] = None) -> None:
        self.total, self.done = total, 0
        self.stream = stream if stream is not None else sys.stderr
        self.bar = bar
        self.t0 = self.case_t0 = time.perf_counter()
        self.label = ""

    def _head(self) -> str:
        elapsed = time.perf_counter() - self.t0
        eta = _clock(elapsed / self.done * (self.total - self.done)) if self.done else "?"
        pct = 100 * self.done // max(self.total, 1)
        return f"[{self.done}/{self.total}] {pct:3d}% {_clock(elapsed)} eta {eta}"

    def _draw(self, detail: str = "") -> None:
        width = shutil.get_terminal_size((100, 20)).columns - 1
        line = f"{self._head()} | {self.label} {detail}".rstrip()[:width]
        self.stream.write("\r" + line.ljust(width))
        self.stream.flush()

    def begin(self, label: str) -> None:
        """The current case is now ``label`` (shown on the bar at once); its time runs from the
        end of the previous one, so building and checking count towards the first mode."""
        self.label = label
        if self.bar:
            self._draw()

    def status(self, detail: str) -> None:
        """What the current case is doing (the bar only)."""
        if self.bar:
            self._draw(detail)

    def advance(self, n: int = 1, note: str = "") -> None:
        """``n`` cases are finished (skipped ones too)."""
        self.done += n
        if self.bar:
            self._draw(note)
        else:
            took = f"{time.perf_counter() - self.case_t0:.1f} s"
            self.stream.write(f"{self._head()} {self.label}: {took}{f' | {note}' if note else ''}\n")
            self.stream.flush()
        self.case_t0 = time.perf_counter()

    def close(self) -> None:
        if self.bar:
            self.stream.write("\n")
            self.stream.flush()


# ---------------------------------------------------------------- the runner


class Bench:
    """Runs every case and keeps what it measured: ``rows`` (one per implementation, protocol
    and mode), ``correctness`` (one per shape and configuration) and ``skipped``."""

    def __init__(self, args: argparse.Namespace, progress: Progress) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.progress = progress
        self.rows: List[Dict[str, Any]] = []
        self.correctness: List[Dict[str, Any]] = []
        self.skipped: List[Dict[str, Any]] = []
        ao = "fp8" in args.configs and not args.no_compile and self.cuda and _torchao() is not None
        self.impls = [
            i for i in IMPLS if (i != "compile" or not args.no_compile) and (i not in TORCHAO_IMPLS or ao)
        ]
        # What is already recorded, so that a case failing half-way gets each missing cell once.
        self._cells: set = set()
        self._modes_done: set = set()
        self._checked: set = set()
        self.flush: Optional[Tensor] = None
        if self.cuda and "flushed" in args.protocols:
            l2 = getattr(torch.cuda.get_device_properties(self.device), "L2_cache_size", 0)
            self.flush = torch.empty(max(FLUSH_BYTES_MIN, 2 * l2), dtype=torch.uint8, device=self.device)

    # -- bookkeeping

    def _base(self, shape: Shape, config: str) -> Dict[str, Any]:
        return {
            "config": config,
            "model": shape.model,
            "chain": shape.chain,
            "rows": shape.rows,
            "in": shape.in_features,
            "out": shape.out_features,
        }

    def _record(
        self,
        shape: Shape,
        config: str,
        mode: str,
        impl: str,
        protocol: str,
        value: Optional[float],
        error: Optional[str],
    ) -> None:
        self._cells.add((shape, config, mode, impl, protocol))
        row = self._base(shape, config)
        row.update(mode=mode, impl=impl, protocol=protocol, value=value, unit=PROTOCOL_UNITS[protocol])
        row["error"] = error
        self.rows.append(row)

    def _impls_for(self, config: str) -> List[str]:
        """The implementations a configuration times (torchao's only in fp8)."""
        return [i for i in self.impls if i not in TORCHAO_IMPLS or config == "fp8"]

    def _record_all(self, shape: Shape, config: str, mode: str, error: str) -> None:
        for protocol in self.args.protocols:
            for impl in self._impls_for(config):
                if (shape, config, mode, impl, protocol) not in self._cells:
                    self._record(shape, config, mode, impl, protocol, None, error)

    def _cleanup(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def _too_big(self, shape: Shape, config: str) -> Optional[str]:
        """Why this case cannot fit in the GPU's free memory, or None."""
        if not self.cuda:
            return None
        self._cleanup()
        free, _ = torch.cuda.mem_get_info(self.device)
        need = estimate_bytes(shape, config, self.args.modes, self.args.protocols)
        if need > MEMORY_HEADROOM * free:
            return f"needs about {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
        return None

    def _flags(self, impl: str, config: str) -> contextlib.AbstractContextManager:
        """The peers run with TF32 allowed only in the tf32 configuration; ours untouched."""
        if impl == "ours" or not self.cuda:
            return contextlib.nullcontext()
        return tf32_allowed(config == "tf32")

    def _compile(self, plain: nn.Module) -> nn.Module:
        """A fresh ``torch.compile`` of the peer (Dynamo's caches reset first, so earlier cases'
        graphs neither pile up nor get reused). Static shapes, or (--compile-dynamic) the
        batch dimension left dynamic through ``mark_dynamic`` on each input."""
        torch._dynamo.reset()
        mode = None if self.args.compile_mode == "default" else self.args.compile_mode
        return torch.compile(plain, mode=mode, dynamic=None if self.args.compile_dynamic else False)

    def _torchao_peers(self, plain: nn.Module) -> Dict[str, nn.Module]:
        """torchao's float8 recipes on copies of the bf16 peer, each compiled (static shapes)."""
        ao = _torchao()
        peers = {}
        for impl, recipe in TORCHAO_IMPLS.items():
            if impl in self.impls:
                model = copy.deepcopy(plain)
                config = ao.Float8LinearConfig.from_recipe_name(recipe)
                ao.convert_to_float8_training(model, config=config)
                mode = None if self.args.compile_mode == "default" else self.args.compile_mode
                peers[impl] = torch.compile(model, mode=mode, dynamic=False)
        return peers

    def _mark(self, t: Tensor) -> Tensor:
        # A batch of one is specialised by Dynamo (marking it dynamic is an error): compiled apart.
        if self.args.compile_dynamic and not self.args.no_compile and t.shape[0] > 1:
            torch._dynamo.mark_dynamic(t, 0)
        return t

    # -- running

    def run(self, shapes: Sequence[Shape]) -> None:
        groups: Dict[Tuple[str, str, int, int, str], List[Shape]] = {}
        for shape in shapes:
            groups.setdefault(shape.group, []).append(shape)
        for members in groups.values():
            for config in self.args.configs:
                self._run_group(sorted(members, key=lambda s: s.rows), config)

    def _run_group(self, shapes: Sequence[Shape], config: str) -> None:
        """The shapes of one block (weights built once), smallest batch first; compiled once
        for the group with --compile-dynamic, else once per shape."""
        pair: Optional[Pair] = None
        compiled: Optional[nn.Module] = None
        ao: Dict[str, nn.Module] = {}
        n_modes = len(self.args.modes)
        try:
            for shape in shapes:
                self.progress.begin(f"{shape.label} {config}")
                reason = self._too_big(shape, config)
                if reason is not None:
                    self.skipped.append({**self._base(shape, config), "reason": reason})
                    for mode in self.args.modes:
                        self._record_all(shape, config, mode, f"skipped: {reason}")
                    self.progress.advance(n_modes, f"skipped ({reason})")
                    continue
                try:
                    if pair is None:
                        pair = build_pair(shape, config, self.device, self.args.seed)
                    if "compile" in self.impls and (compiled is None or not self.args.compile_dynamic):
                        compiled = self._compile(pair.plain)
                        if config == "fp8":
                            ao = self._torchao_peers(pair.plain)
                    self._run_shape(shape, config, pair, compiled, ao)
                except Exception as e:  # noqa: BLE001 -- a failed case is a result; the next one runs
                    error = _short(e)
                    left = [m for m in self.args.modes if (shape, config, m) not in self._modes_done]
                    for mode in left:
                        self._record_all(shape, config, mode, error)
                    if (shape, config) not in self._checked:
                        self.correctness.append({**self._base(shape, config), "error": error})
                    self.progress.advance(len(left), f"failed: {error[:80]}")
                    self._cleanup()
        finally:
            del pair, compiled, ao
            if "compile" in self.impls:
                torch._dynamo.reset()
            self._cleanup()

    def _run_shape(
        self,
        shape: Shape,
        config: str,
        pair: Pair,
        compiled: Optional[nn.Module],
        ao: Optional[Dict[str, nn.Module]] = None,
    ) -> None:
        seed = self.args.seed
        x = self._mark(make_input(shape, config, self.device, seed))
        blocks: Dict[str, nn.Module] = {"eager": pair.plain, "ours": pair.ours}
        if compiled is not None:
            blocks["compile"] = compiled
        blocks.update(ao or {})
        with torch.no_grad(), self._flags("eager", config):
            dy = fixed_grad(pair.plain(x), seed)
        check = self._check(shape, config, pair, x, dy)
        self.correctness.append(check)
        self._checked.add((shape, config))
        for mode in self.args.modes:
            self.progress.begin(f"{shape.label} {config} {mode}")
            first = len(self.rows)
            self._run_mode(shape, config, mode, blocks, x, dy, check)
            self._modes_done.add((shape, config, mode))
            self.progress.advance(note=self._summary(self.rows[first:]))
        del x, dy

    def _summary(self, rows: Sequence[Dict[str, Any]]) -> str:
        """A finished case's times in one line (``graph eager/compile/ours x ratio; ...``):
        what a log keeps of a run that stops before its tables are written."""
        parts = []
        for protocol in self.args.protocols:
            got = {r["impl"]: r["value"] for r in rows if r["protocol"] == protocol}
            if not got or any(v is None for v in got.values()):
                continue
            times = "/".join(f"{got[i]:.4g}" for i in self.impls if i in got)
            peers = [got[i] for i in ("eager", "compile") if i in got]
            ratio = f" x{min(peers) / got['ours']:.2f}" if peers and got.get("ours") else ""
            parts.append(f"{protocol} {times}{ratio}")
        return "; ".join(parts)

    def _calls(
        self,
        block: nn.Module,
        mode: str,
        x: Tensor,
        xg: Optional[Tensor],
        dy: Tensor,
        requantise: bool = False,
    ) -> Tuple[Callable[[], Any], Callable[[], Any]]:
        """(the call timed by flushed, stream and host; its capturable form for graph).
        ``requantise``: an fp8 training step quantises its weight again, as after the
        optimizer step every real step has (the forward alone reuses it, as inference does)."""
        if mode == "fwd":

            def forward() -> Any:
                with torch.no_grad():
                    return block(x)

            return forward, forward
        assert xg is not None
        params = [p for p in block.parameters() if p.requires_grad]

        def step() -> None:
            # A training step: fresh gradients (no accumulation kernels), the input's too.
            for p in params:
                p.grad = None
            xg.grad = None
            if requantise:
                clear_fp8_cache()
            block(xg).backward(dy)

        inputs = [xg, *params] if xg.requires_grad else params

        def captured_step() -> Any:
            if requantise:
                clear_fp8_cache()
            return torch.autograd.grad(block(xg), inputs, dy)

        return step, captured_step

    def _run_mode(
        self,
        shape: Shape,
        config: str,
        mode: str,
        blocks: Dict[str, nn.Module],
        x: Tensor,
        dy: Tensor,
        check: Dict[str, Any],
    ) -> None:
        """One mode of one case: every implementation's first call (untimed; compile's is
        reported as its compile time), then each protocol for each implementation."""
        args = self.args
        xg = self._mark(x.detach().clone().requires_grad_(mode == "fwdbwd")) if mode != "fwd" else None
        calls = {
            impl: self._calls(block, mode, x, xg, dy, config == "fp8" and impl == "ours")
            for impl, block in blocks.items()
        }
        impls = [i for i in self.impls if i in blocks]
        failed: Dict[str, str] = {}
        # First calls (compilation, autotuning, lazy initialisation) are never timed.
        for impl in impls:
            self.progress.status(f"{mode} {impl} first call")
            try:
                t0 = time.perf_counter()
                with self._flags(impl, config):
                    calls[impl][0]()
                _sync(self.device)
                if impl == "compile":
                    check["compile_s_" + mode] = round(time.perf_counter() - t0, 3)
            except Exception as e:  # noqa: BLE001 -- e.g. an Inductor failure: this impl's cells say so
                failed[impl] = _short(e)
                self._cleanup()
        for protocol in args.protocols:
            if protocol in ("stream", "host"):
                self._interleaved(shape, config, mode, protocol, (impls, calls, blocks, xg), failed)
                continue
            for impl in impls:
                if impl in failed:
                    self._record(shape, config, mode, impl, protocol, None, failed[impl])
                    continue
                self.progress.status(f"{mode} {impl} {protocol}")
                call, captured = calls[impl]
                if protocol == "flushed":
                    assert self.flush is not None
                    timing = functools.partial(time_flushed, call, args.iters, args.warmup, self.flush)
                else:
                    timing = functools.partial(time_graph, captured, args.iters, args.warmup)
                value, error = self._timed(impl, config, blocks[impl], xg, timing)
                self._record(shape, config, mode, impl, protocol, value, error)
        del calls, xg

    def _timed(
        self, impl: str, config: str, block: nn.Module, xg: Optional[Tensor], body: Callable[[], Any]
    ) -> Tuple[Any, Optional[str]]:
        """One measurement of ``impl`` under its flags: ``(body's result, None)``, or
        ``(None, message)`` where it raised (a failed capture, out of memory: recorded in
        this impl's cells while the run goes on). The gradients the measured calls left are
        cleared either way."""
        try:
            with self._flags(impl, config):
                return body(), None
        except Exception as e:  # noqa: BLE001 -- recorded in this impl's cells
            with contextlib.suppress(Exception):
                self._cleanup()
            return None, _short(e)
        finally:
            for p in block.parameters():
                p.grad = None
            if xg is not None:
                xg.grad = None

    def _interleaved(
        self,
        shape: Shape,
        config: str,
        mode: str,
        protocol: str,
        run: Tuple[List[str], Dict[str, Any], Dict[str, nn.Module], Optional[Tensor]],
        failed: Dict[str, str],
    ) -> None:
        """`stream` and `host`, the protocols the host bounds at small sizes: the
        implementations take turns, a batch each per round for BATCHES rounds (the first
        of each round rotating), so that a drift of the machine's speed over the seconds a
        case takes falls on all of them alike (a build's host time was seen to move by a
        third between runs on the H100 machine). The value: the median of an
        implementation's batches (`stream`) or of all its calls (`host`)."""
        args = self.args
        impls, calls, blocks, xg = run
        if not impls:
            return
        errors = dict(failed)
        samples: Dict[str, List[float]] = {impl: [] for impl in impls}

        def measure(impl: str, what: str, body: Callable[[], None]) -> None:
            self.progress.status(f"{mode} {impl} {protocol} {what}")
            _, error = self._timed(impl, config, blocks[impl], xg, body)
            if error is not None:
                errors[impl] = error

        def warm(call: Callable[[], Any]) -> None:
            for _ in range(args.warmup):
                call()
            _sync(self.device)

        for impl in impls:
            if impl not in errors:
                measure(impl, "warm-up", functools.partial(warm, calls[impl][0]))
        host_per_turn = max(1, math.ceil(args.iters / BATCHES))

        def take(impl: str, call: Callable[[], Any]) -> None:
            if protocol == "stream":
                samples[impl].append(stream_batch(call, args.iters, self.device))
            else:
                samples[impl].extend(host_calls(call, host_per_turn, self.device))

        for turn in range(BATCHES):
            for impl in impls[turn % len(impls) :] + impls[: turn % len(impls)]:
                if impl in errors:
                    continue
                measure(impl, f"turn {turn + 1}", functools.partial(take, impl, calls[impl][0]))
        for impl in impls:
            value = statistics.median(samples[impl]) if impl not in errors and samples[impl] else None
            self._record(shape, config, mode, impl, protocol, value, errors.get(impl))

    def _check(self, shape: Shape, config: str, pair: Pair, x: Tensor, dy: Tensor) -> Dict[str, Any]:
        """Ours against eager, once per shape and configuration: the output's relative error,
        and with fwdbwd the input's and the Linear weight's gradients'. Reported, not judged."""
        result = self._base(shape, config)
        result["error"] = None
        try:
            with torch.no_grad():
                with _same_rng(x.device):
                    y_ours = pair.ours(x)
                with self._flags("eager", config), _same_rng(x.device):
                    y_ref = pair.plain(x)
            result["rel_err_y"] = rel_err(y_ours, y_ref)
            del y_ours, y_ref
            if "fwdbwd" in self.args.modes:
                grads = []
                for impl, block in (("ours", pair.ours), ("eager", pair.plain)):
                    xg = x.detach().clone().requires_grad_(True)
                    with self._flags(impl, config), _same_rng(x.device):
                        block(xg).backward(dy)
                    grads.append((xg.grad, _first_linear_weight(block).grad))
                    for p in block.parameters():
                        p.grad = None
                (dx, dw), (dx_ref, dw_ref) = grads
                result["rel_err_dx"] = rel_err(dx, dx_ref)
                result["rel_err_dw"] = rel_err(dw, dw_ref)
            if "fwdbwd_nodx" in self.args.modes:
                # The weight's gradient where the input needs none (ours skips dX then).
                dws = []
                for impl, block in (("ours", pair.ours), ("eager", pair.plain)):
                    with self._flags(impl, config), _same_rng(x.device):
                        block(x.detach()).backward(dy)
                    dws.append(_first_linear_weight(block).grad)
                    for p in block.parameters():
                        p.grad = None
                result["rel_err_dw_nodx"] = rel_err(*dws)
        except Exception as e:  # noqa: BLE001 -- reported in the correctness column
            result["error"] = _short(e)
        return result


# ---------------------------------------------------------------- report


def _fmt(v: Optional[float]) -> str:
    if v is None or not math.isfinite(v):
        return "-"
    if v >= 100:
        return f"{v:.1f}"
    return f"{v:.3f}" if v >= 1 else f"{v:.4f}"


@functools.lru_cache(maxsize=1)
def _torchao() -> Optional[ModuleType]:
    """``torchao.float8`` where torchao is installed, else None (its peers are then left out)."""
    try:
        import torchao.float8 as float8
    except ImportError:
        return None
    return float8


def _ratio(row: Dict[str, Optional[float]]) -> Optional[float]:
    """min(eager, compile) / ours: above 1, ours is faster than the faster peer."""
    peers = [row[k] for k in ("eager", "compile") if row.get(k)]
    ours = row.get("ours")
    return min(peers) / ours if peers and ours else None  # type: ignore[type-var]


def _tables(result: Dict[str, Any]) -> Tuple[List[str], List[Tuple[str, str, str, List[float], int]]]:
    """The per-(protocol, config, mode) tables, and for the summary the ratios of each."""
    rows = result["rows"]
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
    check = {(c["model"], c["rows"], c["in"], c["out"], c["config"]): c for c in result["correctness"]}
    out: List[str] = []
    summary = []
    defs = result["protocols"]
    for protocol in result["meta"]["protocols"]:
        out += [f"## {protocol}", "", defs.get(protocol, ""), ""]
        for config in result["meta"]["configs"]:
            for mode in result["meta"]["modes"]:
                cell = [
                    r for r in rows if (r["protocol"], r["config"], r["mode"]) == (protocol, config, mode)
                ]
                if not cell:
                    continue
                unit = PROTOCOL_UNITS[protocol]
                cell_impls = [i for i in impls if any(r["impl"] == i for r in cell)]
                err_key, err_name = {
                    "fwd": ("rel_err_y", "rel err y"),
                    "fwdbwd": ("rel_err_dx", "rel err dx"),
                }.get(mode, ("rel_err_dw_nodx", "rel err dW"))
                head = [
                    "model",
                    "rows",
                    "in",
                    "out",
                    *(f"{i} {unit}" for i in cell_impls),
                    "x best",
                    err_name,
                ]
                out += [
                    f"### {protocol}, {config}, {mode} ({unit}; lower is better, x best = "
                    "min(eager, compile) / ours)",
                    "",
                ]
                out += [
                    "| " + " | ".join(head) + " |",
                    "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|",
                ]
                lines: Dict[Tuple[str, int, int, int], Dict[str, Any]] = {}
                notes: List[str] = []
                for r in cell:
                    key = (r["model"], r["rows"], r["in"], r["out"])
                    line = lines.setdefault(key, {})
                    line[r["impl"]] = r["value"]
                    if r["error"] is not None:
                        line[r["impl"] + "!"] = r["error"]
                ratios = []
                for key, line in lines.items():
                    cells = []
                    for impl in cell_impls:
                        error = line.get(impl + "!")
                        if error is None:
                            cells.append(_fmt(line.get(impl)))
                        elif error.startswith("skipped"):
                            cells.append("skip")
                        else:
                            notes.append(f"- {key[0]} {key[1]}x{key[2]}x{key[3]} {impl}: {error}")
                            cells.append(f"err[{len(notes)}]")
                    ratio = _ratio(line)
                    if ratio is not None:
                        ratios.append(ratio)
                    c = check.get((*key, config), {})
                    err = c.get(err_key)
                    model = key[0]
                    out.append(
                        "| "
                        + " | ".join(
                            [
                                model,
                                str(key[1]),
                                str(key[2]),
                                str(key[3]),
                                *cells,
                                f"{ratio:.2f}" if ratio else "-",
                                f"{err:.1e}" if isinstance(err, float) else "-",
                            ]
                        )
                        + " |"
                    )
                out.append("")
                if notes:
                    out += ["Errors:", "", *notes, ""]
                summary.append((protocol, config, mode, ratios, len(lines)))
    return out, summary


def markdown(result: Dict[str, Any]) -> str:
    """The report: a header (device, versions, protocol and configuration definitions, the
    chains), one table per (protocol, config, mode), and a summary table last."""
    meta = result["meta"]
    comp = meta["compile"]
    compile_text = (
        "off"
        if not comp["enabled"]
        else f"mode {comp['mode']}, {'dynamic batch (mark_dynamic)' if comp['dynamic'] else 'static shapes'}"
    )
    out = [
        "# fused_linear benchmark",
        "",
        f"{meta['device_name']} ({meta['device']}), torch {meta['torch']}, "
        f"fused_linear {meta['fused_linear']}, {meta['date']}. torch.compile: {compile_text}. "
        f"--iters {meta['iters']}, --warmup {meta['warmup']}.",
        "",
        "Configurations:",
        "",
        *(f"- `{c}`: {CONFIG_DEFS[c]}" for c in meta["configs"]),
        "",
        "Chains:",
        "",
    ]
    chains: Dict[str, set] = {}
    for r in result["rows"]:
        chains.setdefault(r["model"], set()).add(r["chain"])
    out += [f"- {model}: {', '.join(f'`{c}`' for c in sorted(cs))}" for model, cs in chains.items()]
    out.append("")
    for note in meta.get("notes", []):
        out += [f"Note: {note}", ""]
    tables, summary = _tables(result)
    out += tables
    out += [summary_markdown(summary), ""]
    return "\n".join(out)


def summary_markdown(summary: Sequence[Tuple[str, str, str, List[float], int]]) -> str:
    """Per (protocol, config, mode): how many shapes ours won, and the geometric mean, smallest
    and largest of min(eager, compile) / ours."""
    out = [
        "## Summary: min(eager, compile) / ours (above 1: ours faster)",
        "",
        "| protocol | config | mode | shapes | ours faster | geomean | min | max |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for protocol, config, mode, ratios, n in summary:
        if ratios:
            geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
            wins = sum(r > 1 for r in ratios)
            stats = [f"{wins}/{len(ratios)}", f"{geo:.2f}", f"{min(ratios):.2f}", f"{max(ratios):.2f}"]
        else:
            stats = ["-", "-", "-", "-"]
        out.append(f"| {protocol} | {config} | {mode} | {n} | " + " | ".join(stats) + " |")
    return "\n".join(out)


# ---------------------------------------------------------------- arguments


def _comma_list(allowed: Sequence[str], what: str) -> Callable[[str], Tuple[str, ...]]:
    def parse(text: str) -> Tuple[str, ...]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(bad) or '(none given)'}; choose from {', '.join(allowed)}"
            )
        return tuple(dict.fromkeys(items))

    return parse


def _int_list(text: str) -> Tuple[int, ...]:
    try:
        values = tuple(dict.fromkeys(int(t) for t in text.split(",") if t.strip()))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"`{text}`: expected comma-separated integers, e.g. 1,64,1024"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"`{text}`: every value must be at least 1")
    return values


def _features_list(text: str) -> Tuple[Tuple[int, int], ...]:
    pairs = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        m = re.fullmatch(r"(\d+)[xX](\d+)", item)
        if m is None or min(int(m.group(1)), int(m.group(2))) < 1:
            raise argparse.ArgumentTypeError(f"`{item}`: expected INxOUT with positive sizes, e.g. 1024x4096")
        pairs.append((int(m.group(1)), int(m.group(2))))
    if not pairs:
        raise argparse.ArgumentTypeError("expected at least one INxOUT, e.g. 1024x1024,4096x4096")
    return tuple(dict.fromkeys(pairs))


def _count(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"`{text}` is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fused_linear.bench",
        description="Time FusedLinear against PyTorch eager and torch.compile of the same block "
        "(same process, same weights), forward and forward+backward, through several protocols.",
        epilog=__doc__.split("Usage::", 1)[1].split("Results go", 1)[0].rstrip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="cuda (default), or cpu: a smoke test"
    )
    p.add_argument(
        "--configs",
        type=_comma_list(CONFIGS, "config"),
        help=f"comma list of {', '.join(CONFIGS)} (default: all on cuda, fp32 on cpu)",
    )
    p.add_argument(
        "--modes",
        type=_comma_list(MODES, "mode"),
        default=DEFAULT_MODES,
        help="fwd,fwdbwd (default both); fwdbwd_nodx: a training step whose input needs no gradient",
    )
    p.add_argument(
        "--protocols",
        type=_comma_list(PROTOCOLS, "protocol"),
        help=f"comma list of {', '.join(PROTOCOLS)} (default: all on cuda, {','.join(CPU_PROTOCOLS)} on cpu)",
    )
    p.add_argument(
        "--shapes",
        choices=SHAPE_SETS,
        help="seed: the presets at their KernelBench sizes; sweep: --sweep-chain over --rows and --features; "
        "all: both (default on cuda); tiny: small shapes (default on cpu); none: only --kernelbench's "
        "problems (the default with --kernelbench)",
    )
    p.add_argument(
        "--models",
        type=_comma_list(tuple(PRESETS), "model"),
        default=tuple(PRESETS),
        help="presets for seed/tiny shapes (default M1,M2,M3,M4,M5)",
    )
    p.add_argument(
        "--rows", type=_int_list, help=f"sweep batch rows (default {','.join(map(str, SWEEP_ROWS))})"
    )
    p.add_argument(
        "--features",
        type=_features_list,
        help="sweep sizes INxOUT, comma list (default "
        + ",".join(f"{i}x{o}" for i, o in SWEEP_FEATURES)
        + ")",
    )
    p.add_argument(
        "--sweep-chain",
        default=DEFAULT_SWEEP_CHAIN,
        help="the sweep's chain; {groups} is out/32 (32 channels per group), {out} the width "
        f"(default {DEFAULT_SWEEP_CHAIN!r})",
    )
    p.add_argument("--iters", type=_count(1), default=20, help="timed calls per measurement (20)")
    p.add_argument("--warmup", type=_count(0), default=5, help="untimed calls before each measurement (5)")
    p.add_argument("--compile-mode", choices=COMPILE_MODES, default="default", help="torch.compile's mode")
    p.add_argument(
        "--compile-dynamic",
        action="store_true",
        help="compile once per (chain, in, out, config) with the batch dimension dynamic (mark_dynamic), "
        "instead of once per shape with static shapes: much less compile time on sweeps",
    )
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    p.add_argument(
        "--kernelbench",
        type=Path,
        metavar="DIR",
        help="also time the KernelBench problem files' ModelNew (fuse(Model) where a file has none) "
        "against Model (e.g. examples/kernelbench)",
    )
    p.add_argument(
        "--problems",
        type=_int_list,
        help="with --kernelbench: only these problem numbers, comma list (e.g. 30,84)",
    )
    p.add_argument(
        "--fuse",
        action="store_true",
        help="with --kernelbench: ours is fused_linear.fuse(Model), and any *.py with a Model counts "
        "(KernelBench's own files)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and inputs (0)")
    p.add_argument("--json", default="bench.json", metavar="PATH", help="results as JSON ('' to skip)")
    p.add_argument(
        "--markdown", default="bench.md", metavar="PATH", help="the tables as markdown ('' to skip)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar: one line per finished case")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parses and completes the arguments: device-dependent defaults, and the CPU's limits
    (fp32 only; stream and host only) applied with a note rather than an error where the rest
    of the request still makes sense."""
    p = build_parser()
    args = p.parse_args(argv)
    cpu = args.device == "cpu"
    args.notes = []
    if not cpu and not torch.cuda.is_available():
        p.error("no CUDA device here (torch.cuda.is_available() is False); use --device cpu for a smoke test")
    if args.configs is None:
        args.configs = CPU_CONFIGS if cpu else CONFIGS
    if args.protocols is None:
        args.protocols = CPU_PROTOCOLS if cpu else PROTOCOLS
    if cpu:
        for name, allowed, why in (
            (
                "configs",
                CPU_CONFIGS,
                "the CPU backend is FP32 whatever the precision, and runs no bf16 model",
            ),
            ("protocols", CPU_PROTOCOLS, "CUDA events, L2 flushes and CUDA graphs need a GPU"),
        ):
            kept = tuple(v for v in getattr(args, name) if v in allowed)
            dropped = [v for v in getattr(args, name) if v not in allowed]
            if not kept:
                p.error(f"--device cpu runs --{name} {','.join(allowed)} only ({why})")
            if dropped:
                args.notes.append(f"--device cpu: {name} {', '.join(dropped)} skipped ({why})")
            setattr(args, name, kept)
    if args.shapes is None:
        # With --kernelbench the problems alone, unless shapes are asked for too.
        args.shapes = "none" if args.kernelbench is not None else "tiny" if cpu else "all"
    if args.kernelbench is not None and not args.kernelbench.is_dir():
        p.error(f"--kernelbench {args.kernelbench}: not a directory")
    if args.kernelbench is not None and not problem_files(args.kernelbench, args.fuse):
        p.error(f"--kernelbench {args.kernelbench}: no KernelBench problem files there")
    if args.shapes == "none" and args.kernelbench is None:
        p.error("--shapes none times only --kernelbench's problems: give --kernelbench DIR")
    if args.problems and args.kernelbench is None:
        p.error("--problems picks among --kernelbench's problem files: give --kernelbench DIR")
    if args.kernelbench is not None and args.problems:
        numbers = {problem_number(f) for f in problem_files(args.kernelbench, args.fuse)}
        missing = sorted(set(args.problems) - numbers)
        if missing:
            p.error(f"--problems {','.join(map(str, missing))}: no such problem file in {args.kernelbench}")
    if args.fuse and args.kernelbench is None:
        p.error("--fuse times fuse(Model) of --kernelbench's problem files: give --kernelbench DIR")
    if args.shapes in ("sweep", "all", "tiny"):
        default_features = TINY_FEATURES if args.shapes == "tiny" else SWEEP_FEATURES
        for fin, fout in args.features or default_features:
            try:
                _native.describe(fin, fout, sweep_chain(args.sweep_chain, fout))
            except (KeyError, IndexError, ValueError) as e:
                p.error(f"--sweep-chain {args.sweep_chain!r} at {fin}x{fout}: {e}")
    return args


def select_shapes(args: argparse.Namespace) -> List[Shape]:
    shapes: List[Shape] = []
    tiny = args.shapes == "tiny"
    if args.shapes in ("seed", "all", "tiny"):
        shapes += preset_shapes(args.models, tiny)
    if args.shapes in ("sweep", "all", "tiny"):
        rows = args.rows or (TINY_ROWS if tiny else SWEEP_ROWS)
        features = args.features or (TINY_FEATURES if tiny else SWEEP_FEATURES)
        shapes += sweep_shapes(args.sweep_chain, rows, features)
    if args.kernelbench is not None:
        # On the CPU the problems run at their small scale (1/32 of the seed sizes by default).
        scale = None if args.device == "cpu" else 1
        shapes += kernelbench_shapes(args.kernelbench, scale, args.fuse, args.problems)
    return shapes


def metadata(args: argparse.Namespace, argv: Sequence[str]) -> Dict[str, Any]:
    device = torch.device(args.device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine() or "cpu"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "fused_linear": _fused_linear_version,
        "python": platform.python_version(),
        "device": args.device,
        "device_name": name,
        "argv": list(argv),
        "args": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items() if k != "notes"},
        "compile": {
            "enabled": not args.no_compile,
            "mode": args.compile_mode,
            "dynamic": bool(args.compile_dynamic),
            "how": "torch.compile(plain, dynamic=None) once per (chain, in, out, config), the batch dim "
            "marked dynamic (a batch of 1 compiles apart)"
            if args.compile_dynamic
            else "torch.compile(plain, dynamic=False), torch._dynamo.reset() before each case",
        },
        "configs": list(args.configs),
        "modes": list(args.modes),
        "protocols": list(args.protocols),
        "iters": args.iters,
        "warmup": args.warmup,
        "notes": list(args.notes),
    }


def _write(path: str, text: str) -> None:
    if path:
        folder = os.path.dirname(path)
        if folder:
            os.makedirs(folder, exist_ok=True)
        with open(path, "w") as f:
            f.write(text)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the benchmark; returns 0 (130 when interrupted by Ctrl-C or SIGTERM: what was
    measured is still written)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    for note in args.notes:
        print(f"note: {note}", file=sys.stderr)
    if not args.no_compile:
        # Every case recompiles; never let Dynamo give up and fall back to eager in silence.
        for name in (
            "cache_size_limit",
            "recompile_limit",
            "accumulated_cache_size_limit",
            "accumulated_recompile_limit",
        ):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 1024))
    shapes = select_shapes(args)
    total = len(shapes) * len(args.configs) * len(args.modes)
    progress = Progress(total, bar=not args.no_progress and sys.stderr.isatty())
    bench = Bench(args, progress)
    meta = metadata(args, argv)
    status = 0
    t0 = time.perf_counter()
    # SIGTERM (`timeout`, a job scheduler) stops the run as Ctrl-C does: what was measured
    # is still written.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        bench.run(shapes)
    except KeyboardInterrupt:
        meta["notes"].append("interrupted: the results are partial")
        status = 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        progress.close()
    meta["elapsed_s"] = round(time.perf_counter() - t0, 1)
    result = {
        "meta": meta,
        "protocols": protocol_definitions(bench.device),
        "rows": bench.rows,
        "correctness": bench.correctness,
        "skipped": bench.skipped,
    }
    _write(args.json, json.dumps(result, indent=1, default=str) + "\n")
    report = markdown(result)
    _write(args.markdown, report)
    print(report)
    written = [p for p in (args.json, args.markdown) if p]
    if written:
        print(f"wrote {', '.join(written)}", file=sys.stderr)
    return status


if __name__ == "__main__":
    raise SystemExit(main())

"""Fused Linear + epilogue blocks (GroupNorm, Swish, Mish, GELU, ...) as a PyTorch op.

The kernels and the host that launches them are written in Rust (`fused_linear._native`).
This package registers them as the custom ops `torch.ops.fused_linear.forward` and
`torch.ops.fused_linear.backward`, with autograd between them, and offers
:func:`fused_linear` (functional) and :class:`FusedLinear` (an ``nn.Module``).

On CUDA the op reads and writes the tensors' memory where it is, runs on
``torch.cuda.current_stream()`` and allocates every buffer through PyTorch's caching
allocator, so it can be captured in a CUDA graph. CPU tensors run the CPU backend in
their own dtype (float32 or float64).
"""

import functools
import re
import weakref
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn
from torch._C._functorch import peek_interpreter_stack as _functorch_level
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode

from . import _native

__all__ = [
    "PRECISIONS",
    "PRESETS",
    "FusedLinear",
    "clear_fp8_cache",
    "fuse",
    "fused_linear",
    "kernel_image",
    "release_buffers",
]
__version__ = _native.__version__

#: The GEMMs' arithmetic (the epilogue is always FP32): strict FP32 on the FMA units;
#: 3xTF32 on the tensor cores (FP32-level accuracy); TF32; bf16 operands, FP32 accumulation.
PRECISIONS = ("fp32", "tf32x3", "tf32", "bf16", "fp16", "fp8", "fp8_gw_bf16")

#: The five reference blocks' chains (KernelBench level 2: #88, #37, #62, #98, #94).
PRESETS: Dict[str, str] = {
    "M1": "groupnorm(256),swish,mul,swish",
    "M2": "swish,bias,groupnorm(64)",
    "M3": "groupnorm(512),leakyrelu(0.01),double",
    "M4": "avgpool(16),gelu,scale(2),max",
    "M5": "bias,hardtanh(-1,1),mish,groupnorm(256)",
}

_ALIGNMENT = 16

#: The 16-bit model dtypes the GPU kernels read as stored, and their precision.
_HALF = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@functools.lru_cache(maxsize=512)
def _describe(in_features: int, out_features: int, ops: str):
    """(output shape after the batch, z's width on the GPU, on the CPU, ops, params)."""
    return _native.describe(in_features, out_features, ops)


def _batch_norm_in(canonical: List[str]) -> bool:
    """Whether a chain (its ops in canonical form, `_describe`'s) holds a BatchNorm on batch
    statistics (written `batchnorm` or `bn`)."""
    return any(op.startswith("batchnorm") for op in canonical)


@functools.lru_cache(maxsize=64)
def _allocator(device: torch.device, dtype: torch.dtype):
    """Buffers for the Rust side, from PyTorch's allocator, made in the shape (a tuple, or
    a length) the Rust side will use: kind 0 holds `dtype` values
    (float32 for a 16-bit block), kind 1 bytes, kind 2 bfloat16 values, kind 3 float16
    values (the returned tensor owns the memory for as long as Rust keeps it). One per
    device and dtype, made once."""

    # A 16-bit block's float32 buffers (z, the small gradients) are kind 0 too.
    wide = torch.float32 if dtype in _HALF else dtype
    kinds = (wide, torch.uint8, torch.bfloat16, torch.float16)
    empty = torch.empty

    def allocate(shape, kind: int) -> Tensor:
        return empty(shape, dtype=kinds[kind], device=device)

    return allocate


# The raw handle of PyTorch's current stream on a device, without building a
# `torch.cuda.Stream` object per call (that alone cost ~10 us of a small call).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream(x: Tensor) -> int:
    if not x.is_cuda:
        return 0
    if _raw_stream is not None:
        return _raw_stream(x.get_device())
    return torch.cuda.current_stream(x.device).cuda_stream


def _run_forward(
    x: Tensor,
    weight: Tensor,
    bias: Tensor,
    params: List[Tensor],
    ops: str,
    precision: str,
    save: bool,
    fp8_weight: Optional[List[Tensor]] = None,
):
    return _native.forward(
        x,
        weight,
        bias,
        params,
        ops,
        precision,
        _stream(x),
        _allocator(x.device, x.dtype),
        save=save,
        fp8_weight=fp8_weight,
    )


def _run_backward(x, weight, bias, params, z, dy, ops: str, precision: str, fp8_weight=None, input_grad=True):
    """`(dx, dweight, dbias, dparams)`; `dx` is None without `input_grad` on the GPU, which
    then skips the dX GEMM (an input that needs no gradient: a model's first layer)."""
    if not dy.is_contiguous() or (dy.is_cuda and dy.data_ptr() % _ALIGNMENT):
        # Gradients arrive as autograd makes them (expanded, offset views): dense them.
        dy = dy.contiguous().clone()
    return _native.backward(
        x,
        weight,
        bias,
        params,
        z,
        dy,
        ops,
        precision,
        _stream(x),
        _allocator(x.device, x.dtype),
        fp8_weight=fp8_weight,
        input_grad=input_grad,
    )


#: Each fp8 weight's quantised copies (:func:`_fp8_weight`), by the weight's ``id``; an
#: entry goes when its weight does (a ``WeakKeyDictionary`` would compare tensors with ``==``).
_FP8_CACHE: Dict[int, Tuple[tuple, List[Tensor]]] = {}
#: The ids whose weights have a finaliser dropping their entry (registered once each).
_FP8_WATCHED: set = set()


def _forget_fp8(key: int) -> None:
    _FP8_CACHE.pop(key, None)
    _FP8_WATCHED.discard(key)


def _fp8_weight(weight: Tensor, precision: str, ops: str) -> Optional[List[Tensor]]:
    """A CUDA weight quantised for the fp8 GEMMs, once per version of it: the forward's
    copy (by rows, with its scales), the same bytes transposed for ``dX``, and the factors
    that move its scales onto ``dZ``'s columns there. The cache
    entry is keyed by the weight's storage address, dtype, shape and version counter, which
    every in-place write through the weight or its views bumps (optimizer steps,
    ``copy_``, ``load_state_dict``): a changed weight is quantised again before use. Writes
    through ``weight.data`` bypass the counter; :func:`clear_fp8_cache` after them. None
    where the kernels quantise per call instead (not fp8, not CUDA, a shape they refuse,
    a leading AvgPool, which the block folds into the weight before quantising)."""
    if not precision.startswith("fp8") or not weight.is_cuda or weight.dim() != 2:
        return None
    n, k = weight.shape
    if n % 16 or k % 16 or weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    if _describe(int(k), int(n), ops)[1] != n:  # the GPU's GEMM is narrower: a folded AvgPool
        return None
    key = (weight.data_ptr(), weight._version, weight.dtype, tuple(weight.shape))
    hit = _FP8_CACHE.get(id(weight))
    if hit is not None and hit[0] == key:
        return hit[1]
    with torch.no_grad():
        w = weight.detach()
        quantised = _native.fp8_weight(w, _stream(w), _allocator(w.device, w.dtype))
    if id(weight) not in _FP8_WATCHED:
        weakref.finalize(weight, _forget_fp8, id(weight))
        _FP8_WATCHED.add(id(weight))
    _FP8_CACHE[id(weight)] = (key, quantised)
    return quantised


def kernel_image(device: Union[int, str, torch.device, None] = None) -> str:
    """Which image of the kernels a CUDA device runs (opening it if needed): ``"cubin"``,
    assembled by CUDA's ``ptxas`` when the wheel was built, which loads at once; or
    ``"ptx"``, which the driver compiles before the first launch (up to a minute on a
    machine whose CUDA cache does not hold it yet; a ``RuntimeWarning`` says so once).
    Build the wheel with ``PTXAS`` set to get the cubin. ``device``: an index, ``"cuda:N"``
    or a ``torch.device``; default the current CUDA device."""
    if device is None:
        index = torch.cuda.current_device()
    else:
        d = torch.device(device if not isinstance(device, int) else f"cuda:{device}")
        if d.type != "cuda":
            raise ValueError(f"kernel_image: {device!r} is not a CUDA device")
        index = d.index if d.index is not None else torch.cuda.current_device()
    return _native.kernel_image(index)


def release_buffers() -> None:
    """Gives back the memory the GPU calls keep between calls: small temporary buffers
    (up to 32 MB per stream) and the small tables their kernels read, kept so that the
    next call on the stream does not allocate and write them again. They stay
    allocated in PyTorch's caching allocator until released; ``torch.cuda.empty_cache()``
    afterwards returns the memory to the device. The next calls allocate afresh."""
    _native.release_buffers()


def clear_fp8_cache() -> None:
    """Drops every cached fp8 weight: needed only after writing a weight through
    ``.data`` (which PyTorch's version counter does not see); the next call quantises
    again."""
    _FP8_CACHE.clear()


@torch.library.custom_op("fused_linear::forward", mutates_args=())
def _forward_op(
    x: Tensor, weight: Tensor, bias: Tensor, params: List[Tensor], ops: str, precision: str
) -> Tuple[Tensor, Tensor]:
    """`(y, z)`: the block's output and the state its backward takes."""
    return _run_forward(x, weight, bias, params, ops, precision, True)


@_forward_op.register_fake
def _forward_fake(x, weight, bias, params, ops, precision):
    out_shape, gpu_width, cpu_width, canonical, _ = _describe(int(x.shape[1]), int(weight.shape[0]), ops)
    y = x.new_empty((x.shape[0], *out_shape))
    # A 16-bit model's saved z is float32; a BatchNorm's batch statistics are two more rows.
    z_dtype = torch.float32 if x.dtype in _HALF else x.dtype
    rows = x.shape[0] + (2 if _batch_norm_in(canonical) else 0)
    z = x.new_empty((rows, gpu_width if x.device.type == "cuda" else cpu_width), dtype=z_dtype)
    return y, z


@torch.library.custom_op("fused_linear::inference", mutates_args=())
def _inference_op(
    x: Tensor, weight: Tensor, bias: Tensor, params: List[Tensor], ops: str, precision: str
) -> Tensor:
    """The block's output alone: nothing is saved for a backward (no gradient wanted)."""
    return _run_forward(x, weight, bias, params, ops, precision, False)[0]


@_inference_op.register_fake
def _inference_fake(x, weight, bias, params, ops, precision):
    out_shape = _describe(int(x.shape[1]), int(weight.shape[0]), ops)[0]
    return x.new_empty((x.shape[0], *out_shape))


@torch.library.custom_op("fused_linear::backward", mutates_args=())
def _backward_op(
    x: Tensor,
    weight: Tensor,
    bias: Tensor,
    params: List[Tensor],
    z: Tensor,
    dy: Tensor,
    ops: str,
    precision: str,
) -> List[Tensor]:
    """`[dx, dweight, dbias, *dparams]` from the forward's `z` and the output's gradient `dy`."""
    dx, dw, db, dparams = _run_backward(x, weight, bias, params, z, dy, ops, precision)
    return [dx, dw, db, *dparams]


@_backward_op.register_fake
def _backward_fake(x, weight, bias, params, z, dy, ops, precision):
    return [torch.empty_like(t) for t in (x, weight, bias, *params)]


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, params, ops, precision = inputs
    _, z = output
    ctx.save_for_backward(x, weight, bias, z, *params)
    ctx.ops, ctx.precision = ops, precision
    ctx.mark_non_differentiable(z)


def _backward_rule(ctx, grad_y: Tensor, grad_z: Optional[Tensor]):
    x, weight, bias, z, *params = ctx.saved_tensors
    dx, dw, db, *dparams = torch.ops.fused_linear.backward(
        x, weight, bias, params, z, grad_y, ctx.ops, ctx.precision
    )
    return dx, dw, db, dparams, None, None


_forward_op.register_autograd(_backward_rule, setup_context=_setup_context)


class _Eager(torch.autograd.Function):
    """The same forward and backward as the custom ops, called directly: in eager mode
    the dispatcher's round trips through Python cost more host time per call than the
    block's own work at small sizes. Taken only where nothing traces or transforms the
    call (:func:`_plain_eager`); everything else goes through the registered ops."""

    @staticmethod
    def forward(ctx, x, weight, bias, ops, precision, *params):
        fp8 = _fp8_weight(weight, precision, ops)
        y, z = _run_forward(x, weight, bias, list(params), ops, precision, True, fp8)
        ctx.save_for_backward(x, weight, bias, z, *params)
        ctx.ops, ctx.precision, ctx.fp8 = ops, precision, fp8
        ctx.mark_non_differentiable(z)
        # z's gradient is never used: not materialised as zeros (the size of z each step).
        ctx.set_materialize_grads(False)
        return y, z

    @staticmethod
    def backward(ctx, dy, _dz):
        if dy is None:  # y unused by the loss: every gradient is zero
            return (None,) * (5 + len(ctx.saved_tensors) - 4)
        x, weight, bias, z, *params = ctx.saved_tensors
        # No dX where x needs no gradient (a first layer's data): the GPU skips its GEMM.
        input_grad = ctx.needs_input_grad[0]
        dx, dw, db, dparams = _run_backward(
            x, weight, bias, params, z, dy, ctx.ops, ctx.precision, ctx.fp8, input_grad=input_grad
        )
        return (dx, dw, db, None, None, *dparams)


_PLAIN = (Tensor, nn.Parameter)


def _plain_eager(x: Tensor, weight: Tensor, bias: Tensor, params: List[Tensor]) -> bool:
    """Whether this call runs eagerly on plain tensors: not under torch.compile or export,
    no dispatch mode (fake tensors, functionalisation), no functorch transform, no
    tensor subclass other than nn.Parameter."""
    # is_compiling first: under Dynamo it is a constant and the rest is not traced.
    return (
        not torch.compiler.is_compiling()
        and type(x) in _PLAIN
        and type(weight) in _PLAIN
        and type(bias) in _PLAIN
        and all(type(p) in _PLAIN for p in params)
        and _current_dispatch_mode() is None
        and _functorch_level() is None
    )


def fused_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor,
    ops: str,
    params: Sequence[Tensor] = (),
    precision: Optional[str] = None,
) -> Tensor:
    """``chain(x @ weight.T + bias)`` in as few kernels as the chain allows.

    ``x`` is ``(*, in_features)``: leading dimensions are flattened into the batch (each
    row is one sample; a GroupNorm normalises a row's channels, as ``nn.GroupNorm`` does
    on ``(N, C)``). ``ops`` is the chain (e.g. ``"groupnorm(256),swish,mul,swish"``),
    ``params`` its parameters in chain order, ``precision`` one of :data:`PRECISIONS`
    (default: ``"fp32"`` for float tensors, ``"bf16"`` for bfloat16 ones, ``"fp16"`` for
    float16 ones).
    Returns ``(*, F)``, or ``(*)`` when the chain reduces each row (``max``, ``sum``, ...).

    A bf16 model (``x`` and ``weight`` in ``torch.bfloat16``) stays bf16 on CUDA: the
    GEMMs read ``x`` and ``weight`` as they are and the output and the gradients of
    ``x`` and ``weight`` come back in bf16; the bias and the chain's parameters (bf16
    or float32) enter the FP32 epilogue widened, and their gradients come back in their
    own dtype. An fp16 model (``torch.float16``) is served the same way by the fp16
    kernels. On the CPU a 16-bit block runs on float32 copies, its output rounded once.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    params = list(params)
    for dtype in _HALF:
        if x.dtype == dtype or (isinstance(weight, Tensor) and weight.dtype == dtype):
            return _half_block(x, weight, bias, ops, params, precision, dtype)
    precision = _resolve_precision(x, precision)
    if x.dim() == 2:
        return _apply(x, weight, bias, params, ops, precision)
    if x.dim() == 0:
        raise ValueError("x: expected a tensor of shape (*, in_features), got a scalar")
    if not x.is_contiguous():
        raise ValueError(f"x is not contiguous (shape {tuple(x.shape)}); pass x.contiguous()")
    lead = x.shape[:-1]
    y = _apply(x.view(-1, x.shape[-1]), weight, bias, params, ops, precision)
    return y.view(tuple(lead) + tuple(y.shape[1:]))


def _resolve_precision(x: Tensor, precision: Optional[str]) -> str:
    """The precision asked for, or the tensors' own: bf16 for bfloat16, fp16 for float16,
    else fp32. A 16-bit model's GEMMs read its values as stored (its own precision) or
    quantise them to fp8."""
    own = _HALF.get(x.dtype)
    if precision is None:
        return own or "fp32"
    if precision not in PRECISIONS:
        raise ValueError(f"precision `{precision}` is not one of {', '.join(PRECISIONS)}")
    if own is not None and precision != own and not precision.startswith("fp8"):
        raise ValueError(
            f"precision `{precision}` with {str(x.dtype).removeprefix('torch.')} tensors: a {own} model's "
            f"GEMMs read its {own} values as they are (precision {own}) or quantise them to fp8; leave "
            f"precision unset, pass fp8 or fp8_gw_bf16, or pass float32 tensors for {precision}"
        )
    return precision


def _half_block(
    x: Tensor,
    weight: Tensor,
    bias: Tensor,
    ops: str,
    params: List[Tensor],
    precision: Optional[str],
    dtype: torch.dtype,
) -> Tensor:
    """A 16-bit model's block (bf16 or fp16): x and weight as they are; the bias and the
    chain's parameters (of ``dtype`` or float32) passed as stored: the kernels read 16-bit
    ones as they are (widened on load into the FP32 epilogue, no copy per call) and the op
    returns their gradients in their own dtype, so the autograd graph holds one node per
    block (a BatchNorm on batch statistics included).
    On the CPU (no 16-bit kernels there) the float32 path on copies, the output rounded
    to ``dtype`` once."""
    _check_half_dtypes(x, weight, [bias, *params], dtype)
    precision = _resolve_precision(x, precision)
    if not x.is_cuda:
        wide = [t.float() if isinstance(t, Tensor) else t for t in (bias, *params)]
        fp8 = precision.startswith("fp8")
        y = fused_linear(x.float(), weight.float(), wide[0], ops, wide[1:], precision if fp8 else "fp32")
        return y.to(dtype)
    if x.dim() == 2:
        return _apply(x, weight, bias, params, ops, precision)
    if x.dim() == 0:
        raise ValueError("x: expected a tensor of shape (*, in_features), got a scalar")
    if not x.is_contiguous():
        raise ValueError(f"x is not contiguous (shape {tuple(x.shape)}); pass x.contiguous()")
    lead = x.shape[:-1]
    y = _apply(x.view(-1, x.shape[-1]), weight, bias, params, ops, precision)
    return y.view(tuple(lead) + tuple(y.shape[1:]))


def _check_half_dtypes(x: Tensor, weight: Tensor, rest: List[Tensor], dtype: torch.dtype) -> None:
    """A 16-bit model's tensors: ``x`` and ``weight`` both in ``dtype``, the bias and the
    chain's parameters in ``dtype`` or float32; a ``TypeError`` naming the first that is not."""
    # The common case first, without building the messages (this runs on every call).
    if type(x) in _PLAIN and type(weight) in _PLAIN and x.dtype is dtype and weight.dtype is dtype:
        wide = torch.float32
        for t in rest:
            if isinstance(t, Tensor) and t.dtype is not dtype and t.dtype is not wide:
                break
        else:
            return
    block = f"a {_HALF[dtype]} block"
    convert = ".half()" if dtype == torch.float16 else ".to(torch.bfloat16)"
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, Tensor) or t.dtype != dtype:
            got = t.dtype if isinstance(t, Tensor) else type(t).__name__
            raise TypeError(
                f"{name} has dtype {got}, but {block} takes x and weight both in {dtype} "
                f"(convert the model with {convert}, or pass float32 tensors)"
            )
    for i, t in enumerate(rest):
        if isinstance(t, Tensor) and t.dtype not in (dtype, torch.float32):
            name = "bias" if i == 0 else f"params[{i - 1}]"
            raise TypeError(f"{name} has dtype {t.dtype}; {block} takes {dtype} or float32 parameters")


class _EmptyBatch(torch.autograd.Function):
    """A batch of no rows, as PyTorch's layers take it: an empty output, and gradients
    that are sums over no rows (zeros; `x`'s is empty). Nothing runs on the device."""

    @staticmethod
    def forward(ctx, out_shape, x, weight, bias, *params):
        ctx.save_for_backward(x, weight, bias, *params)
        return x.new_empty((0, *out_shape))

    @staticmethod
    def backward(ctx, dy):
        x, *rest = ctx.saved_tensors
        return (None, torch.zeros_like(x), *(torch.zeros_like(t) for t in rest))


def _empty_batch(x: Tensor, weight: Tensor, bias: Tensor, params: List[Tensor], ops: str) -> Tensor:
    """`x` of shape `(0, in_features)`: the arguments checked as a full batch's are (shapes,
    dtypes, devices, the chain), then :class:`_EmptyBatch`."""
    in_features = int(x.shape[1])
    for name, t in (("weight", weight), ("bias", bias), *((f"params[{i}]", p) for i, p in enumerate(params))):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != x.device:
            raise RuntimeError(
                f"{name} is on {t.device} but x is on {x.device}: "
                "all tensors of the block must be on one device"
            )
    if weight.dim() != 2 or int(weight.shape[1]) != in_features or int(weight.shape[0]) < 1:
        raise ValueError(
            f"weight: expected shape (out_features, {in_features}) to match x's {in_features} features, "
            f"got {tuple(weight.shape)}"
        )
    out_features = int(weight.shape[0])
    try:
        out_shape, _, _, _, specs = _describe(in_features, out_features, ops)
    except ValueError as e:
        raise ValueError(f"ops: {e}") from None
    if tuple(bias.shape) != (out_features,):
        raise ValueError(
            f"bias: expected shape ({out_features},) (out_features, as the weight's rows), "
            f"got {tuple(bias.shape)}"
        )
    if len(params) != len(specs):
        names = ", ".join(name for name, _, _ in specs) or "none"
        raise ValueError(
            f"params: the chain `{ops}` takes {len(specs)} tensor(s) ({names}), got {len(params)}"
        )
    for i, (p, (name, shape, _)) in enumerate(zip(params, specs)):
        if tuple(p.shape) != tuple(shape):
            raise ValueError(f"params[{i}]: expected shape {tuple(shape)} ({name}), got {tuple(p.shape)}")
    return _EmptyBatch.apply(tuple(out_shape), x, weight, bias, *params)


def _apply(x: Tensor, weight: Tensor, bias: Tensor, params: List[Tensor], ops: str, precision: str) -> Tensor:
    """The forward op where a gradient may be wanted (it saves `z`), else the inference op."""
    if x.shape[0] == 0:
        return _empty_batch(x, weight, bias, params, ops)
    wants_grad = torch.is_grad_enabled() and any(
        getattr(t, "requires_grad", False) for t in (x, weight, bias, *params)
    )
    if _plain_eager(x, weight, bias, params):
        if wants_grad:
            return _Eager.apply(x, weight, bias, ops, precision, *params)[0]
        return _run_forward(
            x, weight, bias, params, ops, precision, False, _fp8_weight(weight, precision, ops)
        )[0]
    if wants_grad:
        return torch.ops.fused_linear.forward(x, weight, bias, params, ops, precision)[0]
    return torch.ops.fused_linear.inference(x, weight, bias, params, ops, precision)


def _with_batch_stats(
    x: Tensor, weight: Tensor, bias: Tensor, ops: str, params: List[Tensor], precision: Optional[str]
) -> Tuple[Tensor, Tensor]:
    """:func:`fused_linear` of a chain with a ``batchnorm`` on a 2-D ``x``, and the batch
    statistics of its BatchNorm, ``(2, C)``: each feature's mean and biased variance (detached),
    what the caller's running statistics are updated from. The forward saves its state
    ``z`` (it carries the statistics as two more rows) even where no gradient is wanted."""
    params = list(params)
    if x.dim() != 2:
        raise ValueError(
            f"x: a chain with a BatchNorm takes 2-D (batch, features) inputs, got {tuple(x.shape)}"
        )
    # 16-bit models on the CPU: float32 copies in their own precision (there are no 16-bit
    # kernels there), the output rounded once. On CUDA their own kernels run it.
    if x.dtype in _HALF and not x.is_cuda:
        wide = [t.float() if isinstance(t, Tensor) else t for t in (bias, *params)]
        y, stats = _with_batch_stats(
            x.float(), weight.float(), wide[0], ops, wide[1:], precision or _HALF[x.dtype]
        )
        return y.to(x.dtype), stats
    if x.dtype in _HALF:
        _check_half_dtypes(x, weight, [bias, *params], x.dtype)
    precision = _resolve_precision(x, precision)
    wants_grad = torch.is_grad_enabled() and any(
        getattr(t, "requires_grad", False) for t in (x, weight, bias, *params)
    )
    if _plain_eager(x, weight, bias, params):
        if wants_grad:
            y, z = _Eager.apply(x, weight, bias, ops, precision, *params)
        else:
            y, z = _run_forward(x, weight, bias, params, ops, precision, True)
    else:
        y, z = torch.ops.fused_linear.forward(x, weight, bias, params, ops, precision)
    return y, z[-2:].detach()


_GROUPNORM = re.compile(r"groupnorm\((\d+),([^)]+)\)")


class FusedLinear(nn.Module):
    """``Linear(in_features, out_features)`` followed by the epilogue chain ``ops``, fused.

    Parameters are named as the plain PyTorch modules name theirs — ``lin.weight``,
    ``lin.bias``, ``gn.weight``, ``gn.bias`` (``ln``, ``rms``, ``bn`` likewise), ``w``
    (``mul``), ``bias`` (the chain's ``bias``); a second op of a kind gets a number (``gn2``,
    ``bias2``) — and are
    initialised as PyTorch initialises them, in chain order, so ``load_state_dict`` from
    the plain model works and the same seed draws the same values. A ``batchnorm`` is an
    ``nn.BatchNorm1d`` (``bn``): batch statistics and its running statistics' update in
    training mode, the running statistics in eval mode, as the module computes.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        ops: str = "",
        precision: Optional[str] = None,
        *,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if precision is not None and precision not in PRECISIONS:
            raise ValueError(f"precision `{precision}` is not one of {', '.join(PRECISIONS)}")
        _, _, _, canonical, params = _describe(in_features, out_features, ops)
        self.in_features, self.out_features, self.ops, self.precision = (
            in_features,
            out_features,
            ops,
            precision,
        )
        factory = {"device": device, "dtype": dtype}
        self.lin = nn.Linear(in_features, out_features, **factory)
        self._param_names: List[str] = []
        self._param_refs: List[Tuple[str, str]] = []  # (submodule or "", attribute): one getattr each
        # A BatchNorm: (its module, its op's index, its weight's index in the parameters).
        self._batch_norm: Optional[Tuple[str, int, int]] = None
        for i, (name, shape, op_index) in enumerate(params):
            module, _, field = name.rpartition(".")
            if module:  # a norm's weight or bias: its module holds both
                if field == "weight":
                    op = canonical[op_index]
                    eps = float(op[op.rindex(",") + 1 if "," in op else op.index("(") + 1 : -1])
                    if op.startswith("groupnorm"):
                        groups = int(_GROUPNORM.fullmatch(op).group(1))
                        norm = nn.GroupNorm(groups, shape[0], eps=eps, **factory)
                    elif op.startswith("layernorm"):
                        norm = nn.LayerNorm(shape[0], eps=eps, **factory)
                    elif op.startswith("rmsnorm"):
                        norm = nn.RMSNorm(shape[0], eps=eps, **factory)
                    else:  # batchnorm: its running statistics too, updated in training mode
                        norm = nn.BatchNorm1d(shape[0], eps=eps, **factory)
                        self._batch_norm = (module, op_index, i)
                    self.add_module(module, norm)
            else:
                self.register_parameter(name, nn.Parameter(torch.randn(*shape, **factory)))
            self._param_names.append(name)
            self._param_refs.append((module, field if module else name))

    def chain_parameters(self) -> List[Tensor]:
        """The chain's parameters in the op's order (what :func:`fused_linear` takes)."""
        # Straight from the registries (`Module.__getattr__` costs a lookup chain per
        # name, and this runs on every call); a replaced Parameter is found as well.
        own, modules = self._parameters, self._modules
        return [modules[m]._parameters[f] if m else own[f] for m, f in self._param_refs]

    def forward(self, x: Tensor) -> Tensor:
        lin = self._modules["lin"]._parameters
        params = self.chain_parameters()
        if self._batch_norm is not None:
            from .fuse import _fused_call

            module, op, p = self._batch_norm
            norm = self._modules[module]
            return _fused_call(
                x, lin["weight"], lin["bias"], self.ops, params, self.precision, True, norm, (op, p)
            )
        return fused_linear(x, lin["weight"], lin["bias"], self.ops, params, self.precision)

    @property
    def effective_precision(self) -> str:
        """The precision the GEMMs run in: the one asked for, or the tensors' own (``bf16``
        for a bfloat16 model, ``fp16`` for a float16 one, else ``fp32``)."""
        if self.precision is not None:
            return self.precision
        weight = self._modules["lin"]._parameters["weight"]
        return _HALF.get(weight.dtype, "fp32")

    def extra_repr(self) -> str:
        chosen = "" if self.precision is not None else " (the tensors' own)"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, ops='{self.ops}', "
            f"precision='{self.effective_precision}'{chosen}"
        )

    def save(self, path) -> None:
        """The parameters to a safetensors file at ``path``, under their names and in their
        dtypes, with the chain and the precision in the file's metadata: ``FusedLinear.load``
        and ``host forward --weights`` read the block back without being told its chain, and
        refuse the file for another one (``load_state_dict`` reads it as any state dict)."""
        from . import files

        _, _, _, canonical, _ = _describe(self.in_features, self.out_features, self.ops)
        metadata = {files.CHAIN_KEY: ",".join(canonical), files.PRECISION_KEY: self.effective_precision}
        files.write(path, dict(self.state_dict()), metadata)

    @classmethod
    def load(cls, path, precision: Optional[str] = None, *, device=None) -> "FusedLinear":
        """The block a file written by :meth:`save` holds: its chain from the metadata, its
        parameters in their stored dtypes on ``device``, and the stored precision unless
        ``precision`` says otherwise (a bf16 model's is its tensors' own)."""
        from . import files

        tensors, metadata = files.read(path)
        chain = metadata.get(files.CHAIN_KEY)
        if chain is None:
            raise ValueError(
                f"{path}: no `{files.CHAIN_KEY}` in its metadata (not written by FusedLinear.save); "
                "build the block and use load_state_dict"
            )
        weight = tensors.get("lin.weight")
        if weight is None or weight.dim() != 2:
            raise ValueError(f"{path}: no 2-D lin.weight (it holds: {', '.join(sorted(tensors))})")
        stored = metadata.get(files.PRECISION_KEY)
        if precision is None and not (weight.dtype in _HALF and stored == _HALF[weight.dtype]):
            precision = stored
        out_features, in_features = weight.shape
        block = cls(in_features, out_features, chain, precision, device=device, dtype=weight.dtype)
        block.load_state_dict(tensors)
        # Parameters stored in another dtype than the weight's (a bf16 model's float32
        # GroupNorm, say) keep it.
        with torch.no_grad():
            own = dict(block.named_parameters())  # (a BatchNorm's running statistics are buffers)
            for name, t in tensors.items():
                p = own.get(name)
                if p is not None and p.dtype != t.dtype:
                    p.data = t.to(p.device)
        return block

    @classmethod
    def from_module(
        cls,
        module: nn.Module,
        ops: str,
        precision: Optional[str] = None,
        names: Optional[Dict[str, str]] = None,
    ) -> "FusedLinear":
        """A fused block with the parameters of a plain module (copied).

        ``module`` holds an ``nn.Linear`` (its first) and the chain's parameters, named as
        :class:`FusedLinear` names them, or as ``names`` maps them (ours to the module's,
        e.g. ``{"lin.weight": "gemm.weight", "gn.weight": "group_norm.weight"}``).
        """
        linear = next((m for m in module.modules() if isinstance(m, nn.Linear)), None)
        if linear is None:
            raise ValueError(f"{type(module).__name__} holds no nn.Linear")
        w = linear.weight
        block = cls(linear.in_features, linear.out_features, ops, precision, device=w.device, dtype=w.dtype)
        theirs = dict(module.named_parameters())
        names = names or {}
        missing = []
        with torch.no_grad():
            for ours, p in block.named_parameters():
                source = theirs.get(names.get(ours, ours))
                if ours in ("lin.weight", "lin.bias") and ours not in names and source is None:
                    source = getattr(linear, ours.split(".")[1])
                if source is None or source.shape != p.shape:
                    missing.append(ours)
                else:
                    p.copy_(source)
        if missing:
            raise ValueError(
                f"from_module: {type(module).__name__} has no parameter for {', '.join(missing)} "
                f"(its parameters: {', '.join(theirs)}); pass names={{ours: theirs}}"
            )
        return block


from .fuse import fuse  # noqa: E402 (it calls back into this module)

"""A block's parameters in a safetensors file that names its block: the chain and the
precision in the file's metadata (``fused_linear.chain``, ``fused_linear.precision``), so
that ``host forward --weights FILE`` and :meth:`FusedLinear.load` build the same block
without being told the chain again, and refuse a file of another one. Tensors keep their
names (``lin.weight``, ``gn.weight``, ...) and dtypes, so any safetensors reader, and
``load_state_dict``, read the parameters too.

Written and read here without the ``safetensors`` package (PyTorch does not depend on it):
an 8-byte little-endian header length, a JSON header, then the tensors' bytes.
"""

from __future__ import annotations

import ctypes
import json
import struct
from pathlib import Path
from typing import Dict, Tuple, Union

import torch
from torch import Tensor

CHAIN_KEY = "fused_linear.chain"
PRECISION_KEY = "fused_linear.precision"

# int64: a BatchNorm's `num_batches_tracked`.
_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}
_DTYPES[torch.int64] = "I64"
_TORCH = {name: dtype for dtype, name in _DTYPES.items()}


def write(path: Union[str, Path], tensors: Dict[str, Tensor], metadata: Dict[str, str]) -> None:
    """``tensors`` (floating point or int64, any device) and string ``metadata`` to ``path``, written
    to ``<path>.partial`` first and renamed, so a failure never leaves half a file."""
    header: Dict[str, object] = {"__metadata__": dict(metadata)}
    blobs = []
    offset = 0
    for name in sorted(tensors):
        t = tensors[name].detach()
        if t.dtype not in _DTYPES:
            raise TypeError(
                f"{name} has dtype {t.dtype}; a weights file holds float32, bfloat16, float16, float64 "
                "or int64"
            )
        t = t.to("cpu").contiguous()
        size = t.numel() * t.element_size()
        blobs.append(ctypes.string_at(t.data_ptr(), size) if size else b"")
        header[name] = {
            "dtype": _DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    try:
        with open(partial, "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            for blob in blobs:
                f.write(blob)
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


def read(path: Union[str, Path]) -> Tuple[Dict[str, Tensor], Dict[str, str]]:
    """The tensors (on the CPU, in their stored dtypes) and the metadata of a safetensors
    file; a clear ``ValueError`` for a file that is not one."""
    data = Path(path).read_bytes()
    if len(data) < 8:
        raise ValueError(f"{path}: not a safetensors file ({len(data)} bytes)")
    (n,) = struct.unpack("<Q", data[:8])
    if 8 + n > len(data):
        raise ValueError(f"{path}: not a safetensors file (a header of {n} bytes in {len(data)})")
    try:
        header = json.loads(data[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a safetensors file (its header is not JSON: {e})") from None
    metadata = header.pop("__metadata__", None) or {}
    body = data[8 + n :]
    tensors = {}
    for name, info in header.items():
        dtype = _TORCH.get(info.get("dtype"))
        if dtype is None:
            raise ValueError(
                f"{path}: {name} has dtype {info.get('dtype')}; expected F32, BF16, F16, F64 or I64"
            )
        begin, end = info["data_offsets"]
        if not 0 <= begin <= end <= len(body):
            raise ValueError(f"{path}: {name}'s bytes {begin}..{end} lie outside the file")
        flat = (
            torch.frombuffer(bytearray(body[begin:end]), dtype=dtype)
            if end > begin
            else torch.empty(0, dtype=dtype)
        )
        tensors[name] = flat.reshape(info["shape"])
    return tensors, metadata

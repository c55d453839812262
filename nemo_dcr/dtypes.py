"""Canonical dtype names (as safetensors spells them) and their bit views.

Deltas never look at values, only at stored bits, so every dtype is handled
through an unsigned integer view of the same width.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class DType:
    name: str  # safetensors spelling, e.g. "BF16"
    torch_dtype: torch.dtype
    itemsize: int

    @property
    def bits_numpy(self) -> np.dtype:
        """Unsigned numpy view used for bits on the wire and in baselines."""
        return unsigned(self.itemsize)

    @property
    def bits_torch(self) -> torch.dtype:
        """Signed torch view of the same width (torch lacks wide unsigned ops)."""
        return _TORCH_INT_OF_WIDTH[self.itemsize]


_NUMPY_UINT_OF_WIDTH = {w: np.dtype(f"<u{w}") for w in (1, 2, 4, 8)}  # made once: np.dtype parses its string
_TORCH_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

_ALL = [
    DType("BF16", torch.bfloat16, 2),
    DType("F16", torch.float16, 2),
    DType("F32", torch.float32, 4),
    DType("F64", torch.float64, 8),
    DType("I8", torch.int8, 1),
    DType("U8", torch.uint8, 1),
    DType("I16", torch.int16, 2),
    DType("I32", torch.int32, 4),
    DType("I64", torch.int64, 8),
    DType("BOOL", torch.bool, 1),
    DType("F8_E4M3", torch.float8_e4m3fn, 1),
    DType("F8_E5M2", torch.float8_e5m2, 1),
]
BY_NAME = {d.name: d for d in _ALL}
BY_TORCH = {d.torch_dtype: d for d in _ALL}


def unsigned(width: int) -> np.dtype:
    """The little-endian unsigned numpy dtype of `width` bytes (1, 2, 4 or 8)."""
    return _NUMPY_UINT_OF_WIDTH[width]


def from_name(name: str) -> DType:
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {sorted(BY_NAME)}") from None


def from_torch(dtype: torch.dtype) -> DType:
    try:
        return BY_TORCH[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no canonical name") from None


def bits_of(tensor: torch.Tensor) -> torch.Tensor:
    """Same-storage integer view of a tensor's stored bits."""
    return tensor.view(from_torch(tensor.dtype).bits_torch)


def unsigned_view(a: np.ndarray) -> np.ndarray:
    """The same memory as the unsigned integer of its width (the bits, never the values)."""
    return a.view(unsigned(a.itemsize))


def host_bits(t: torch.Tensor) -> np.ndarray:
    """A tensor's stored bits on the host (copied there from a device), as the unsigned
    numpy integer of its width."""
    return unsigned_view(t.cpu().numpy())

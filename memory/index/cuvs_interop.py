"""cuVS interop for CagraIndex: the optional import, bitset packing, results back to the host.

cuVS (cuvs-cu13 / cuvs-cu12) is an optional dependency; nothing here imports it at module
import time. Also the call of `cagra.extend`, whose signature changed in cuVS 26.10.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import torch

__all__ = ["U32Words", "call_extend", "cuvs_available", "import_cuvs", "pack_bits", "to_numpy"]


def import_cuvs() -> tuple[Any, Any]:
    """(cuvs.neighbors.cagra, cuvs.neighbors.filters); raises ImportError without cuVS."""
    from cuvs.neighbors import cagra, filters  # optional dependency (cuvs-cu13 / cuvs-cu12)

    return cagra, filters


def cuvs_available() -> bool:
    """True when cuVS imports and torch sees a CUDA device."""
    try:
        import_cuvs()
    except Exception:
        return False
    return torch.cuda.is_available()


def to_numpy(x: Any) -> np.ndarray:
    """cuVS outputs (pylibraft device_ndarray, cupy, torch or numpy) -> host numpy."""
    if isinstance(x, torch.Tensor):
        return x.cpu().numpy()
    if hasattr(x, "copy_to_host"):
        return x.copy_to_host()
    if hasattr(x, "get"):
        return x.get()
    return np.asarray(x)


class U32Words:
    """A torch int32 CUDA tensor presented to cuVS as uint32 words (bitsets are uint32)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t

    @property
    def __cuda_array_interface__(self) -> dict:
        cai = dict(self.tensor.__cuda_array_interface__)
        cai["typestr"] = "<u4"
        return cai

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)


def pack_bits(mask: np.ndarray) -> np.ndarray:
    """bool [n] -> uint32 words, bit i of word j = row 32 j + i (cuVS bitset layout)."""
    packed = np.packbits(mask.astype(np.bool_), bitorder="little")
    pad = (-packed.size) % 4
    if pad:
        packed = np.concatenate([packed, np.zeros(pad, dtype=np.uint8)])
    if packed.size == 0:
        packed = np.zeros(4, dtype=np.uint8)
    return packed.view("<u4")


def call_extend(cagra: Any, params: Any, index: Any, rows: torch.Tensor, n_old: int, n_new: int, style: str | None) -> tuple[Any, str]:
    """Insert rows [n_old, n_new) of `rows` into `index`; returns (extend's result, the form used).

    cuVS >= 26.10: extend(params, index, old || new rows, new_start_row) rebinding the index;
    older: extend(params, index, new rows) -> index. `style` is the form found earlier ("new",
    "old") or None: then it is read off the signature (or docstring), else tried: new first,
    the old one on a TypeError.
    """
    if style is None:
        try:
            names = set(inspect.signature(cagra.extend).parameters)
        except (TypeError, ValueError):
            names = set()
        if "new_start_row" in names or "new_start_row" in (getattr(cagra.extend, "__doc__", "") or ""):
            style = "new"
        elif "additional_dataset" in names:
            style = "old"
    if style in (None, "new"):
        try:
            return cagra.extend(params, index, rows[:n_new], new_start_row=n_old), "new"
        except TypeError:
            if style == "new":
                raise
    return cagra.extend(params, index, rows[n_old:n_new].contiguous()), "old"

"""Safetensors files read with plain reads, never a memory map: what a check or a sharded load reads stays in the
page cache, not in the reading process's resident set.

A memory map's pages count in the process's RSS as they are touched, the whole file by the end of a pass over it: a
checkpoint's commit that hashed and checked its 4.4 GiB optimizer state through maps (BLAKE3's ``update_mmap``,
``safe_open``) grew the trainer's RSS by that much for seconds, the peak of a one-rank resident run at Qwen3-0.6B's
shape (``benchmarks/bench_real_shape.py``; a pod's memory limit and the OOM killer count those pages too).

The format: an 8-byte little-endian header length, the JSON header (tensor name → ``dtype``, ``shape``,
``data_offsets`` from the start of the data), the data.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any, Dict, List, Optional, Tuple

import torch

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}
FLOAT_DTYPES = {**{name: dtype for name, dtype in SAFETENSORS_DTYPES.items() if dtype.is_floating_point},
                "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
"""The floating-point dtypes whose values the finite check reads."""
BLOCK = 16 << 20
"""Bytes read at a time where a pass needs no more than a block (hashing, the finite check)."""


def read_header(path: str) -> Tuple[Dict[str, dict], int]:
    """A safetensors file's header (tensor name → ``dtype``, ``shape``, ``data_offsets``) and the byte
    where its data starts."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > size - 8:
            raise ValueError(f"{path} is not a safetensors file: its first 8 bytes give a header of {length} bytes, "
                             f"the file has {size}")
        header = json.loads(f.read(length))
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file: its header is no JSON object")
    header.pop("__metadata__", None)
    return header, 8 + length


def read_exactly(f, view: memoryview) -> None:
    """Fill ``view`` from ``f``'s position; a file that ends first is a truncated one."""
    done = 0
    while done < len(view):
        got = f.readinto(view[done:])
        if not got:
            raise ValueError(f"{f.name}: ends inside a tensor (truncated file)")
        done += got


def nonfinite_tensors(path: str) -> List[str]:
    """Names of the floating-point tensors of the safetensors file ``path`` that hold NaN or ±inf, read a block at a
    time (:func:`hash_and_scan`, its bytes hashed by nothing). A file that is no safetensors file gives none (loading
    it fails on its own, with its error)."""
    return hash_and_scan(path, _NoHash()) or []


class _NoHash:
    def update(self, data) -> None:
        pass


def hash_and_scan(path: str, h: Any) -> Optional[List[str]]:
    """Every byte of the safetensors file ``path``, in order, into the hash ``h`` (``update``) and the names of its
    floating-point tensors that hold NaN or ±inf, from one read of the file (a commit hashed it and checked it in two:
    twice the disk reads at a size no page cache holds). None, with nothing hashed, for a file that is no safetensors
    file or whose tensors overlap (the caller hashes it whole; loading it fails on its own); a ValueError for one whose
    last tensor runs past its end (truncated)."""
    try:
        header, start = read_header(path)
    except (OSError, ValueError, struct.error, UnicodeDecodeError):
        return None
    size = os.path.getsize(path)
    spans = sorted((start + e["data_offsets"][0], start + e["data_offsets"][1], name, FLOAT_DTYPES.get(e["dtype"]))
                   for name, e in header.items())
    if any(lo > hi for lo, hi, _, _ in spans) or any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
        return None
    if spans and spans[-1][1] > size:  # as the separate finite check refused it
        raise ValueError(f"{path}: ends inside a tensor (truncated file)")
    buf = torch.empty(BLOCK, dtype=torch.uint8)
    view = memoryview(buf.numpy())
    bad: List[str] = []
    with open(path, "rb", buffering=0) as f:
        pos = 0

        def feed(end: int, dtype: Optional[torch.dtype] = None) -> bool:
            """Bytes up to ``end`` hashed (and checked as ``dtype``, a tensor's whole data); whether all finite."""
            nonlocal pos
            finite, size_of = True, dtype.itemsize if dtype is not None else 1
            while pos < end:
                n = min(BLOCK - BLOCK % size_of, end - pos)
                read_exactly(f, view[:n])
                h.update(view[:n])
                whole = n - n % size_of
                if dtype is not None and finite and whole:
                    finite = bool(torch.isfinite(buf[:whole].view(dtype)).all())
                pos += n
            return finite

        for lo, hi, name, dtype in spans:
            feed(lo)  # the header, and any bytes between tensors
            if not feed(hi, dtype):
                bad.append(name)
        feed(size)
    return sorted(bad)

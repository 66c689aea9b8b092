"""A delta push's buckets (``run.weight_push=delta``): per tensor only the elements whose value at the engine's dtype
changed since the push the engine holds, in the encoding that is smallest for their density, exactly as the full
push's buckets are checked (a checksum per bucket, sampled elements read back bit for bit).

An element changed when its bits at the engine's dtype differ from the bits last pushed (:func:`changed_mask`:
bits, so ``-0.0``/``+0.0`` and NaN payloads count). A tensor of ``N`` elements, ``c`` of them changed, ``s`` bytes
each, travels as the smallest of (:func:`choose`)::

    FULL    every element                               N * s
    IDX32   int32 flat positions, then the values       4 c + c s        (N < 2**31)
    IDX64   int64 flat positions, then the values       8 c + c s
    BITMAP  one bit per element (LSB first), values     ceil(N / 8) + c s
    BLOCK8  per block of 256 elements a uint8 count,    ceil(N / 256) + c + c s
            each position's uint8 offset in its block,  (no block all changed)
            then the values

(the positions or the bitmap padded to 8 bytes, so the values stay aligned for their dtype).

A bucket (the tensors :func:`~models.engines.weight_stream.plan_push` put in it, in that order), of a length the
sender learns only once it has the tensors (the receiver reads it first: the channel sends it ahead, an HTTP body
frames each bucket with it)::

    [code, changed, offset, nbytes, samples] x tensors (int64) | payloads (16-aligned) | pad to 8 |
    [position, bits] x samples (int64) | checksum (int64)
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Tuple

import numpy as np
import torch

from models.engines.weight_stream import (ALIGN, PushError, Samples, _dtype, _numel, _up, checksum)

FULL, IDX32, IDX64, BITMAP, BLOCK8 = 0, 1, 2, 3, 4
NAMES = {FULL: "full", IDX32: "idx32", IDX64: "idx64", BITMAP: "bitmap", BLOCK8: "block8"}
BLOCK, _SHIFT = 256, 8
"""Elements of a BLOCK8 block (``1 << _SHIFT``): a position within one is a byte."""
_FIELDS = 5
"""int64 fields of a tensor's record."""
INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""The integer dtype of each element size: a tensor's bits compared, or gathered, as integers."""


class Patch(NamedTuple):
    """What a delta push gives one tensor: ``values`` at flat ``indices`` (int64, ascending), or with ``indices``
    None the whole tensor (``values`` shaped as it)."""

    indices: Optional[torch.Tensor]
    values: torch.Tensor


def changed_mask(new: torch.Tensor, old: Optional[torch.Tensor]) -> torch.Tensor:
    """Flat bool mask of the elements of ``new`` whose bits differ from ``old`` (all of them without ``old``, or
    where the shapes or dtypes differ)."""
    if old is None or old.shape != new.shape or old.dtype != new.dtype:
        return torch.ones(new.numel(), dtype=torch.bool, device=new.device)
    if new.dtype == torch.bool:
        return new.reshape(-1) != old.reshape(-1)
    as_int = INT_OF[new.element_size()]
    new, old = new.reshape(-1).view(as_int), old.reshape(-1).view(as_int)
    if new.device.type == "cpu":  # numpy's compare takes half torch's time on one core
        return torch.from_numpy(new.numpy() != old.numpy())
    return new != old


def positions_of(mask: torch.Tensor) -> torch.Tensor:
    """The flat positions (int64, ascending) where ``mask`` is set (numpy's on the CPU: a third of torch's time)."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(mask.numpy()))
    return mask.nonzero().reshape(-1)


def nbytes(code: int, numel: int, count: int, itemsize: int) -> int:
    """Payload bytes of a tensor of ``numel`` elements (``itemsize`` each), ``count`` of them changed, as ``code``."""
    return _head(code, numel, count) + (numel if code == FULL else count) * itemsize


def _head(code: int, numel: int, count: int) -> int:
    """Bytes before the values (padded to 8, so the values stay aligned for any dtype)."""
    return _up({FULL: 0, IDX32: 4 * count, IDX64: 8 * count, BITMAP: -(-numel // 8),
                BLOCK8: -(-numel // BLOCK) + count}[code], 8)


def choose(numel: int, count: int, itemsize: int, block8: bool = True, full: bool = True) -> int:
    """The encoding with the fewest bytes (ties: the first of FULL, IDX32, IDX64, BITMAP, BLOCK8); ``block8``: BLOCK8
    may carry them (no block of 256 has all its elements changed); ``full``: FULL may."""
    codes = ([FULL] * full + [IDX32] * (numel < (1 << 31)) + [IDX64, BITMAP] + [BLOCK8] * block8)
    return min(codes, key=lambda c: nbytes(c, numel, count, itemsize))


def sparse_code(numel: int, indices: torch.Tensor, itemsize: int, full: bool = True) -> int:
    """Once the changed positions are known (ascending): the smallest encoding that can carry them (``full``: FULL
    among them, where the sender has the whole tensor)."""
    counts = torch.bincount(indices >> _SHIFT) if indices.numel() else indices
    return choose(numel, indices.numel(), itemsize, not counts.numel() or int(counts.max()) < BLOCK, full)


def _pack_bits(indices: torch.Tensor, numel: int) -> torch.Tensor:
    mask = torch.zeros(_up(numel, 8), dtype=torch.uint8)
    mask[indices] = 1
    weights = (1 << torch.arange(8, dtype=torch.int32)).to(torch.uint8)  # [8]: LSB first
    return (mask.view(-1, 8) * weights).sum(dim=1, dtype=torch.int32).to(torch.uint8)[:-(-numel // 8)]  # [ceil(N/8)]


def _unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    mask = (packed.unsqueeze(1) >> shifts) & 1  # [ceil(N/8), 8]
    return mask.reshape(-1)[:numel].nonzero().reshape(-1)  # [c] int64, ascending


def encode(code: int, numel: int, indices: Optional[torch.Tensor], values: torch.Tensor) -> torch.Tensor:
    """The payload (uint8, on the CPU): ``values`` the whole tensor for FULL, else the changed elements' values at
    ``indices`` (int64, ascending)."""
    raw = values.detach().reshape(-1).contiguous().cpu().view(torch.uint8)
    if code == FULL:
        return raw
    if code == BITMAP:
        head = _pack_bits(indices.cpu(), numel)
    elif code == BLOCK8:
        indices = indices.cpu()
        counts = torch.bincount(indices >> _SHIFT, minlength=-(-numel // BLOCK)).to(torch.uint8)  # [blocks]
        head = torch.cat([counts, (indices & (BLOCK - 1)).to(torch.uint8)])
    else:
        head = indices.cpu().to(torch.int32 if code == IDX32 else torch.int64).view(torch.uint8)
    pad = torch.zeros(_head(code, numel, indices.numel()) - head.numel(), dtype=torch.uint8)
    return torch.cat([head, pad, raw])


def decode(code: int, payload: torch.Tensor, shape, dtype: torch.dtype, count: int) -> Patch:
    """:func:`encode`'s inverse: the tensor's :class:`Patch` (views of ``payload`` where it can)."""
    numel = _numel(shape)
    if code == FULL:
        return Patch(None, payload.view(dtype).view(list(shape)))
    head = _head(code, numel, count)
    values = payload[head:].view(dtype)
    if code == BITMAP:
        indices = _unpack_bits(payload[:-(-numel // 8)], numel)
    elif code == BLOCK8:
        blocks = -(-numel // BLOCK)
        counts = payload[:blocks].cpu().numpy()
        starts = torch.from_numpy(np.repeat(np.arange(blocks, dtype=np.int64) << _SHIFT, counts))  # [c]
        indices = starts.to(payload.device) + payload[blocks:blocks + count].to(torch.int64)
    else:
        width = 4 if code == IDX32 else 8
        indices = payload[:width * count].view(torch.int32 if code == IDX32 else torch.int64).to(torch.int64)
    if indices.numel() != count or values.numel() != count:
        raise PushError(f"a delta of {count} elements decodes to {indices.numel()} positions and {values.numel()} "
                        f"values")
    if count and (int(indices.max()) >= numel or int(indices.min()) < 0):
        raise PushError(f"a delta names positions outside its tensor of {numel} elements")
    return Patch(indices, values)


class Delta(NamedTuple):
    """One tensor of a delta push, as the sender's rank 0 has it: its encoding, the count of changed elements, the
    payload and the samples read back after the push (``[2, n]``: positions, bits)."""

    code: int
    changed: int
    payload: torch.Tensor
    samples: torch.Tensor


def seal_delta(header: Mapping[str, Any], index: int, deltas: List[Tuple[str, Delta]]) -> torch.Tensor:
    """Bucket ``index`` of a delta push: ``deltas`` (its tensors in the header's order) laid out with their
    records, samples and checksum (see the module's docstring)."""
    entries = [t for t in header["tensors"] if t[3] == index]
    if [n for n, *_ in entries] != [n for n, _ in deltas]:
        raise ValueError(f"bucket {index} of the delta push holds {[n for n, _ in deltas][:4]} where its header "
                         f"has {[n for n, *_ in entries][:4]}")
    records = torch.zeros(len(deltas), _FIELDS, dtype=torch.int64)
    at = _up(records.numel() * 8, ALIGN)
    for k, (_, d) in enumerate(deltas):
        records[k] = torch.tensor([d.code, d.changed, at, d.payload.numel(), d.samples.shape[1]])
        at = _up(at + d.payload.numel(), ALIGN)
    data = _up(at, 8)
    tail = torch.cat([d.samples for _, d in deltas] + [torch.zeros(2, 0, dtype=torch.int64)], dim=1)  # [2, n]
    buffer = torch.zeros(data + 16 * tail.shape[1] + 8, dtype=torch.uint8)
    buffer[:records.numel() * 8] = records.reshape(-1).view(torch.uint8)
    for k, (_, d) in enumerate(deltas):
        buffer[int(records[k, 2]):int(records[k, 2]) + d.payload.numel()] = d.payload
    buffer[data:-8].view(torch.int64).copy_(tail.t().reshape(-1))
    buffer[-8:].view(torch.int64).fill_(checksum(buffer[:-8], header.get("checksum", "crc32")))
    return buffer


def open_delta(header: Mapping[str, Any], index: int, buffer: torch.Tensor
               ) -> Tuple[Dict[str, Patch], Samples, Dict[str, int]]:
    """The receiver's side of :func:`seal_delta`: its checksum checked (:class:`PushError` naming the bucket and its
    tensors), then per tensor its :class:`Patch`, its samples and ``{"changed": ..., "elements": ...}``."""
    entries = [t for t in header["tensors"] if t[3] == index]
    names = [e[0] for e in entries]
    buffer = buffer.cpu()
    got, sent = checksum(buffer[:-8], header.get("checksum", "crc32")), int(buffer[-8:].view(torch.int64).item())
    if got != sent:
        raise PushError(f"bucket {index} of the delta push arrived other than it was sent (checksum {got:#x}, sent "
                        f"{sent:#x}); it holds {names[:4]}{' ...' if len(names) > 4 else ''}")
    records = buffer[:len(entries) * _FIELDS * 8].view(torch.int64).view(-1, _FIELDS).tolist()
    data = _up(max([_up(o + n, ALIGN) for _, _, o, n, _ in records] + [_up(len(entries) * _FIELDS * 8, ALIGN)]), 8)
    pairs = buffer[data:-8].view(torch.int64).view(-1, 2).tolist()
    patches, samples, k = {}, {}, 0
    counts = {"changed": 0, "elements": 0}
    for (name, dtype, shape, *_), (code, count, offset, size, n) in zip(entries, records):
        patches[name] = decode(code, buffer[offset:offset + size], shape, _dtype(dtype), count)
        samples[name] = [(int(p), int(b)) for p, b in pairs[k:k + n]]
        k += n
        counts["changed"] += count
        counts["elements"] += _numel(shape)
    return patches, samples, counts

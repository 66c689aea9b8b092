"""A delta push's buckets (``run.weight_push=delta``): per tensor only the elements whose value at the engine's dtype
changed since the push the engine holds, in the encoding that is smallest for their density, exactly as the full
push's buckets are checked (a checksum per bucket, sampled elements read back bit for bit).

An element changed when its bits at the engine's dtype differ from the bits last pushed (:func:`changed`:
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

The values of a sparse encoding travel in one of three modes (a tensor's code is its positions' code plus the mode's,
:data:`STEP8` or :data:`SIGN`): its raw elements (``c s`` bytes), or the steps of their bits from the bits the engine
holds (the bits read as an integer of the element's width, the difference wrapping around): ``STEP8`` one int8 a
step, ``SIGN`` one bit a step (LSB first: set for +1, clear for -1). An RL update moves a bfloat16 weight that
changed by one unit in its last place almost always; the few whose step does not fit (a weight within the update of
zero crosses it, or moves many of its tiny units) follow as exceptions, their raw values at their ordinals among the
changed elements::

    steps (STEP8: c bytes, -128 marks an exception; SIGN: ceil(c / 8)) | pad to 8 | E (int64) |
    E int32 ordinals | pad to 8 | E values

so a delta's values take an eighth of their raw bytes or a half. The engine adds the steps to what it holds
(:func:`stepped`), and the push's samples, read back bit for bit among the changed elements, catch a step applied
onto anything but the push the delta was made against.

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

from kernels.block8 import Head
from kernels.block8 import exceptions as block8_exceptions
from kernels.block8 import head as block8_head
from models.engines.weight_patch import _WIDER, INT_OF, Packed, Patch, _wrap, stepped  # noqa: F401 (theirs too)
from models.engines.weight_stream import (ALIGN, PushError, Samples, _dtype, _numel, _up, checksum)

FULL, IDX32, IDX64, BITMAP, BLOCK8 = 0, 1, 2, 3, 4
NAMES = {FULL: "full", IDX32: "idx32", IDX64: "idx64", BITMAP: "bitmap", BLOCK8: "block8"}
RAW, STEP8, SIGN = 0, 16, 32
"""The values' modes (added to a positions' code): raw elements, int8 steps of their bits, or one bit a ±1 step."""
_POSITIONS = 15
BLOCK, _SHIFT = 256, 8
"""Elements of a BLOCK8 block (``1 << _SHIFT``): a position within one is a byte."""
_FIELDS = 5
"""int64 fields of a tensor's record."""


def steps_of(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """int8 steps from ``old``'s bits to ``new``'s (same dtype, element sizes 2 or 4), wrapping at their width; -128
    where the step is outside -127..127."""
    as_int, wider = INT_OF[new.element_size()], _WIDER[new.element_size()]
    raw = _wrap(new.reshape(-1).view(as_int).to(wider) - old.reshape(-1).view(as_int).to(wider), 8 * new.element_size())
    return torch.where(raw.abs() <= 127, raw, -128).to(torch.int8)


def exceptions(mode: int, steps: torch.Tensor) -> torch.Tensor:
    """Which of ``steps`` (:func:`steps_of`'s) ``mode`` cannot carry (bool)."""
    return steps == -128 if mode == STEP8 else (steps != 1) & (steps != -1)


def step_mode(count: int, sign_exceptions: int, step8_exceptions: int, itemsize: int) -> Tuple[int, int]:
    """The values' mode with the fewest bytes for ``count`` changed elements whose steps leave that many exceptions to
    SIGN and to STEP8 (:func:`exceptions`): SIGN, STEP8 or RAW, and the exceptions it leaves."""
    left = {RAW: 0, SIGN: sign_exceptions, STEP8: step8_exceptions}
    mode = min((RAW, SIGN, STEP8), key=lambda m: _values_bytes(m, count, itemsize, left[m]))
    return mode, left[mode]


def exceptions_of(steps: Optional[torch.Tensor]) -> Tuple[int, int]:
    """How many of ``steps`` SIGN and STEP8 cannot carry ((0, 0) without steps): one count of each step's byte."""
    if steps is None:
        return 0, 0
    as_bytes = steps.reshape(-1).view(torch.uint8)
    tally = (np.bincount(as_bytes.numpy(), minlength=256) if as_bytes.device.type == "cpu"
             else torch.bincount(as_bytes, minlength=256).cpu().numpy()).tolist()
    return steps.numel() - tally[1] - tally[255], tally[128]  # not +1 or -1 (255); -128 (128)


def mode_of(steps: Optional[torch.Tensor], itemsize: int) -> Tuple[int, int]:
    """:func:`step_mode` of one tensor's ``steps`` (None: RAW) and the exceptions it leaves."""
    return (RAW, 0) if steps is None else step_mode(steps.numel(), *exceptions_of(steps), itemsize)


def changed(new: torch.Tensor, old: Optional[torch.Tensor]) -> torch.Tensor:
    """Flat positions (int64, ascending) of the elements of ``new`` whose bits differ from ``old``'s (all of them
    without ``old``, or where the shapes or dtypes differ); numpy's compare and scan on the CPU (a half and a third of
    torch's time on one core)."""
    if old is None or old.shape != new.shape or old.dtype != new.dtype:
        return torch.arange(new.numel(), device=new.device)
    if new.dtype != torch.bool:
        as_int = INT_OF[new.element_size()]
        new, old = new.reshape(-1).view(as_int), old.reshape(-1).view(as_int)
    if new.device.type != "cpu":
        return (new.reshape(-1) != old.reshape(-1)).nonzero().reshape(-1)
    return _flatnonzero(torch.from_numpy(new.reshape(-1).numpy() != old.reshape(-1).numpy()))


def _flatnonzero(mask: torch.Tensor) -> torch.Tensor:
    """The positions (int64, ascending) where the flat bool ``mask`` (on the CPU) is set: numpy's scan."""
    out = np.flatnonzero(mask.numpy())
    return torch.from_numpy(out) if out.size else torch.zeros(0, dtype=torch.int64)  # (numpy's empty: stride 0)


def nbytes(code: int, numel: int, count: int, itemsize: int, exact: int = 0) -> int:
    """Payload bytes of a tensor of ``numel`` elements (``itemsize`` each), ``count`` of them changed, as ``code``
    (``exact``: the exceptions of a mode of steps)."""
    if code == FULL:
        return numel * itemsize
    return _head(code & _POSITIONS, numel, count) + _values_bytes(code & ~_POSITIONS, count, itemsize, exact)


def _values_bytes(mode: int, count: int, itemsize: int, exact: int) -> int:
    if mode == RAW:
        return count * itemsize
    return _steps_bytes(mode, count) + 8 + _up(4 * exact, 8) + exact * itemsize


def _steps_bytes(mode: int, count: int) -> int:
    """The steps' own bytes in a values' section of ``mode`` (STEP8 or SIGN), padded to 8."""
    return _up(count if mode == STEP8 else -(-count // 8), 8)


def _head(code: int, numel: int, count: int) -> int:
    """Bytes before the values (padded to 8, so the values stay aligned for any dtype)."""
    return _up({FULL: 0, IDX32: 4 * count, IDX64: 8 * count, BITMAP: -(-numel // 8),
                BLOCK8: -(-numel // BLOCK) + count}[code], 8)


def choose(numel: int, count: int, itemsize: int, block8: bool = True, full: bool = True, mode: int = RAW,
           exact: int = 0) -> int:
    """The encoding with the fewest bytes (ties: the first of FULL, IDX32, IDX64, BITMAP, BLOCK8); ``block8``: BLOCK8
    may carry them (no block of 256 has all its elements changed); ``full``: FULL may; ``mode``: the values' mode
    (:func:`step_mode`), with ``exact`` exceptions."""
    codes = ([FULL] * full + [c | mode for c in [IDX32] * (numel < (1 << 31)) + [IDX64, BITMAP] + [BLOCK8] * block8])
    return min(codes, key=lambda c: nbytes(c, numel, count, itemsize, exact))


def sparse_code(numel: int, indices: torch.Tensor, itemsize: int, full: bool = True, mode: int = RAW,
                exact: int = 0) -> int:
    """Once the changed positions are known (ascending): the smallest encoding that can carry them (``full``: FULL
    among them, where the sender has the whole tensor)."""
    counts = torch.bincount(indices >> _SHIFT) if indices.numel() else indices
    return choose(numel, indices.numel(), itemsize, not counts.numel() or int(counts.max()) < BLOCK, full, mode,
                  exact)


def encoded(numel: int, pieces: List[Tuple[torch.Tensor, int]], values: torch.Tensor,
            steps: Optional[torch.Tensor] = None, mode: int = RAW, exact: int = 0,
            whole: Optional[torch.Tensor] = None) -> Tuple[int, torch.Tensor]:
    """The smallest encoding (:func:`choose`) of a tensor of ``numel`` elements whose changed ones are at the positions
    of ``pieces`` (each ``(positions, start)``: int32 or int64 positions, ascending, in a part whose first element is
    ``start``; the pieces in order), with their ``values`` and ``steps`` in ``mode``, and its payload; ``whole``: the
    whole tensor (flat), where FULL may carry it. BLOCK8's positions are built from the pieces in one pass
    (:func:`kernels.block8.head`); the positions are joined into one int64 tensor only for another encoding, or where
    a block has all its elements changed (BLOCK8 cannot carry it)."""
    count, itemsize = sum(p.numel() for p, _ in pieces), values.element_size()
    code = choose(numel, count, itemsize, full=whole is not None, mode=mode, exact=exact)
    if code == FULL:
        return code, encode(FULL, numel, None, whole)
    head = block8_head(pieces, numel) if code & _POSITIONS == BLOCK8 else None
    if head is not None:
        return code, encode(code, numel, None, values, steps, head=head)
    indices = torch.cat([p.to(torch.int64) + start for p, start in pieces]) if len(pieces) != 1 or pieces[0][1] \
        else pieces[0][0].to(torch.int64)
    if code & _POSITIONS == BLOCK8:
        code = sparse_code(numel, indices, itemsize, whole is not None, mode, exact)
    return code, encode(code, numel, indices, whole if code == FULL else values, steps)


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool ``mask`` (on the CPU) as bits, LSB first: ``[ceil(N / 8)]`` uint8."""
    return torch.from_numpy(np.packbits(mask.numpy(), bitorder="little"))


def _mask(indices: torch.Tensor, numel: int) -> torch.Tensor:
    mask = torch.zeros(numel, dtype=torch.bool)
    mask[indices] = True
    return mask


def _unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The bits of ``packed`` (LSB first) as ``[numel]`` bool, where ``packed`` is."""
    if packed.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(packed.numpy(), count=numel, bitorder="little").view(np.bool_))
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & 1).reshape(-1)[:numel].bool()  # [numel]


def encode(code: int, numel: int, indices: Optional[torch.Tensor], values: torch.Tensor,
           steps: Optional[torch.Tensor] = None, head: Optional[Head] = None) -> torch.Tensor:
    """The payload (uint8, on the CPU): ``values`` the whole tensor for FULL, else the changed elements' values at
    ``indices`` (int64, ascending), for STEP8 and SIGN with their ``steps`` (:func:`steps_of`). ``head``: BLOCK8's
    positions as :func:`kernels.block8.head` built them from the pieces the ranks gathered, in place of ``indices``."""
    mode, code = code & ~_POSITIONS, code & _POSITIONS
    raw = values.detach().reshape(-1).contiguous().cpu().view(torch.uint8)
    if mode != RAW:
        raw = _values_section(mode, raw.view(values.dtype), steps.cpu())
    if code == FULL:
        return raw
    if code == BLOCK8:
        head = head or block8_head([(indices.cpu(), 0)], numel)
        if head is None:  # (no C compiler)
            indices = indices.cpu()
            head = Head(torch.bincount(indices >> _SHIFT, minlength=-(-numel // BLOCK)).to(torch.uint8),  # [blocks]
                        (indices & (BLOCK - 1)).to(torch.uint8))
        return torch.cat([_padded(torch.cat([head.counts, head.offsets])), raw])
    if code == BITMAP:
        return torch.cat([_padded(_pack_bits(_mask(indices.cpu(), numel))), raw])
    return torch.cat([_padded(indices.cpu().to(torch.int32 if code == IDX32 else torch.int64).view(torch.uint8)), raw])


def _values_section(mode: int, values: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """A mode of steps' values section (see the module's docstring): the sign bits and the exceptions' ordinals in one
    pass (:func:`kernels.block8.exceptions`) where a C compiler builds it."""
    fast = block8_exceptions(steps, mode == SIGN)
    if fast is None:
        fast = (_pack_bits(steps > 0) if mode == SIGN else None,
                _flatnonzero(exceptions(mode, steps)).to(torch.int32))
    bits, ordinals = fast  # [ceil(c / 8)] for SIGN, [E] int32
    carried = steps.view(torch.uint8) if mode == STEP8 else bits
    return torch.cat([_padded(carried), torch.tensor([ordinals.numel()], dtype=torch.int64).view(torch.uint8),
                      _padded(ordinals.view(torch.uint8)), values[ordinals.long()].view(torch.uint8)])


def _padded(t: torch.Tensor) -> torch.Tensor:
    """uint8 ``t`` padded with zeros to a multiple of 8 bytes."""
    return torch.cat([t.reshape(-1), torch.zeros(_up(t.numel(), 8) - t.numel(), dtype=torch.uint8)])


def decode(code: int, payload: torch.Tensor, shape, dtype: torch.dtype, count: int) -> Patch:
    """:func:`encode`'s inverse: the tensor's :class:`Patch` (views of ``payload`` where it can). A BLOCK8 payload on
    the CPU: a packed patch (:class:`~models.engines.weight_patch.Packed`), its counts and sections checked here, its
    positions and values expanded only where the engine needs them (:func:`~models.engines.weight_patch.patch_into`
    applies it from the payload)."""
    numel = _numel(shape)
    if code == FULL:
        return Patch(None, payload.view(dtype).view(list(shape)))
    if code & _POSITIONS != BLOCK8 or payload.device.type != "cpu":
        return _decoded(code, payload, numel, dtype, count)
    mode, blocks = code & ~_POSITIONS, -(-numel // BLOCK)
    at = _head(BLOCK8, numel, count)
    if payload.numel() < at or int(payload[:blocks].sum()) != count:
        raise PushError(f"a delta of {count} elements arrives with positions for another count")
    if mode == RAW:
        carried, ordinals, exact = payload[at:].view(dtype), torch.zeros(0, dtype=torch.int32), payload[:0].view(dtype)
        if carried.numel() != count:
            raise PushError(f"a delta of {count} elements arrives with {carried.numel()} values")
    else:
        carried, ordinals, exact = _section(mode, payload[at:], count, dtype)
    packed = Packed(Head(payload[:blocks], payload[blocks:blocks + count]), mode, carried, ordinals, exact)
    return Patch.of_packed(packed, lambda: _decoded(code, payload, numel, dtype, count))


def _decoded(code: int, payload: torch.Tensor, numel: int, dtype: torch.dtype, count: int) -> Patch:
    mode, code = code & ~_POSITIONS, code & _POSITIONS
    head = _head(code, numel, count)
    values, exact = (payload[head:].view(dtype), None) if mode == RAW else _steps(mode, payload[head:], count, dtype)
    if code == BITMAP:
        indices = _unpack_bits(payload[:-(-numel // 8)], numel).nonzero().reshape(-1)  # [c] ascending
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
    return Patch(indices, values, None if mode == RAW else dtype, exact)


def _section(mode: int, payload: torch.Tensor, count: int, dtype: torch.dtype
             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A values' section in ``mode`` (see the module's docstring), checked: what the mode carries (STEP8: the int8
    steps; SIGN: their bits), the exceptions' ordinals (int32) and values (views of ``payload``)."""
    carried = _steps_bytes(mode, count)
    if payload.numel() < carried + 8:
        raise PushError(f"a delta's steps of {count} elements arrive in {payload.numel()} bytes")
    n = int(payload[carried:carried + 8].view(torch.int64).item())
    at = carried + 8
    ordinals = payload[at:at + 4 * max(n, 0)].view(torch.int32)
    values = payload[_up(at + 4 * max(n, 0), 8):].view(dtype)
    if n < 0 or ordinals.numel() != n or values.numel() != n or (n and int(ordinals.max()) >= count):
        raise PushError(f"a delta's {n} exceptions among {count} steps do not decode")
    return payload[:count] if mode == STEP8 else payload[:carried], ordinals, values


def _steps(mode: int, payload: torch.Tensor, count: int, dtype: torch.dtype):
    """The steps (int8) and the exceptions (ordinals, values) of a values' section in ``mode``."""
    carried, ordinals, values = _section(mode, payload, count, dtype)
    steps = carried.view(torch.int8) if mode == STEP8 else _unpack_bits(carried, count).to(torch.int8) * 2 - 1
    return steps, (ordinals.to(torch.int64), values)  # (SIGN: set +1, clear -1)


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

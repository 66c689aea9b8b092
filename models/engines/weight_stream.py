"""A weight push as a stream of buckets: the layout both ends read (the header), a bucket's bytes, their
checksum and the samples the engine reads back after loading them.

The trainer's weights go to a running engine at the engine's dtype (the trainer casts before sending), bucket
by bucket, so neither end ever holds the whole state at once (the trainer gathers a bucket's tensors, the
engine loads a bucket before it takes the next). :func:`plan_push` lays the tensors out from their names and
shapes alone (no tensor gathered): each bucket one flat byte buffer of at most :data:`BUCKET_BYTES` of
tensors (a bigger tensor gets a bucket of its own), every tensor at a 16-byte-aligned offset, any dtype.
Behind a bucket's tensors come its samples and its checksum::

    [tensor bytes ... | pad to 8][position, bits] x samples (int64)[checksum (int64)]

- **Checksum** (:func:`checksum`): of the bucket's bytes before it (tensors and samples), computed by the
  sender on what it sends and by the receiver on what it received (CRC-32 in host memory, an exact torch
  reduction on a GPU, so a GPU's buffer never crosses to the host for it);
  a mismatch fails the push before that bucket is loaded, naming it and its tensors.
- **Samples**: :data:`SAMPLES` positions of each tensor (seeded per push) and the bits the trainer sent there.
  After the load the engine reads those elements back from its own weights (vLLM: from its workers) and
  :func:`check_read_back` compares them bit for bit: a tensor the engine did not load, or loaded wrongly,
  fails the push naming it, whatever the probe's tolerance.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

BUCKET_BYTES = 256 << 20
"""Most tensor bytes in one bucket (a bigger tensor is a bucket by itself)."""
ALIGN = 16
"""Every tensor starts at a multiple of this many bytes of its bucket."""
SAMPLES = 8
"""Elements of each tensor read back after a push (all of a smaller tensor)."""
_WORD = torch.int64
_MOD = (1 << 61) - 1
"""The checksum is a position-weighted sum of the bucket's 32-bit words modulo this prime."""
_ROW = 1 << 14
"""Words per row of the checksum's reduction: a row's weighted sum stays below 2**63."""
_ROWS_AT_ONCE = 1 << 10
"""Rows reduced per step (64 MiB of words widened at a time)."""


class PushError(RuntimeError):
    """A bucket arrived other than it was sent, or the engine does not hold what was pushed."""


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"the weights header names dtype {name!r}, which torch does not have")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _up(n: int, to: int) -> int:
    return -(-n // to) * to


def wire_dtype(dtype: torch.dtype, engine_dtype: torch.dtype) -> torch.dtype:
    """What a tensor of ``dtype`` travels as: floating point at the engine's dtype, anything else as it is."""
    return engine_dtype if dtype.is_floating_point else dtype


def plan_push(tensors: Sequence[Tuple[str, Sequence[int], torch.dtype]], aliases: Mapping[str, str],
              bucket_bytes: int = BUCKET_BYTES, kind: str = "crc32") -> Dict[str, Any]:
    """The header of a push of ``tensors`` (``(name, shape, dtype sent)``, in the order they are sent) and
    ``aliases`` (``{name: name of the tensor it is}``, a tied head): ``tensors`` as ``[name, dtype, shape,
    bucket, byte offset, samples]``, ``buckets`` as ``[tensor bytes (padded to 8), samples]``, ``checksum`` the
    checksum's kind (:data:`CHECKSUMS`)."""
    header: Dict[str, Any] = {"tensors": [], "buckets": [], "aliases": dict(aliases), "checksum": kind}
    used, samples = 0, 0
    for name, shape, dtype in tensors:
        nbytes = _numel(shape) * dtype.itemsize
        if used and _up(used, ALIGN) + nbytes > bucket_bytes:
            header["buckets"].append([_up(used, 8), samples])
            used, samples = 0, 0
        offset = _up(used, ALIGN)
        n = min(SAMPLES, _numel(shape))
        header["tensors"].append([name, dtype_name(dtype), [int(s) for s in shape], len(header["buckets"]), offset, n])
        used, samples = offset + nbytes, samples + n
    if used or not header["buckets"]:
        header["buckets"].append([_up(used, 8), samples])
    return header


def bucket_nbytes(header: Mapping[str, Any], index: int) -> int:
    """Bytes of bucket ``index`` on the wire: its tensors, its samples (two int64 each), its checksum."""
    data, samples = header["buckets"][index]
    return int(data) + 16 * int(samples) + 8


def tensor_bytes(header: Mapping[str, Any]) -> int:
    """Bytes of the tensors a push carries (each once; padding, samples and checksums not counted)."""
    return sum(_numel(shape) * _dtype(dtype).itemsize for _, dtype, shape, *_ in header["tensors"])


def check_header(header: Mapping[str, Any]) -> None:
    """A header :func:`plan_push` could have written; else ``ValueError`` naming what is wrong."""
    if not isinstance(header, Mapping) or not {"tensors", "buckets", "aliases"} <= set(header):
        raise ValueError(f"not a weights header (needs tensors, buckets, aliases): {str(header)[:200]}")
    names = set()
    for name, dtype, shape, index, offset, samples in header["tensors"]:
        end = int(offset) + _numel(shape) * _dtype(dtype).itemsize
        if not 0 <= index < len(header["buckets"]) or offset < 0 or offset % ALIGN or end > header["buckets"][index][0]:
            raise ValueError(f"the weights header puts {name!r} {shape} ({dtype}) at byte {offset} of bucket {index}, "
                             f"outside it or unaligned")
        if not 0 <= samples <= _numel(shape):
            raise ValueError(f"the weights header samples {samples} elements of {name!r} {shape}")
        names.add(name)
    counts = [0] * len(header["buckets"])
    for *_, index, _, samples in header["tensors"]:
        counts[index] += samples
    if counts != [int(s) for _, s in header["buckets"]]:
        raise ValueError(f"the weights header's buckets declare {[s for _, s in header['buckets']]} samples, its "
                         f"tensors {counts}")
    missing = {a: t for a, t in header["aliases"].items() if t not in names}
    if missing:
        raise ValueError(f"the weights header names aliases of tensors it does not hold: {missing}")


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t``'s elements as int64 (flat): NaN payloads and -0.0 kept."""
    t = t.reshape(-1)
    if t.dtype == torch.bool:
        return t.to(torch.int64)
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(as_int).to(torch.int64)


def _sum61(data: torch.Tensor) -> int:
    """The sum over the 32-bit words ``w[i]`` of ``data`` of ``w[i] * (i % 16384 + 1) * (i // 16384 + 1)`` modulo
    2**61 - 1, in exact integer arithmetic (no overflow, so no dependence on the reduction order): the same value on
    any device, computed where the bytes are (a CUDA buffer is never copied to the host for it)."""
    words = data.view(torch.int32)
    n = words.numel()
    rows = -(-n // _ROW)
    col = torch.arange(1, _ROW + 1, dtype=_WORD, device=data.device)  # [ROW]
    total = 0
    for r0 in range(0, rows, _ROWS_AT_ONCE):
        r1 = min(rows, r0 + _ROWS_AT_ONCE)
        chunk = words[r0 * _ROW:min(n, r1 * _ROW)].to(_WORD)
        if chunk.numel() < (r1 - r0) * _ROW:  # the last row, zero-padded
            chunk = torch.cat([chunk, chunk.new_zeros((r1 - r0) * _ROW - chunk.numel())])
        sums = (chunk.view(r1 - r0, _ROW) * col).sum(dim=1) % _MOD  # [rows], each below 2**61
        for r, s in zip(range(r0, r1), sums.tolist()):
            total = (total + s * (r + 1)) % _MOD
    return total


def _crc32(data: torch.Tensor) -> int:
    """zlib's CRC-32 of the bytes (1.4 GB/s on one core here, 3x the torch reduction on the CPU)."""
    import zlib

    return zlib.crc32(data.cpu().numpy())


CHECKSUMS = {"crc32": _crc32, "sum61": _sum61}
"""A bucket's checksum by name: CRC-32 for buffers in host memory, :func:`_sum61` for buffers on a GPU (NCCL).
The sender names the one it used in the header; the receiver computes the same one on what it received."""


def checksum_kind(device: torch.device) -> str:
    return "crc32" if device.type == "cpu" else "sum61"


def checksum(data: torch.Tensor, kind: str = "crc32") -> int:
    """The checksum ``kind`` (:data:`CHECKSUMS`) of the bytes ``data`` (uint8, a multiple of 8 long)."""
    if kind not in CHECKSUMS:
        raise ValueError(f"the weights header names checksum {kind!r}; this engine knows {sorted(CHECKSUMS)}")
    return CHECKSUMS[kind](data)


def sample_positions(numel: int, n: int, generator: torch.Generator) -> torch.Tensor:
    """The ``n`` flat positions (sorted) a push samples of a tensor of ``numel`` elements, drawn from ``generator``."""
    return torch.randint(0, max(numel, 1), (n,), generator=generator).sort().values


class BucketWriter:
    """The sender's side of one bucket: its buffer, filled tensor by tensor, then sealed (samples and checksum)."""

    def __init__(self, header: Mapping[str, Any], index: int, device: torch.device, generator: torch.Generator):
        self.header, self.index, self.generator = header, index, generator
        self.entries = [t for t in header["tensors"] if t[3] == index]
        self.buffer = torch.empty(bucket_nbytes(header, index), dtype=torch.uint8, device=device)  # [bytes]
        self.samples: List[torch.Tensor] = []  # per tensor [2, n]: positions, bits
        self.filled = 0

    def put(self, name: str, tensor: torch.Tensor) -> None:
        """Copy ``tensor`` into its slot, cast to the dtype the header gives it (float32 → bfloat16: round to
        nearest even, as ``Tensor.to`` and a checkpoint load do)."""
        entry = self.entries[self.filled]
        _, dtype, shape, _, offset, n = entry
        if entry[0] != name or list(tensor.shape) != shape:
            raise ValueError(f"the push sends {name!r} {list(tensor.shape)} where its header has {entry[0]!r} {shape}")
        nbytes = _numel(shape) * _dtype(dtype).itemsize
        slot = self.buffer[offset:offset + nbytes].view(_dtype(dtype)).view(shape)
        slot.copy_(tensor)
        positions = sample_positions(_numel(shape), n, self.generator)  # [n]
        self.samples.append(torch.stack([positions, bits(slot.reshape(-1)[positions.to(slot.device)]).cpu()]))
        self.filled += 1

    def seal(self) -> torch.Tensor:
        """The bucket's bytes, ready to send: every tensor put, the samples and the checksum written."""
        if self.filled != len(self.entries):
            raise ValueError(f"bucket {self.index} of the push is sealed with {self.filled} of its "
                             f"{len(self.entries)} tensors")
        data = int(self.header["buckets"][self.index][0])
        tail = torch.cat([s for s in self.samples] + [torch.zeros(2, 0, dtype=_WORD)], dim=1)  # [2, samples]
        words = self.buffer[data:-8].view(_WORD)
        words.copy_(tail.t().reshape(-1))  # (position, bits) pairs
        kind = self.header.get("checksum", "crc32")
        self.buffer[-8:].view(_WORD).fill_(checksum(self.buffer[:-8], kind))
        return self.buffer


Samples = Dict[str, List[Tuple[int, int]]]
"""``{tensor name: [(flat position, bits sent), ...]}``."""


def open_bucket(header: Mapping[str, Any], index: int, buffer: torch.Tensor) -> Tuple[Dict[str, torch.Tensor],
                                                                                      Samples]:
    """The receiver's side: bucket ``index`` as received, its checksum checked (:class:`PushError` naming the
    bucket and its tensors on a mismatch): its tensors (views of ``buffer``) and its samples."""
    entries = [t for t in header["tensors"] if t[3] == index]
    got = checksum(buffer[:-8], header.get("checksum", "crc32"))
    sent = int(buffer[-8:].view(_WORD).item())
    if got != sent:
        names = [e[0] for e in entries]
        raise PushError(f"bucket {index} of the push arrived other than it was sent (checksum {got:#x}, sent "
                        f"{sent:#x}); it holds {names[:4]}{' ...' if len(names) > 4 else ''}")
    tensors = {}
    for name, dtype, shape, _, offset, _ in entries:
        nbytes = _numel(shape) * _dtype(dtype).itemsize
        tensors[name] = buffer[offset:offset + nbytes].view(_dtype(dtype)).view(shape)
    return tensors, read_samples(header, index, buffer[int(header["buckets"][index][0]):-8])


def read_samples(header: Mapping[str, Any], index: int, tail: torch.Tensor) -> Samples:
    """Bucket ``index``'s samples from ``tail``, the bytes of its ``(position, bits)`` pairs."""
    pairs = tail.view(_WORD).view(-1, 2).cpu().tolist()  # [(position, bits)]
    samples: Samples = {}
    k = 0
    for name, *_, n in (t for t in header["tensors"] if t[3] == index):
        samples[name] = [(int(p), int(b)) for p, b in pairs[k:k + n]]
        k += n
    return samples


def check_read_back(header: Mapping[str, Any], sent: Samples, held: Mapping[str, Sequence[Sequence[int]]],
                    what: str, shard: bool = False) -> Dict[str, List[int]]:
    """``held``: per tensor and sampled position, the bits the engine holds there (from each of its workers that
    holds that element; none: no worker does). :class:`PushError` naming the first tensor whose element is
    missing or differs from what was sent; a float zero of either sign is the same weight (a read through a
    kernel, ``w * 1 + 0``, cannot tell them apart). ``shard``: the engine is one rank of a tensor-parallel group,
    holding its shard: an element it does not hold is not missing here (the group's union is checked apart:
    :func:`models.hosts.colocated.uncovered`). The positions it holds, per tensor."""
    dtypes = {name: _dtype(dtype) for name, dtype, *_ in header["tensors"]}
    holds: Dict[str, List[int]] = {}
    for name, samples in sent.items():
        found = held.get(name)
        if found is None or len(found) != len(samples):
            raise PushError(f"{what}: the engine cannot read back {name!r}: it holds no such weight")
        sign = 1 << (dtypes[name].itemsize * 8 - 1) if dtypes[name].is_floating_point else 0
        holds[name] = [position for (position, _), got in zip(samples, found) if got]
        for (position, want), got in zip(samples, found):
            if not got and not shard:
                raise PushError(f"{what}: the engine did not load {name!r}: element {position} is in none of its "
                                f"weights")
            wrong = [b for b in got if b != want and not (sign and _zero(b, sign) and _zero(want, sign))]
            if wrong:
                raise PushError(f"{what}: the engine holds other weights than were sent in {name!r}: element "
                                f"{position} holds bits {wrong[0] & (2 * sign - 1 if sign else -1):#x} where the "
                                f"trainer sent {want & (2 * sign - 1 if sign else -1):#x}")
    return holds


def _zero(value: int, sign: int) -> bool:
    """Whether ``value`` (bits read as a signed integer) is +0.0 or -0.0 of a float whose sign bit is ``sign``."""
    return value % (2 * sign) in (0, sign)


def positions(samples: Samples) -> Dict[str, List[int]]:
    """``{name: sampled positions}``: what the engine is asked to read back."""
    return {name: [p for p, _ in pairs] for name, pairs in samples.items()}


def merge_held(parts: Iterable[Mapping[str, Sequence[Optional[int]]]]) -> Dict[str, List[List[int]]]:
    """Per tensor and position, the bits every worker (``parts``: each worker's ``{name: [bits or None]}``) holds."""
    out: Dict[str, List[List[int]]] = {}
    for part in parts:
        for name, values in part.items():
            slots = out.setdefault(name, [[] for _ in values])
            for slot, value in zip(slots, values):
                if value is not None:
                    slot.append(int(value))
    return out

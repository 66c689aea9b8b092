"""A worker's share of a push: the parts of each tensor one tensor-parallel worker of the engine loads, and the
bytes that carry them straight to it (:mod:`models.engines.worker_channel`), so each worker receives its shard and
no process holds the whole push for it.

A share is, per tensor name, the regions of the tensor the worker's loaders read (``(storage offset, shape,
stride)`` of a view of the contiguous tensor, in elements: a block of rows for a layer split by rows, of columns for
one split by columns, the whole tensor for a replicated norm), as :func:`models.engines.vllm_push._where` finds them
with one dry run of the model's loaders. A tensor the share does not name travels whole.

A share of bucket ``index`` on the wire::

    [region bytes, each at a 16-byte-aligned offset ... | pad to 8][the bucket's samples][checksum (int64)]

The samples are the bucket's own (positions in the whole tensors, read back from every worker afterwards); the
checksum is of the share's bytes before it, of the header's kind. The receiving worker rebuilds each tensor at its
full shape with its regions filled (the rest is never read by its loaders) and loads it as a whole bucket's.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from models.engines.weight_stream import ALIGN, PushError, Samples, _dtype, _numel, _up, checksum, read_samples

Region = Tuple[int, Tuple[int, ...], Tuple[int, ...]]
Share = Mapping[str, Sequence[Region]]
"""``{tensor name: regions it loads}``."""


def distinct_regions(regions: Sequence[Sequence[Any]]) -> List[Region]:
    """``regions`` without repeats (a tied tensor is read twice in the same place), in a fixed order, as plain
    tuples (JSON gives lists)."""
    out = {(int(o), tuple(int(s) for s in shape), tuple(int(s) for s in stride)) for o, shape, stride in regions}
    return sorted(out)


def _whole(shape: Sequence[int]) -> Region:
    stride, step = [], 1
    for s in reversed([int(s) for s in shape]):
        stride.append(step)
        step *= s
    return 0, tuple(int(s) for s in shape), tuple(reversed(stride))


Place = Tuple[str, torch.dtype, List[int], Region, int]
"""A region on the wire: ``(tensor name, dtype, tensor shape, region, byte offset in the share)``."""


def layout(header: Mapping[str, Any], index: int, share: Optional[Share]) -> Tuple[List[Place], int]:
    """Bucket ``index``'s share on the wire: ``[(name, dtype, tensor shape, region, byte offset)]`` and the bytes
    of the regions (padded to 8)."""
    out, end = [], 0
    for name, dtype, shape, at, _, _ in header["tensors"]:
        if at != index:
            continue
        regions = (share or {}).get(name)
        for region in (distinct_regions(regions) if regions else [_whole(shape)]):
            offset = _up(end, ALIGN)
            out.append((name, _dtype(dtype), list(shape), region, offset))
            end = offset + _numel(region[1]) * _dtype(dtype).itemsize
    return out, _up(end, 8)


def share_nbytes(header: Mapping[str, Any], index: int, share: Optional[Share]) -> int:
    """Bytes of bucket ``index``'s share on the wire (regions, the bucket's samples, the checksum)."""
    return layout(header, index, share)[1] + 16 * int(header["buckets"][index][1]) + 8


def tensor_share_bytes(header: Mapping[str, Any], share: Optional[Share]) -> int:
    """The tensor bytes a worker with ``share`` receives over the whole push (padding, samples, checksums not
    counted): what it loads, its shard's part of :func:`models.engines.weight_stream.tensor_bytes`."""
    return sum(_numel(region[1]) * dtype.itemsize for index in range(len(header["buckets"]))
               for _, dtype, _, region, _ in layout(header, index, share)[0])


def _view(flat: torch.Tensor, region: Region) -> torch.Tensor:
    offset, shape, stride = region
    return flat.as_strided(shape, stride, flat.storage_offset() + offset)


def pack(header: Mapping[str, Any], index: int, bucket: torch.Tensor, share: Optional[Share]) -> torch.Tensor:
    """The share ``share`` of sealed bucket ``index`` (:meth:`~models.engines.weight_stream.BucketWriter.seal`),
    sealed with its own checksum, on the bucket's device."""
    places, data = layout(header, index, share)
    offsets = {e[0]: (e[1], e[2], e[4]) for e in header["tensors"] if e[3] == index}
    samples = bucket[int(header["buckets"][index][0]):-8]
    out = torch.empty(data + samples.numel() + 8, dtype=torch.uint8, device=bucket.device)
    for name, dtype, shape, region, at in places:
        _, _, start = offsets[name]
        tensor = bucket[start:start + _numel(shape) * dtype.itemsize].view(dtype)
        n = _numel(region[1]) * dtype.itemsize
        out[at:at + n].view(dtype).view(region[1]).copy_(_view(tensor, region))
    out[data:-8].copy_(samples)
    out[-8:].view(torch.int64).fill_(checksum(out[:-8], header.get("checksum", "crc32")))
    return out


def unpack(header: Mapping[str, Any], index: int, payload: torch.Tensor, share: Optional[Share]
           ) -> Tuple[Dict[str, torch.Tensor], Samples]:
    """The receiving worker's side of :func:`pack`: the checksum checked (:class:`PushError` naming the bucket on a
    mismatch), each tensor at its full shape with its regions filled (on ``payload``'s device), and the samples."""
    places, data = layout(header, index, share)
    if payload.numel() != data + 16 * int(header["buckets"][index][1]) + 8:
        raise PushError(f"bucket {index}'s share of the push arrived with {payload.numel()} bytes where this worker's "
                        f"share is {share_nbytes(header, index, share)}")
    got = checksum(payload[:-8], header.get("checksum", "crc32"))
    sent = int(payload[-8:].view(torch.int64).item())
    if got != sent:
        raise PushError(f"bucket {index}'s share of the push arrived other than it was sent (checksum {got:#x}, "
                        f"sent {sent:#x})")
    tensors: Dict[str, torch.Tensor] = {}
    for name, dtype, shape, region, at in places:
        if name not in tensors:
            tensors[name] = torch.empty(shape, dtype=dtype, device=payload.device)
        n = _numel(region[1]) * dtype.itemsize
        _view(tensors[name].reshape(-1), region).copy_(payload[at:at + n].view(dtype).view(region[1]))
    return tensors, read_samples(header, index, payload[data:-8])

"""The engine's copy of the weights last pushed, kept by the trainer (``run.weight_push=delta``): per rank, its own
part of each tensor (its FSDP2 rows; rank 0 the whole tensor where the trainer is not sharded) at the engine's dtype
on the host, so a push can send only what changed since.

:meth:`Shadow.deltas` casts each rank's part to the engine's dtype, compares its bits with the part kept, keeps the
new part and gives rank 0 each tensor's :class:`~models.engines.weight_delta.Delta`: every rank counts its changed
elements and the steps of their bits (:func:`~models.engines.weight_delta.step_mode`), all learn the total and the
mode all steps allow (so all pick the same encoding, :func:`~models.engines.weight_delta.choose`), and rank 0 gathers
only the changed elements (their flat positions in the whole tensor, values and steps), or the whole tensor where
that is smaller. The samples read back after the push are drawn alike on every rank (a generator seeded by
the push and the tensor): :data:`~models.engines.weight_stream.SAMPLES` positions anywhere (their bits summed to
rank 0 from the one rank holding each) and as many among the changed elements, so a lost or misplaced delta is
caught where a sample of the whole tensor would rarely land.
"""

from __future__ import annotations

import math
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from models.engines.weight_delta import (FULL, RAW, Delta, changed, choose, encode, exceptions_of,
                                         mode_of, sparse_code, step_mode, steps_of)
from models.engines.weight_stream import SAMPLES, bits
from models.training.weight_source import WeightSource


class Shadow:
    """``tensors``: this rank's part of each tensor as last pushed; ``base``: the id of the push the engine
    confirmed holding them ("" until one is confirmed, and after a push that failed)."""

    def __init__(self) -> None:
        self.tensors: Dict[str, torch.Tensor] = {}
        self.base = ""

    def keep(self, name: str, local: torch.Tensor) -> None:
        """A full push's part of ``name`` (this rank's, at the engine's dtype): kept as the engine's."""
        self.tensors[name] = _host_copy(local, local)

    def deltas(self, source: WeightSource, dtype: torch.dtype, push: int
               ) -> Iterator[Tuple[str, Optional[Delta]]]:
        """Every tensor of ``source`` in send order: its :class:`Delta` on rank 0, None on the others (a collective
        under FSDP2: every rank iterates all of it; without FSDP2 only rank 0 has anything to do)."""
        sharded = source.sharded()
        if not sharded and not source.info.is_main:
            return
        for i, (name, t) in enumerate(source.state.items()):
            gen = torch.Generator().manual_seed(int(push) * 1_000_003 + i)
            cast = dtype if t.dtype.is_floating_point else None
            whole = not hasattr(t, "to_local") or _replicated(t)
            local = t.detach().to_local() if hasattr(t, "to_local") else t.detach()
            new = _host_copy(local if cast is None else local.to(cast), local)
            old = self.tensors.get(name)
            indices = changed(new, old)  # [c] ascending
            self.tensors[name] = new
            old = old if cast is not None and new.element_size() in (2, 4) and \
                old is not None and old.shape == new.shape and old.dtype == new.dtype else None  # steps from it
            if whole:
                yield name, _whole_delta(new, old, indices, gen) if source.info.is_main else None
            else:
                yield name, _sharded_delta(t, new, old, indices, gen, source, cast)


def _host_copy(t: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
    """``t`` on the host, never sharing memory with ``owner`` (the trained weight itself)."""
    out = t.to("cpu")
    return out.clone() if out.untyped_storage().data_ptr() == owner.untyped_storage().data_ptr() else out


def _replicated(t) -> bool:
    from torch.distributed.tensor import Replicate

    return isinstance(t.placements[0], Replicate)


def _positions(gen: torch.Generator, numel: int) -> torch.Tensor:
    return torch.randint(0, max(numel, 1), (min(SAMPLES, numel),), generator=gen)  # [n]


def _among(gen: torch.Generator, indices: torch.Tensor) -> torch.Tensor:
    if not indices.numel():
        return indices
    return indices[torch.randint(0, indices.numel(), (min(SAMPLES, indices.numel()),), generator=gen)]


def _sample_table(positions: torch.Tensor, values_bits: torch.Tensor) -> torch.Tensor:
    """``[2, n]``: positions (sorted, unique) and their bits."""
    order = torch.argsort(positions, stable=True)
    positions, values_bits = positions[order], values_bits[order]
    keep = torch.ones_like(positions, dtype=torch.bool)
    keep[1:] = positions[1:] != positions[:-1]
    return torch.stack([positions[keep], values_bits[keep]])


def _steps(new: torch.Tensor, old: Optional[torch.Tensor], indices: torch.Tensor) -> Optional[torch.Tensor]:
    """The steps of the changed elements' bits (:func:`~models.engines.weight_delta.steps_of`; None without
    ``old``)."""
    return None if old is None else steps_of(new.reshape(-1)[indices], old.reshape(-1)[indices])  # [c] int8


def _whole_delta(new: torch.Tensor, old: Optional[torch.Tensor], indices: torch.Tensor, gen: torch.Generator
                 ) -> Delta:
    flat, numel = new.reshape(-1), new.numel()
    steps = _steps(new, old, indices)
    mode, exact = mode_of(steps, new.element_size())
    code = sparse_code(numel, indices, new.element_size(), mode=mode, exact=exact)
    payload = encode(code, numel, indices, flat if code == FULL else flat[indices], steps)
    at = torch.cat([_positions(gen, numel), _among(gen, indices)])
    return Delta(code, indices.numel(), payload, _sample_table(at, bits(flat[at])))


def _sharded_delta(t, new: torch.Tensor, old: Optional[torch.Tensor], local_idx: torch.Tensor, gen: torch.Generator,
                   source: WeightSource, cast: Optional[torch.dtype]) -> Optional[Delta]:
    """A tensor FSDP2 shards along dim 0 (``ceil(rows / ranks)`` rows a rank): counts and the steps' modes
    all-gathered, the changed elements (or, smaller, the whole tensor) gathered to rank 0, the samples anywhere
    summed to it."""
    from models.training.weight_shards import gather_to

    info, device = source.info, source.info.device
    numel, rows = t.numel(), t.shape[0]
    row = numel // rows if rows else 0
    start = min(info.rank * math.ceil(rows / info.world_size), rows) * row  # my first element's flat position
    steps = _steps(new, old, local_idx)
    here = [local_idx.numel(), *exceptions_of(steps), int(steps is None)]
    counts = [torch.zeros(4, dtype=torch.int64, device=device) for _ in range(info.world_size)]
    dist.all_gather(counts, torch.tensor(here, dtype=torch.int64, device=device))
    counts_list = [int(c[0].item()) for c in counts]
    total = torch.stack(counts).sum(dim=0).tolist()  # changed, SIGN's and STEP8's exceptions, ranks without steps
    mode, exact = (RAW, 0) if total[3] else step_mode(total[0], total[1], total[2], new.element_size())
    code = choose(numel, sum(counts_list), new.element_size(), mode=mode, exact=exact)
    anywhere = _positions(gen, numel)
    mine = (anywhere >= start) & (anywhere < start + new.numel())
    held = torch.where(mine, bits(new.reshape(-1)[(anywhere - start).clamp(0, max(new.numel() - 1, 0))])
                       if new.numel() else torch.zeros_like(anywhere), torch.zeros_like(anywhere)).to(device)
    dist.reduce(held, dst=0)
    if code == FULL:
        whole = gather_to(t, 0, info, torch.device("cpu"), cast)
        if whole is None:
            return None
        flat = whole.reshape(-1)
        return Delta(code, sum(counts_list), encode(FULL, numel, None, flat),
                     _sample_table(anywhere, held.cpu()))
    parts = [local_idx + start, new.reshape(-1)[local_idx]] + ([steps] if mode != RAW else [])
    gathered = _gather_changed(parts, counts_list, info)
    if gathered is None:
        return None
    indices, values, *rest = gathered
    code = sparse_code(numel, indices, new.element_size(), full=False, mode=mode, exact=exact)  # among sparse ones
    at = _among(gen, indices)
    table = torch.cat([torch.stack([anywhere, held.cpu()]),
                       torch.stack([at, bits(values[torch.searchsorted(indices, at)])])], dim=1)
    return Delta(code, indices.numel(), encode(code, numel, indices, values, *rest),
                 _sample_table(table[0], table[1]))


def _gather_changed(parts: List[torch.Tensor], counts: List[int], info) -> Optional[List[torch.Tensor]]:
    """Every rank's ``parts`` (its changed elements' positions, values, steps: one element each), in rank order
    (ascending), on rank 0 (as bytes, padded to the largest count for the gather); None on the others."""
    most, device, out = max(counts), info.device, []
    for part in parts:
        size = part.element_size()
        pad = torch.zeros(most * size, dtype=torch.uint8, device=device)  # as bytes: every backend gathers those
        pad[:part.numel() * size] = part.contiguous().view(torch.uint8).to(device)
        got = [torch.empty_like(pad) for _ in counts] if info.is_main else None
        dist.gather(pad, got, dst=0)
        if info.is_main:
            out.append(torch.cat([p[:c * size].cpu() for p, c in zip(got, counts)]).view(part.dtype))
    return out if info.is_main else None

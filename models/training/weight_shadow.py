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
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from kernels.bit_steps import changed_steps, warm
from models.engines.weight_delta import (FULL, RAW, Delta, changed, choose, encode, encoded, exceptions_of,
                                         step_mode, steps_of)
from models.engines.weight_stream import SAMPLES, bits
from models.training.weight_source import WeightSource


GROUP_ELEMENTS = 1 << 28
"""Elements (of whole tensors) whose deltas are made together, a few collectives for all of them
(:class:`_Sharded`): five a tensor cost a push of the 0.6B model 0.4 s of waiting on gloo's round trips."""


class Shadow:
    """``tensors``: this rank's part of each tensor as last pushed; ``base``: the id of the push the engine
    confirmed holding them ("" until one is confirmed, and after a push that failed)."""

    def __init__(self) -> None:
        self.tensors: Dict[str, torch.Tensor] = {}
        self.base = ""
        warm()  # the one pass's library built meanwhile (:func:`kernels.bit_steps.changed_steps`)

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
        parts, size = [], 0
        for i, (name, t) in enumerate(source.state.items()):
            gen = torch.Generator().manual_seed(int(push) * 1_000_003 + i)
            cast = dtype if t.dtype.is_floating_point else None
            local = t.detach().to_local() if hasattr(t, "to_local") else t.detach()
            parts.append(_Part(name, t, *self._changed(name, local, cast), gen=gen, cast=cast))
            size += t.numel()
            if size >= GROUP_ELEMENTS:
                yield from _group(parts, source.info)
                parts, size = [], 0
        yield from _group(parts, source.info)

    def _changed(self, name: str, local: torch.Tensor, cast: Optional[torch.dtype]
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor], Tuple[int, int]]:
        """This rank's part of ``name`` at the engine's dtype (kept from now as the engine's), the flat positions of
        its elements whose bits changed ([c], ascending), their new values ([c]) and their steps (:func:`~models.
        engines.weight_delta.steps_of`; None where the part kept is not of the same shape and dtype, or the values are
        not floats of 2 or 4 bytes) with the exceptions SIGN and STEP8 would leave. A float32 part on the host goes
        through one pass (:func:`kernels.bit_steps.changed_steps`), which also writes the new values into the part
        kept; otherwise the cast, the compare, the steps and the count are passes of their own."""
        old = self.tensors.get(name)
        fast = changed_steps(local, old, keep=True) if cast is not None and old is not None and old.dtype == cast \
            else None
        if fast is not None:
            return old, *fast
        new = _host_copy(local if cast is None else local.to(cast), local)
        indices = changed(new, old)  # [c] ascending
        self.tensors[name] = new
        stepping = cast is not None and new.element_size() in (2, 4) and \
            old is not None and old.shape == new.shape and old.dtype == new.dtype
        flat = new.reshape(-1)
        values = flat if indices.numel() == flat.numel() else flat[indices]  # (all changed: no copy of the whole)
        steps = steps_of(values, old.reshape(-1)[indices]) if stepping else None
        return new, indices, values, steps, exceptions_of(steps)


def _host_copy(t: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
    """``t`` on the host, never sharing memory with ``owner`` (the trained weight itself)."""
    out = t.to("cpu")
    return out.clone() if out.untyped_storage().data_ptr() == owner.untyped_storage().data_ptr() else out


def _replicated(t) -> bool:
    from torch.distributed.tensor import Replicate

    return isinstance(t.placements[0], Replicate)


def _positions(gen: torch.Generator, numel: int) -> torch.Tensor:
    """:data:`SAMPLES` draws below ``numel`` (all of them where fewer): positions in a tensor, or ordinals among its
    changed elements."""
    return torch.randint(0, max(numel, 1), (min(SAMPLES, numel),), generator=gen)  # [n]


def _among(gen: torch.Generator, indices: torch.Tensor) -> torch.Tensor:
    return indices[_positions(gen, indices.numel())]  # (ordinals among them)


def _positions_of(pieces: List[Tuple[torch.Tensor, int]], ordinals: torch.Tensor) -> torch.Tensor:
    """The flat positions (int64) of the changed elements at ``ordinals`` among those of ``pieces`` (in order)."""
    ends = np.cumsum([p.numel() for p, _ in pieces])  # numpy's indexing: a few microseconds a tensor, not torch's tens
    which = np.searchsorted(ends, ordinals.numpy(), side="right")  # [n]: the piece of each
    out = np.zeros(ordinals.numel(), np.int64)
    for k in np.unique(which):
        mine = which == k
        positions, start = pieces[k]
        out[mine] = positions.numpy()[ordinals.numpy()[mine] - (ends[k] - positions.numel())] + start
    return torch.from_numpy(out) if out.size else torch.zeros(0, dtype=torch.int64)


def _sample_table(positions: torch.Tensor, values_bits: torch.Tensor) -> torch.Tensor:
    """``[2, n]``: positions (sorted, unique) and their bits."""
    order = torch.argsort(positions, stable=True)
    positions, values_bits = positions[order], values_bits[order]
    keep = torch.ones_like(positions, dtype=torch.bool)
    keep[1:] = positions[1:] != positions[:-1]
    return torch.stack([positions[keep], values_bits[keep]])


def _whole_delta(p: "_Part") -> Delta:
    new, steps, indices, gen = p.new, p.steps, p.indices, p.gen
    flat, numel = new.reshape(-1), new.numel()
    mode, exact = (RAW, 0) if steps is None else step_mode(indices.numel(), *p.exceptions, new.element_size())
    code, payload = encoded(numel, [(indices, 0)], p.values, steps, mode, exact, whole=flat)
    at = torch.cat([_positions(gen, numel), _among(gen, indices)])
    return Delta(code, indices.numel(), payload, _sample_table(at, bits(flat[at])))


class _Part(NamedTuple):
    """One tensor of a push on this rank: the trained tensor, this rank's part at the engine's dtype (``new``),
    its changed elements' flat positions in the part, their new values and steps (with the exceptions SIGN and
    STEP8 would leave), the samples' generator, the cast."""

    name: str
    t: Any
    new: torch.Tensor
    indices: torch.Tensor
    values: torch.Tensor
    steps: Optional[torch.Tensor]
    exceptions: Tuple[int, int]
    gen: torch.Generator
    cast: Optional[torch.dtype]

    @property
    def whole(self) -> bool:
        return not hasattr(self.t, "to_local") or _replicated(self.t)


def _group(parts: List[_Part], info) -> Iterator[Tuple[str, Optional[Delta]]]:
    """The deltas of ``parts`` in their order; those of tensors FSDP2 shards along dim 0 (``ceil(rows / ranks)``
    rows a rank) made together (:class:`_Sharded`: every rank takes part)."""
    sharded = [p for p in parts if not p.whole]
    together = _Sharded(sharded, info) if sharded else None
    for p in parts:
        if p.whole:
            yield p.name, _whole_delta(p) if info.is_main else None
        else:
            yield p.name, together.delta(p)


class _Sharded:
    """Sharded tensors' deltas, a few collectives for all of them: each rank's counts (changed elements, the
    exceptions SIGN and STEP8 would leave, whether it has steps) all-gathered, so every rank picks every tensor's
    encoding alike; the bits at the samples anywhere summed to rank 0 from the rank holding each; then one gather to
    rank 0 of every rank's changed elements (positions, values, steps) of the tensors a sparse encoding carries, and
    for any that is smaller whole (:data:`~models.engines.weight_delta.FULL`) its own gather, in order."""

    def __init__(self, parts: List[_Part], info) -> None:
        self.info, device = info, info.device
        here, held, self.anywhere, self.plans = [], [], {}, {}
        self.starts = {}
        for p in parts:
            numel, rows = p.t.numel(), p.t.shape[0]
            self.starts[p.name] = [min(r * math.ceil(rows / info.world_size), rows) * (numel // rows if rows else 0)
                                   for r in range(info.world_size)]  # each rank's first element's flat position
            start = self.starts[p.name][info.rank]
            at = _positions(p.gen, numel)
            mine = (at >= start) & (at < start + p.new.numel())
            flat = p.new.reshape(-1)
            held.append(torch.where(mine, bits(flat[(at - start).clamp(0, max(flat.numel() - 1, 0))])
                                    if flat.numel() else torch.zeros_like(at), torch.zeros_like(at)))
            here.append([p.indices.numel(), *p.exceptions, int(p.steps is None)])
            self.anywhere[p.name] = at
        counts = [torch.zeros(len(parts), 4, dtype=torch.int64, device=device) for _ in range(info.world_size)]
        dist.all_gather(counts, torch.tensor(here, dtype=torch.int64, device=device))
        self.counts = torch.stack(counts).cpu()  # [ranks, parts, 4]
        held_all = torch.cat(held).to(device)
        dist.reduce(held_all, dst=0)
        self.held = dict(zip([p.name for p in parts], held_all.cpu().split([h.numel() for h in held])))
        for k, p in enumerate(parts):
            total = self.counts[:, k].sum(dim=0).tolist()  # changed, SIGN's and STEP8's exceptions, ranks w/o steps
            size = p.new.element_size()
            mode, exact = (RAW, 0) if total[3] else step_mode(total[0], total[1], total[2], size)
            self.plans[p.name] = (choose(p.t.numel(), total[0], size, mode=mode, exact=exact), mode, exact, k)
        self.gathered = self._gather([p for p in parts if self.plans[p.name][0] != FULL])

    def _gather(self, parts: List[_Part]) -> Dict[str, List[torch.Tensor]]:
        """Rank 0: per tensor its changed elements' positions (a piece per rank: the positions within its part, as
        gathered, and its part's first element), values and steps (with a mode of steps; else None), every rank's
        in rank order (ascending): one gather of each rank's bytes, padded to the most."""
        if not parts:
            return {}
        info = self.info
        count = self.counts[:, [self.plans[p.name][3] for p in parts], 0]  # [ranks, parts]
        wide = max(p.t.numel() for p in parts) >= 1 << 31  # positions within a rank's part: int32 where any fits
        # (decided from the whole tensors, so that every rank lays its bytes out alike)
        position = torch.int64 if wide else torch.int32
        sizes = torch.tensor([[8 if wide else 4, p.new.element_size(), int(self.plans[p.name][1] != RAW)]
                              for p in parts])
        lengths = [(count[r, :, None] * sizes).t().reshape(-1).tolist() for r in range(info.world_size)]
        mine = [p.indices.to(position).view(torch.uint8) for p in parts] + \
            [p.values.reshape(-1).view(torch.uint8) for p in parts] + \
            [p.steps.view(torch.uint8) if self.plans[p.name][1] != RAW else torch.zeros(0, dtype=torch.uint8)
             for p in parts]  # positions, then values, then steps (as bytes: every backend gathers those)
        most = max(sum(lens) for lens in lengths)
        pad = torch.empty(most, dtype=torch.uint8)  # (the padding is never read)
        torch.cat(mine, out=pad[:sum(lengths[info.rank])])
        got = [torch.empty(most, dtype=torch.uint8, device=info.device) for _ in lengths] if info.is_main else None
        dist.gather(pad.to(info.device), got, dst=0)
        if not info.is_main:
            return {}
        pieces = [list(g.cpu()[:sum(lens)].split(lens)) for g, lens in zip(got, lengths)]  # [ranks][3 * parts]
        out = {}
        for k, p in enumerate(parts):
            starts = self.starts[p.name]  # [ranks]: each rank's first element's flat position in the whole tensor
            kinds = [[pieces[r][j * len(parts) + k] for r in range(len(pieces))] for j in range(3)]
            out[p.name] = [[(at.view(position), start) for at, start in zip(kinds[0], starts)],
                           torch.cat(kinds[1]).view(p.new.dtype),
                           torch.cat(kinds[2]).view(torch.int8) if self.plans[p.name][1] != RAW else None]
        return out

    def delta(self, p: _Part) -> Optional[Delta]:
        """``p``'s delta on rank 0 (None on the others), its whole tensor gathered here where that is smaller."""
        from models.training.weight_shards import gather_to

        code, mode, exact, k = self.plans[p.name]
        numel, anywhere, held = p.t.numel(), self.anywhere[p.name], self.held[p.name]
        if code == FULL:
            whole = gather_to(p.t, 0, self.info, torch.device("cpu"), p.cast)
            if whole is None:
                return None
            return Delta(code, int(self.counts[:, k, 0].sum()), encode(FULL, numel, None, whole.reshape(-1)),
                         _sample_table(anywhere, held))
        if not self.info.is_main:
            return None
        pieces, values, steps = self.gathered.pop(p.name)
        code, payload = encoded(numel, pieces, values, steps, mode, exact)
        ordinals = _positions(p.gen, values.numel())  # among the changed elements
        table = torch.cat([torch.stack([anywhere, held]),
                           torch.stack([_positions_of(pieces, ordinals), bits(values[ordinals])])], dim=1)
        return Delta(code, values.numel(), payload, _sample_table(table[0], table[1]))

"""The trained weights as a push sends them (``run.resident``): gathered and cast one tensor at a time, never the
whole float32 state at once.

Names, shapes and the tensors that are one (a tied head) come from the model without gathering anything
(:meth:`WeightSource.tensors`); :meth:`WeightSource.gathered` then gives each tensor whole on rank 0, in that
order, on the device the push sends from. Under FSDP2 that is a gather per tensor (:func:`gather_to`: rank 0
receives every rank's rows, the others hold nothing extra), a collective: every rank iterates in step
(:meth:`WeightSource.follow`), whatever rank 0 does with the tensors. DDP and one process hold every tensor
whole already.
"""

from __future__ import annotations

import copy
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Tuple, Union

import torch
from torch import nn

from models.training.distributed import DistInfo
from models.training.host_collectives import full_tensor
from models.training.weight_shards import gather_to


def _key(t: torch.Tensor) -> Tuple:
    """Two entries of a state dict with this key are one tensor (a DTensor by identity: its shards have no
    shared storage to compare)."""
    if hasattr(t, "to_local"):
        return ("dtensor", id(t))
    return (t.device, t.dtype, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())


class WeightSource:
    """``module``'s state dict (or the state dict ``module``; the keys under ``prefix``, which is dropped: ``lm.``
    of a training wrapper) on every rank of ``info``."""

    def __init__(self, module: Union[nn.Module, Mapping[str, torch.Tensor]], info: DistInfo, prefix: str = "lm."):
        self.info = info
        self.keep: Optional[Callable[[str, torch.Tensor], None]] = None
        state = dict(module) if isinstance(module, Mapping) else module.state_dict(keep_vars=True)
        if any(k.startswith(prefix) for k in state):
            state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        self.state: Dict[str, torch.Tensor] = {}
        self.aliases: Dict[str, str] = {}
        first: Dict[Tuple, str] = {}
        for name, t in state.items():
            key = _key(t)
            if t.numel() and key in first:
                self.aliases[name] = first[key]
                continue
            first[key] = name
            self.state[name] = t

    def tensors(self, dtype: Optional[torch.dtype] = None) -> List[Tuple[str, List[int], torch.dtype]]:
        """``(name, shape, dtype sent)`` of each distinct tensor, in send order: floating point at ``dtype``
        (the engine's; None: as trained), anything else as it is. Nothing is gathered."""
        return [(name, list(t.shape), dtype if dtype is not None and t.dtype.is_floating_point else t.dtype)
                for name, t in self.state.items()]

    def parameters(self) -> int:
        return sum(t.numel() for t in self.state.values())

    def keeping(self, keep: Callable[[str, torch.Tensor], None]) -> "WeightSource":
        """This source, whose :meth:`gathered` also hands each rank's own part of every tensor, cast as sent, to
        ``keep(name, part)`` (``run.weight_push=delta``: the engine's copy kept, :mod:`models.training.weight_shadow`)."""
        out = copy.copy(self)
        out.keep = keep
        return out

    def gathered(self, device: torch.device, dtype: Optional[torch.dtype] = None, everywhere: bool = False
                 ) -> Iterator[Tuple[str, Optional[torch.Tensor]]]:
        """``(name, the whole tensor on ``device``)`` on rank 0, ``(name, None)`` on the others, one tensor at a
        time, in :meth:`tensors`' order, floating point cast to ``dtype`` (None: as trained) by each rank before
        its rows travel: a collective under FSDP2, so every rank iterates all of it. ``everywhere``: the whole
        tensor on every rank (an all-gather of the shards already cast, so a float32 tensor never stands whole on a
        rank: each rank loads its own engine, ``run.resident_layout=colocated``)."""
        sharded = self.sharded()
        for name, t in self.state.items():
            cast = dtype if dtype is not None and t.dtype.is_floating_point else None
            if self.keep is not None and (sharded or self.info.is_main):
                local = t.detach().to_local() if hasattr(t, "to_local") else t.detach()
                self.keep(name, local if cast is None else local.to(cast))
            if everywhere:
                local = t.detach() if cast is None else t.detach().to(cast)  # a DTensor: each rank casts its shard
                yield name, full_tensor(local).to(device)  # through shared memory between ranks of one host
            elif sharded:
                yield name, gather_to(t, 0, self.info, device, cast)
            else:
                yield name, t.detach().to(device, cast) if self.info.is_main else None

    def sharded(self) -> bool:
        return any(hasattr(t, "to_local") for t in self.state.values())

    def follow(self, dtype: Optional[torch.dtype] = None) -> None:
        """What a rank other than 0 does during a push at ``dtype``: its part in every gather (none without FSDP2)."""
        if self.sharded():
            for _ in self.gathered(self.info.device, dtype):
                pass

    def full(self, everywhere: bool = False) -> Dict[str, torch.Tensor]:
        """Every tensor whole as trained, aliases included (rank 0, or every rank with ``everywhere``; empty
        elsewhere): the LoRA adapter's push."""
        out = {name: t for name, t in self.gathered(torch.device("cpu"), None, everywhere) if t is not None}
        out.update({a: out[t] for a, t in self.aliases.items() if t in out})
        return out

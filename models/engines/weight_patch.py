"""What a delta push gives an engine's tensor (:mod:`models.engines.weight_delta`): a :class:`Patch`, and its
application in place (:func:`patch_into`, :func:`stepped`).

A BLOCK8 delta (the encoding of an RL update's density) arrives as a :class:`Packed` patch, views of the payload: the
engine's CPU tensor of the pushed dtype takes it in one pass from them (:func:`kernels.block8.apply`); anything else
(another engine's memory, a GPU's) reads the patch's ``indices`` and ``values``, expanded from the payload on first
use, as every other encoding's.
"""

from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional, Tuple

import torch

from models.engines.weight_stream import PushError

INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""The integer dtype of each element size: a tensor's bits compared, or gathered, as integers."""
_WIDER = {2: torch.int32, 4: torch.int64}

Fields = Tuple[Optional[torch.Tensor], torch.Tensor, Optional[torch.dtype], Optional[Tuple[torch.Tensor, torch.Tensor]]]


class Packed(NamedTuple):
    """A BLOCK8 delta as it arrived: its head (:class:`kernels.block8.Head`), its values' mode (0, 16: STEP8, 32: SIGN)
    with what the mode carries (the values, int8 steps or the sign bits) and its exceptions (int32 ordinals, values)."""

    head: object
    mode: int
    carried: torch.Tensor
    ordinals: torch.Tensor
    exact: torch.Tensor


class Patch:
    """What a delta push gives one tensor: ``values`` at flat ``indices`` (int64, ascending), or with ``indices``
    None the whole tensor (``values`` shaped as it). With ``step`` (the pushed dtype), ``values`` are int8 steps of
    the bits held at ``indices`` and ``exact`` the exceptions (their ordinals among ``indices``, their values):
    :func:`stepped` gives the new values. A patch made by :meth:`of_packed` expands those on first use."""

    __slots__ = ("_fields", "_expand", "packed")

    def __init__(self, indices: Optional[torch.Tensor], values: torch.Tensor, step: Optional[torch.dtype] = None,
                 exact: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> None:
        self._fields: Optional[Fields] = (indices, values, step, exact)
        self._expand: Optional[Callable[[], Fields]] = None
        self.packed: Optional[Packed] = None

    @classmethod
    def of_packed(cls, packed: Packed, expand: Callable[[], "Patch"]) -> "Patch":
        patch = cls.__new__(cls)
        patch._fields, patch.packed = None, packed
        patch._expand = lambda: expand()._all()
        return patch

    def _all(self) -> Fields:
        if self._fields is None:
            self._fields, self._expand = self._expand(), None
        return self._fields

    indices = property(lambda self: self._all()[0])
    values = property(lambda self: self._all()[1])
    step = property(lambda self: self._all()[2])
    exact = property(lambda self: self._all()[3])

    @property
    def whole(self) -> bool:
        return self.packed is None and self.indices is None

    def tensors(self) -> List[torch.Tensor]:
        """The tensors it holds (views of the payload it came in), not expanding it."""
        if self.packed is not None and self._fields is None:
            p = self.packed
            return [p.head.counts, p.head.offsets, p.carried, p.ordinals, p.exact]
        indices, values, _, exact = self._all()
        return [t for t in (indices, values, *(exact or ())) if t is not None]

    def __reduce__(self):  # (to a worker process: expanded)
        return Patch, self._all()


def _wrap(raw: torch.Tensor, width: int) -> torch.Tensor:
    """``raw`` (int32 or int64, at least ``width`` + 1 bits) wrapped into a signed integer of ``width`` bits."""
    return ((raw + (1 << (width - 1))) & ((1 << width) - 1)) - (1 << (width - 1))


def stepped(held: torch.Tensor, patch: Patch) -> torch.Tensor:
    """The new values of a patch of steps (``patch.step``): the steps added to the bits ``held`` at its positions (the
    engine's elements there, of the pushed dtype), wrapping as :func:`~models.engines.weight_delta.steps_of` did, and
    the exceptions' values; the patch's own values otherwise."""
    if patch.step is None:
        return patch.values
    if held.dtype != patch.step:
        raise PushError(f"a delta's steps were taken at {patch.step}, but the engine holds {held.dtype}")
    as_int, wider = INT_OF[held.element_size()], _WIDER[held.element_size()]
    raw = held.reshape(-1).view(as_int).to(wider) + patch.values.to(held.device, wider)
    out = _wrap(raw, 8 * held.element_size()).to(as_int).view(held.dtype)
    ordinals, values = patch.exact
    out[ordinals.to(out.device)] = values.to(out.device)
    return out


def patch_into(target: torch.Tensor, patch: Patch) -> None:
    """``patch`` written into ``target`` (the engine's own tensor) in place: a packed BLOCK8 patch in one pass where
    ``target`` is a contiguous CPU tensor of its dtype (:func:`kernels.block8.apply`), else ``index_copy_`` of the
    values (stepped from the elements held), or the whole tensor copied."""
    from kernels.block8 import apply

    with torch.no_grad():
        if patch.whole:
            target.copy_(patch.values.view(target.shape))
            return
        p = patch.packed
        if p is not None and target.is_contiguous():  # (another dtype: apply declines, torch's path says why)
            try:
                if apply(target.view(-1), p.head, p.mode, p.carried, p.ordinals, p.exact):
                    return
            except ValueError as err:
                raise PushError(str(err)) from err
        flat, at = target.view(-1), patch.indices.to(target.device)  # the parameter's own memory
        flat.index_copy_(0, at, stepped(flat[at], patch).to(flat.device, flat.dtype))

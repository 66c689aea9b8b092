"""A push's steps in an engine, a full push's and a delta's (``run.weight_push=delta``: the weights patched in place,
chunk by chunk, through the same checks and failures as a full push), held by
:class:`models.engines.base.SwappableEngine`; and :class:`EngineLoadError`, what a step that fails raises."""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Mapping, Sequence


class EngineLoadError(RuntimeError):
    """Weights could not be served: an unreadable checkpoint, an engine that failed to start from it, or
    tensors that do not fit the served model."""


class Patching:
    """What a :class:`~models.engines.base.SwappableEngine` adds for delta pushes, and the steps of a push both kinds
    share (it provides ``_layout``, ``stats`` and ``close``)."""

    pushed: str = ""
    """The id of the trainer's push the engine holds, read back and confirmed (:mod:`models.hosts.pushes`); "" from a
    checkpoint, after a restart, or while a push is under way. A delta push applies only onto the one it names."""
    patchable: bool = True
    """Whether a delta push can patch the weights in place (:meth:`begin_patch`)."""

    def begin_patch(self, shapes: Mapping[str, Sequence[int]]) -> None:
        """A delta push (``run.weight_push=delta``): :meth:`patch_chunk` per bucket, then :meth:`end_patch`, patched in
        place over the weights held; the same checks and failures as :meth:`begin_push` (a failed patch closes
        the engine)."""
        self._start_push(shapes, self._begin_patch_in_place, patch=True)

    def patch_chunk(self, patches: Mapping[str, Any]) -> None:
        """``patches``: ``{name: Patch}`` (:class:`models.engines.weight_delta.Patch`: values at flat positions, or
        the whole tensor), at the engine's dtype."""
        self._pushed("copy", lambda: self._patch_chunk_in_place(dict(patches)))

    def end_patch(self) -> None:
        self._finish_push(self._end_patch_in_place)

    def _begin_patch_in_place(self) -> None:
        pass

    def _patch_chunk_in_place(self, patches: Dict[str, Any]) -> None:
        raise NotImplementedError

    def _end_patch_in_place(self) -> None:
        pass

    def check_fits(self, shapes: Mapping[str, Sequence[int]], patch: bool = False) -> None:
        """:class:`EngineLoadError` unless tensors of ``shapes`` fit the served model (and, ``patch``, it can be
        patched in place): what a push checks before it takes anything."""
        reason = self._layout.shapes_mismatch({k: tuple(v) for k, v in shapes.items()})
        if reason:
            raise EngineLoadError(f"these weights do not fit the served model: {reason}")
        if patch and not self.patchable:
            raise EngineLoadError(f"{type(self).__name__} cannot patch its weights in place: it takes full pushes only")

    def _start_push(self, shapes: Mapping[str, Sequence[int]], begin: Callable[[], None], patch: bool = False) -> None:
        self.check_fits(shapes, patch)
        self.pushed = ""
        self._pushing, self._push_t0 = True, time.perf_counter()
        self._pushed("begin", begin)

    def _finish_push(self, end: Callable[[], None]) -> None:
        self._pushed("finish", end)
        self._pushing = False
        self.stats.reload_s += time.perf_counter() - self._push_t0
        self.stats.reloads += 1

    def _pushed(self, step: str, fn: Callable[[], None]) -> None:
        if not getattr(self, "_pushing", False):
            raise EngineLoadError(f"no push to {step}: begin_push first (the last one failed or ended)")
        try:
            fn()
        except Exception as err:  # the weights may be half-replaced
            self._pushing = False
            self.close()
            raise EngineLoadError(f"copying new weights into the engine failed ({type(err).__name__}: {err}); "
                                  f"the engine is closed: restart it from a checkpoint") from err

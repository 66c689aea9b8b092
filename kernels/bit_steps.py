"""One pass over a float32 weight for a delta push (``run.weight_push=delta``): its value at the engine's dtype
compared with the bits the engine holds, and for the elements that differ their flat positions, new bits and the int8
steps between the two bit patterns, without materialising the cast tensor.

:func:`changed_steps` computes exactly what the separate passes compute
(``new = w.to(dtype)``; ``changed(new, held)``; ``steps_of(new[idx], held[idx])`` of
:mod:`models.engines.weight_delta`): bfloat16's rounding is float32's to nearest, ties to even (torch's, c10's
``round_to_nearest_even``), the steps wrap at the element's width and are -128 outside -127..127. One numba loop
reads 6 bytes an element (4 for bfloat16's source and 2 held) and writes 11 per changed element; the separate
passes read and write the whole tensor four times (on one core of the test machine: 0.14 s against 0.54 s for 140M
elements at 4 % changed, ``benchmarks/bench_delta_push.py``).

None where it does not apply, and the caller takes the separate passes: a source other than a contiguous float32
CPU tensor, an engine dtype other than bfloat16 or float32, a NaN in the source (torch's vectorised cast and its
scalar one give NaN different bits), more changed elements than ``capacity`` (then a sparse encoding rarely pays),
or no numba (it comes with vLLM).
"""

from __future__ import annotations

import threading
from typing import Optional, Tuple

import numpy as np
import torch

__all__ = ["changed_steps", "warm"]

_KERNELS = {}
"""dtype -> the compiled loop, built on first use (numba compiles in ~0.5 s)."""


def _compile():
    import numba

    @numba.njit(nogil=True, boundscheck=False)
    def loop(src, held, pos, new, steps, to_bf16, width):  # pragma: no cover - compiled
        """``src``: float32 bits (uint32); ``held``: the engine's bits (int16 for bfloat16, int32 for float32)."""
        cap, c, half = pos.shape[0], 0, np.int64(1) << (width - 1)
        for i in range(src.shape[0]):
            u = src[i]
            if to_bf16:
                if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
                    return -1  # NaN
                b = np.int64(np.int16(np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
                                                >> np.uint32(16))))
            else:
                b = np.int64(np.int32(u))
            h = np.int64(held[i])
            if b != h:
                if c < cap:
                    pos[c] = i
                    new[c] = b
                    d = b - h
                    if d >= half:
                        d -= 2 * half
                    elif d < -half:
                        d += 2 * half
                    steps[c] = np.int8(d) if -127 <= d <= 127 else np.int8(-128)
                c += 1
        return c

    # dtype -> (the loop, whether it rounds to bfloat16, the width in bits, the held bits' type in numpy and torch)
    return {torch.bfloat16: (loop, True, 16, np.int16, torch.int16),
            torch.float32: (loop, False, 32, np.int32, torch.int32)}


_LOCK = threading.Lock()


def _kernels():
    with _LOCK:
        if not _KERNELS:
            try:
                _KERNELS.update(_compile())
            except ImportError:
                _KERNELS[None] = None  # no numba: every call takes the separate passes
    return _KERNELS


def warm() -> threading.Thread:
    """Compile the loop for both dtypes in a background thread (numba compiles at a signature's first call, ~0.6 s
    in all): a trainer that will push deltas starts it when it starts, not at its first push. A call meanwhile waits
    for the compile."""
    def run() -> None:
        src = torch.zeros(8)
        for dtype in (torch.bfloat16, torch.float32):
            changed_steps(src, src.to(dtype))

    thread = threading.Thread(target=run, name="bit-steps-compile", daemon=True)
    thread.start()
    return thread


def changed_steps(src: torch.Tensor, held: torch.Tensor, capacity: Optional[int] = None
                  ) -> Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``src`` (float32) at ``held``'s dtype against ``held``'s bits: ``(positions, new, steps)`` of the elements that
    differ (flat positions int64 ascending; their new values at ``held``'s dtype; int8 steps), or None where the
    pass does not apply (see the module's docstring). ``capacity``: the most changed elements to take (default a
    sixteenth of the elements, at least 1,024). ``held`` is only read."""
    kernel = _kernels().get(held.dtype)
    if (kernel is None or src.dtype != torch.float32 or src.device.type != "cpu" or held.device.type != "cpu"
            or not src.is_contiguous() or not held.is_contiguous() or src.shape != held.shape):
        return None
    loop, to_bf16, width, np_int, torch_int = kernel
    numel = src.numel()
    cap = min(numel, max(1024, numel // 16)) if capacity is None else capacity
    pos, new, steps = np.empty(cap, np.int64), np.empty(cap, np_int), np.empty(cap, np.int8)
    count = loop(src.reshape(-1).numpy().view(np.uint32), held.reshape(-1).view(torch_int).numpy(), pos, new, steps,
                 to_bf16, width)
    if count < 0 or count > cap:
        return None
    return _tensor(pos[:count]), _tensor(new[:count]).view(held.dtype), _tensor(steps[:count])


def _tensor(a: np.ndarray) -> torch.Tensor:
    """``a`` as a tensor, no copy (the buffer's pages past it were never written, so take no memory), an empty one
    with its stride 1 (torch gives numpy's empty arrays stride 0)."""
    return torch.from_numpy(a) if a.size else torch.zeros(0, dtype=torch.from_numpy(a[:1]).dtype)

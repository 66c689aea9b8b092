"""One pass over a float32 weight for a delta push (``run.weight_push=delta``): its value at the engine's dtype
compared with the bits the engine holds, and for the elements that differ their flat positions, new bits and the int8
steps between the two bit patterns, without materialising the cast tensor.

:func:`changed_steps` computes exactly what the separate passes compute
(``new = w.to(dtype)``; ``changed(new, held)``; ``steps_of(new[idx], held[idx])`` of
:mod:`models.engines.weight_delta`): bfloat16's rounding is float32's to nearest, ties to even (torch's, c10's
``round_to_nearest_even``), the steps wrap at the element's width and are -128 outside -127..127. One C loop reads 6
bytes an element (bfloat16: 4 of the source, 2 held) and writes 11 per changed element; the separate passes read
and write the whole tensor four times (on one core of the test machine: 0.17-0.18 s against 0.54 s for 140M elements at
4 % changed, ``benchmarks/bench_delta_push.py``).

The loop is C built by the machine's C compiler (``cc``, ``$CC``) on first use into the cache
(``$RLHF_CACHE_DIR/kernels/``, default ``~/.cache/flyte-rlhf``, named by the source's digest) and called through
ctypes: no import that changes the process (numba, which vLLM ships, made vLLM 0.32's CPU worker fail to start in
the same process: its kernel registry scans every module and trips on llvmlite's library wrapper).

None where it does not apply, and the caller takes the separate passes: a source other than a contiguous float32
CPU tensor, an engine dtype other than bfloat16 or float32, a NaN in the source (torch's vectorised cast and its
scalar one give NaN different bits), more changed elements than ``capacity`` (then a sparse encoding rarely pays),
or no C compiler.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from typing import Optional, Tuple

import numpy as np
import torch

__all__ = ["changed_steps", "library", "warm"]

SOURCE = r"""
#include <stdint.h>

/* Returns the count of elements whose bits differ (the first `cap` of them written), or -1 at a NaN. */
int64_t bf16_steps(const uint32_t *src, const int16_t *held, int64_t n, int64_t *pos, int16_t *out, int8_t *steps,
                   int64_t cap) {
    int64_t c = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t u = src[i];
        if ((u & 0x7FFFFFFFu) > 0x7F800000u) return -1;
        int16_t b = (int16_t)(uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
        int16_t h = held[i];
        if (b != h) {
            if (c < cap) {
                int32_t d = (int32_t)b - (int32_t)h;
                if (d > 32767) d -= 65536; else if (d < -32768) d += 65536;
                pos[c] = i; out[c] = b; steps[c] = (d >= -127 && d <= 127) ? (int8_t)d : (int8_t)-128;
            }
            c++;
        }
    }
    return c;
}

int64_t f32_steps(const int32_t *src, const int32_t *held, int64_t n, int64_t *pos, int32_t *out, int8_t *steps,
                  int64_t cap) {
    int64_t c = 0;
    for (int64_t i = 0; i < n; i++) {
        int32_t b = src[i], h = held[i];
        if (b != h) {
            if (c < cap) {
                int64_t d = (int64_t)b - (int64_t)h;
                if (d > 2147483647LL) d -= 4294967296LL; else if (d < -2147483648LL) d += 4294967296LL;
                pos[c] = i; out[c] = b; steps[c] = (d >= -127 && d <= 127) ? (int8_t)d : (int8_t)-128;
            }
            c++;
        }
    }
    return c;
}
"""

_LIB: dict = {}
_LOCK = threading.Lock()
_P = ctypes.c_void_p
_I64 = ctypes.c_int64


def _cache() -> str:
    root = os.environ.get("RLHF_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "flyte-rlhf"))
    return os.path.join(root, "kernels")


def _build(path: str) -> None:
    """The source compiled into the shared library ``path`` (written beside it, then renamed: concurrent builders
    agree)."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as work:
        src = os.path.join(work, "bit_steps.c")
        with open(src, "w") as f:
            f.write(SOURCE)
        out = os.path.join(work, "lib.so")
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            raise OSError("no C compiler (cc, gcc or $CC)")
        subprocess.run([compiler, "-O3", "-shared", "-fPIC", "-o", out, src], check=True, capture_output=True,
                       timeout=120)
        os.replace(out, path)


def library() -> Optional[ctypes.CDLL]:
    """The compiled loops (built on first use, ~0.3 s), or None where no C compiler builds them."""
    with _LOCK:
        if "lib" not in _LIB:
            digest = hashlib.sha256((SOURCE + platform.machine()).encode()).hexdigest()[:16]
            path = os.path.join(_cache(), f"bit_steps-{digest}.so")
            try:
                if not os.path.isfile(path):
                    _build(path)
                lib = ctypes.CDLL(path)
                for name in ("bf16_steps", "f32_steps"):
                    fn = getattr(lib, name)
                    fn.restype, fn.argtypes = _I64, [_P, _P, _I64, _P, _P, _P, _I64]
            except (OSError, subprocess.SubprocessError):
                lib = None  # every call takes the separate passes
            _LIB["lib"] = lib
        return _LIB["lib"]


def warm() -> threading.Thread:
    """Build (or find) the library in a background thread: a trainer that will push deltas starts it when it
    starts, not at its first push. A call meanwhile waits for it."""
    thread = threading.Thread(target=library, name="bit-steps-build", daemon=True)
    thread.start()
    return thread


_KINDS = {torch.bfloat16: ("bf16_steps", np.int16, torch.int16), torch.float32: ("f32_steps", np.int32, torch.int32)}


def changed_steps(src: torch.Tensor, held: torch.Tensor, capacity: Optional[int] = None
                  ) -> Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``src`` (float32) at ``held``'s dtype against ``held``'s bits: ``(positions, new, steps)`` of the elements that
    differ (flat positions int64 ascending; their new values at ``held``'s dtype; int8 steps), or None where the
    pass does not apply (see the module's docstring). ``capacity``: the most changed elements to take (default a
    sixteenth of the elements, at least 1,024). ``held`` is only read."""
    kind = _KINDS.get(held.dtype)
    if (kind is None or src.dtype != torch.float32 or src.device.type != "cpu" or held.device.type != "cpu"
            or not src.is_contiguous() or not held.is_contiguous() or src.shape != held.shape):
        return None
    lib = library()
    if lib is None:
        return None
    name, np_int, torch_int = kind
    numel = src.numel()
    cap = min(numel, max(1024, numel // 16)) if capacity is None else capacity
    pos, new, steps = np.empty(cap, np.int64), np.empty(cap, np_int), np.empty(cap, np.int8)
    count = getattr(lib, name)(src.data_ptr(), held.view(torch_int).data_ptr(), numel, pos.ctypes.data,
                               new.ctypes.data, steps.ctypes.data, cap)
    if count < 0 or count > cap:
        return None
    return _tensor(pos[:count]), _tensor(new[:count]).view(held.dtype), _tensor(steps[:count])


def _tensor(a: np.ndarray) -> torch.Tensor:
    """``a`` as a tensor, no copy (the buffer's pages past it were never written, so take no memory), an empty one
    with its stride 1 (torch gives numpy's empty arrays stride 0)."""
    return torch.from_numpy(a) if a.size else torch.zeros(0, dtype=torch.from_numpy(a[:1]).dtype)

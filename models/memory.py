"""Memory handed back to the machine once a process is done with a model.

Freeing a tensor returns its pages to the C allocator, not always to the machine: glibc serves
allocations under its (dynamic, up to 32 MiB) mmap threshold from heap arenas, and a freed arena
stays in the process's resident set until trimmed. A decoder layer's weights are a few MiB each, so
a 0.6B model loaded and dropped can leave gigabytes resident in a process that goes on to other
work (the launching ``pyflyte`` of a local run executes every stateless task). :func:`release` drops
unreachable objects and trims the arenas.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc


@functools.lru_cache(maxsize=1)
def _libc():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


RELEASE_MIN_BYTES = 64 << 20
"""What a freed model must have held for :func:`release` to run: a full ``gc.collect()`` costs about 0.3 s in a
process that imported torch and transformers, for nothing when the model was a few MiB."""


def nbytes(module) -> int:
    """Bytes of ``module``'s parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def release(freed_bytes: int = RELEASE_MIN_BYTES) -> bool:
    """Collect garbage, then give the C allocator's free memory back to the machine (glibc's
    ``malloc_trim``); True when the allocator could trim (False elsewhere: musl, macOS, or ``freed_bytes``, what
    the caller just let go, under :data:`RELEASE_MIN_BYTES`)."""
    if freed_bytes < RELEASE_MIN_BYTES:
        return False
    gc.collect()
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is None:
        return False
    trim(0)
    return True

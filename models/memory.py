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


def release() -> bool:
    """Collect garbage, then give the C allocator's free memory back to the machine (glibc's
    ``malloc_trim``); True when the allocator could trim (False elsewhere: musl, macOS)."""
    gc.collect()
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is None:
        return False
    trim(0)
    return True

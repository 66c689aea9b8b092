"""Memory handed back to the machine once a process is done with a model.

Freeing a tensor returns its pages to the C allocator, not always to the machine: glibc serves
allocations under its (dynamic, up to 32 MiB) mmap threshold from heap arenas, and a freed arena
stays in the process's resident set until trimmed. A decoder layer's weights are a few MiB each, so
a 0.6B model loaded and dropped can leave gigabytes resident in a process that goes on to other
work (the launching ``pyflyte`` of a local run executes every stateless task). :func:`release` drops
unreachable objects and trims the arenas; :func:`bound_heap` keeps a trainer rank's large allocations out of
the arenas in the first place, and :func:`use_huge_pages` has torch fault those allocations in by 2 MiB pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os


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


M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter of the mmap threshold (malloc.h)."""
TRAINER_MMAP_THRESHOLD = 4 << 20
"""What a trainer rank allocates by mmap (:func:`bound_heap`): at least 4 MiB."""


def bound_heap(threshold: int = TRAINER_MMAP_THRESHOLD) -> bool:
    """Serve allocations of at least ``threshold`` bytes with their own mappings, each given back to the machine
    when freed, and keep glibc from raising that threshold by itself (``mallopt(M_MMAP_THRESHOLD)`` fixes it).

    A trainer rank frees a model's worth of activations and gathered layers every micro-batch while its gradients
    and optimizer moments, allocated in between, stay: under glibc's dynamic threshold (up to 32 MiB) those
    allocations share heap arenas, and the long-lived ones keep the freed pages between them resident. Measured
    on a Qwen3-0.6B-shaped update on 2 FSDP2 ranks (benchmarks/RESULTS.md, 2026-11-29): 9.06 GiB peak per rank
    dynamic, 7.9 GiB at a fixed 4 MiB at the same speed, 7.4 GiB at 1 MiB but 17% slower (every mapping's pages
    are faulted in afresh). False where the allocator is not glibc's, or where the user set the threshold
    (``MALLOC_MMAP_THRESHOLD_``, ``GLIBC_TUNABLES``): theirs stands."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "mmap_threshold" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    return bool(mallopt is not None and mallopt(M_MMAP_THRESHOLD, int(threshold)))


HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"
"""torch's switch for its CPU allocator (c10's ``alloc_cpu``, read once per process at its first allocation):
allocations of at least 2 MiB aligned to a page and advised ``MADV_HUGEPAGE`` (the mapping's ``hg`` flag in
``/proc/<pid>/smaps``)."""


def use_huge_pages() -> bool:
    """Set :data:`HUGE_PAGES_ENV` to 1 in this process's environment unless it is set (the user's value stands);
    True when it is 1 now. torch reads it once per process, at its first allocation: it holds for every process
    started from here on (the ranks and their forkserver, the services, the engines), and for this one when torch has
    allocated nothing yet.

    A trainer rank's large allocations are each a fresh mapping (:func:`bound_heap`), freed within a micro-batch:
    every layer FSDP2 gathers, its copy-in and copy-out buffers, the activations. Each one's pages are faulted in and
    zeroed by the kernel as they are first written, 4 KiB at a time; with transparent huge pages, 2 MiB at a time.
    Measured on the 2-core machine, one thread (``benchmarks/bench_huge_pages.py``, benchmarks/RESULTS.md): a
    copy of 60 MB into a new tensor 90 ms without, 17-23 ms with (11-17 ms into a tensor written before); at
    Qwen3-0.6B's shape on two FSDP2 ranks, the probe's forward 9.9 -> 7.0 s and the gather of every weight for a
    colocated engine 4.6 -> 3.2 s. Where the kernel's THP setting is ``never`` the advice does nothing; with
    ``always`` the kernel gives huge pages without it."""
    os.environ.setdefault(HUGE_PAGES_ENV, "1")
    return os.environ[HUGE_PAGES_ENV] == "1"

"""models/memory.py: memory handed back only after a model worth a full garbage collection (about 0.3 s in a
process that imported torch and transformers), and a trainer rank's large allocations mapped apart from the heap."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models import memory

ROOT = Path(__file__).resolve().parents[3]


def test_release_runs_after_a_large_model_only(monkeypatch):
    collected = []
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(1) or 0)
    small = torch.nn.Linear(16, 16)  # 16 * 16 * 4 + 16 * 4 = 1,088 bytes
    assert memory.nbytes(small) == 1088
    assert memory.release(memory.nbytes(small)) is False and collected == []
    assert memory.release(memory.RELEASE_MIN_BYTES) is True and collected == [1]  # glibc here: trimmed
    assert memory.release() is True and collected == [1, 1]  # no size given: what a caller closing an engine frees


PROBE = r"""
import ctypes, ctypes.util, json, sys
from models import memory

libc = ctypes.CDLL(ctypes.util.find_library("c"))
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
bounded = memory.bound_heap(1 << 20) if sys.argv[1] == "bound" else None
if sys.argv[1] == "service":  # what a service's process (an engine service, the rollout server) sets first
    from models.hosts.__main__ import prepare
    prepare()
libc.free(libc.malloc(16 << 20))  # a freed 16 MiB mapping: glibc's dynamic threshold rises past it
before = libc.mallinfo2().hblkhd
block = libc.malloc(8 << 20)
print(json.dumps({"bounded": bounded, "mapped": libc.mallinfo2().hblkhd - before}))
"""


@pytest.mark.parametrize("how, env, bounded, mapped", [
    ("dynamic", {}, None, False),  # glibc's own: 8 MiB from the heap once a 16 MiB block was freed
    ("bound", {}, True, True),  # bound_heap: its own mapping, given back when freed
    ("bound", {"MALLOC_MMAP_THRESHOLD_": str(32 << 20)}, False, False),  # the user's threshold stands
    ("service", {}, None, True),  # python -m models.hosts: an engine service's freed weights go back too
])
def test_bound_heap_maps_what_glibc_would_keep_in_its_heap(how, env, bounded, mapped):
    proc = subprocess.run([sys.executable, "-c", PROBE, how], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**{k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}, **env,
                               "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["bounded"] == bounded and (got["mapped"] >= 8 << 20) == mapped, got


ADVISED = r"""
import json, os, sys
if sys.argv[1] == "tasks":
    import tasks  # noqa: F401  (what every process that runs a task imports first)
import torch
t = torch.empty(8 << 20, dtype=torch.uint8).fill_(1)
flags, inside = [], False
for line in open("/proc/self/smaps"):  # the mapping that holds the tensor: its VmFlags
    head = line.split()
    if "-" in head[0] and not head[0].endswith(":"):
        lo, hi = (int(x, 16) for x in head[0].split("-"))
        inside = lo <= t.data_ptr() < hi
    elif inside and head[0] == "VmFlags:":
        flags = head[1:]
print(json.dumps({"env": os.environ.get("THP_MEM_ALLOC_ENABLE"), "advised": "hg" in flags}))
"""


@pytest.mark.parametrize("entry, env, on", [
    ("tasks", {}, True),  # a task's process: on before torch allocates, and so in every process it starts
    ("tasks", {memory.HUGE_PAGES_ENV: "0"}, False),  # the user's value stands
    ("plain", {}, False),  # torch's default: no advice
])
def test_huge_pages_are_on_in_a_tasks_process_and_its_children(entry, env, on):
    """torch's large allocations advised ``MADV_HUGEPAGE`` (the mapping's ``hg`` flag in /proc/self/smaps, whatever
    the kernel's THP setting then makes of it) in a process that imported ``tasks`` first; the variable it set is
    what that process's children inherit."""
    base = {k: v for k, v in os.environ.items() if k != memory.HUGE_PAGES_ENV}
    proc = subprocess.run([sys.executable, "-c", ADVISED, entry], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**base, **env, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"env": "1" if on else env.get(memory.HUGE_PAGES_ENV), "advised": on}, got


def test_use_huge_pages_sets_a_default_only(monkeypatch):
    monkeypatch.delenv(memory.HUGE_PAGES_ENV, raising=False)
    assert memory.use_huge_pages() is True and os.environ[memory.HUGE_PAGES_ENV] == "1"
    monkeypatch.setenv(memory.HUGE_PAGES_ENV, "0")
    assert memory.use_huge_pages() is False and os.environ[memory.HUGE_PAGES_ENV] == "0"

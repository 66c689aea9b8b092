"""One checkpoint cache per node: remote checkpoints downloaded once, shared by every process of the
node (the ranks of an elastic update, the tasks of a long local run), keyed by content, bounded.

    {root}/{digest}/           a verified copy of a committed checkpoint (with its COMMITTED.json)
    {root}/{digest}.ready      written after the copy is verified: the entry is whole (its time: last use)
    {root}/{digest}.lock       held while one process downloads it; the others wait, then reuse it
    {root}/{digest}.use        a shared lock on it for each process using the entry (its pin)
    {root}/.evict.lock         held while entries are touched and evicted

``digest`` is the BLAKE3 of the marker's file list (names, sizes, digests), so the same weights
committed at two URLs share an entry and a checkpoint rewritten at the same URL gets a new one.
Every use touches its entry; after a use only the ``keep`` most recently used entries stay (the
others are removed). ``keep`` must cover what one task reads at once (``score``: actor, reference,
critic and reward model = 4, the default).

Processes of a node share the cache, so one process's use must not remove an entry another is still
reading (two runs on one machine, a run's resident services beside its tasks). A process pins each
entry it is handed: a shared ``flock`` on ``{digest}.use`` taken before the entry is checked and kept
until the process has pinned ``keep`` newer entries of that cache, or exits (the kernel drops it, so
a killed process never pins for ever). Eviction removes only entries it can lock exclusively, so the
cache holds at most ``keep`` entries plus those other live processes still use.

Root: ``RLHF_CHECKPOINT_CACHE`` (default ``{tempdir}/flyte-rlhf-checkpoints``: a pod's ranks share
its ``/tmp``); ``keep``: ``RLHF_CHECKPOINT_CACHE_KEEP``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import time
from collections import OrderedDict
from typing import Any, Iterator, Mapping, Optional, Tuple

import blake3

CACHE_ENV = "RLHF_CHECKPOINT_CACHE"
KEEP_ENV = "RLHF_CHECKPOINT_CACHE_KEEP"
DEFAULT_KEEP = 4
READY = ".ready"
"""Suffix of an entry's marker, beside the folder (the folder itself stays a plain checkpoint copy)."""
USE = ".use"
"""Suffix of an entry's pin file: every process using the entry holds a shared lock on it."""

_PINS: "OrderedDict[Tuple[str, str], Any]" = OrderedDict()
"""This process's pins, ``(root, key) -> open file`` holding the shared lock, least recent first."""


def cache_root() -> str:
    return os.environ.get(CACHE_ENV) or os.path.join(tempfile.gettempdir(), "flyte-rlhf-checkpoints")


def cache_keep() -> int:
    return max(int(os.environ.get(KEEP_ENV) or DEFAULT_KEEP), 1)


def content_digest(marker: Mapping[str, Any]) -> str:
    """BLAKE3 of the marker's file list: the checkpoint's identity, whatever its URL."""
    return blake3.blake3(json.dumps(marker["files"], sort_keys=True).encode()).hexdigest()[:32]


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (released when the process dies, so a killed rank never wedges it)."""
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def entries(root: str):
    """``[(last use, name)]`` of the whole entries, newest first."""
    out = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        if name.endswith(READY) and not name.startswith("."):
            out.append((os.stat(os.path.join(root, name)).st_mtime_ns, name[:-len(READY)]))
    return sorted(out, reverse=True)


def cached(url: str, marker: Mapping[str, Any], download, root: Optional[str] = None,
           keep: Optional[int] = None) -> str:
    """The entry of ``marker``'s checkpoint under ``root``, made by ``download(url, folder)`` (a
    verified download into an empty folder) if no process of this node made it before."""
    root = root or cache_root()
    keep = keep or cache_keep()
    os.makedirs(root, exist_ok=True)
    key = content_digest(marker)
    entry = os.path.join(root, key)
    _pin(root, key, keep)  # before the check: an eviction under way finishes first, then we see it gone
    with _locked(f"{entry}.lock"):  # one download per node; the other ranks wait for it
        if not os.path.isfile(entry + READY):
            shutil.rmtree(entry, ignore_errors=True)  # leftovers of a process killed mid-download
            download(url, entry)
            open(entry + READY, "w").close()
    with _locked(os.path.join(root, ".evict.lock")):
        _touch(root, key)
        for _, name in entries(root)[keep:]:
            if name == key:
                continue
            free = _unused_lock(root, name)
            if free is None:
                continue  # another process (or an older use in this one) still reads it
            with free:
                _remove(root, name)
    return entry


def _pin(root: str, key: str, keep: int) -> None:
    """Hold a shared lock on ``key``'s pin file for this process; let go of this process's oldest
    pins of ``root`` beyond ``keep``."""
    if (root, key) in _PINS:
        _PINS.move_to_end((root, key))
    else:
        f = open(os.path.join(root, key + USE), "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_SH)  # waits while an eviction of this entry is under way
        except BaseException:
            f.close()
            raise
        _PINS[(root, key)] = f
    mine = [k for k in _PINS if k[0] == root]
    for old in mine[:max(len(mine) - keep, 0)]:
        _PINS.pop(old).close()


def _unused_lock(root: str, name: str):
    """An open file holding the exclusive lock on ``name``'s pin (no process uses it), else None."""
    f = open(os.path.join(root, name + USE), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    return f


def _touch(root: str, key: str) -> None:
    """Mark ``key`` as the most recent use: its ``.ready`` gets a time after every other entry's (the
    filesystem's clock is too coarse to order uses a millisecond apart)."""
    newest = max((t for t, _ in entries(root)), default=0)
    t = max(time.time_ns(), newest + 1)
    os.utime(os.path.join(root, key + READY), ns=(t, t))


def _remove(root: str, name: str) -> None:
    """Unmark first (an interrupted removal leaves no entry that looks whole), then delete."""
    path = os.path.join(root, name)
    with contextlib.suppress(FileNotFoundError):
        os.remove(path + READY)
    shutil.rmtree(path, ignore_errors=True)  # its lock file stays: a process may be waiting on it

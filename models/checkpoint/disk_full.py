"""A full disk while a checkpoint is committed, as an error that names the checkpoint, the folder
written, its size and what the weights need (safetensors' own error names no path)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from typing import Iterator

from models import storage


class DiskFull(RuntimeError):
    """No space was left on the disk a checkpoint was being written to."""


@contextlib.contextmanager
def naming_a_full_disk(url: str, model) -> Iterator[None]:
    """A full disk while committing ``model``'s checkpoint at ``url`` as a :class:`DiskFull` that names the
    checkpoint, the folder written, its size and what the weights need (safetensors' error names no path)."""
    try:
        yield
    except Exception as err:
        if not _no_space_left(err):
            raise
        where = _existing_parent(storage.local_path(url)) if storage.is_local(url) else tempfile.gettempdir()
        usage = shutil.disk_usage(where)
        need = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        raise DiskFull(f"no space left on the disk while writing checkpoint {url}: its files go to a temporary folder "
                       f"in {where} first, on a filesystem of {usage.total / 2**20:.1f} MiB ({usage.free / 2**20:.1f} "
                       f"MiB free once the partial files were removed), and the trained weights alone take "
                       f"{need / 2**20:.1f} MiB. Nothing of this iteration was committed: free space, or put "
                       f"run.storage_root (remote storage: TMPDIR) on a larger disk, and rerun the same command to "
                       f"resume") from err


def _no_space_left(err: BaseException) -> bool:
    for _ in range(8):  # the error and what caused it
        if err is None:
            return False
        if (isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)) or \
                "No space left on device" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def _existing_parent(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.isdir(path):
        path = os.path.dirname(path)
    return path

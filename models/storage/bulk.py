"""Deleting many files at once, and the local folders that leaves empty: what retention
(``models/run/retention.py``) deletes at a commit, in a few requests whatever the store."""

from __future__ import annotations

import contextlib
import os
from typing import Sequence

from fsspec.implementations.local import LocalFileSystem

from models.storage import DEFAULT_RETRY, RetryPolicy, fs_and_path, is_local, local_path, remove, with_retry


def remove_files(urls: Sequence[str], retry: RetryPolicy = DEFAULT_RETRY) -> None:
    """Delete the files at ``urls`` (all on one filesystem), skipping missing ones: locally one unlink each,
    on an object store one bulk request per 1,000 files (S3's ``DeleteObjects`` skips missing keys itself)."""
    if not urls:
        return
    fs, _ = fs_and_path(urls[0])
    paths = [fs_and_path(u)[1] for u in urls]
    if isinstance(fs, LocalFileSystem):
        for url, path in zip(urls, paths):
            with_retry("remove", url, lambda p=path: _unlink_missing_ok(p), retry)
        return
    try:
        with_retry("remove", urls[0], lambda: fs.rm(paths), retry)
    except FileNotFoundError:  # a store whose bulk delete refuses a missing file: one at a time
        for url in urls:
            remove(url, retry=retry)
    for path in paths:
        fs.invalidate_cache(path)


def _unlink_missing_ok(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def remove_dir_if_empty(url: str) -> None:
    """Remove the local folder ``url`` if it is empty (an object store has no folders: nothing to do)."""
    if is_local(url):
        with contextlib.suppress(OSError):  # missing, or not empty
            os.rmdir(local_path(url))

"""Compare-and-swap writes of small files on run storage: the primitive under the run lock.

``read_versioned(url)`` returns a file's content and a version token; ``write_if(url, data, version)``
replaces the file only if its version is still ``version`` (``None``: only if there is no file), and
says whether it did. Two writers that read the same version can never both succeed.

- S3 (and S3-compatible servers): a conditional ``PutObject`` — ``If-None-Match: *`` to create,
  ``If-Match: <ETag>`` to replace (AWS since 2024; moto 5 and MinIO too). The version is the ETag,
  read together with the content by one ``GetObject``.
- Local folders: the read-compare-replace runs under an exclusive ``flock`` of a guard file beside the
  target (``<name>.guard``), and the replace is the usual atomic rename. The version is the content's
  BLAKE3 digest. ``flock`` holds between processes of one machine, which is what local storage serves.
- Other fsspec stores: not supported (:class:`NotImplementedError` naming the URL).

A conditional PUT whose answer was lost and that is retried may report a failed condition although the
first attempt succeeded; callers re-read and compare the content (the run lock compares the owner).
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import blake3
from fsspec.implementations.local import LocalFileSystem

from models.storage import _atomic_local_write, count, fs_and_path, with_retry

_S3_PROTOCOLS = ("s3", "s3a")


def _kind(url: str, fs) -> str:
    if isinstance(fs, LocalFileSystem):
        return "local"
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if protocol in _S3_PROTOCOLS:
        return "s3"
    raise NotImplementedError(f"{url}: compare-and-swap writes (the run lock) need a local folder or S3, "
                              f"not {protocol}://")


def read_versioned(url: str) -> Optional[Tuple[bytes, str]]:
    """``(content, version)`` of the file at ``url``, or None when there is none."""
    got = _read_versioned(url)
    if got is not None:
        count("read", url, len(got[0]))
    return got


def _read_versioned(url: str) -> Optional[Tuple[bytes, str]]:
    fs, path = fs_and_path(url)
    if _kind(url, fs) == "local":
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        return data, blake3.blake3(data).hexdigest()
    from fsspec.asyn import sync

    try:
        return with_retry("read", url, lambda: sync(fs.loop, _s3_get, fs, path))
    except FileNotFoundError:
        return None


async def _s3_get(fs, path: str) -> Tuple[bytes, str]:
    """One ``GetObject``: the body and the ETag of the same object version."""
    bucket, key, _ = fs.split_path(path)
    resp = await fs._call_s3("get_object", Bucket=bucket, Key=key)  # s3fs translates errors (404: FileNotFoundError)
    try:
        data = await resp["Body"].read()
    finally:
        resp["Body"].close()
    return data, resp["ETag"].strip('"')


def write_if(url: str, data: bytes, version: Optional[str]) -> bool:
    """Write ``data`` at ``url`` only if the file's version is ``version`` (None: only if absent).
    True if written, False if the condition failed (someone else wrote first)."""
    done = _write_if(url, data, version)
    if done:
        count("write", url, len(data))
    return done


def _write_if(url: str, data: bytes, version: Optional[str]) -> bool:
    fs, path = fs_and_path(url)
    if _kind(url, fs) == "local":
        return with_retry("conditional write", url, lambda: _local_write_if(path, data, version))
    condition = {"IfNoneMatch": "*"} if version is None else {"IfMatch": f'"{version}"'}

    def attempt() -> bool:
        try:
            fs.pipe_file(path, data, **condition)
        except (FileExistsError, FileNotFoundError):  # If-None-Match failed / If-Match on a missing object
            return False
        except OSError as err:
            if _precondition_failed(err):
                return False
            raise
        return True

    return with_retry("conditional write", url, attempt)


def _precondition_failed(err: OSError) -> bool:
    """s3fs turns a 412 answer into an ``OSError(EINVAL)``; its cause holds the S3 error code."""
    cause = err.__cause__
    code = str(getattr(cause, "response", {}).get("Error", {}).get("Code", ""))
    return code in ("PreconditionFailed", "412") or "PreconditionFailed" in str(err)


def _local_write_if(path: str, data: bytes, version: Optional[str]) -> bool:
    import fcntl

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(f"{path}.guard", "a+b") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # released when the file closes
        try:
            with open(path, "rb") as f:
                current: Optional[str] = blake3.blake3(f.read()).hexdigest()
        except FileNotFoundError:
            current = None
        if current != version:
            return False
        _atomic_local_write(path, data)
        return True

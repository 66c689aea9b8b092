"""Small fsspec helpers for run storage: local folders, ``file://`` and ``s3://`` alike.

Every helper takes a URL (a plain local path is a URL too), retries transient failures
with exponential backoff, and raises errors whose message names the URL. Permanent
failures (missing file, permission denied, bad argument) are raised at once.

S3 endpoint and credentials come from the standard environment, read when a filesystem
is made (never at import): ``FSSPEC_S3_ENDPOINT_URL``, ``AWS_ENDPOINT_URL_S3`` or
``AWS_ENDPOINT_URL`` for the endpoint, and botocore's usual chain (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, profiles, instance roles) for credentials. Explicit
``storage_options`` win over the environment. Credentials never appear in messages.

Example::

    write_json("s3://bucket/runs/r1/run.json", {"algorithm": "ppo"})
    read_json(join("s3://bucket/runs", "r1", "run.json"))  # {'algorithm': 'ppo'}
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import json
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Mapping, NamedTuple, Optional, Tuple, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

T = TypeVar("T")

_S3_ENDPOINT_ENV = ("FSSPEC_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
# Never retried: retrying cannot fix them.
_PERMANENT = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError,
              NotADirectoryError, ValueError, TypeError, KeyError)
_DENIED = (errno.EACCES, errno.EPERM, errno.EROFS)
"""OS errors that deny the write however often it is tried: a read-only file system is one (a plain
``OSError``, not a ``PermissionError``)."""


class StorageError(OSError):
    """A storage operation failed (after retries, for transient errors); names the URL."""


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to retry a transient storage failure."""

    attempts: int = 4
    """Total tries, including the first (1 = no retry)."""
    initial_delay_s: float = 0.5
    """Sleep before the second try; doubles (``multiplier``) after each failure."""
    multiplier: float = 2.0
    """Backoff growth factor."""
    max_delay_s: float = 8.0
    """Upper bound on one sleep."""

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be >= 1, got {self.attempts}")
        if self.initial_delay_s < 0 or self.max_delay_s < 0:
            raise ValueError("RetryPolicy delays must be >= 0")
        if self.multiplier < 1:
            raise ValueError(f"RetryPolicy.multiplier must be >= 1, got {self.multiplier}")


DEFAULT_RETRY = RetryPolicy()


class Transfer(NamedTuple):
    """One whole file moved by this process: ``op`` is ``"read"`` or ``"write"``, ``nbytes`` its size."""

    op: str
    url: str
    nbytes: int


_COUNTERS: List[List[Transfer]] = []


@contextlib.contextmanager
def count_bytes() -> Iterator[List[Transfer]]:
    """Record every file this process reads or writes through this module (and ``models/storage/cas.py``)
    while open: the exact bytes a task moves, for ``benchmarks/project_iteration.py --check-small``.

    Counted: :func:`read_bytes`, :func:`write_bytes`, :func:`get_file`, :func:`put_file` (so
    :func:`get_dir`, :func:`put_dir`, checkpoints and batches). Not counted: listings, ``exists``,
    server-side copies (:func:`move_dir` on S3: no byte crosses the node) and local checkpoints used in
    place or hard-linked (no byte moves; measure on S3 to see what a pod moves). Nested counters each
    see every transfer."""
    records: List[Transfer] = []
    _COUNTERS.append(records)
    try:
        yield records
    finally:
        _COUNTERS.remove(records)


TRANSFER_LOG_ENV = "RLHF_STORAGE_LOG"
"""A file every transfer of this process is appended to as a JSON line (``{"op", "url", "nbytes"}``): what a
pod moved, for measurements across processes (``benchmarks/bench_resident.py --harness``); unset: none."""


def count(op: str, url: str, nbytes: int) -> None:
    """Add one transfer to every open :func:`count_bytes` (nothing when none is open), and to the file
    ``RLHF_STORAGE_LOG`` names."""
    for records in _COUNTERS:
        records.append(Transfer(op, os.fspath(url), int(nbytes)))
    log = os.environ.get(TRANSFER_LOG_ENV)
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"op": op, "url": os.fspath(url), "nbytes": int(nbytes)}) + "\n")


def utc_now_iso(timespec: str = "seconds") -> str:
    """Now, UTC, ISO 8601 (``2026-11-24T00:30:00+00:00``): the time stamp of what is written to storage
    (batch metadata, ``run.json``, ``state.json``, checkpoint markers)."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec=timespec)


def is_transient(err: BaseException) -> bool:
    """True for errors worth retrying: network/timeouts/5xx, not missing files or bad input."""
    if isinstance(err, _PERMANENT) or getattr(err, "errno", None) in _DENIED:
        return False
    if isinstance(err, (OSError, ConnectionError, TimeoutError)):
        return True
    try:  # botocore's connection/timeout errors are not OSErrors
        from botocore.exceptions import BotoCoreError
    except ImportError:  # pragma: no cover - botocore comes with s3fs
        return False
    return isinstance(err, BotoCoreError)


def with_retry(op: str, url: str, fn: Callable[[], T], retry: RetryPolicy = DEFAULT_RETRY) -> T:
    """Call ``fn()``; retry transient failures per ``retry``; re-raise naming ``op`` and ``url``."""
    delay = retry.initial_delay_s
    for attempt in range(1, retry.attempts + 1):
        try:
            return fn()
        except Exception as err:  # noqa: BLE001 - classified below
            if isinstance(err, FileNotFoundError):
                raise FileNotFoundError(f"{op}: not found: {url}") from err
            if isinstance(err, PermissionError) or getattr(err, "errno", None) in _DENIED:
                raise PermissionError(f"{op}: permission denied for {url}: {err}") from err
            if isinstance(err, NotADirectoryError):
                raise NotADirectoryError(f"{op}: {url}: {_file_in_the_way(err.filename or url)} is a file, "
                                         f"not a folder") from err
            if not is_transient(err):
                if hasattr(err, "add_note"):  # Python >= 3.11
                    err.add_note(f"while trying to {op} {url}")
                raise
            if attempt == retry.attempts:
                raise StorageError(f"{op} failed for {url} after {attempt} attempt(s): "
                                   f"{type(err).__name__}: {err}") from err
            time.sleep(delay)
            delay = min(delay * retry.multiplier, retry.max_delay_s)
    raise AssertionError("unreachable")  # pragma: no cover


def _file_in_the_way(path) -> str:
    """The nearest ancestor of local ``path`` that exists (the file a folder was expected at)."""
    path = os.path.abspath(os.fspath(path))
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def fs_and_path(url: str, **storage_options: Any) -> Tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem for ``url`` and the path inside it (protocol stripped).

    For ``s3://`` URLs without an explicit ``endpoint_url``/``client_kwargs`` the endpoint
    is taken from the environment (see module docstring).
    """
    url = os.fspath(url)
    if not url:
        raise ValueError("empty storage URL")
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    explicit = "endpoint_url" in storage_options or \
        "endpoint_url" in (storage_options.get("client_kwargs") or {})
    if protocol in ("s3", "s3a") and not explicit:
        endpoint = next((os.environ[k] for k in _S3_ENDPOINT_ENV if os.environ.get(k)), None)
        if endpoint:
            storage_options["endpoint_url"] = endpoint
    return fsspec.core.url_to_fs(url, **storage_options)


def is_local(url: str) -> bool:
    """True if ``url`` is a local path or ``file://`` URL."""
    url = os.fspath(url)
    return "://" not in url or url.startswith("file://")


def local_path(url: str) -> str:
    """The plain local path of a local ``url`` (``file://`` stripped)."""
    if not is_local(url):
        raise ValueError(f"not a local URL: {url}")
    return url[len("file://"):] if url.startswith("file://") else os.fspath(url)


def join(url: str, *parts: str) -> str:
    """Join path parts onto ``url`` with ``/``, keeping the scheme: ``join("s3://b/x", "y")``."""
    out = os.fspath(url).rstrip("/") or "/"
    for part in parts:
        part = str(part).strip("/")
        if part:
            out = out + part if out.endswith("/") else f"{out}/{part}"
    return out


def exists(url: str, retry: RetryPolicy = DEFAULT_RETRY, **storage_options: Any) -> bool:
    """True if a file or directory (prefix) exists at ``url``."""
    fs, path = fs_and_path(url, **storage_options)
    _fresh(fs, path)
    return with_retry("exists", url, lambda: fs.exists(path), retry)


def _fresh(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Drop cached listings: another process (task, pod) may have written since."""
    if isinstance(fs, LocalFileSystem):
        return
    root = fs._strip_protocol(path).rstrip("/")
    for key in [k for k in list(fs.dircache) if k.startswith(root + "/")]:
        fs.dircache.pop(key, None)
    fs.invalidate_cache(path)


def read_bytes(url: str, retry: RetryPolicy = DEFAULT_RETRY, **storage_options: Any) -> bytes:
    """The whole content of the file at ``url`` as it is now (no cached listing decides whether it is there)."""
    fs, path = fs_and_path(url, **storage_options)
    _fresh(fs, path)
    data = with_retry("read", url, lambda: fs.cat_file(path), retry)
    count("read", url, len(data))
    return data


def write_bytes(url: str, data: bytes | memoryview, retry: RetryPolicy = DEFAULT_RETRY, durable: bool = True,
                **storage_options: Any) -> None:
    """Write ``data`` to ``url`` so readers never see a partial file.

    Local: write a temporary file in the same folder, fsync (``durable``), then ``os.replace``
    (a memoryview is written without a copy). The rename alone makes the file whole or absent
    after a crash of the process; fsync adds the same after a crash of the machine. Object
    stores: one PUT, which is atomic per object.
    """
    fs, path = fs_and_path(url, **storage_options)
    if isinstance(fs, LocalFileSystem):
        with_retry("write", url, lambda: _atomic_local_write(path, data, durable), retry)
    else:
        body = bytes(data)  # no copy for bytes; botocore wants bytes or a file
        with_retry("write", url, lambda: fs.pipe_file(path, body), retry)
    count("write", url, memoryview(data).nbytes)


def _atomic_local_write(path: str, data: bytes | memoryview, durable: bool = True) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_json(url: str, retry: RetryPolicy = DEFAULT_RETRY, **storage_options: Any) -> Any:
    """Parse the JSON file at ``url``; a parse error names the URL."""
    raw = read_bytes(url, retry, **storage_options)
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{url} is not valid UTF-8 JSON: {err}") from err


def write_json(url: str, obj: Any, retry: RetryPolicy = DEFAULT_RETRY,
               **storage_options: Any) -> None:
    """Write ``obj`` as indented, key-sorted JSON, atomically (see :func:`write_bytes`)."""
    data = json.dumps(obj, indent=2, sort_keys=True).encode("utf-8") + b"\n"
    write_bytes(url, data, retry, **storage_options)


def list_files(url: str, retry: RetryPolicy = DEFAULT_RETRY,
               **storage_options: Any) -> Mapping[str, int]:
    """All files under the directory/prefix ``url``, recursively: ``{relative path: size}``.

    Missing prefix: empty mapping.
    """
    fs, path = fs_and_path(url, **storage_options)
    root = path.rstrip("/")
    _fresh(fs, root)
    found = with_retry("list", url, lambda: fs.find(root, detail=True), retry)
    out = {}
    for full, info in found.items():
        if info.get("type") == "directory":
            continue
        rel = full[len(root):].lstrip("/") if full.startswith(root) else full
        out[rel] = int(info.get("size") or 0)
    return dict(sorted(out.items()))


def put_dir(local_dir: str, url: str, retry: RetryPolicy = DEFAULT_RETRY,
            **storage_options: Any) -> None:
    """Upload every file under ``local_dir`` to ``{url}/{relative path}`` (one put per file)."""
    if not os.path.isdir(local_dir):
        raise NotADirectoryError(f"put_dir: not a local directory: {local_dir}")
    for dirpath, _, names in os.walk(local_dir):
        for name in sorted(names):
            src = os.path.join(dirpath, name)
            rel = os.path.relpath(src, local_dir).replace(os.sep, "/")
            put_file(src, join(url, rel), retry, **storage_options)


def put_file(local_file: str, url: str, retry: RetryPolicy = DEFAULT_RETRY,
             **storage_options: Any) -> None:
    """Upload the local file ``local_file`` to ``url``."""
    fs, path = fs_and_path(url, **storage_options)
    if isinstance(fs, LocalFileSystem):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with_retry("upload", url, lambda: fs.put_file(local_file, path), retry)
    count("write", url, os.path.getsize(local_file))


def get_dir(url: str, local_dir: str, retry: RetryPolicy = DEFAULT_RETRY,
            **storage_options: Any) -> Mapping[str, int]:
    """Download every file under ``url`` into ``local_dir``; returns ``{relative path: size}``."""
    files = list_files(url, retry, **storage_options)
    if not files:
        raise FileNotFoundError(f"get_dir: no files under {url}")
    for rel in files:
        dst = os.path.join(local_dir, *rel.split("/"))
        get_file(join(url, rel), dst, retry, **storage_options)
    return files


def get_file(url: str, local_file: str, retry: RetryPolicy = DEFAULT_RETRY,
             **storage_options: Any) -> None:
    """Download the file at ``url`` to the local path ``local_file`` (parents created)."""
    fs, path = fs_and_path(url, **storage_options)
    os.makedirs(os.path.dirname(os.path.abspath(local_file)), exist_ok=True)
    with_retry("download", url, lambda: fs.get_file(path, local_file), retry)
    count("read", url, os.path.getsize(local_file))


def move_dir(src_url: str, dst_url: str, retry: RetryPolicy = DEFAULT_RETRY,
             **storage_options: Any) -> None:
    """Move the directory/prefix ``src_url`` to ``dst_url`` (which must not hold files).

    Local: one ``os.replace`` (atomic). Object stores: server-side copy of each file,
    then delete the source.
    """
    if list_files(dst_url, retry, **storage_options):
        raise FileExistsError(f"move_dir: destination is not empty: {dst_url}")
    fs, src = fs_and_path(src_url, **storage_options)
    _, dst = fs_and_path(dst_url, **storage_options)
    if isinstance(fs, LocalFileSystem):
        if os.path.isdir(dst):
            os.rmdir(dst)  # empty (checked above); os.replace wants it gone on every OS
        os.makedirs(os.path.dirname(dst.rstrip("/")) or ".", exist_ok=True)
        with_retry("move", src_url, lambda: os.replace(src, dst), retry)
        return
    for rel in list_files(src_url, retry, **storage_options):
        with_retry("copy", join(src_url, rel),
                   lambda r=rel: fs.copy(join(src, r), join(dst, r)), retry)
    remove(src_url, recursive=True, retry=retry, **storage_options)


def remove(url: str, recursive: bool = False, missing_ok: bool = True,
           retry: RetryPolicy = DEFAULT_RETRY, **storage_options: Any) -> None:
    """Delete the file (or, with ``recursive``, the directory/prefix) at ``url``."""
    fs, path = fs_and_path(url, **storage_options)
    _fresh(fs, path)
    if not with_retry("exists", url, lambda: fs.exists(path), retry):
        if missing_ok:
            return
        raise FileNotFoundError(f"remove: not found: {url}")
    with_retry("remove", url, lambda: fs.rm(path, recursive=recursive), retry)


def size(url: str, retry: RetryPolicy = DEFAULT_RETRY,
         **storage_options: Any) -> Optional[int]:
    """Size in bytes of the file at ``url``."""
    fs, path = fs_and_path(url, **storage_options)
    return with_retry("size", url, lambda: fs.size(path), retry)

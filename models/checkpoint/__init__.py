"""Hugging Face checkpoint directories on any fsspec URL, committed by a final marker.

A checkpoint at ``url`` is whole only if ``{url}/COMMITTED.json`` exists; the marker is
written last and lists every file with its size and BLAKE3 digest (markers written before
BLAKE3 list sha256, still checked). Writing goes

    local dir --upload--> {url}.tmp-{uuid}/ --move--> {url}/ --then--> {url}/COMMITTED.json

so a crash at any point leaves either no marker (refused on read) or a whole checkpoint.
Reading verifies sizes and checksums against the marker.

No pickle anywhere: only safetensors weights and the text and metadata files of a Hub snapshot
(JSON, tokenizer files, chat templates, model cards, LICENSE, ``.gitattributes``) are accepted, on
write and on read (nothing loaded from storage may execute code); pickled weights are refused with
how to convert them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, Iterator, List, Mapping, Optional

import blake3

from models import storage
from models.faults import pause_point

MARKER = "COMMITTED.json"
ALLOWED_SUFFIXES = (".safetensors", ".json", ".txt", ".model", ".tiktoken", ".jinja", ".md")
"""Files a checkpoint may hold: weights (safetensors), configs and metadata (``config.json``,
``generation_config.json``, ``tokenizer.json``, ``vocab.json``, ...), tokenizer files (``merges.txt``,
``vocab.txt``, sentencepiece ``tokenizer.model``, ``*.tiktoken``), chat templates (``*.jinja``) and
model cards (``README.md``, ``USE_POLICY.md``)."""
ALLOWED_NAME_PREFIXES = ("license", "notice", "copying")
"""Legal files of Hub snapshots without a suffix (``LICENSE``, ``NOTICE``, ``LICENSE-MODEL``); with one
(``LICENSE.txt``, ``LICENSE.md``) they are text files of :data:`ALLOWED_SUFFIXES`."""
ALLOWED_HIDDEN = (".gitattributes",)
"""Hidden files a Hub snapshot carries that are copied with it; other hidden files and folders
(``.cache/`` of ``huggingface-cli download --local-dir``, editor leftovers) are skipped."""
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib", ".npy", ".npz")
SAFETENSORS_HINT = ("convert it with transformers: AutoModelForCausalLM.from_pretrained(dir)"
                    ".save_pretrained(out, safe_serialization=True), or delete it when the folder also has "
                    "*.safetensors weights (Hub snapshots often ship both, e.g. original/consolidated.00.pth)")


class CheckpointError(ValueError):
    """A checkpoint is not committed, corrupted, or holds a file that is not allowed."""


def is_allowed_file(rel_path: str) -> bool:
    """Whether ``rel_path`` is a file type a checkpoint may hold (pickles never are)."""
    name = rel_path.lower()
    base = name.rsplit("/", 1)[-1]
    if name.endswith(PICKLE_SUFFIXES):
        return False
    legal = base.startswith(ALLOWED_NAME_PREFIXES) and "." not in base
    return name.endswith(ALLOWED_SUFFIXES) or legal or base in ALLOWED_HIDDEN


def check_file_allowed(rel_path: str, where: str) -> None:
    """Raise :class:`CheckpointError` unless ``rel_path`` may be in a checkpoint."""
    if rel_path.lower().endswith(PICKLE_SUFFIXES):
        raise CheckpointError(
            f"checkpoint {where} contains '{rel_path}', a pickle-based file; only safetensors "
            f"weights are allowed — pickle can execute code. To use this checkpoint, {SAFETENSORS_HINT}")
    if not is_allowed_file(rel_path):
        raise CheckpointError(
            f"checkpoint {where} contains '{rel_path}', which is not an allowed file type: safetensors weights, "
            f"{', '.join(s for s in ALLOWED_SUFFIXES if s != '.safetensors')} files, LICENSE/NOTICE files and "
            f".gitattributes are (no code, e.g. modeling_*.py: nothing loaded from storage may execute code)")


def buffer_digest(data: Any) -> str:
    """Hex BLAKE3 of a buffer (bytes, memoryview) on every core: 1.5-2.4 GB/s on the 2-core CI
    machine, where one core of sha256 gave 0.7 GB/s and capped batch reads and writes below 1 GB/s.
    RolloutBatch files (their ``.arrow.blake3``) are checked with it."""
    return blake3.blake3(data, max_threads=blake3.blake3.AUTO).hexdigest()


def file_digest(path: str, algorithm: str = "blake3") -> Dict[str, Any]:
    """``{"size": bytes, algorithm: hex}`` of a local file: BLAKE3 (all cores: ~7x sha256 on one core, which
    made hashing a visible share of every checkpoint save and load) or ``sha256`` for markers written before
    BLAKE3. Read 16 MiB at a time into one buffer, not memory-mapped: a map's pages counted in the process's
    resident set, the whole file by the end (4.4 GiB for Qwen3-0.6B's optimizer state); as fast here."""
    h = _hasher(algorithm)
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while got := f.readinto(buf):
            h.update(view[:got])
    return {"size": os.path.getsize(path), algorithm: h.hexdigest()}


def _hasher(algorithm: str) -> Any:
    if algorithm == "blake3":
        return blake3.blake3(max_threads=blake3.blake3.AUTO)
    if algorithm == "sha256":
        return hashlib.sha256()
    raise CheckpointError(f"unknown checksum algorithm {algorithm!r} (blake3 or sha256)")


def checked_digest(path: str, rel: str, url: str) -> Dict[str, Any]:
    """:func:`file_digest` of the local file ``path`` (``rel`` in checkpoint ``url``) as a commit records it, and for
    safetensors weights :func:`check_finite`'s verdict, both from one read of the file
    (:func:`models.checkpoint.tensor_file.hash_and_scan`)."""
    if rel.endswith(".safetensors"):
        from models.checkpoint.tensor_file import hash_and_scan

        h = _hasher("blake3")
        bad = hash_and_scan(path, h)
        if bad is not None:
            _refuse_nonfinite(bad, rel, url)
            return {"size": os.path.getsize(path), "blake3": h.hexdigest()}
    return file_digest(path)


def _local_files(local_dir: str) -> Dict[str, str]:
    """``{relative posix path: absolute path}``; hidden folders (e.g. ``.cache``) and hidden files other
    than :data:`ALLOWED_HIDDEN` (``.gitattributes``) skipped."""
    files = {}
    for dirpath, dirnames, names in os.walk(local_dir):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(n for n in names if not n.startswith(".") or n in ALLOWED_HIDDEN):
            full = os.path.join(dirpath, name)
            files[os.path.relpath(full, local_dir).replace(os.sep, "/")] = full
    return files


def save_checkpoint(local_dir: str, url: str, overwrite: bool = False,
                    workers: Optional[int] = None, consume: bool = False,
                    require_model: bool = True) -> Mapping[str, Any]:
    """Commit the HF directory ``local_dir`` to ``url``; returns the marker's content.

    Refuses pickle files and unknown file types before uploading anything, and weights holding
    NaN or inf (:func:`check_finite`) before anything is moved into place. An existing
    committed checkpoint at ``url`` is replaced only with ``overwrite`` (after the upload
    to the temporary prefix succeeded; its marker is removed first); leftovers of a crashed
    write (no marker) are removed. Files are hashed and uploaded by ``workers`` threads
    (default: Python's thread-pool default), so the shards of a big model go in parallel.
    ``consume``: the caller drops ``local_dir`` afterwards, so on the same local filesystem
    its files are hard-linked into place instead of copied. ``require_model=False`` commits a
    folder that is no model (an optimizer state, ``models/training/optimizer_state.py``).
    """
    files = _local_files(local_dir)
    files.pop(MARKER, None)  # a downloaded copy carries its old marker; a new one is written
    if not files:
        raise CheckpointError(f"save_checkpoint: no files in {local_dir}")
    for rel in files:
        check_file_allowed(rel, local_dir)
    if require_model and "config.json" not in files and "adapter_config.json" not in files:  # full weights or a peft adapter
        raise CheckpointError(f"save_checkpoint: {local_dir} has no config.json (not an HF directory) "
                              f"and no adapter_config.json (not a peft adapter)")
    if is_committed(url) and not overwrite:
        raise FileExistsError(f"checkpoint {url} is already committed (pass overwrite=True to replace it)")
    tmp = f"{url.rstrip('/')}.tmp-{uuid.uuid4().hex[:12]}"

    def upload(rel: str) -> Dict[str, Any]:
        digest = checked_digest(files[rel], rel, url)  # refused if not finite, before anything is moved into place
        put_checkpoint_file(files[rel], storage.join(tmp, rel), consume)
        return digest

    try:  # a failed upload leaves any old checkpoint intact
        with ThreadPoolExecutor(max_workers=workers) as pool:  # hashing and file I/O release the GIL
            manifest = dict(zip(files, pool.map(upload, files)))
    except BaseException:
        storage.remove(tmp, recursive=True)
        raise
    return commit_uploaded(tmp, url, manifest)


def commit_uploaded(tmp: str, url: str, manifest: Mapping[str, Any]) -> Mapping[str, Any]:
    """Move the uploaded folder ``tmp`` (its files' digests in ``manifest``) to ``url`` and commit it with
    the marker; an old checkpoint at ``url`` is uncommitted first. Also the last step of the per-rank
    optimizer state (``models/training/optimizer_shards.py``), whose ranks upload their files themselves."""
    try:
        storage.remove(storage.join(url, MARKER))  # uncommit first: a crash now leaves no marker
        storage.remove(url, recursive=True)
        storage.move_dir(tmp, url)
    finally:
        storage.remove(tmp, recursive=True)
    pause_point(f"commit/{url}")  # tests only: files in place, not committed yet
    marker = {"format": 1, "created_at": storage.utc_now_iso(),
              "files": dict(manifest)}
    storage.write_json(storage.join(url, MARKER), marker)
    return marker


def nonfinite_tensors(path: str) -> List[str]:
    """Names of the floating-point tensors of the safetensors file ``path`` that hold NaN or ±inf (read a block
    at a time: :mod:`models.checkpoint.tensor_file`)."""
    from models.checkpoint.tensor_file import nonfinite_tensors as scan

    return scan(path)


def check_finite(path: str, rel: str, url: str) -> None:
    """:class:`CheckpointError` if the safetensors file ``path`` (``rel`` in checkpoint ``url``) holds a
    NaN or infinite weight: such a model would sample garbage, so it is never committed, served or
    registered."""
    _refuse_nonfinite(nonfinite_tensors(path), rel, url)


def _refuse_nonfinite(bad: List[str], rel: str, url: str) -> None:
    if bad:
        raise CheckpointError(f"checkpoint {url}: '{rel}' holds NaN or inf in {len(bad)} tensor(s) ({', '.join(bad[:3])}"
                              f"{', ...' if len(bad) > 3 else ''}); weights that are not finite are never committed")


def put_checkpoint_file(path: str, dst: str, consume: bool = False) -> None:
    """Upload the local file ``path`` of a checkpoint being written to ``dst``; with ``consume`` (the caller
    drops ``path`` afterwards) hard-linked instead where ``dst`` is on the same local filesystem."""
    if not (consume and storage.is_local(dst) and _hard_link(path, storage.local_path(dst))):
        storage.put_file(path, dst)


def _hard_link(src: str, dst: str) -> bool:
    """Make ``dst`` a hard link to ``src``; False where that is impossible (another filesystem)."""
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        return False
    return True


MIN_SHARD_BYTES = 256 << 20
"""Smallest safetensors shard :func:`save_model_checkpoint` cuts (smaller models stay one file)."""


def shard_bytes(state_dict: Mapping[str, Any], parts: Optional[int] = None) -> int:
    """``max_shard_size`` that splits ``state_dict`` into about ``parts`` safetensors shards
    (default: one per core, so they are hashed and uploaded in parallel), at least
    :data:`MIN_SHARD_BYTES` and at most 5 GB (the Hugging Face Hub's default)."""
    total = sum(t.numel() * t.element_size() for t in state_dict.values())
    parts = parts or os.cpu_count() or 1
    return min(max(-(-total // parts), MIN_SHARD_BYTES), 5 * 10**9)


@contextlib.contextmanager
def staging_dir(url: str) -> Iterator[str]:
    """A temporary folder to write the files of the checkpoint ``url`` into, removed on exit: next to
    ``url`` when it is local (the same filesystem, so :func:`save_checkpoint` with ``consume=True``
    hard-links the files into place instead of copying them), else in the system's temp folder."""
    near = None
    if storage.is_local(url):
        near = os.path.dirname(os.path.abspath(storage.local_path(url).rstrip("/")))
        os.makedirs(near, exist_ok=True)
    name = os.path.basename(url.rstrip("/"))
    with tempfile.TemporaryDirectory(prefix=f"{name}.tmp-save-", dir=near) as tmp:
        yield tmp


def save_model_checkpoint(model: Any, tokenizer: Any, url: str, overwrite: bool = False,
                          state_dict: Optional[Mapping[str, Any]] = None,
                          max_shard_size: Optional[int] = None, workers: Optional[int] = None) -> Mapping[str, Any]:
    """``save_pretrained`` (safetensors shards of ``max_shard_size`` bytes, default
    :func:`shard_bytes`) ``model`` and ``tokenizer`` (may be None), then commit with
    :func:`save_checkpoint` (``workers`` threads). For a local ``url`` the files are written
    next to it and linked into place, so the weights are written once.

    ``state_dict``: the full weights when the model's own are sharded (FSDP2)."""
    weights = dict(state_dict) if state_dict is not None else model.state_dict()
    with staging_dir(url) as tmp:
        kwargs = {"state_dict": weights} if state_dict is not None else {}
        model.save_pretrained(tmp, safe_serialization=True, max_shard_size=max_shard_size or shard_bytes(weights),
                              **kwargs)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        return save_checkpoint(tmp, url, overwrite=overwrite, workers=workers, consume=True)


def is_committed(url: str) -> bool:
    """True if ``{url}/COMMITTED.json`` exists."""
    return storage.exists(storage.join(url, MARKER))


def read_marker(url: str) -> Mapping[str, Any]:
    """The commit marker of ``url``; refuses an uncommitted checkpoint and any listed pickle."""
    marker_url = storage.join(url, MARKER)
    if not storage.exists(marker_url):
        raise CheckpointError(f"checkpoint {url} is not committed (no {MARKER}) — it may be partial "
                              f"from a crashed run")
    marker = storage.read_json(marker_url)
    if not isinstance(marker, dict) or not isinstance(marker.get("files"), dict):
        raise CheckpointError(f"checkpoint {url}: malformed {MARKER}")
    for rel in sorted(set(marker["files"]) | set(storage.list_files(url))):  # the same first error every time
        check_file_allowed(rel, url)  # also files not in the marker: never leave a pickle beside
    return marker


def verify_local(local_dir: str, marker: Mapping[str, Any], url: str) -> None:
    """Check every file of ``marker`` in ``local_dir`` for size and checksum (BLAKE3, or sha256 in older
    markers); errors name file and URL."""
    for rel, want in marker["files"].items():
        path = os.path.join(local_dir, *rel.split("/"))
        if not os.path.isfile(path):
            raise CheckpointError(f"checkpoint {url}: file '{rel}' listed in {MARKER} is missing")
        algorithm = next((a for a in ("blake3", "sha256") if a in want), None)
        if algorithm is None:
            raise CheckpointError(f"checkpoint {url}: {MARKER} gives file '{rel}' no blake3 or sha256 checksum")
        size = os.path.getsize(path)
        if size != want["size"]:
            raise CheckpointError(f"checkpoint {url}: file '{rel}' has {size} bytes, {MARKER} says {want['size']}")
        if file_digest(path, algorithm)[algorithm] != want[algorithm]:
            raise CheckpointError(f"checkpoint {url}: file '{rel}' fails its {algorithm} check "
                                  f"(corrupted or changed after commit)")


def download_checkpoint(url: str, local_dir: Optional[str] = None, verify: bool = True) -> str:
    """A local, verified copy of the committed checkpoint at ``url``; returns its path.

    A local committed checkpoint is used in place (no copy) when ``local_dir`` is None, and a
    remote one comes from the node's checkpoint cache (:func:`cached_checkpoint`: downloaded
    once per node, bounded). Otherwise the marker's files are downloaded next to ``local_dir``,
    checked against the marker, and renamed into ``local_dir`` with a copy of the marker, so
    the copy is itself a committed checkpoint. A ``local_dir`` that already holds this
    checkpoint is reused; any other non-empty one is refused.
    """
    marker = read_marker(url)
    if storage.is_local(url) and local_dir is None:
        path = storage.local_path(url)
        if verify:
            verify_local(path, marker, url)
        return path
    if local_dir is None:
        return cached_checkpoint(url, marker=marker)
    local_dir = os.path.abspath(local_dir)
    if _holds(local_dir, marker):
        if verify:
            verify_local(local_dir, marker, url)
        return local_dir
    if os.path.isdir(local_dir) and os.listdir(local_dir):
        raise CheckpointError(f"download_checkpoint({url}): {local_dir} is not empty and holds "
                              f"a different checkpoint")
    tmp = f"{local_dir.rstrip(os.sep)}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        for rel in marker["files"]:
            storage.get_file(storage.join(url, rel), os.path.join(tmp, *rel.split("/")))
        if verify:
            verify_local(tmp, marker, url)
        with open(os.path.join(tmp, MARKER), "w", encoding="utf-8") as f:
            json.dump(marker, f, indent=2, sort_keys=True)
        if os.path.isdir(local_dir):
            os.rmdir(local_dir)  # empty (checked above)
        os.replace(tmp, local_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return local_dir


def _holds(local_dir: str, marker: Mapping[str, Any]) -> bool:
    path = os.path.join(local_dir, MARKER)
    if not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8") as f:
        return json.load(f).get("files") == marker["files"]


def load_model(url: str, auto_cls: Any, **kwargs: Any) -> Any:
    """``auto_cls.from_pretrained`` on the verified checkpoint at ``url`` (safetensors only,
    no remote code). A remote checkpoint is downloaded to a temporary folder, removed after
    loading."""
    if kwargs.get("trust_remote_code"):
        raise CheckpointError(f"load_model({url}): trust_remote_code is not allowed")
    kwargs["use_safetensors"] = True
    with verified_copy(url) as local:
        return auto_cls.from_pretrained(local, **kwargs)


@contextlib.contextmanager
def verified_copy(url: str) -> Iterator[str]:
    """The committed checkpoint at ``url`` as a verified local folder: in place when ``url`` is local,
    else downloaded to a temporary folder that is removed on exit."""
    if storage.is_local(url):
        yield download_checkpoint(url)
        return
    with tempfile.TemporaryDirectory(prefix="ckpt-") as tmp:
        yield download_checkpoint(url, tmp)


def cached_checkpoint(url: str, marker: Optional[Mapping[str, Any]] = None, root: Optional[str] = None,
                      keep: Optional[int] = None) -> str:
    """The committed remote checkpoint at ``url`` as a verified folder of the node's checkpoint cache
    (``models/checkpoint/cache.py``): downloaded once per node and content, shared by its processes,
    the least recently used removed beyond ``keep`` entries. Do not modify the folder."""
    from models.checkpoint.cache import cached

    return cached(url, marker or read_marker(url), lambda u, d: download_checkpoint(u, d), root, keep)

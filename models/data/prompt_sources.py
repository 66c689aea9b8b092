"""Where prompt rows come from: JSONL and Parquet files on any fsspec URL (plain or compressed:
``.jsonl.gz``, ``.bz2``, ``.xz``), Hugging Face ``datasets``, reasoning-gym; each as ``(where, row)``
records that :func:`models.data.prompts.load_prompts` validates the same way."""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pyarrow as pa
import pyarrow.parquet as pq

from models import storage

Record = Tuple[str, Optional[Dict[str, Any]]]
"""``(where, row)``: the row's place for messages, and the row (None where it could not be read)."""

JSONL_SUFFIXES = (".jsonl",)
PARQUET_SUFFIXES = (".parquet", ".pq")
COMPRESSIONS = {".gz": gzip.decompress, ".bz2": bz2.decompress, ".xz": lzma.decompress}
"""Compressed data files read (by the last suffix, as ``datasets`` infers it): ``train.jsonl.gz``."""
OTHER_COMPRESSIONS = (".zst", ".zstd", ".lz4", ".zip", ".7z", ".tar", ".tgz", ".rar")
"""Compressions refused (neither this reader nor ``datasets`` here has their codec, or they are archives)."""
WANT = (f"want .jsonl or .parquet, optionally compressed as "
        f"{', '.join('.jsonl' + c for c in COMPRESSIONS)}")


def split_compression(path: str) -> Tuple[str, str]:
    """``("train.jsonl", ".gz")`` for ``train.jsonl.gz``; ``(path, "")`` when uncompressed."""
    stem, suffix = os.path.splitext(path)
    return (stem, suffix.lower()) if suffix.lower() in COMPRESSIONS else (path, "")


def is_data_file(path: str) -> bool:
    """A (possibly compressed) ``.jsonl`` or ``.parquet`` file name."""
    return split_compression(path)[0].lower().endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES)


class PromptDataError(ValueError):
    """The prompt data has problems; ``errors`` lists them (file, row, what is wrong)."""

    def __init__(self, url: str, errors: Sequence[str], total: int, hint: str = "") -> None:
        self.errors = list(errors)
        more = f"\n  ... and {total - len(errors)} more" if total > len(errors) else ""
        super().__init__(f"{total} problem(s) in prompt data {url}:\n  " + "\n  ".join(errors) + more
                         + (f"\n{hint}" if hint else ""))


class ErrorList:
    """Problems found so far: all counted, the first ``limit`` kept."""

    def __init__(self, limit: int) -> None:
        self.limit, self.total, self.listed = limit, 0, []

    def add(self, msg: str) -> None:
        self.total += 1
        if len(self.listed) < self.limit:
            self.listed.append(msg)


def resolve_files(url: str) -> List[str]:
    """The data files ``url`` names: itself, the files under it, or the glob's matches."""
    fs, path = storage.fs_and_path(url)
    keep_plain = storage.is_local(url) and not url.startswith("file://")

    def as_url(p: str) -> str:
        return p if keep_plain else fs.unstrip_protocol(p)

    if any(ch in path for ch in "*?["):
        found = sorted(storage.with_retry("glob", url, lambda: fs.glob(path)))
        files = [as_url(p) for p in found if is_data_file(p)]
        if not files:
            raise PromptDataError(url, [f"no .jsonl or .parquet files match {url} ({WANT})"], 1)
        return files
    if storage.with_retry("isdir", url, lambda: fs.isdir(path)):
        files = [storage.join(url, rel) for rel in storage.list_files(url) if is_data_file(rel)]
        if not files:
            raise PromptDataError(url, [f"no .jsonl or .parquet files under {url} ({WANT})"], 1)
        return files
    if not is_data_file(path):
        kind = "a compression this reader lacks" if path.lower().endswith(OTHER_COMPRESSIONS) else "unknown extension"
        raise PromptDataError(url, [f"{url}: {kind} ({WANT})"], 1)
    return [url]


def _read_jsonl(url: str, data: bytes, errors: ErrorList) -> List[Record]:
    records = []
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        where = f"{url} line {lineno} (row {len(records)})"
        try:
            row = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as err:
            errors.add(f"{where}: not valid UTF-8 (byte 0x{raw[err.start]:02x} at column {err.start + 1})")
            row = None
        except json.JSONDecodeError as err:
            errors.add(f"{where}: invalid JSON: {err.msg} at column {err.colno}")
            row = None
        if row is not None and not isinstance(row, dict):
            errors.add(f"{where}: expected a JSON object, got {type(row).__name__}")
            row = None
        records.append((where, row))
    return records


def _read_parquet(url: str, data: bytes, column: str, errors: ErrorList) -> List[Record]:
    try:
        table = pq.read_table(io.BytesIO(data))
    except (pa.ArrowInvalid, OSError) as err:
        errors.add(f"{url}: not a readable Parquet file: {err}")
        return []
    if column not in table.column_names:
        errors.add(f"{url}: missing column '{column}' (available columns: {table.column_names})")
        return []
    return [(f"{url} row {i}", row) for i, row in enumerate(table.to_pylist())]


def _read_file(url: str, config, errors: ErrorList) -> List[Record]:
    try:
        data = storage.read_bytes(url)
    except FileNotFoundError:
        errors.add(f"{url}: file not found")
        return []
    plain, compression = split_compression(url)
    if compression:
        try:
            data = COMPRESSIONS[compression](data)
        except (OSError, EOFError, lzma.LZMAError, ValueError) as err:
            errors.add(f"{url}: not a readable {compression} file: {err}")
            return []
    if not data.strip():
        errors.add(f"{url}: file is empty")
        return []
    if plain.lower().endswith(JSONL_SUFFIXES):
        records = _read_jsonl(url, data, errors)
    else:
        records = _read_parquet(url, data, config.key_column, errors)
    if not records and not errors.total:
        errors.add(f"{url}: file is empty (no rows)")
    return records


def read_records(config, errors: ErrorList) -> List[Record]:
    """Every row of the configured source, as ``(where, row)`` (row None where unreadable)."""
    if config.source == "hf":
        return hf_records(config.url, config.hf_name, config.split, errors)
    if config.source == "reasoning_gym":
        return reasoning_gym_records(config.reasoning_gym, config.split, errors)
    records: List[Record] = []
    for url in resolve_files(config.url):
        records.extend(_read_file(url, config, errors))
    return records



HF_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".pq": "parquet", ".csv": "csv"}
"""``datasets`` builders of data files by extension (any fsspec URL)."""


def load_hf_dataset(path: str, name: str = "", split: str = "train"):
    """``datasets.load_dataset`` of ``path``: a data file (builder by extension, ``data_files`` on any
    fsspec URL), a ``save_to_disk`` folder (``load_from_disk``), or a dataset folder or Hub name."""
    import datasets

    stem, _ = split_compression(path.split("?")[0])
    if stem.lower().endswith(OTHER_COMPRESSIONS):
        raise ValueError(f"{path}: a compression this reader lacks ({WANT}, or .json/.csv likewise)")
    suffix = os.path.splitext(stem)[1].lower()
    if suffix in HF_FILE_BUILDERS:  # datasets decompresses .gz, .bz2, .xz data files itself
        return datasets.load_dataset(HF_FILE_BUILDERS[suffix], data_files={split: path}, split=split)
    if storage.is_local(path) and os.path.isfile(os.path.join(storage.local_path(path), "dataset_info.json")) \
            and os.path.isfile(os.path.join(storage.local_path(path), "state.json")):
        loaded = datasets.load_from_disk(storage.local_path(path))
        return loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
    return datasets.load_dataset(path, name or None, split=split)


def hf_records(path: str, name: str, split: str, errors) -> List[Record]:
    """The rows of ``split`` of the dataset at ``path``; a dataset that cannot be loaded is one error
    naming it (and the splits it has, when the split is the problem)."""
    try:
        ds = load_hf_dataset(path, name, split)
    except Exception as err:  # datasets raises many kinds (FileNotFound, ValueError for splits, hub errors)
        errors.add(f"{path}: datasets.load_dataset failed (config {name or None!r}, split {split!r}): "
                   f"{type(err).__name__}: {err}")
        return []
    if len(ds) == 0:
        errors.add(f"{path} split {split}: no rows")
    return [(f"{path} split {split} row {i}", row) for i, row in enumerate(ds.to_list())]


def eval_seed(cfg) -> int:
    """Seed of reasoning-gym's held-out rows (see :func:`reasoning_gym_records`)."""
    return cfg.seed + cfg.size


def reasoning_gym_records(cfg, split: str, errors) -> List[Record]:
    """Rows of ``cfg`` (a :class:`models.config.ReasoningGymConfig`): ``train`` drawn with ``cfg.seed``,
    ``eval`` with ``cfg.seed + cfg.size`` minus any question the training rows have. (reasoning-gym
    makes entry i of seed s from ``Random(s + i)``: seed + 1 would repeat the training entries shifted
    by one; seed + size shares no generator with them.)"""
    from models.data.reasoning_gym import generate_rows

    options = cfg.option_values()
    try:
        rows = train = generate_rows(cfg.task, cfg.size, cfg.seed, options)
        if split == "eval":
            seen = {r["question"] for r in train}
            rows = [r for r in generate_rows(cfg.task, cfg.eval_size, eval_seed(cfg), options)
                    if r["question"] not in seen]
    except ValueError as err:
        errors.add(f"data.reasoning_gym: {err}")
        return []
    where = f"reasoning-gym {cfg.task} (seed {eval_seed(cfg) if split == 'eval' else cfg.seed})"
    return [(f"{where} row {i}", row) for i, row in enumerate(rows)]

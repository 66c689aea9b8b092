"""Prompt datasets: JSONL or Parquet on any fsspec URL, validated before any model loads.

``url`` may be one file (``.jsonl`` / ``.parquet``, chosen by extension), a folder/prefix
(every such file in it, sorted), or a glob (``s3://bucket/prompts/part-*.parquet``).
Every row is checked and all problems are reported together, by file and row, in one
:class:`PromptDataError` (up to ``max_errors`` listed)::

    data = load_prompts(PromptDataConfig(url="s3://bucket/prompts/train.jsonl"), tokenizer)
    data.prompts[0], data.prompt_ids[0], data.columns["answer"][0]

Row numbers are 0-based; JSONL errors also give the 1-based line number (blank lines are
skipped). ``prompt_id`` comes from the ``id_column`` if the data has it (integers, unique),
else it is the row's index over all files.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from models import storage
from models.ragged import shard_bounds

JSONL_SUFFIXES = (".jsonl",)
PARQUET_SUFFIXES = (".parquet", ".pq")


class PromptDataError(ValueError):
    """The prompt data has problems; ``errors`` lists them (file, row, what is wrong)."""

    def __init__(self, url: str, errors: Sequence[str], total: int) -> None:
        self.errors = list(errors)
        more = f"\n  ... and {total - len(errors)} more" if total > len(errors) else ""
        super().__init__(f"{total} problem(s) in prompt data {url}:\n  " + "\n  ".join(errors) + more)


@dataclass(frozen=True)
class PromptDataConfig:
    """Where the prompts are and what a valid prompt is."""

    url: str
    """File, folder/prefix or glob of ``.jsonl`` / ``.parquet`` files, on any fsspec URL."""
    prompt_column: str = "prompt"
    """Column (JSON key) holding the prompt text."""
    id_column: str = "prompt_id"
    """Column with integer prompt ids, used if present; else ids are row indices."""
    max_prompt_chars: int = 8192
    """Longest allowed prompt, in characters."""
    max_prompt_tokens: Optional[int] = None
    """Longest allowed prompt in tokens (checked only when a tokenizer is given)."""
    max_errors: int = 20
    """How many problems to list in the error (all are counted)."""

    def __post_init__(self) -> None:
        if not self.url:
            raise ValueError("PromptDataConfig.url must not be empty")
        if not self.prompt_column:
            raise ValueError("PromptDataConfig.prompt_column must not be empty")
        if self.max_prompt_chars < 1 or (self.max_prompt_tokens is not None and self.max_prompt_tokens < 1):
            raise ValueError("PromptDataConfig max_prompt_chars/max_prompt_tokens must be >= 1")
        if self.max_errors < 1:
            raise ValueError("PromptDataConfig.max_errors must be >= 1")


@dataclass(frozen=True)
class PromptDataset:
    """Validated prompts, in file order."""

    prompts: List[str]
    """Prompt texts, ``[N]``."""
    prompt_ids: np.ndarray
    """``[N]`` int64, unique."""
    columns: Mapping[str, List[Any]] = field(default_factory=dict)
    """Every other column, ``{name: [N] values}`` (None where a JSONL row lacks the key)."""

    def __len__(self) -> int:
        return len(self.prompts)

    def take(self, indices: Sequence[int]) -> "PromptDataset":
        """The rows at ``indices`` (in that order)."""
        idx = np.asarray(indices, dtype=np.int64)
        return PromptDataset([self.prompts[i] for i in idx], self.prompt_ids[idx],
                             {k: [v[i] for i in idx] for k, v in self.columns.items()})

    def shard(self, rank: int, world_size: int) -> "PromptDataset":
        """Contiguous balanced shard (``np.array_split`` split, see ``shard_bounds``)."""
        start, stop = shard_bounds(len(self), rank, world_size)
        return self.take(range(start, stop))


class _Errors:
    def __init__(self, limit: int) -> None:
        self.limit, self.total, self.listed = limit, 0, []

    def add(self, msg: str) -> None:
        self.total += 1
        if len(self.listed) < self.limit:
            self.listed.append(msg)


Record = Tuple[str, Dict[str, Any]]  # (where, row)


def resolve_files(url: str) -> List[str]:
    """The data files ``url`` names: itself, the files under it, or the glob's matches."""
    fs, path = storage.fs_and_path(url)
    keep_plain = storage.is_local(url) and not url.startswith("file://")

    def as_url(p: str) -> str:
        return p if keep_plain else fs.unstrip_protocol(p)

    suffixes = JSONL_SUFFIXES + PARQUET_SUFFIXES
    if any(ch in path for ch in "*?["):
        found = sorted(storage.with_retry("glob", url, lambda: fs.glob(path)))
        files = [as_url(p) for p in found if p.lower().endswith(suffixes)]
        if not files:
            raise PromptDataError(url, [f"no .jsonl or .parquet files match {url}"], 1)
        return files
    if storage.with_retry("isdir", url, lambda: fs.isdir(path)):
        files = [storage.join(url, rel) for rel in storage.list_files(url) if rel.lower().endswith(suffixes)]
        if not files:
            raise PromptDataError(url, [f"no .jsonl or .parquet files under {url}"], 1)
        return files
    if not path.lower().endswith(suffixes):
        raise PromptDataError(url, [f"{url}: unknown extension (want .jsonl or .parquet)"], 1)
    return [url]


def _read_jsonl(url: str, data: bytes, errors: _Errors) -> List[Record]:
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


def _read_parquet(url: str, data: bytes, prompt_column: str, errors: _Errors) -> List[Record]:
    try:
        table = pq.read_table(io.BytesIO(data))
    except (pa.ArrowInvalid, OSError) as err:
        errors.add(f"{url}: not a readable Parquet file: {err}")
        return []
    if prompt_column not in table.column_names:
        errors.add(f"{url}: missing column '{prompt_column}' (available columns: {table.column_names})")
        return []
    return [(f"{url} row {i}", row) for i, row in enumerate(table.to_pylist())]


def _read_file(url: str, config: PromptDataConfig, errors: _Errors) -> List[Record]:
    try:
        data = storage.read_bytes(url)
    except FileNotFoundError:
        errors.add(f"{url}: file not found")
        return []
    if not data.strip():
        errors.add(f"{url}: file is empty")
        return []
    if url.lower().endswith(JSONL_SUFFIXES):
        records = _read_jsonl(url, data, errors)
    else:
        records = _read_parquet(url, data, config.prompt_column, errors)
    if not records and not errors.total:
        errors.add(f"{url}: file is empty (no rows)")
    return records


def _check_rows(records: List[Record], config: PromptDataConfig, errors: _Errors) -> None:
    col, limit = config.prompt_column, config.max_prompt_chars
    for where, row in records:
        if row is None:
            continue  # already reported
        if col not in row:
            errors.add(f"{where}: missing column '{col}' (available columns: {sorted(row)})")
            continue
        prompt = row[col]
        if not isinstance(prompt, str):
            errors.add(f"{where}: '{col}' is {type(prompt).__name__}, not a string")
        elif not prompt.strip():
            errors.add(f"{where}: empty prompt")
        elif len(prompt) > limit:
            errors.add(f"{where}: prompt has {len(prompt)} characters > max_prompt_chars={limit}")


def _check_tokens(records: List[Record], config: PromptDataConfig, tokenizer: Any, errors: _Errors) -> None:
    """Token lengths (with the tokenizer's special tokens) against ``max_prompt_tokens``."""
    wheres = [w for w, _ in records]
    prompts = [r[config.prompt_column] for _, r in records]
    lengths = [len(ids) for ids in tokenizer(prompts, add_special_tokens=True)["input_ids"]]
    for where, n in zip(wheres, lengths):
        if n > config.max_prompt_tokens:
            errors.add(f"{where}: prompt has {n} tokens > max_prompt_tokens={config.max_prompt_tokens}")


def _prompt_ids(records: List[Record], id_column: str, errors: _Errors) -> np.ndarray:
    if not any(id_column in row for _, row in records):
        return np.arange(len(records), dtype=np.int64)
    seen: Dict[int, str] = {}
    for where, row in records:
        pid = row.get(id_column)
        if not isinstance(pid, int) or isinstance(pid, bool):
            errors.add(f"{where}: '{id_column}' is {pid!r}, not an integer")
        elif pid in seen:
            errors.add(f"{where}: duplicate '{id_column}' {pid} (first at {seen[pid]})")
        else:
            seen[pid] = where
    return np.array([row.get(id_column) if isinstance(row.get(id_column), int) else -1
                     for _, row in records], dtype=np.int64)


def load_prompts(config: PromptDataConfig, tokenizer: Any = None) -> PromptDataset:
    """Read and validate every row of ``config.url``; raise one :class:`PromptDataError`
    listing all problems, or return the prompts. Call this before loading any model."""
    errors = _Errors(config.max_errors)
    records: List[Record] = []
    for url in resolve_files(config.url):
        records.extend(_read_file(url, config, errors))
    _check_rows(records, config, errors)
    if errors.total:
        raise PromptDataError(config.url, errors.listed, errors.total)
    if tokenizer is not None and config.max_prompt_tokens is not None:
        _check_tokens(records, config, tokenizer, errors)
    prompt_ids = _prompt_ids(records, config.id_column, errors)
    if errors.total:
        raise PromptDataError(config.url, errors.listed, errors.total)
    names = list(dict.fromkeys(k for _, row in records for k in row))
    others = [k for k in names if k not in (config.prompt_column, config.id_column)]
    return PromptDataset(prompts=[row[config.prompt_column] for _, row in records],
                         prompt_ids=prompt_ids,
                         columns={k: [row.get(k) for _, row in records] for k in others})

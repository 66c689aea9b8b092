"""RolloutBatch: the samples of one iteration as one Arrow table, moved between tasks by URI.

Stages add columns and never rewrite existing ones (:meth:`RolloutBatch.with_columns`
refuses). Files are Arrow IPC (file format, ``.arrow``) on any fsspec URL, readable with
plain ``pyarrow`` by the column names of docs/concepts/rollout_batch.md::

    import pyarrow as pa
    with open("runs/r1/iter-000007/score.arrow", "rb") as f:
        table = pa.ipc.open_file(f).read_all()
    table.column("reward").to_pylist()            # one float per sample
    table.column("response_tokens")[0].as_py()     # token ids of sample 0 (ragged)
    table.schema.metadata[b"iteration"]            # b"7"

Writing and reading with the project::

    batch = RolloutBatch.from_columns(BatchMetadata(iteration=7, policy_version=7, algorithm="ppo"),
                                      prompt_id=ids, prompt_tokens=prompts,     # lists or (padded, mask)
                                      response_tokens=(resp, resp_mask), sampler_logprobs=...,
                                      is_end=ended)
    batch = batch.write(layout.batch_url(7, "rollouts"))
    scored = RolloutBatch.read(url).with_columns(old_logprobs=logp)   # logp: [B, T_resp] right-padded
    tensors = RolloutBatch.read(url, shard=(rank, world)).to_padded(["advantages", "old_logprobs"])

This module knows nothing of Flyte: :mod:`tasks.batch_type` makes RolloutBatch a Flyte type, and
:mod:`tasks.caching` (which every task module that passes a batch imports) registers it.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Dict, Iterable, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa

from models.data import ragged

from models import storage
from models.checkpoint import buffer_digest
from models.data.batch_schema import (ADVANTAGE_COLUMNS, COLUMN_TYPES, RESPONSE_ALIGNED, ROLLOUT_COLUMNS,
                                SCORE_COLUMNS, BatchMetadata, BatchSchemaError, validate_table)
from models.data.ragged import list_lengths

if TYPE_CHECKING:
    import torch

    from models.data.batch_tensors import ModelInputs

__all__ = ["RolloutBatch", "BatchMetadata", "BatchSchemaError", "BatchCorruptError", "ModelInputs",
           "ROLLOUT_COLUMNS", "SCORE_COLUMNS", "ADVANTAGE_COLUMNS", "RESPONSE_ALIGNED", "COLUMN_TYPES",
           "checksum_url"]


def __getattr__(name: str) -> Any:
    """``ModelInputs``, a torch type, imported when asked for: reading and writing batches loads no torch
    (a thin task's pod, issue 29); the methods that build tensors import it themselves."""
    if name == "ModelInputs":
        from models.data.batch_tensors import ModelInputs
        return ModelInputs
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class BatchCorruptError(BatchSchemaError):
    """A batch file is truncated, is not Arrow IPC, or fails its BLAKE3 check; names the URL."""


def checksum_url(url: str) -> str:
    """``{url}.blake3``: the hex BLAKE3 digest of the batch file, written after it."""
    return url + ".blake3"


class RolloutBatch:
    """An immutable RolloutBatch: an Arrow table, its :class:`BatchMetadata`, maybe its URI.

    A batch made by :meth:`open` is lazy: nothing is read until a column is needed.
    ``uri`` is set only while the content equals the file at ``uri``.
    """

    def __init__(self, table: pa.Table, metadata: Optional[BatchMetadata] = None, *,
                 uri: Optional[str] = None) -> None:
        """Wrap ``table`` (validated now). ``metadata`` replaces the table's schema metadata;
        without it the schema metadata must hold a :class:`BatchMetadata`."""
        if metadata is None:
            metadata = BatchMetadata.from_arrow(table.schema.metadata, uri or "")
        validate_table(table, source=uri or "")
        self._table: Optional[pa.Table] = table.replace_schema_metadata(metadata.to_arrow())
        self._metadata: Optional[BatchMetadata] = metadata
        self._uri = uri

    # --- construction -------------------------------------------------------------------
    @classmethod
    def open(cls, uri: str) -> "RolloutBatch":
        """A lazy batch for the file at ``uri``: read (memory-mapped if local) on first use."""
        batch = cls.__new__(cls)
        batch._table, batch._metadata, batch._uri = None, None, uri
        return batch

    @classmethod
    def read(cls, uri: str, columns: Optional[Sequence[str]] = None,
             shard: Optional[Tuple[int, int]] = None, required: Iterable[str] = ()) -> "RolloutBatch":
        """Read the batch at ``uri``; optionally only ``columns`` and only rows of
        ``shard=(rank, world_size)`` (see :func:`models.data.ragged.shard_bounds`).

        Local files are memory-mapped (zero-copy); remote files are fetched once.
        A partial read (columns or shard) has no ``uri``.
        """
        batch = cls(_read_table(uri), uri=uri).validate(required=list(required) + list(columns or ()))
        if columns is not None:
            batch = batch.select(columns)
        return batch.shard(*shard) if shard is not None else batch

    @classmethod
    def from_columns(cls, metadata: BatchMetadata, **columns: Any) -> "RolloutBatch":
        """Build a batch from columns given as Arrow arrays, Python lists, numpy arrays or
        torch tensors (see :meth:`with_columns` for the accepted forms)."""
        if not columns:
            raise BatchSchemaError("from_columns: no columns given")
        # Canonical column order (COLUMN_TYPES' order, then extras as given); response_tokens is
        # converted first because padded response-aligned columns need its row lengths.
        ordered = [k for k in COLUMN_TYPES if k in columns] + [k for k in columns if k not in COLUMN_TYPES]
        table = None
        for name in sorted(ordered, key=lambda k: k != "response_tokens"):
            table = _append(table, name, columns[name])
        table = table.select(ordered)
        return cls(table, metadata)

    @classmethod
    def from_rollout(cls, metadata: BatchMetadata, prompt_id: Any, prompt_tokens: Any,
                     response_tokens: Any, sampler_logprobs: Any, is_end: Any,
                     **optional: Any) -> "RolloutBatch":
        """What ``rollout`` writes; ``optional`` may add ``prompt``/``response`` text."""
        batch = cls.from_columns(metadata, prompt_id=prompt_id, prompt_tokens=prompt_tokens,
                                 response_tokens=response_tokens, sampler_logprobs=sampler_logprobs,
                                 is_end=is_end, **optional)
        batch.validate(required=ROLLOUT_COLUMNS)
        return batch

    # --- access -------------------------------------------------------------------------
    @property
    def table(self) -> pa.Table:
        """The Arrow table (schema metadata included); loads a lazy batch."""
        self._load()
        return self._table

    @property
    def metadata(self) -> BatchMetadata:
        """Iteration, policy version, algorithm, creation time, extras."""
        self._load()
        return self._metadata

    def _load(self) -> None:
        if self._table is None:
            loaded = RolloutBatch.read(self._uri)
            self._table, self._metadata = loaded._table, loaded._metadata

    @property
    def uri(self) -> Optional[str]:
        """Where this exact content is stored, or None if not written (or partial)."""
        return self._uri

    @property
    def column_names(self) -> list:
        return self.table.column_names

    @property
    def num_rows(self) -> int:
        return self.table.num_rows

    def __len__(self) -> int:
        return self.num_rows

    def __repr__(self) -> str:
        if self._table is None:
            return f"RolloutBatch(uri={self._uri!r}, not loaded)"
        m = self._metadata
        return (f"RolloutBatch(rows={self.num_rows}, columns={self.column_names}, "
                f"iteration={m.iteration}, algorithm={m.algorithm!r}, uri={self._uri!r})")

    def column(self, name: str) -> pa.ChunkedArray:
        """One column as Arrow; a missing column raises naming it."""
        self.validate(required=[name])
        return self.table.column(name)

    def response_lengths(self) -> np.ndarray:
        """Response tokens per row, ``[B]`` int64."""
        return list_lengths(self.column("response_tokens"))

    def validate(self, required: Iterable[str] = ()) -> "RolloutBatch":
        """Raise :class:`BatchSchemaError` unless ``required`` columns exist and all known
        columns are well typed and aligned; returns ``self`` for chaining."""
        validate_table(self.table, required=required, source=self._uri or "")
        return self

    # --- derived batches (never mutate) ----------------------------------------------------
    def with_columns(self, **columns: Any) -> "RolloutBatch":
        """A new batch with extra columns; an existing column is never overwritten.

        Accepted forms per column: an Arrow array; a Python list (of lists for list
        columns); a 1-D numpy array / torch tensor for scalar columns; for list columns a
        tuple ``(values [B, T], mask [B, T])`` (row b keeps ``values[b][mask[b]]``), or for
        response-aligned columns a right-padded ``[B, T]`` array/tensor cut to each row's
        response length. Values are cast to the column's type (:data:`COLUMN_TYPES`).
        """
        clash = [c for c in columns if c in self.column_names]
        if clash:
            raise BatchSchemaError(f"with_columns: column(s) {clash} already exist; stages add "
                                   f"columns and never overwrite them (write a new column instead)")
        table = self.table
        for name, value in columns.items():
            table = _append(table, name, value)
        return RolloutBatch(table, self.metadata)

    def with_metadata(self, **changes: Any) -> "RolloutBatch":
        """A new (unwritten) batch with some metadata fields changed."""
        return RolloutBatch(self.table, self.metadata.replace(**changes))

    def select(self, columns: Sequence[str]) -> "RolloutBatch":
        """Only ``columns`` (zero-copy); a missing column raises naming it."""
        self.validate(required=columns)
        return RolloutBatch(self.table.select(list(columns)), self.metadata)

    def shard(self, rank: int, world_size: int) -> "RolloutBatch":
        """Rows of ``rank`` of ``world_size`` (zero-copy slice; ``np.array_split`` split)."""
        start, stop = ragged.shard_bounds(self.num_rows, rank, world_size)
        return RolloutBatch(self.table.slice(start, stop - start), self.metadata)

    # --- I/O and tensors ------------------------------------------------------------------
    def write(self, url: str) -> "RolloutBatch":
        """Write as one Arrow IPC file to ``url`` (atomic) and its BLAKE3 to ``{url}.blake3``;
        returns the batch bound to ``url``. The old checksum goes first, so a crash in between
        leaves a whole file without a checksum (read unverified), never a false mismatch.
        The checksum is computed while the file is written (both release the GIL). Local files
        are not fsynced: the atomic rename keeps them whole through a crash of the process, the
        checksum catches a file torn by a crash of the machine, and a batch is re-made from the
        last committed iteration on resume; fsync would cap writes at the disk's sync speed
        (0.2 GB/s on the CI machine)."""
        data = memoryview(self._ipc_buffer())
        with ThreadPoolExecutor(1) as pool:
            digest = pool.submit(buffer_digest, data)
            storage.remove(checksum_url(url))
            storage.write_bytes(url, data, durable=False)
            checksum = digest.result()
        storage.write_bytes(checksum_url(url), checksum.encode())
        return RolloutBatch(self.table, self.metadata, uri=url)

    def to_ipc_bytes(self) -> bytes:
        """The Arrow IPC file (one record batch per table chunk) as bytes."""
        return self._ipc_buffer().to_pybytes()

    def _ipc_buffer(self) -> pa.Buffer:
        """The Arrow IPC file in one buffer: sized by a dry run, so it never regrows (each regrowth
        copies everything written so far), and filled by a multi-threaded memcpy."""
        table = self.table
        dry_run = pa.MockOutputStream()
        with pa.ipc.new_file(dry_run, table.schema) as writer:
            writer.write_table(table)
        buffer = pa.allocate_buffer(dry_run.size())
        sink = pa.FixedSizeBufferWriter(buffer)
        sink.set_memcopy_threads(os.cpu_count() or 1)
        with pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        return buffer

    def to_padded(self, columns: Sequence[str], pad_value: float = 0,
                  shard: Optional[Tuple[int, int]] = None,
                  prompt_padding: str = "left") -> Dict[str, torch.Tensor]:
        """Padded tensors of ``columns`` (see :func:`models.data.batch_tensors.padded_tensors`)."""
        from models.data.batch_tensors import padded_tensors

        batch = self.shard(*shard) if shard is not None else self
        batch.validate(required=columns)
        return padded_tensors(batch.table, columns, pad_value, prompt_padding)

    def to_model_inputs(self, pad_token_id: int = 0,
                        shard: Optional[Tuple[int, int]] = None) -> ModelInputs:
        """``prompt + response`` per row, right-padded, for a forward pass
        (see :func:`models.data.batch_tensors.model_inputs`)."""
        from models.data.batch_tensors import model_inputs

        batch = self.shard(*shard) if shard is not None else self
        batch.validate(required=("prompt_tokens", "response_tokens"))
        return model_inputs(batch.table, pad_token_id)


def _read_table(uri: str) -> pa.Table:
    try:
        if storage.is_local(uri):
            path = storage.local_path(uri)
            try:
                source = pa.memory_map(path, "r")
            except FileNotFoundError as err:
                raise FileNotFoundError(f"RolloutBatch: not found: {uri}") from err
        else:
            source = pa.py_buffer(storage.read_bytes(uri))
        _verify_checksum(uri, source)
        return pa.ipc.open_file(source).read_all()
    except pa.ArrowInvalid as err:
        raise BatchCorruptError(f"{uri} is not an Arrow IPC file (truncated or corrupted?): {err}") from err


def _verify_checksum(uri: str, source: Any) -> None:
    """Compare the file's BLAKE3 with ``{uri}.blake3`` when that exists (files written by
    :meth:`RolloutBatch.write` have one; plain Arrow files from elsewhere do not)."""
    if not storage.exists(checksum_url(uri)):
        return
    want = storage.read_bytes(checksum_url(uri)).decode("ascii", "replace").strip()
    if isinstance(source, pa.MemoryMappedFile):
        got = buffer_digest(memoryview(source.read_buffer()))
        source.seek(0)
    else:
        got = buffer_digest(memoryview(source))
    if got != want:
        raise BatchCorruptError(f"batch {uri} fails its BLAKE3 check against {checksum_url(uri)} "
                                f"(corrupted or changed after it was written)")


def _append(table: Optional[pa.Table], name: str, value: Any) -> pa.Table:
    """``table`` plus column ``name`` (a new one-column table if ``table`` is None)."""
    arr = _to_arrow(name, value, table)
    if table is None:
        return pa.table({name: arr})
    if len(arr) != table.num_rows:
        raise BatchSchemaError(f"column '{name}' has {len(arr)} rows, batch has {table.num_rows}")
    return table.append_column(name, arr)


def _is_tensor(value: Any) -> bool:
    """A torch tensor; without torch imported nothing can be one (this module does not import it)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _to_numpy(value: Any) -> np.ndarray:
    if _is_tensor(value):
        value = value.detach().cpu()
        return (value.float() if value.dtype == sys.modules["torch"].bfloat16 else value).numpy()
    return np.asarray(value)


def _to_arrow(name: str, value: Any, table: Optional[pa.Table]) -> pa.Array | pa.ChunkedArray:
    """Coerce one column value to Arrow of the column's declared type."""
    typ = COLUMN_TYPES.get(name)
    if isinstance(value, (pa.Array, pa.ChunkedArray)):
        return value  # typed input is taken as is and checked by validate_table
    is_list = typ is not None and pa.types.is_list(typ)
    if isinstance(value, tuple):
        if not is_list or len(value) != 2:
            raise BatchSchemaError(f"column '{name}': a (values, mask) tuple is only for list columns")
        return ragged.list_from_padded(_to_numpy(value[0]), _to_numpy(value[1]), typ.value_type)
    if isinstance(value, np.ndarray) or _is_tensor(value):
        arr = _to_numpy(value)
        if arr.ndim == 1 and not is_list:
            return pa.array(arr.astype(typ.to_pandas_dtype(), copy=False) if typ else arr, typ)
        if arr.ndim == 2 and name in RESPONSE_ALIGNED:
            if table is None or "response_tokens" not in table.column_names:
                raise BatchSchemaError(f"column '{name}': a padded [B, T] array needs "
                                       f"'response_tokens' first (for the row lengths)")
            lengths = list_lengths(table.column("response_tokens"))
            return ragged.list_from_lengths(arr, lengths, typ.value_type)
        raise BatchSchemaError(f"column '{name}': cannot take a {arr.ndim}-D array"
                               + (" — give (values, mask) for a padded list column" if is_list else ""))
    if isinstance(value, list) and value and _is_tensor(value[0]):
        value = [_to_numpy(v) for v in value]  # ragged rows as 1-D tensors
    try:
        return pa.array(value, type=typ)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as err:
        raise BatchSchemaError(f"column '{name}': cannot convert to {typ}: {err}") from err


"""Ragged Arrow list columns <-> padded numpy arrays, vectorised (no loop over rows).

A list column of B rows is ``offsets [B+1]`` plus flat ``values [N]``; row b is
``values[offsets[b]:offsets[b+1]]``. Padding scatters the flat values into ``[B, T]`` with
row index ``repeat(arange(B), lengths)`` and column index ``arange(N) - repeat(starts, lengths)``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import pyarrow as pa


def shard_bounds(num_rows: int, rank: int, world_size: int) -> Tuple[int, int]:
    """Rows ``[start, stop)`` of shard ``rank`` of ``world_size``: contiguous and balanced.

    Same split as ``np.array_split``: with ``num_rows = q * world_size + r`` the first r
    ranks get q+1 rows, the others q. Ranks beyond ``num_rows`` get an empty shard.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    q, r = divmod(num_rows, world_size)
    start = rank * q + min(rank, r)
    return start, start + q + (1 if rank < r else 0)


def single_chunk(column: pa.ChunkedArray | pa.Array) -> pa.Array:
    """The column as one Array (zero-copy when it already has one chunk)."""
    if isinstance(column, pa.Array):
        return column
    if column.num_chunks == 1:
        return column.chunk(0)
    return column.combine_chunks() if column.num_chunks else pa.array([], type=column.type)


def offsets_and_values(column: pa.ChunkedArray | pa.Array) -> Tuple[np.ndarray, np.ndarray]:
    """``(offsets [B+1] int64 starting at 0, values [N])`` of a list column (slice-aware)."""
    arr = single_chunk(column)
    offsets = np.asarray(arr.offsets, dtype=np.int64)  # [B+1], relative to arr.values
    start, stop = int(offsets[0]), int(offsets[-1])
    values = arr.values.slice(start, stop - start).to_numpy(zero_copy_only=False)  # [N]
    return offsets - start, values


def padded_from_list(column: pa.ChunkedArray | pa.Array, pad_value: float = 0,
                     side: str = "right", width: Optional[int] = None,
                     dtype: Optional[np.dtype] = None) -> Tuple[np.ndarray, np.ndarray]:
    """Pad a list column into ``(values [B, T], mask [B, T] bool)``.

    ``side="right"``: row b occupies columns ``[0, len_b)``; ``"left"``: ``[T - len_b, T)``.
    ``T = width`` or the longest row (0 if every row is empty).
    """
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    offsets, values = offsets_and_values(column)
    lengths = np.diff(offsets)  # [B]
    num_rows = lengths.shape[0]
    longest = int(lengths.max()) if num_rows else 0
    width = longest if width is None else width
    if width < longest:
        raise ValueError(f"width={width} is shorter than the longest row ({longest})")
    out = np.full((num_rows, width), pad_value, dtype=dtype or values.dtype)  # [B, T]
    rows = np.repeat(np.arange(num_rows), lengths)  # [N]
    cols = np.arange(values.shape[0]) - np.repeat(offsets[:-1], lengths)  # [N]
    if side == "left":
        cols = cols + np.repeat(width - lengths, lengths)
    out[rows, cols] = values
    positions = np.arange(width)[None, :]  # [1, T]
    if side == "right":
        mask = positions < lengths[:, None]
    else:
        mask = positions >= (width - lengths)[:, None]
    return out, mask


def list_from_padded(values: np.ndarray, mask: np.ndarray, value_type: pa.DataType) -> pa.ListArray:
    """Ragged list column from padded ``values [B, T]`` keeping entries where ``mask [B, T]``.

    Row b becomes ``values[b][mask[b]]`` in column order, so left- and right-padded inputs
    both work.
    """
    values, mask = np.asarray(values), np.asarray(mask, dtype=bool)
    if values.ndim != 2 or values.shape != mask.shape:
        raise ValueError(f"values and mask must both be [B, T]; got {values.shape} and {mask.shape}")
    return list_from_flat(values[mask], mask.sum(axis=1, dtype=np.int64), value_type)  # row-major


def list_from_flat(flat: np.ndarray, lengths: np.ndarray, value_type: pa.DataType) -> pa.ListArray:
    """Ragged list column from the rows' entries concatenated (``flat [N]``) and ``lengths [B]``."""
    flat, lengths = np.asarray(flat), np.asarray(lengths, dtype=np.int64)
    if int(lengths.sum()) != flat.shape[0]:
        raise ValueError(f"lengths add up to {int(lengths.sum())} but {flat.shape[0]} values were given")
    offsets = np.zeros(lengths.shape[0] + 1, dtype=np.int32)  # [B+1]
    np.cumsum(lengths, out=offsets[1:])
    flat = flat.astype(value_type.to_pandas_dtype(), copy=False)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(flat, value_type))


def list_from_lengths(values: np.ndarray, lengths: np.ndarray, value_type: pa.DataType) -> pa.ListArray:
    """Ragged list column from right-padded ``values [B, T]``, row b keeping ``lengths[b]``."""
    values = np.asarray(values)
    lengths = np.asarray(lengths, dtype=np.int64)
    if values.ndim != 2 or values.shape[0] != lengths.shape[0]:
        raise ValueError(f"values must be [B, T] with B={lengths.shape[0]}, got {values.shape}")
    if lengths.size and int(lengths.max()) > values.shape[1]:
        raise ValueError(f"values has {values.shape[1]} columns but a row needs {int(lengths.max())}")
    mask = np.arange(values.shape[1])[None, :] < lengths[:, None]  # [B, T]
    return list_from_padded(values, mask, value_type)


def list_lengths(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Entries per row of a list column, ``[B]`` int64 (no copy of the values)."""
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    parts = [np.diff(np.asarray(c.offsets, dtype=np.int64)) for c in chunks]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def unpermute_flat(flat: np.ndarray, lengths: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Row order restored: ``flat`` holds the entries of rows ``order[0], order[1], ...`` one after
    the other, row b having ``lengths[b]`` entries; returns them as rows ``0, 1, ...``."""
    lengths, order = np.asarray(lengths, dtype=np.int64), np.asarray(order, dtype=np.int64)
    if int(lengths.sum()) != len(flat):
        raise ValueError(f"lengths add up to {int(lengths.sum())} but {len(flat)} values were given")
    starts_in_flat = np.empty_like(lengths)
    starts_in_flat[order] = np.cumsum(lengths[order]) - lengths[order]  # where row b begins in `flat`
    row_starts = np.cumsum(lengths) - lengths  # where row b begins in the result
    within = np.arange(len(flat)) - np.repeat(row_starts, lengths)
    return np.asarray(flat)[np.repeat(starts_in_flat, lengths) + within]

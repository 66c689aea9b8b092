"""A batch's rows as model inputs in micro-batches, for the forwards of the score and evaluate stages."""

from __future__ import annotations

from typing import Optional

import numpy as np
import pyarrow as pa

from models.data.batch import RolloutBatch
from models.data.batch_tensors import model_inputs
from models.data.ragged import list_lengths


def micro_batches(batch: RolloutBatch, size: int, pad_id: int, order: Optional[np.ndarray] = None):
    """Model inputs of consecutive row slices (each padded to its own longest row), of the rows
    taken in ``order`` when given."""
    table = batch.table if order is None else batch.table.take(pa.array(order))
    for start in range(0, table.num_rows, size):
        yield model_inputs(table.slice(start, size), pad_id)


def by_length(batch: RolloutBatch) -> np.ndarray:
    """Row order by sequence length (stable): micro-batches of similar lengths carry little padding."""
    return np.argsort(list_lengths(batch.column("prompt_tokens")) + batch.response_lengths(), kind="stable")

"""The RolloutBatch Arrow schema: column types, stage column sets, metadata, validation.

One Arrow row per sample; list columns are ragged (no padding on disk). See docs/concepts/rollout_batch.md.
Index convention: position t of a response-aligned column is the action that
produced response token t, so those columns have ``len(response_tokens)`` entries per row.

What each sample was judged against travels with it: ``row_id`` is its prompt's row in the data
and ``data_columns`` that row's other columns as one JSON object (``{"answer": "72", "level": 3}``),
the same for the samples of one prompt. One JSON column rather than an Arrow column per field,
because user columns may have any name (``reward`` and ``response`` included) and any JSON type,
mixed from row to row; :func:`decode_data_columns` gives them back as the lists reward functions
take. ``prompt_id`` names the group: every drawn prompt instance has its own (docs/data.md).
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, field, replace
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

import numpy as np
import pyarrow as pa

from models.storage import utc_now_iso
from models.data.ragged import list_lengths

LIST_INT32 = pa.list_(pa.int32())
LIST_FLOAT32 = pa.list_(pa.float32())

RESPONSE_ALIGNED = ("sampler_logprobs", "old_logprobs", "ref_logprobs", "values",
                    "token_rewards", "advantages", "returns", "loss_mask", "token_versions")
"""List columns with one entry per response token (same length as ``response_tokens``); the tensor side
(``models/data/batch_tensors.py``) reads them from here."""

COLUMN_TYPES: Mapping[str, pa.DataType] = {
    "prompt_id": pa.int64(),            # rollout: same id for the samples of one drawn prompt (its group)
    "row_id": pa.int64(),               # rollout: the prompt's row in the data (repeats across draws)
    "prompt_tokens": LIST_INT32,        # rollout
    "response_tokens": LIST_INT32,      # rollout
    "sampler_logprobs": LIST_FLOAT32,   # rollout: the engine's own log-probs
    "token_versions": LIST_INT32,       # rollout (run.max_staleness >= 2): the policy version that drew each token
    "is_end": pa.bool_(),               # rollout: the response ended with a stop token
    "old_logprobs": LIST_FLOAT32,       # score: π_old recomputed by the training-side model
    "ref_logprobs": LIST_FLOAT32,       # score: π_ref
    "values": LIST_FLOAT32,             # score (PPO): critic V_t
    "reward": pa.float32(),             # score: sequence-level reward (after reward.normalize/scale/clip)
    "reward_raw": pa.float32(),         # score: weighted sum of the reward functions, before any scaling
    "token_rewards": LIST_FLOAT32,      # advantages: KL-shaped per-token rewards
    "advantages": LIST_FLOAT32,         # advantages
    "returns": LIST_FLOAT32,            # advantages
    "loss_mask": pa.list_(pa.bool_()),  # advantages: the response tokens the actor's loss learns from
    "prompt": pa.string(),              # rollout: the prompt text exactly as the model saw it
    "response": pa.string(),            # rollout: response text (special tokens skipped), as rewards see it
    "data_columns": pa.string(),        # rollout: the prompt row's other data columns, one JSON object
    "prompt_messages": pa.string(),     # rollout (chat prompts): the conversation the prompt was rendered from, JSON
}
"""Known columns and their exact Arrow types. Other (extra) columns are allowed, unchecked."""


ROLLOUT_COLUMNS = ("prompt_id", "prompt_tokens", "response_tokens", "sampler_logprobs", "is_end")
"""Columns every batch has after ``rollout``."""
SCORE_COLUMNS = ROLLOUT_COLUMNS + ("old_logprobs", "ref_logprobs", "reward")
"""Columns after ``score`` (PPO adds ``values``)."""
ADVANTAGE_COLUMNS = SCORE_COLUMNS + ("token_rewards", "advantages", "returns", "loss_mask")
"""Columns after ``advantages``: what the actor update reads.

``loss_mask`` (one bool per response token) is False where the actor's loss must not learn:
rows left out by DAPO's dynamic sampling or overlong filtering (``advantage.dynamic_sampling``,
``advantage.mask_truncated``; docs/rlvr/). The forward still sees every token; only the loss,
its token and sequence counts and the KL and entropy terms skip them. A stage before
``advantages`` may write its own ``loss_mask`` (e.g. tool-output tokens of a multi-turn
episode); ``advantages`` then ANDs its row filters into it. The critic ignores it."""

FORMAT_VERSION = "1"

REWARD_NORM_KEY = "reward_norm"
"""Metadata extra of a scored batch: the running reward moments after it (JSON), with ``reward.normalize``."""


def encode_data_columns(rows: Sequence[Mapping[str, Any]]) -> List[str]:
    """Per sample, its prompt row's other columns as one JSON object (the ``data_columns`` column)."""
    return [json.dumps(dict(row), ensure_ascii=False) for row in rows]


def decode_data_columns(values: Sequence[Optional[str]]) -> Dict[str, list]:
    """``data_columns`` back as ``{column: [B] values}`` (None where a row lacks the column), the
    form reward functions take (TRL's convention)."""
    rows = [json.loads(v) if v else {} for v in values]
    names = list(dict.fromkeys(k for row in rows for k in row))
    return {name: [row.get(name) for row in rows] for name in names}


_META_KEYS = ("iteration", "policy_version", "algorithm", "created_at")


class BatchSchemaError(ValueError):
    """A RolloutBatch column is missing, mistyped, null or has the wrong per-row length."""


@dataclass(frozen=True)
class BatchMetadata:
    """What a batch belongs to; stored as Arrow schema metadata (string keys and values)."""

    iteration: int
    """Training iteration that produced the batch (0-based)."""
    policy_version: int
    """Version of the actor checkpoint that generated the responses (k for iteration k)."""
    algorithm: str
    """Algorithm name, e.g. ``"ppo"``, ``"grpo"`` (the names of ``models/algorithms/``)."""
    created_at: str = field(default_factory=utc_now_iso)
    """Creation time, ISO 8601 UTC."""
    extras: Mapping[str, str] = field(default_factory=dict)
    """Free-form string annotations (e.g. ``{"run_name": ...}``); stored as one JSON value."""

    def __post_init__(self) -> None:
        if self.iteration < 0 or self.policy_version < 0:
            raise ValueError(f"iteration and policy_version must be >= 0, got "
                             f"{self.iteration}, {self.policy_version}")
        if not self.algorithm:
            raise ValueError("BatchMetadata.algorithm must not be empty")
        dt.datetime.fromisoformat(self.created_at)  # raises on a malformed time
        bad = [k for k, v in self.extras.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise ValueError(f"BatchMetadata.extras must map str to str; bad keys: {bad}")
        object.__setattr__(self, "extras", dict(self.extras))

    def replace(self, **changes) -> "BatchMetadata":
        """A copy with some fields changed."""
        return replace(self, **changes)

    def to_arrow(self) -> Dict[bytes, bytes]:
        """Schema metadata: ``{b"iteration": b"7", ..., b"extras": b"{...}"}``."""
        out = {k: str(getattr(self, k)) for k in _META_KEYS}
        out["extras"] = json.dumps(dict(self.extras), sort_keys=True)
        out["rlhf_batch_format"] = FORMAT_VERSION
        return {k.encode(): v.encode() for k, v in out.items()}

    @classmethod
    def from_arrow(cls, meta: Optional[Mapping[bytes, bytes]], source: str = "") -> "BatchMetadata":
        """Parse :meth:`to_arrow` output; a missing key raises naming the key and ``source``."""
        meta = {k.decode(): v.decode() for k, v in (meta or {}).items()}
        missing = [k for k in _META_KEYS if k not in meta]
        if missing:
            raise BatchSchemaError(f"RolloutBatch{_at(source)}: schema metadata lacks {missing} "
                                   f"(present keys: {sorted(meta)})")
        return cls(iteration=int(meta["iteration"]), policy_version=int(meta["policy_version"]),
                   algorithm=meta["algorithm"], created_at=meta["created_at"],
                   extras=json.loads(meta.get("extras", "{}")))


def _at(source: str) -> str:
    return f" at {source}" if source else ""


def _type_ok(actual: pa.DataType, expected: pa.DataType) -> bool:
    if pa.types.is_list(expected):  # the child field's name ("item", "element") does not matter
        return pa.types.is_list(actual) and actual.value_type == expected.value_type
    return actual == expected


def validate_table(table: pa.Table, required: Iterable[str] = (), source: str = "") -> None:
    """Check ``table`` against the RolloutBatch contract.

    Every ``required`` column must be present; every known column present must have its
    exact type (:data:`COLUMN_TYPES`) and no nulls; response-aligned columns must have as
    many entries as ``response_tokens`` in every row. Errors name the column (and row).
    """
    names = table.column_names
    missing = [c for c in required if c not in names]
    if missing:
        raise BatchSchemaError(f"RolloutBatch{_at(source)}: missing column(s) {missing} "
                               f"(present: {names})")
    for name in names:
        expected = COLUMN_TYPES.get(name)
        if expected is None:
            continue
        actual = table.schema.field(name).type
        if not _type_ok(actual, expected):
            raise BatchSchemaError(f"RolloutBatch{_at(source)}: column '{name}' has type {actual}, "
                                   f"expected {expected}")
        col = table.column(name)
        if col.null_count:
            row = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
            raise BatchSchemaError(f"RolloutBatch{_at(source)}: column '{name}' is null at row {row}")
    aligned = [c for c in RESPONSE_ALIGNED if c in names]
    if aligned and "response_tokens" not in names:
        raise BatchSchemaError(f"RolloutBatch{_at(source)}: columns {aligned} need "
                               f"'response_tokens' (present: {names})")
    if aligned:
        _check_aligned(table, aligned, source)


def _check_aligned(table: pa.Table, aligned: Sequence[str], source: str) -> None:
    resp_len = list_lengths(table.column("response_tokens"))  # [B]
    for name in aligned:
        lengths = list_lengths(table.column(name))  # [B]
        bad = np.flatnonzero(lengths != resp_len)
        if bad.size:
            row = int(bad[0])
            raise BatchSchemaError(
                f"RolloutBatch{_at(source)}: row {row}: '{name}' has {lengths[row]} entries but "
                f"'response_tokens' has {resp_len[row]} ({bad.size} row(s) differ)")

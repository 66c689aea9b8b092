"""Prompt datasets, validated before any model loads: JSONL or Parquet on any fsspec URL, Hugging
Face ``datasets``, or reasoning-gym (:mod:`models.data.prompt_sources`).

For files, ``url`` may be one file (``.jsonl`` / ``.parquet``, chosen by extension), a
folder/prefix (every such file in it, sorted), or a glob (``s3://bucket/prompts/part-*.parquet``).
Every row is checked, rendered into the text the model sees (prompt template, system prompt, chat
template: :mod:`models.data.prompt_render`) and checked again (length in characters and tokens,
characters the tokenizer cannot represent); all problems are reported together, by file and row,
in one :class:`PromptDataError` (up to ``max_errors`` listed)::

    data = load_prompts(PromptDataConfig(url="s3://bucket/prompts/train.jsonl"), tokenizer)
    data.prompts[0], data.row_ids[0], data.columns["answer"][0]

Row numbers are 0-based; JSONL errors also give the 1-based line number (blank lines are
skipped). A row's id comes from the ``id_column`` if the data has it (integers, unique), else it
is the row's index over all files. The run reads its own copy of the data back through this same
reader (:mod:`models.run.data`), so data that validates is data that trains.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from models.data.ragged import shard_bounds
from models.data.prompt_render import check_messages, render_prompts, report_unknown_chars
from models.data.prompt_sources import ErrorList, PromptDataError, Record, read_records



@dataclass(frozen=True)
class PromptDataConfig:
    """Where the prompts are, how a row becomes the prompt the model sees, and what a valid prompt is."""

    url: str
    """File, folder/prefix or glob of ``.jsonl`` / ``.parquet`` files on any fsspec URL (``files``), or the
    dataset ``datasets.load_dataset`` takes (``hf``)."""
    source: str = "files"
    """``files``, ``hf`` or ``reasoning_gym`` (rows generated from ``reasoning_gym``)."""
    prompt_column: str = "prompt"
    """Column (JSON key) holding the prompt text; a column of message lists is read as conversations
    (TRL's conversational format), as if ``messages_column`` named it."""
    messages_column: str = ""
    """Column of conversations (``[{"role", "content"}, ...]``) used instead of ``prompt_column``."""
    id_column: str = "prompt_id"
    """Column with integer row ids, used if present; else ids are row indices."""
    prompt_template: str = ""
    """``str.format`` template over the row's columns giving the prompt text; empty: the prompt column."""
    apply_chat_template: bool = False
    """Render text prompts with the tokenizer's chat template (conversations always are)."""
    system_prompt: str = ""
    """System message put before conversations that have none (chat template only)."""
    allow_unknown_chars: bool = False
    """Accept prompts with characters the tokenizer cannot represent (else they are errors)."""
    max_prompt_chars: int = 8192
    """Longest allowed prompt as rendered, in characters."""
    max_prompt_tokens: Optional[int] = None
    """Longest allowed prompt in tokens (checked only when a tokenizer is given): a longer prompt is an error
    naming its file and row, never truncated."""
    max_errors: int = 20
    """How many problems to list in the error (all are counted)."""
    hf_name: str = ""
    """``hf``: the dataset's configuration name."""
    split: str = "train"
    """``hf``: the split to read; ``reasoning_gym``: ``train`` or ``eval``."""
    reasoning_gym: Any = None
    """``reasoning_gym``: a :class:`models.config.ReasoningGymConfig`."""
    context_room: Optional[Tuple] = None
    """(tokens a prompt may take in the model's context, the generation budget that leaves them, and optionally
    the budget's setting, default ``rollout.max_new_tokens``): prompts longer than the first are errors (checked
    with a tokenizer)."""

    def __post_init__(self) -> None:
        if not self.url and self.source != "reasoning_gym":
            raise ValueError("PromptDataConfig.url must not be empty")
        if not self.prompt_column:
            raise ValueError("PromptDataConfig.prompt_column must not be empty")
        if self.max_prompt_chars < 1 or (self.max_prompt_tokens is not None and self.max_prompt_tokens < 1):
            raise ValueError("PromptDataConfig max_prompt_chars/max_prompt_tokens must be >= 1")
        if self.max_errors < 1:
            raise ValueError("PromptDataConfig.max_errors must be >= 1")

    @property
    def uses_chat_template(self) -> bool:
        return self.apply_chat_template or bool(self.messages_column)

    @property
    def key_column(self) -> str:
        """The column a row's prompt comes from."""
        return self.messages_column or self.prompt_column


@dataclass(frozen=True)
class PromptDataset:
    """Validated prompts, in data order, as the model sees them."""

    prompts: List[str]
    """Prompt texts as the model sees them (prompt template and chat template applied), ``[N]``."""
    row_ids: np.ndarray
    """``[N]`` int64, unique: the ``id_column``, else the row's index."""
    columns: Mapping[str, List[Any]] = field(default_factory=dict)
    """Every other column, ``{name: [N] values}`` as JSON gives them back (None where a row lacks it)."""
    messages: Optional[List[Optional[list]]] = None
    """The conversation the chat template rendered, per row (None without a chat template)."""
    chat: bool = False
    """The prompts were rendered by a chat template, so they hold its special tokens (BOS included
    where the template writes it): encode them without adding special tokens."""

    def __len__(self) -> int:
        return len(self.prompts)

    def take(self, indices: Sequence[int]) -> "PromptDataset":
        """The rows at ``indices`` (in that order; repeats allowed)."""
        idx = np.asarray(indices, dtype=np.int64)
        return PromptDataset([self.prompts[i] for i in idx], self.row_ids[idx],
                             {k: [v[i] for i in idx] for k, v in self.columns.items()},
                             None if self.messages is None else [self.messages[i] for i in idx], self.chat)

    def shard(self, rank: int, world_size: int) -> "PromptDataset":
        """Contiguous balanced shard (``np.array_split`` split, see ``shard_bounds``)."""
        start, stop = shard_bounds(len(self), rank, world_size)
        return self.take(range(start, stop))

    def row_columns(self) -> List[Dict[str, Any]]:
        """Per row, its other columns as one dict (what travels with its samples)."""
        return [{k: v[i] for k, v in self.columns.items()} for i in range(len(self))]


def conversational(config: PromptDataConfig, records: List[Record]) -> PromptDataConfig:
    """``config`` reading ``prompt_column`` as conversations when its cells are lists (TRL's
    conversational prompt-only format, ``{"prompt": [{"role": "user", "content": ...}]}``) and no
    ``messages_column`` or ``prompt_template`` says otherwise; else ``config`` unchanged."""
    col = config.prompt_column
    if config.messages_column or config.prompt_template:
        return config
    if any(row is not None and isinstance(row.get(col), list) for _, row in records):
        return replace(config, messages_column=col)
    return config


def _check_rows(records: List[Record], config: PromptDataConfig, errors: ErrorList) -> List[Record]:
    """The records with their row replaced by None where the prompt cell is missing or bad."""
    col, good = config.key_column, []
    for where, row in records:
        problem = None
        if row is None:
            pass  # already reported
        elif col not in row:
            problem = f"{where}: missing column '{col}' (available columns: {sorted(row)})"
            if config.messages_column and isinstance(row.get(config.prompt_column), list):
                problem += (f"; its '{config.prompt_column}' column holds conversations, read as such when "
                            f"data.messages_column is empty: set data.messages_column=''")
        elif config.messages_column:
            problem = check_messages(where, row[col], col)
        elif isinstance(row[col], list):
            problem = (f"{where}: '{col}' is a list (a conversation?), which data.prompt_template cannot fill; "
                       f"leave data.prompt_template empty to read '{col}' as conversations")
        elif not isinstance(row[col], str):
            problem = f"{where}: '{col}' is {type(row[col]).__name__}, not a string"
        elif not row[col].strip():
            problem = f"{where}: empty prompt"
        if problem:
            errors.add(problem)
        good.append((where, row if problem is None else None))
    return good


def _check_chars(wheres: Sequence[str], texts: Sequence[Optional[str]], limit: int, errors: ErrorList) -> None:
    for where, text in zip(wheres, texts):
        if text is not None and len(text) > limit:
            errors.add(f"{where}: prompt has {len(text)} characters > max_prompt_chars={limit}")


def _check_tokens(wheres: Sequence[str], encoded: Sequence[Sequence[int]], config: PromptDataConfig,
                  errors: ErrorList) -> None:
    """Token lengths (with the special tokens the model sees) against ``max_prompt_tokens`` and the
    room the model's context leaves."""
    room, new, *named = config.context_room or (None, 0)
    name = named[0] if named else "rollout.max_new_tokens"
    for where, ids in zip(wheres, encoded):
        if config.max_prompt_tokens is not None and len(ids) > config.max_prompt_tokens:
            errors.add(f"{where}: prompt has {len(ids)} tokens > data.max_prompt_tokens={config.max_prompt_tokens}")
        elif room is not None and len(ids) > room:
            errors.add(f"{where}: prompt has {len(ids)} tokens, but the model's context of {room + new} tokens "
                       f"(max_position_embeddings) leaves {room} beside {name}={new}")


def _prompt_ids(records: List[Record], id_column: str, errors: ErrorList) -> np.ndarray:
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


def _jsonable(value: Any) -> Any:
    """``value`` as JSON gives it back (what the run's copy of the data and the batches hold)."""
    return json.loads(json.dumps(value, default=str))


def load_prompts(config: PromptDataConfig, tokenizer: Any = None) -> PromptDataset:
    """Read, render and validate every row of the configured source; raise one
    :class:`PromptDataError` listing all problems, or return the prompts as the model sees them.
    Call this before loading any model (it needs only the tokenizer)."""
    from models.engines.rollout import encode_prompts

    errors = ErrorList(config.max_errors)
    raw = read_records(config, errors)
    config = conversational(config, raw)
    records = _check_rows(raw, config, errors)
    if not records and not errors.total:
        errors.add(f"{config.url or config.source}: no rows")
    wheres = [w for w, _ in records]
    if config.prompt_template or config.uses_chat_template:
        texts, conversations = render_prompts(records, config, tokenizer, errors)
    else:
        texts, conversations = [row[config.prompt_column] if row else None for _, row in records], None
    _check_chars(wheres, texts, config.max_prompt_chars, errors)
    if errors.total:
        raise PromptDataError(config.url or config.source, errors.listed, errors.total)
    hint = ""
    if tokenizer is not None:
        encoded = encode_prompts(tokenizer, texts, add_special_tokens=not config.uses_chat_template)
        _check_tokens(wheres, encoded, config, errors)
        if report_unknown_chars(wheres, texts, encoded, tokenizer, config.allow_unknown_chars, errors):
            hint = "(set data.allow_unknown_chars=true to train on them as they are)"
    prompt_ids = _prompt_ids(records, config.id_column, errors)
    if errors.total:
        raise PromptDataError(config.url or config.source, errors.listed, errors.total, hint)
    names = list(dict.fromkeys(k for _, row in records for k in row))
    others = [k for k in names if k not in (config.key_column, config.id_column)]
    return PromptDataset(prompts=list(texts), row_ids=prompt_ids,
                         columns={k: [_jsonable(row.get(k)) for _, row in records] for k in others},
                         messages=conversations, chat=config.uses_chat_template)

"""A run's prompt data: from the ``data`` config to validated datasets (before any model loads), the
run's own copy of them (``data/train_prompts.jsonl``, ``data/eval_prompts.jsonl``), and that copy
read back by the rollout and evaluation tasks through the same reader (:mod:`models.data.prompts`)."""

from __future__ import annotations

import json
from typing import Dict, Optional, Tuple

import numpy as np

from models import storage
from models.data.batch_schema import encode_data_columns
from models.config import DataConfig
from models.data.prompts import PromptDataConfig, PromptDataset, load_prompts


def prompt_data_config(d: DataConfig, url: str, split: str = "",
                       context: Optional[Tuple] = None) -> PromptDataConfig:
    """How to read and render ``url`` (or the generated rows of ``split``) as the run's config says;
    ``context``: (tokens a prompt may take in the actor's context, the generation budget, its setting)."""
    rg = d.source == "reasoning_gym"
    return PromptDataConfig(url=url, source=d.source, prompt_column="question" if rg else d.prompt_column,
                            messages_column=d.messages_column, id_column=d.id_column,
                            prompt_template=d.prompt_template, apply_chat_template=d.apply_chat_template,
                            system_prompt=d.system_prompt, allow_unknown_chars=d.allow_unknown_chars,
                            max_prompt_chars=d.max_prompt_chars, max_prompt_tokens=d.max_prompt_tokens,
                            hf_name=d.hf_name, split=split or d.train_split, reasoning_gym=d.reasoning_gym,
                            context_room=context)


def load_run_data(d: DataConfig, tokenizer, train_url: str = "", eval_url: str = "",
                  context: Optional[Tuple] = None) -> Tuple[PromptDataset, PromptDataset]:
    """Training and held-out prompts, every row validated and rendered with ``tokenizer``.
    ``train_url`` / ``eval_url`` (the demo's files) stand in for ``data.train_prompts`` / ``eval_prompts``.
    Held-out prompts default to: reasoning-gym's eval rows, the ``eval_split`` (``hf``), else the
    training prompts. ``context``: see :func:`prompt_data_config`."""
    def load(url: str, split: str = ""):
        return load_prompts(prompt_data_config(d, url, split, context), tokenizer)

    if d.source == "reasoning_gym":
        return load("", "train"), load("", "eval")
    train_url, eval_url = train_url or d.train_prompts, eval_url or d.eval_prompts
    train = load(train_url)
    if d.source == "hf" and d.eval_split:
        return train, load(eval_url or train_url, d.eval_split)
    return train, load(eval_url) if eval_url else train


RUN_COPY_ID = "row_id"
"""Id column of the run's copy of the prompts."""


def write_run_prompts(data: PromptDataset, url: str) -> None:
    """The validated prompts as the run's JSONL copy, one object per row: ``row_id``, ``prompt`` (the
    text the model sees), ``chat``, ``messages`` (the rendered conversation, if any) and ``columns``
    (the row's other columns). ASCII-only JSON (``\\u2028`` stays escaped), so any line splitter
    reads it back as written."""
    lines = []
    for i, columns in enumerate(data.row_columns()):
        row = {RUN_COPY_ID: int(data.row_ids[i]), "prompt": data.prompts[i], "chat": data.chat, "columns": columns}
        if data.messages is not None:
            row["messages"] = data.messages[i]
        lines.append(json.dumps(row, ensure_ascii=True))
    storage.write_bytes(url, ("\n".join(lines) + "\n").encode("ascii"))


def read_run_prompts(url: str) -> PromptDataset:
    """The run's copy written by :func:`write_run_prompts`, read by the same reader as the user's
    data (:func:`models.data.prompts.load_prompts`)."""
    raw = load_prompts(PromptDataConfig(url=url, id_column=RUN_COPY_ID, max_prompt_chars=2**62))
    n = len(raw)
    rows = raw.columns.get("columns") or [{}] * n
    names = list(dict.fromkeys(k for r in rows for k in (r or {})))
    messages: Optional[list] = raw.columns.get("messages")
    return PromptDataset(raw.prompts, raw.row_ids, {k: [(r or {}).get(k) for r in rows] for k in names},
                         messages if messages and any(m is not None for m in messages) else None,
                         bool(n and (raw.columns.get("chat") or [False])[0]))


def sample_columns(data: PromptDataset, n: int) -> Dict[str, object]:
    """The batch columns that carry each prompt's data to its ``n`` samples (adjacent, prompt-major):
    ``row_id``, ``data_columns`` and, for chat prompts, ``prompt_messages`` (:mod:`models.data.batch_schema`)."""
    encoded = encode_data_columns(data.row_columns())
    cols = {"row_id": np.repeat(np.asarray(data.row_ids, dtype=np.int64), n),
            "data_columns": [e for e in encoded for _ in range(n)]}
    if data.messages is not None:
        cols["prompt_messages"] = [json.dumps(m, ensure_ascii=False) if m is not None else ""
                                   for m in data.messages for _ in range(n)]
    return cols

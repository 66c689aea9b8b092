"""The samples a commit logs with each iteration (MLflow ``samples/iter-*.json``), multi-turn episodes
as readable transcripts (also the Flyte deck's)."""

from __future__ import annotations

import json
from typing import Dict

import numpy as np

from models.data.batch import RolloutBatch
from models.data.batch_schema import decode_data_columns


def sample_table(batch: RolloutBatch, n: int) -> Dict[str, list]:
    """The first ``n`` samples: prompt (as the model saw it), response, reward, KL(π_old‖π_ref)
    summed over the response's policy tokens (multi-turn: not the tool's), and what the sample was judged against: its data row (``row_id``)
    and the row's other columns, one table column each (``answer``, ...; a column named like one of
    the table's own gets a ``data.`` prefix)."""
    t = batch.table.slice(0, n)
    masks = t.column("loss_mask").to_pylist() if "loss_mask" in t.column_names else [True] * t.num_rows
    kl = [float(np.sum((np.asarray(o) - np.asarray(r)) * np.asarray(m))) for o, r, m in  # policy tokens only
          zip(t.column("old_logprobs").to_pylist(), t.column("ref_logprobs").to_pylist(), masks)]
    table = {"prompt": t.column("prompt").to_pylist(), "response": t.column("response").to_pylist(),
             "reward": [float(x) for x in t.column("reward").to_pylist()], "kl": kl}
    if "reward_raw" in t.column_names:
        table["reward_raw"] = [float(x) for x in t.column("reward_raw").to_pylist()]
    if "episode" in t.column_names:  # multi-turn: turns, tool calls and results as a transcript
        table["conversation"] = [conversation_text(e) for e in t.column("episode").to_pylist()]
    if "row_id" in t.column_names:
        table["row_id"] = t.column("row_id").to_pylist()
    if "data_columns" in t.column_names:
        for name, values in decode_data_columns(t.column("data_columns").to_pylist()).items():
            table[f"data.{name}" if name in table else name] = [_cell(v) for v in values]
    return table


def _cell(value):
    """A table cell: scalars as they are, lists and objects as their JSON text."""
    scalar = value is None or isinstance(value, (str, int, float, bool))
    return value if scalar else json.dumps(value, ensure_ascii=False)


def conversation_text(episode_json: str) -> str:
    """An episode (the batch's ``episode`` column: its messages as JSON) as a readable transcript: one
    block per message, tool calls as ``→ name(arguments)``, tool results under the tool's name."""
    lines = []
    for m in json.loads(episode_json):
        who = f"tool {m.get('name', '')}".strip() if m["role"] == "tool" else m["role"]
        lines.append(f"[{who}] {m.get('content') or ''}".rstrip())
        for call in m.get("tool_calls") or []:
            fn = call.get("function", call)
            lines.append(f"  → {fn['name']}({json.dumps(fn.get('arguments', {}), ensure_ascii=False)})")
    return "\n".join(lines)

"""Padded torch tensors from a RolloutBatch table (vectorised; no loop over rows).

Two frames:

- response frame ``[B, T_resp]``: position t is response token t; every response-aligned
  column (``old_logprobs``, ``advantages``, ...) and ``response_mask`` live here;
- sequence frame ``[B, L]``: ``prompt + response`` per row, right-padded, as a causal LM
  forward wants it (:func:`model_inputs`).

The logits that score response token t of row b sit at sequence position
``response_positions[b, t] - 1`` (a causal LM predicts position p from position p-1)::

    out = model_inputs(table)
    logits = model(out.input_ids, attention_mask=out.attention_mask).logits     # [B, L, V]
    logp_all = log_softmax(logits[:, :-1], -1).gather(-1, out.input_ids[:, 1:, None])[..., 0]  # [B, L-1]
    logp = logp_all.gather(1, out.response_positions - 1)                       # [B, T_resp]
    # logp[out.response_mask] are the response tokens' log-probs, aligned with the batch columns
"""

from __future__ import annotations

from typing import Dict, NamedTuple, Sequence

import numpy as np
import pyarrow as pa
import torch

from models.data import ragged
from models.data.batch_schema import RESPONSE_ALIGNED
from models.data.ragged import list_lengths

_TOKENS = ("prompt_tokens", "response_tokens")


class ModelInputs(NamedTuple):
    """Inputs for one causal-LM forward over ``prompt + response`` (right-padded)."""

    input_ids: torch.Tensor
    """``[B, L]`` int64: prompt tokens, then response tokens, then ``pad_token_id``."""
    attention_mask: torch.Tensor
    """``[B, L]`` int64: 1 on prompt and response tokens, 0 on padding."""
    is_response: torch.Tensor
    """``[B, L]`` bool: True where ``input_ids`` holds a response token."""
    response_positions: torch.Tensor
    """``[B, T_resp]`` int64: position in ``input_ids`` of response token t (always >= 1;
    padded entries hold a valid position, clamped to ``L-1``, and are masked)."""
    response_mask: torch.Tensor
    """``[B, T_resp]`` bool: True for real response tokens (right-padded)."""


def _scalar_tensor(column: pa.ChunkedArray) -> torch.Tensor:
    arr = ragged.single_chunk(column).to_numpy(zero_copy_only=False)  # [B]
    return torch.from_numpy(np.array(arr, copy=True))  # own the memory (Arrow buffers are read-only)


def padded_tensors(table: pa.Table, columns: Sequence[str], pad_value: float = 0,
                   prompt_padding: str = "left") -> Dict[str, torch.Tensor]:
    """``{column: tensor}`` plus masks for the requested columns of ``table``.

    - scalar columns: ``[B]`` (``prompt_id`` int64, ``reward`` float32, ``is_end`` bool);
    - ``response_tokens`` and response-aligned columns: ``[B, T_resp]``, right-padded with
      ``pad_value``, plus ``response_mask [B, T_resp]`` bool; ``T_resp`` = longest response
      in ``table`` (0 if all are empty); other (extra) list columns: right-padded to their
      own longest row, no mask;
    - ``prompt_tokens``: ``[B, T_prompt]``, padded on ``prompt_padding`` ("left" puts every
      prompt's last token in the last column), plus ``prompt_mask [B, T_prompt]``.

    Token ids come back as int64 (what embedding/gather want); floats as float32.
    """
    out: Dict[str, torch.Tensor] = {}
    resp_width = None
    if any(c in RESPONSE_ALIGNED or c == "response_tokens" for c in columns):
        lengths = list_lengths(table.column("response_tokens"))
        resp_width = int(lengths.max()) if lengths.size else 0
        out["response_mask"] = torch.from_numpy(np.arange(resp_width)[None, :] < lengths[:, None])
    for name in columns:
        column = table.column(name)
        if not pa.types.is_list(column.type):
            out[name] = _scalar_tensor(column)
            continue
        is_prompt = name == "prompt_tokens"
        in_response_frame = name == "response_tokens" or name in RESPONSE_ALIGNED
        dtype = np.int64 if name in _TOKENS else None
        values, mask = ragged.padded_from_list(
            column, pad_value, side=prompt_padding if is_prompt else "right",
            width=resp_width if in_response_frame else None, dtype=dtype)
        out[name] = torch.from_numpy(values)
        if is_prompt:
            out["prompt_mask"] = torch.from_numpy(mask)
    return out


def model_inputs(table: pa.Table, pad_token_id: int = 0) -> ModelInputs:
    """Concatenate each row's prompt and response tokens, right-padded to ``L = max(P+R)``.

    Row b: ``input_ids[b, :P_b]`` = prompt, ``input_ids[b, P_b:P_b+R_b]`` = response.
    Every prompt must have at least one token (the first response token is predicted from
    the last prompt token).
    """
    p_off, p_val = ragged.offsets_and_values(table.column("prompt_tokens"))  # [B+1], [Np]
    r_off, r_val = ragged.offsets_and_values(table.column("response_tokens"))  # [B+1], [Nr]
    p_len, r_len = np.diff(p_off), np.diff(r_off)  # [B], [B]
    empty = np.flatnonzero(p_len == 0)
    if empty.size:
        raise ValueError(f"row {int(empty[0])} has an empty prompt; model inputs need >= 1 "
                         f"prompt token per row ({empty.size} row(s) empty)")
    num_rows = p_len.shape[0]
    total = p_len + r_len  # [B]
    seq_len = int(total.max()) if num_rows else 0
    resp_width = int(r_len.max()) if num_rows else 0
    input_ids = np.full((num_rows, seq_len), pad_token_id, dtype=np.int64)  # [B, L]
    p_rows = np.repeat(np.arange(num_rows), p_len)  # [Np]
    input_ids[p_rows, np.arange(p_val.shape[0]) - np.repeat(p_off[:-1], p_len)] = p_val
    r_rows = np.repeat(np.arange(num_rows), r_len)  # [Nr]
    r_cols = np.arange(r_val.shape[0]) - np.repeat(r_off[:-1], r_len) + np.repeat(p_len, r_len)
    input_ids[r_rows, r_cols] = r_val
    pos = np.arange(seq_len)[None, :]  # [1, L]
    attention_mask = pos < total[:, None]  # [B, L]
    is_response = attention_mask & (pos >= p_len[:, None])  # [B, L]
    t = np.arange(resp_width)[None, :]  # [1, T_resp]
    response_positions = np.minimum(p_len[:, None] + t, max(seq_len - 1, 0))  # [B, T_resp]
    response_mask = t < r_len[:, None]  # [B, T_resp]
    return ModelInputs(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attention_mask.astype(np.int64)),
        is_response=torch.from_numpy(is_response),
        response_positions=torch.from_numpy(response_positions.astype(np.int64)),
        response_mask=torch.from_numpy(response_mask),
    )


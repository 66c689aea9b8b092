"""Reducing a per-token loss ``[B, T]`` to the scalar that is minimised.

Four modes, chosen by :class:`LossAgg` (``kernels/choices.py``, torch-free) through the ``AGGREGATORS``
registry:

- ``token_mean``: ``Σ_{b,t} m·ℓ / N_tok``. Every token weighs the same. Pass the token
  count of the *whole* batch (all minibatches, all ranks) as ``num_tokens`` and summing
  the minibatch losses gives the exact global token mean (the default in this project).
- ``seq_mean_token_mean``: ``Σ_b (Σ_t m·ℓ / n_b) / N_seq``. Every sequence weighs the
  same, whatever its length (the original GRPO objective, Shao et al. 2024, eq. 3).
- ``seq_mean_token_sum``: ``Σ_b Σ_t m·ℓ / N_seq``. Longer sequences weigh more (the
  sequence-level sum of Dr. GRPO, Liu et al. 2025, without its constant).
- ``seq_mean_token_sum_norm``: ``Σ_b Σ_t m·ℓ / (N_seq·L)`` with a constant ``L`` (``horizon``,
  the generation budget): Dr. GRPO's aggregation (Liu et al. 2025, "Understanding R1-Zero-Like
  Training": no division by the response length ``|o_i|``, a constant instead), so every
  token weighs the same whatever the length of its sequence or of the others in the batch.

``N_seq`` defaults to the number of rows with at least one token; rows without tokens
contribute 0. Counts are clamped to at least 1, so an all-masked batch gives a loss of 0.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from kernels.choices import LossAgg
from kernels.masked import as_bool_mask, masked_sum

__all__ = ["LossAgg", "AGGREGATORS", "aggregate"]


def _seq_count(m: Tensor, num_seqs: float | None, dtype: torch.dtype) -> Tensor | float:
    if num_seqs is not None:
        return max(float(num_seqs), 1.0)
    return m.any(dim=-1).sum().to(dtype).clamp(min=1)


Aggregator = Callable[[Tensor, Tensor, Optional[float], Optional[float], Optional[float]], Tensor]
"""``(loss, mask, num_tokens, num_seqs, horizon) -> scalar``."""


def _token_mean(loss: Tensor, m: Tensor, num_tokens: float | None, num_seqs: float | None,
                horizon: float | None) -> Tensor:
    denom = m.sum().to(loss.dtype).clamp(min=1) if num_tokens is None else max(float(num_tokens), 1.0)
    return masked_sum(loss, m) / denom


def _seq_mean_token_mean(loss: Tensor, m: Tensor, num_tokens: float | None, num_seqs: float | None,
                         horizon: float | None) -> Tensor:
    per_seq = masked_sum(loss, m, dim=-1) / m.sum(-1).to(loss.dtype).clamp(min=1)  # [B]
    return per_seq.sum() / _seq_count(m, num_seqs, loss.dtype)


def _seq_mean_token_sum(loss: Tensor, m: Tensor, num_tokens: float | None, num_seqs: float | None,
                        horizon: float | None) -> Tensor:
    per_seq = masked_sum(loss, m, dim=-1)  # [B]
    return per_seq.sum() / _seq_count(m, num_seqs, loss.dtype)


def _seq_mean_token_sum_norm(loss: Tensor, m: Tensor, num_tokens: float | None, num_seqs: float | None,
                             horizon: float | None) -> Tensor:
    if horizon is None or horizon <= 0:
        raise ValueError(f"seq_mean_token_sum_norm needs a horizon L > 0 (the generation budget), got {horizon}")
    return _seq_mean_token_sum(loss, m, num_tokens, num_seqs, horizon) / float(horizon)


AGGREGATORS: dict[LossAgg, Aggregator] = {
    LossAgg.TOKEN_MEAN: _token_mean,
    LossAgg.SEQ_MEAN_TOKEN_MEAN: _seq_mean_token_mean,
    LossAgg.SEQ_MEAN_TOKEN_SUM: _seq_mean_token_sum,
    LossAgg.SEQ_MEAN_TOKEN_SUM_NORM: _seq_mean_token_sum_norm,
}


def aggregate(
    loss: Tensor,
    mask: Tensor,
    agg: LossAgg | str = LossAgg.TOKEN_MEAN,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    horizon: float | None = None,
) -> Tensor:
    """Scalar loss from per-token ``loss`` ``[B, T]`` and ``mask`` ``[B, T]``.

    ``num_tokens`` / ``num_seqs``: global denominators (token_mean / the seq_mean modes);
    None uses the counts in this call. ``horizon``: the constant ``L`` of
    ``seq_mean_token_sum_norm`` (unused by the other modes).
    """
    if loss.shape != mask.shape:
        raise ValueError(f"loss {tuple(loss.shape)} and mask {tuple(mask.shape)} differ in shape")
    return AGGREGATORS[LossAgg(agg)](loss, as_bool_mask(mask), num_tokens, num_seqs, horizon)

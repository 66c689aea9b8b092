"""The distribution a rollout engine samples from, and how it draws from it (pure tensor math).

Both engines sample from and report log-probs of the *processed* distribution of one step
(vLLM's ``logprobs_mode="processed_logprobs"``):

    z = logits / τ                       (τ > 0; τ = 0 is greedy: z = logits, argmax)
    z_v = −inf  for v outside top-k       (the k largest z, ties at the k-th kept; k = 0: all)
    z_v = −inf  for v outside top-p       (the smallest set of largest z whose mass reaches p,
                                           the largest always kept; p = 1: all)
    log π(v) = z_v − logsumexp(z)

with top-p taken on the top-k-filtered distribution, in vLLM's order and tie rules
(``vllm/v1/sample/ops/topk_topp_sampler.py``). A token is drawn by the exponential race
``argmax_v π(v) / q_v`` with ``q_v ~ Exp(1)`` i.i.d., which picks v with probability π(v) — vLLM's
sampler on GPUs; here the noise comes from one ``torch.Generator`` per sample, so each sample's
draw depends on its own seed only.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def top_k_top_p_filter(z: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """``z [N, V]`` with the tokens outside top-k, then outside top-p, set to −inf (a new tensor)."""
    if top_k <= 0 and top_p >= 1.0:
        return z.clone()
    z_sort, idx = z.sort(dim=-1, descending=False)  # [N, V] ascending
    if 0 < top_k < z.shape[-1]:
        kth = z_sort[:, -top_k].unsqueeze(-1)  # [N, 1] the k-th largest
        z_sort = z_sort.masked_fill(z_sort < kth, float("-inf"))
    if top_p < 1.0:
        cum = z_sort.softmax(dim=-1).cumsum(dim=-1)  # [N, V] mass of this token and all smaller ones
        drop = cum <= 1.0 - top_p
        drop[:, -1] = False  # the most likely token always stays
        z_sort = z_sort.masked_fill(drop, float("-inf"))
    return torch.empty_like(z).scatter_(-1, idx, z_sort)


def processed_logprobs(logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """``log π [N, V]`` (float32) of the distribution sampled at ``temperature`` with top-k/top-p
    (module docstring); ``temperature == 0`` (greedy): the plain log-softmax of ``logits``."""
    z = logits.float()
    if temperature == 0:
        return z.log_softmax(dim=-1)
    return top_k_top_p_filter(z / temperature, top_k, top_p).log_softmax(dim=-1)


def exponential_race(logp: Tensor, generators: Sequence[torch.Generator]) -> Tensor:
    """One token per row of ``logp [N, V]``: ``argmax_v exp(logp_v) / q_v``, ``q_v ~ Exp(1)`` drawn from
    ``generators[row]`` (V draws per row and call). Returns ``[N]`` int64."""
    noise = torch.empty_like(logp, dtype=torch.float32)  # [N, V]
    for row, gen in enumerate(generators):
        noise[row].exponential_(generator=gen)
    return (logp.float().exp() / noise).argmax(dim=-1)

"""Critic-free advantages: group baselines (RLOO, GRPO) and REINFORCE++ returns.

Samples of one prompt share a ``prompt_id`` (any integers, any order, any group size).
With k samples in the group of sample i and rewards R:

- RLOO (Ahmadian et al. 2024, "Back to Basics", eq. 6): ``A_i = R_i − (Σ_{j≠i} R_j)/(k−1)``
  ``= k/(k−1)·(R_i − mean)``.
- GRPO (Shao et al. 2024, "DeepSeekMath", §4.1.2): ``A_i = (R_i − mean)/(std + ε)``, with
  the unbiased group std (as ``torch.std``); ``normalize_std=False`` gives ``R_i − mean``
  (Dr. GRPO, Liu et al. 2025).
- REINFORCE++ (Hu 2025, eq. 8-9): token returns ``G_t = Σ_{s>=t} γ^(s−t) r_s`` of the
  KL-shaped token rewards, whitened over the whole batch.

A group of one has no baseline to learn from: its advantage is 0 (RLOO and GRPO), never
NaN. Sequence advantages ``[N]`` become token advantages with :func:`broadcast_to_tokens`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from kernels.gae import compute_gae
from kernels.masked import as_bool_mask, masked_whiten

__all__ = [
    "GroupStats",
    "group_stats",
    "rloo_advantages",
    "grpo_advantages",
    "ReinforcePPResult",
    "reinforce_pp_advantages",
    "broadcast_to_tokens",
]


class GroupStats(NamedTuple):
    """Per-sample statistics of its own group. All ``[N]``."""

    count: Tensor  # k, the group size
    mean: Tensor  # group mean of R
    std: Tensor  # unbiased group std of R (0 for a group of one)


def group_stats(rewards: Tensor, prompt_id: Tensor) -> GroupStats:
    """Group size, mean and unbiased std for each sample, groups given by ``prompt_id``.

    Shape: rewards ``[N]`` float, prompt_id ``[N]`` int → three ``[N]``.
    """
    if rewards.dim() != 1 or rewards.shape != prompt_id.shape:
        raise ValueError(f"rewards and prompt_id must be [N], got {tuple(rewards.shape)}, {tuple(prompt_id.shape)}")
    _, group = torch.unique(prompt_id, return_inverse=True)  # [N] in 0..G-1
    n_groups = int(group.max()) + 1 if group.numel() else 0
    r = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    count = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, group, torch.ones_like(r))  # [G]
    total = torch.zeros_like(count).index_add_(0, group, r)
    mean = (total / count)[group]  # [N]
    sq = torch.zeros_like(count).index_add_(0, group, (r - mean) ** 2)  # [G], centred: no cancellation
    k = count[group]
    std = torch.sqrt(sq[group] / (k - 1).clamp(min=1))
    return GroupStats(k, mean, std)


def rloo_advantages(rewards: Tensor, prompt_id: Tensor) -> Tensor:
    """Leave-one-out advantages ``R_i − mean_{j≠i} R_j``; 0 for groups of one. ``[N]`` → ``[N]``."""
    k, mean, _ = group_stats(rewards, prompt_id)
    adv = k / (k - 1).clamp(min=1) * (rewards.to(mean.dtype) - mean)
    return torch.where(k > 1, adv, 0.0)


def grpo_advantages(rewards: Tensor, prompt_id: Tensor, normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Group-normalised advantages ``(R − mean)/(std + ε)`` (or ``R − mean``). ``[N]`` → ``[N]``."""
    k, mean, std = group_stats(rewards, prompt_id)
    centred = rewards.to(mean.dtype) - mean
    adv = centred / (std + eps) if normalize_std else centred
    return torch.where(k > 1, adv, 0.0)  # a group of one: 0, even with eps = 0


class ReinforcePPResult(NamedTuple):
    advantages: Tensor  # [B, T], whitened returns, 0 at masked positions
    returns: Tensor  # [B, T], discounted token returns before whitening


def reinforce_pp_advantages(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> ReinforcePPResult:
    """REINFORCE++: discounted returns of token rewards, whitened over the batch.

    The returns are GAE with V = 0 and λ = 1 (masked positions skipped the same way).
    Shape: token_rewards, mask ``[B, T]`` → two ``[B, T]``.
    """
    zeros = torch.zeros_like(token_rewards)
    returns = compute_gae(token_rewards, zeros, mask, gamma, 1.0).advantages
    return ReinforcePPResult(masked_whiten(returns, mask), returns)


def broadcast_to_tokens(seq_adv: Tensor, mask: Tensor) -> Tensor:
    """Sequence advantage on every valid token, 0 elsewhere. ``[B]``, ``[B, T]`` → ``[B, T]``."""
    zero = torch.zeros((), dtype=seq_adv.dtype, device=seq_adv.device)
    return torch.where(as_bool_mask(mask), seq_adv.unsqueeze(1), zero)

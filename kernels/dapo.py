"""Which samples the loss learns from, and a length penalty: the RLVR sample filters of DAPO
(Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale").

- Dynamic sampling (§3.2: keep the groups with ``0 < |{o_i correct}| < G``): a group whose
  rewards are all equal has a group-relative advantage of 0 for every sample, so it only dilutes
  the gradient of the others. :func:`informative_groups` marks the samples of groups whose
  rewards differ.
- Overlong filtering (§3.4): a response cut at the length limit (``is_end = False``) has no
  verdict on its answer; its tokens are left out of the loss (the caller masks them).
- Soft overlong punishment (§3.4), with ``L_max`` the generation budget and
  ``L_cache`` the buffer before it::

      R_length(|y|) = 0                                   if |y| <= L_max − L_cache
                    = ((L_max − L_cache) − |y|) / L_cache  if L_max − L_cache < |y| <= L_max
                    = −1                                  if |y| > L_max

  scaled here by ``penalty`` (DAPO: 1) and added to the sequence reward (:func:`overlong_penalty`).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["informative_groups", "overlong_penalty"]


def informative_groups(rewards: Tensor, prompt_id: Tensor) -> Tensor:
    """True for the samples of groups (same ``prompt_id``) whose rewards are not all equal.

    Exact comparison of each group's max and min (no tolerance, no float cancellation). A group
    of one is never informative. Shape: rewards ``[N]`` float, prompt_id ``[N]`` int → ``[N]`` bool.
    """
    if rewards.dim() != 1 or rewards.shape != prompt_id.shape:
        raise ValueError(f"rewards and prompt_id must be [N], got {tuple(rewards.shape)}, {tuple(prompt_id.shape)}")
    if rewards.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=rewards.device)
    _, group = torch.unique(prompt_id, return_inverse=True)  # [N] in 0..G-1
    n_groups = int(group.max()) + 1
    r = rewards.float()
    hi = torch.full((n_groups,), -torch.inf, device=r.device).scatter_reduce(0, group, r, "amax")  # [G]
    lo = torch.full((n_groups,), torch.inf, device=r.device).scatter_reduce(0, group, r, "amin")  # [G]
    return (hi > lo)[group]


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int, penalty: float = 1.0) -> Tensor:
    """``penalty · R_length(|y|)`` of the module docstring for response lengths ``[N]`` → ``[N]`` float32.

    ``max_len``: L_max (tokens), ``buffer``: L_cache (0 < L_cache <= L_max).
    """
    if not 0 < buffer <= max_len:
        raise ValueError(f"need 0 < buffer <= max_len, got buffer={buffer}, max_len={max_len}")
    n = lengths.float()
    start = max_len - buffer  # L_max − L_cache
    ramp = (start - n) / buffer  # [N], in [−1, 0) inside the buffer
    r = torch.where(n <= start, 0.0, torch.where(n <= max_len, ramp, -1.0))
    return penalty * r

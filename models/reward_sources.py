"""Reward sources chosen by config, all called as ``source(prompts, responses, inputs)``.

- ``function``: a user ``module:function`` on texts (validated by :func:`models.rewards.compute_rewards`);
- ``model``: a reward-model checkpoint (sequence-classification head) scored on the batch's tokens.
"""

from __future__ import annotations

from typing import Iterable, List, Sequence

import numpy as np
import torch

from models.policy import inputs_to, reward_model_scores
from models.rewards import RewardError, compute_rewards, resolve_reward_fn


class FunctionReward:
    """A ``module:function`` reward on (prompt, response) texts."""

    def __init__(self, spec: str):
        self.spec = spec
        self.fn = resolve_reward_fn(spec)

    def __call__(self, prompts: Sequence[str], responses: Sequence[str], micro_batches: Iterable = ()) -> List[float]:
        return compute_rewards(self.fn, prompts, responses, spec=self.spec)


class ModelReward:
    """A reward model scored on the same token sequences the policy produced."""

    def __init__(self, model: torch.nn.Module, name: str, device: str | torch.device = "cpu"):
        self.model, self.name, self.device = model.eval(), name, device

    @torch.no_grad()
    def __call__(self, prompts: Sequence[str], responses: Sequence[str], micro_batches: Iterable = ()) -> List[float]:
        scores = [reward_model_scores(self.model, inputs_to(m, self.device)).cpu().numpy() for m in micro_batches]
        values = np.concatenate(scores) if scores else np.zeros(0, np.float32)
        if values.shape[0] != len(prompts):
            raise RewardError(f"reward model {self.name} scored {values.shape[0]} of {len(prompts)} samples")
        bad = np.flatnonzero(~np.isfinite(values))
        if bad.size:
            raise RewardError(f"reward model {self.name}: sample {int(bad[0])} got {values[bad[0]]} (not finite)")
        return values.astype(float).tolist()


def check_rewards(values: Sequence[float], name: str) -> np.ndarray:
    """Every reward finite, else an error naming the first bad sample."""
    arr = np.asarray(values, dtype=np.float64)
    bad = np.flatnonzero(~np.isfinite(arr))
    if bad.size:
        raise RewardError(f"reward {name}: sample {int(bad[0])} got {arr[bad[0]]} (not finite)")
    return arr.astype(np.float32)



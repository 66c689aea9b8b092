"""Reward sources chosen by config, all called as ``source(prompts, responses, micro_batches, columns,
messages, completion_ids)`` and all answering :class:`RewardScores` (the weighted total and each part,
per sample):

- ``function``: one or more user ``module:function`` rewards on texts, weighted, each in worker
  processes under a time limit (:mod:`models.rewards.workers`; validated by
  :func:`models.rewards.compute_rewards`);
- ``model``: a reward-model checkpoint (sequence-classification head) scored on the batch's tokens.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence

import numpy as np
import torch

from models.training.policy import inputs_to, reward_model_scores
from models.rewards.workers import score_function
from models.rewards import RewardError, parse_spec


class RewardScores(NamedTuple):
    """Rewards of a batch before any scaling."""

    total: np.ndarray
    """``[B]`` float64: Σ_k w_k · r_k over the parts."""
    parts: Dict[str, np.ndarray]
    """``{name: [B]}`` each part's own reward (a function's, or the model's); NaN where a TRL-style
    function gave None (no reward from it for that sample)."""

    def part_means(self, prefix: str) -> Dict[str, float]:
        """``{prefix<name>_mean: mean}`` over the samples each part scored (TRL's ``nanmean``); a part
        that scored none is left out."""
        return {f"{prefix}{name}_mean": float(np.nanmean(v)) for name, v in self.parts.items() if np.isfinite(v).any()}


def function_names(specs: Sequence[str]) -> List[str]:
    """Metric names of reward functions: the function's name (``math_reward``), numbered when two
    specs share one (``score``, ``score_2``)."""
    names: List[str] = []
    for spec in specs:
        try:
            base = parse_spec(spec).name
        except RewardError:
            base = "reward"
        name, k = base, 2
        while name in names:
            name, k = f"{base}_{k}", k + 1
        names.append(name)
    return names


class FunctionRewards:
    """Weighted reward functions on (prompt, response) texts and the rows' data columns."""

    def __init__(self, specs: Sequence[str], weights: Sequence[float] = (), timeout_s: float = 300.0,
                 num_workers: int = 1, module_paths: Sequence[str] = (), options: Optional[Mapping[str, Any]] = None):
        self.specs, self.names = list(specs), function_names(specs)
        self.weights = list(weights) or [1.0] * len(self.specs)
        self.timeout_s, self.num_workers = timeout_s, num_workers
        self.module_paths, self.options = list(module_paths), dict(options or {})

    @classmethod
    def from_config(cls, r) -> "FunctionRewards":
        """The functions of a ``reward`` config section (:class:`models.config.RewardConfig`)."""
        return cls(r.specs, r.weights, r.timeout_s, r.num_workers, r.module_paths, r.options)

    def __call__(self, prompts: Sequence[str], responses: Sequence[str], micro_batches: Iterable = (),
                 columns: Optional[Mapping[str, Sequence[Any]]] = None, messages: Optional[Sequence[Any]] = None,
                 completion_ids: Optional[Sequence[Sequence[int]]] = None) -> RewardScores:
        parts = {name: np.array([np.nan if v is None else v for v in score_function(
                     spec, prompts, responses, columns, timeout_s=self.timeout_s, num_workers=self.num_workers,
                     module_paths=self.module_paths, options=self.options, messages=messages,
                     completion_ids=completion_ids)], dtype=np.float64).reshape(len(prompts))
                 for spec, name in zip(self.specs, self.names)}
        return weighted_total(parts, self.weights, len(prompts))


def weighted_total(parts: Mapping[str, np.ndarray], weights: Sequence[float], n: int) -> RewardScores:
    """Σ_k w_k · r_k per sample over the parts that scored it (NaN: a function's None, skipped as
    TRL's ``nansum`` does). A sample no part scored gets 0, with a warning on the console: TRL
    leaves it out of its group's baseline, and a group scored by none gets 0 advantages either way."""
    stacked = np.stack([np.asarray(v, np.float64) for v in parts.values()]) if parts else np.zeros((0, n))  # [K, B]
    total = np.nansum(stacked * np.asarray(weights, np.float64)[:, None], axis=0) if parts else np.zeros(n)
    unscored = np.flatnonzero(np.isnan(stacked).all(axis=0)) if parts else np.zeros(0, np.int64)
    if unscored.size:
        print(f"WARNING reward: every reward function returned None for {unscored.size} of {n} samples (first: "
              f"sample {int(unscored[0])}); they get reward 0. Give every sample at least one reward (e.g. a "
              f"function that scores the format) or drop rows whose reference answer does not parse", flush=True)
    return RewardScores(np.asarray(total, dtype=np.float64).reshape(n), dict(parts))


class ModelReward:
    """A reward model scored on the same token sequences the policy produced."""

    def __init__(self, model: torch.nn.Module, name: str, device: str | torch.device = "cpu"):
        self.model, self.name, self.device = model.eval(), name, device

    @torch.no_grad()
    def __call__(self, prompts: Sequence[str], responses: Sequence[str], micro_batches: Iterable = (),
                 columns: Optional[Mapping[str, Sequence[Any]]] = None, messages: Optional[Sequence[Any]] = None,
                 completion_ids: Optional[Sequence[Sequence[int]]] = None) -> RewardScores:
        scores = [reward_model_scores(self.model, inputs_to(m, self.device)).cpu().numpy() for m in micro_batches]
        values = np.concatenate(scores) if scores else np.zeros(0, np.float32)
        if values.shape[0] != len(prompts):
            raise RewardError(f"reward model {self.name} scored {values.shape[0]} of {len(prompts)} samples")
        bad = np.flatnonzero(~np.isfinite(values))
        if bad.size:
            raise RewardError(f"reward model {self.name}: sample {int(bad[0])} got {values[bad[0]]} (not finite)")
        return as_scores(values, "reward_model")


class PlainSource:
    """A source answering a list of floats (the reward server's client) as :class:`RewardScores`."""

    def __init__(self, source, name: str):
        self.source, self.name = source, name

    def __call__(self, prompts: Sequence[str], responses: Sequence[str], micro_batches: Iterable = (),
                 columns: Optional[Mapping[str, Sequence[Any]]] = None, messages: Optional[Sequence[Any]] = None,
                 completion_ids: Optional[Sequence[Sequence[int]]] = None) -> RewardScores:
        return as_scores(self.source(prompts, responses, micro_batches), self.name)


def as_scores(values: Sequence[float], name: str) -> RewardScores:
    """One source's rewards as :class:`RewardScores` with a single part."""
    arr = np.asarray(values, dtype=np.float64)
    return RewardScores(arr, {name: arr})


def check_rewards(values: Sequence[float], name: str) -> np.ndarray:
    """Every reward finite, else an error naming the first bad sample."""
    arr = np.asarray(values, dtype=np.float64)
    bad = np.flatnonzero(~np.isfinite(arr))
    if bad.size:
        raise RewardError(f"reward {name}: sample {int(bad[0])} got {arr[bad[0]]} (not finite)")
    return arr.astype(np.float32)

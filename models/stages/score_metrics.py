"""The ``rollout/*`` metrics of a scored batch (docs/concepts/metrics.md) and the checks that a batch
is scored as it was sampled (temperature, policy lag)."""

from __future__ import annotations

import json
from typing import Dict

import numpy as np

from models.config import TrainConfig
from models.data import ragged
from models.data.batch import RolloutBatch
from models.run.types import PolicyState


def policy_lag(cfg: TrainConfig, state: PolicyState, batch: RolloutBatch) -> Dict[str, float]:
    """``rollout/policy_lag`` (``run.max_staleness`` k > 0): updates between the oldest actor that sampled the
    batch (its ``policy_version``) and π_old, the actor the update starts from (``state.iteration``).
    A batch staler than k allows is refused."""
    lag, k = state.iteration - batch.metadata.policy_version, cfg.run.staleness
    if not 0 <= lag <= k:
        raise ValueError(f"batch {batch.uri or ''} was sampled by the actor of version "
                         f"{batch.metadata.policy_version}, {lag} updates before iteration {state.iteration}'s; run.max_staleness={k} allows 0..{k}")
    return {"rollout/policy_lag": float(lag)} if k else {}


def logprob_gap(batch: RolloutBatch, old_logprobs: np.ndarray) -> Dict[str, float]:
    """``rollout/logprob_gap_{max,mean}``: |sampler − π_old| log-prob over every response token, the
    sampler's distribution against the one the trainer scores (policy tokens only, where a rollout
    wrote a ``loss_mask``) (0 up to float error when on-policy;
    top-p/top-k sampling adds the log of the kept mass)."""
    sampler = ragged.offsets_and_values(batch.column("sampler_logprobs"))[1].astype(np.float64)
    gap = np.abs(sampler - old_logprobs.astype(np.float64))  # [N_tok]
    gap = gap[policy_tokens(batch, len(gap))]  # multi-turn: tool and template tokens were not sampled
    return {"rollout/logprob_gap_max": float(gap.max()) if gap.size else 0.0,
            "rollout/logprob_gap_mean": float(gap.mean()) if gap.size else 0.0}


def check_sampling_temperature(batch: RolloutBatch, temperature: float) -> None:
    """The batch must have been sampled at the temperature it is scored at (its metadata says)."""
    record = json.loads(batch.metadata.extras.get("sampling", "{}"))
    if "temperature" in record and record["temperature"] != temperature:
        raise ValueError(f"batch {batch.uri or ''} was sampled at temperature {record['temperature']} but is scored "
                         f"at rollout.temperature={temperature}: its log-probs would be of another distribution")


def rollout_stats(rewards: np.ndarray, lengths: np.ndarray, batch: RolloutBatch, flat: Dict[str, np.ndarray]):
    """``rollout/*`` metrics (docs/concepts/metrics.md) that need only the scored batch (``rewards``: the raw reward,
    what the task's success reads as, whatever scaling the advantages get)."""
    seq = np.repeat(np.arange(len(lengths)), lengths)  # [N_tok] row of each token
    policy = policy_tokens(batch, len(seq))  # [N_tok] the tokens the policy chose (multi-turn: not tool tokens)
    kl_tok = (flat["old_logprobs"] - flat["ref_logprobs"]) * policy
    kl_seq = np.bincount(seq, weights=kl_tok, minlength=len(lengths))  # [B]
    ended = batch.table.column("is_end").to_numpy()
    return {
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/reward_std": float(rewards.std()),
        "rollout/init_policy_kl": float(kl_seq.mean()),
        "rollout/response_length_mean": float(lengths.mean()),
        "rollout/fraction_ended": float(np.asarray(ended, dtype=np.float64).mean()),
        **({"rollout/entropy": float(flat["entropy"][policy].mean()) if policy.any() else 0.0}
           if "entropy" in flat else {}),  # the actor's forward: not run with actor.old_logprobs=sampler
    }


def policy_tokens(batch: RolloutBatch, n_tokens: int) -> np.ndarray:
    """``[N_tok]`` bool over the batch's response tokens, flat: the batch's ``loss_mask`` (multi-turn: 1 on
    the tokens the policy sampled, 0 on tool, user and template tokens), all True without one.

    KL and entropy metrics count these only: a tool result's tokens are not the policy's choice, and
    π_old and π_ref can disagree on them by nats (the tool demo's logged KL was 23.6 nats per episode,
    19.0 of them on tool and template tokens; docs/multi_turn.md)."""
    if "loss_mask" not in batch.column_names:
        return np.ones(n_tokens, dtype=bool)
    return ragged.offsets_and_values(batch.column("loss_mask"))[1].astype(bool)

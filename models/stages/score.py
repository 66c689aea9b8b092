"""The score stage: π_old and π_ref log-probs, critic values and the sequence reward for a batch."""

from __future__ import annotations

import json
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import numpy as np
import pyarrow as pa
import torch

from models import memory
from models.checkpoint.local import load_tokenizer

from models.training.load import base_checkpoint_url, load_hf
from models.config import TrainConfig
from models.data import ragged
from models.data.batch import RolloutBatch
from models.data.batch_schema import REWARD_NORM_KEY
from models.run.types import PolicyState, RunHandle
from models.stages.outputs import ScoreOutput
from models.stages.services import critic_service
from models.stages.batches import by_length, micro_batches
from models.rewards.sources import RewardScores, as_scores, check_rewards
from models.stages.rewards import batch_rewards, shaped_rewards
from models.stages.score_metrics import check_sampling_temperature, logprob_gap, policy_lag, rollout_stats
from models.timing import timed
from models.training.lora import canonical_url, without_adapter
from models.training.policy import CriticValues, PolicyLogprobs, with_packing
from models.training.scoring import score_microbatches



def service_values(service, state: PolicyState) -> Callable[[RolloutBatch], np.ndarray]:
    """The critic's values from a service (``critic.remote_url``'s server or a resident run's critic service,
    :func:`models.stages.services.critic_service`), flat in row-major response order."""
    def values(batch: RolloutBatch) -> np.ndarray:
        return np.asarray(service.call("values", {"batch": batch.uri, "iteration": state.iteration}), np.float32)

    return values


def check_reference_base(actor_url: str, reference_url: str) -> None:
    """With LoRA the reference is the actor's base: refuse an adapter trained on another base."""
    base = base_checkpoint_url(actor_url)
    if canonical_url(base) != canonical_url(reference_url):
        raise ValueError(f"LoRA actor {actor_url} adapts {base}, not the run's reference {reference_url}: "
                         f"its base with the adapter off would not be the reference policy")


class Scorers(NamedTuple):
    """The forwards of the score stage: loaded from storage by :func:`load_scorers`, or a resident
    service's own models (``run.resident``)."""

    actor: Optional[torch.nn.Module]
    """π_old's forward; None: the sampler's log-probs are π_old (``actor.old_logprobs=sampler``)."""
    ref: Optional[torch.nn.Module]
    """π_ref's forward (None only in what :func:`score_in_turn` returns, after the forwards)."""
    critic: Optional[torch.nn.Module] = None
    """The critic's values forward, when this process holds the critic."""
    values: Optional[Callable[[RolloutBatch], np.ndarray]] = None
    """The values computed elsewhere (:func:`service_values`), flat in response order."""
    rewards: Optional[Callable] = None
    """The reward source held by the caller (:func:`models.stages.rewards.reward_source`: a resident actor
    service's reward model, loaded once); None: made for this batch."""


def load_scorers(cfg: TrainConfig, run: RunHandle, state: PolicyState) -> Scorers:
    """π_old, π_ref and the critic loaded from their checkpoints in ``model.dtype``, on the GPU when there is one."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    dtype, pack = cfg.model.dtype, cfg.model.pack_sequences
    recompute = cfg.actor.old_logprobs == "recompute"
    actor_lm = load_hf(state.actor_url, AutoModelForCausalLM, dtype) if recompute or cfg.actor.lora.enabled \
        else None
    actor = with_packing(PolicyLogprobs(actor_lm).eval(), pack) if actor_lm is not None else None
    if cfg.actor.lora.enabled:
        check_reference_base(state.actor_url, run.reference_url)
    ref = reference_scorer(cfg, run, actor, actor_lm)
    local_critic = cfg.uses_critic and not cfg.critic.remote_url
    critic = with_packing(CriticValues(load_hf(state.critic_url, AutoModelForTokenClassification, dtype)).eval(),
                          pack) if local_critic else None
    values = service_values(critic_service(cfg, run), state) if cfg.uses_critic and cfg.critic.remote_url else None
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the score pod's GPU when it has one
    for model in (actor, ref, critic):
        if model is not None:
            model.to(device)
    return Scorers(actor if recompute else None, ref, critic, values)


def reference_scorer(cfg: TrainConfig, run: RunHandle, actor, actor_lm):
    """π_ref's forward: with LoRA the actor's model with its adapter off (no second copy), else the reference."""
    from transformers import AutoModelForCausalLM

    if cfg.actor.lora.enabled:
        return without_adapter(actor, actor_lm)
    return with_packing(PolicyLogprobs(load_hf(run.reference_url, AutoModelForCausalLM, cfg.model.dtype)).eval(),
                        cfg.model.pack_sequences)


def score_in_turn(cfg: TrainConfig, run: RunHandle, state: PolicyState, batch: RolloutBatch, pad: int,
                  forward: Callable) -> Tuple[Dict[str, np.ndarray], Scorers]:
    """The stateless score's forwards with one model in memory at a time: π_old, then π_ref, then the
    critic, each loaded, run over the whole batch and freed (:func:`models.memory.release`) before the
    next loads. Loaded together (:func:`load_scorers`) they held two or three whole copies at once, 4.8 GB
    in float32 at Qwen3-0.6B's size. With LoRA π_ref is π_old's own model with the adapter off: one load.
    The returned :class:`Scorers` holds what :func:`run_score` reads after the forwards, no model."""
    from transformers import AutoModelForCausalLM

    if cfg.actor.lora.enabled:
        s = load_scorers(cfg, run, state)
        return forward(cfg, batch, s.actor, s.ref, s.critic, pad), s._replace(actor=None, ref=None, critic=None)
    dtype, pack, flat = cfg.model.dtype, cfg.model.pack_sequences, {}
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the score pod's GPU when it has one
    if cfg.actor.old_logprobs == "recompute":
        actor = with_packing(PolicyLogprobs(load_hf(state.actor_url, AutoModelForCausalLM, dtype)).eval(), pack)
        flat.update(forward(cfg, batch, actor.to(device), None, None, pad))
        freed = memory.nbytes(actor)
        del actor
        memory.release(freed)
    ref = reference_scorer(cfg, run, None, None)
    flat.update(forward(cfg, batch, None, ref.to(device), None, pad))
    freed = memory.nbytes(ref)
    del ref
    memory.release(freed)
    values = None
    if cfg.uses_critic and not cfg.critic.remote_url:
        from transformers import AutoModelForTokenClassification

        critic = with_packing(CriticValues(load_hf(state.critic_url, AutoModelForTokenClassification, dtype)).eval(),
                              pack)
        flat.update(forward(cfg, batch, None, None, critic.to(device), pad))
        freed = memory.nbytes(critic)
        del critic
        memory.release(freed)
    elif cfg.uses_critic:
        values = service_values(critic_service(cfg, run), state)
    return flat, Scorers(None, None, None, values)


def micro_batch_size(cfg: TrainConfig) -> int:
    """Rows per scoring forward."""
    return max(cfg.actor.micro_batch_size, 1) * 2


def score_forward(cfg: TrainConfig, batch: RolloutBatch, actor, ref, critic, pad: int) -> Dict[str, np.ndarray]:
    """The scoring forwards over ``batch`` in micro-batches of similar lengths: flat per-token arrays in
    the batch's response order (``old_logprobs``, ``entropy``, ``ref_logprobs``, ``values``, as given)."""
    order = by_length(batch)
    device = next(next(m.parameters()) for m in (actor, ref, critic) if m is not None).device
    flat = score_microbatches(micro_batches(batch, micro_batch_size(cfg), pad, order), actor, ref, critic,
                              temperature=cfg.rollout.temperature, device=device)
    return {k: ragged.unpermute_flat(v, batch.response_lengths(), order) for k, v in flat.items()}


def model_rewards(cfg: TrainConfig, values: np.ndarray) -> RewardScores:
    """The reward model's sequence rewards computed with the forwards (on the ranks), checked as
    :func:`models.stages.rewards.batch_rewards` checks the rewards it computes."""
    check_rewards(values, cfg.reward.source)
    return as_scores(values, "reward_model")


def run_score(cfg: TrainConfig, run: RunHandle, state: PolicyState, batch: RolloutBatch,
              scorers: Optional[Scorers] = None, forward: Callable = score_forward) -> ScoreOutput:
    """π_old, π_ref, the critic's values and the rewards of ``batch``, written as the iteration's score
    batch; ``scorers``: the forwards to use (default: loaded from the state's checkpoints); ``forward``:
    :func:`score_forward`'s signature, or rank 0's part of the ranks' forward
    (:func:`models.stages.score_ranks.score_forward_ranks`)."""
    stats: Dict[str, float] = {}
    check_sampling_temperature(batch, cfg.rollout.temperature)
    with timed(stats, "time/score_s"):
        tok = load_tokenizer(run.reference_url)
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        lengths = batch.response_lengths()
        with timed(stats, "time/score_forward_s"):
            if scorers is None:
                flat, s = score_in_turn(cfg, run, state, batch, pad, forward)
            else:
                s = scorers
                flat = forward(cfg, batch, s.actor, s.ref, s.critic, pad)
            recomputed = "old_logprobs" in flat
            if not recomputed:  # π_old = the engine's own log-probs (config checks it computes like the trainer)
                flat["old_logprobs"] = ragged.offsets_and_values(batch.column("sampler_logprobs"))[1] \
                    .astype(np.float32)
            if s.values is not None:
                flat["values"] = s.values(batch)
        with timed(stats, "time/reward_s"):
            scores = model_rewards(cfg, flat.pop("rm_reward")) if "rm_reward" in flat \
                else batch_rewards(cfg, run, batch, micro_batch_size(cfg), pad, s.rewards)
        shaped, reward_metrics = shaped_rewards(cfg, state, scores)
        cols = {k: ragged.list_from_flat(flat[k], lengths, pa.float32())
                for k in ("old_logprobs", "ref_logprobs", "values") if k in flat}
        scored = batch.with_columns(reward=shaped.rewards, reward_raw=scores.total.astype(np.float32), **cols)
        if cfg.reward.normalize:  # the moments after this batch, for commit_iteration to keep
            scored = scored.with_metadata(extras={**scored.metadata.extras,
                                                  REWARD_NORM_KEY: json.dumps(shaped.moments.to_dict())})
        scored = scored.write(run.layout.batch_url(state.iteration, "score"))
    stats.update(rollout_stats(scores.total, lengths, batch, flat))
    stats.update(policy_lag(cfg, state, batch))
    stats.update(reward_metrics)
    if recomputed:
        stats.update(logprob_gap(batch, flat["old_logprobs"]))
    return ScoreOutput(scored, stats)

"""``score`` task: π_old and π_ref log-probs, critic values and the sequence reward for a batch."""

from __future__ import annotations

import json
from typing import Dict, NamedTuple, Optional, Tuple

import numpy as np
import pyarrow as pa
from flytekit import task

from models.training.policy import CriticValues, PolicyLogprobs, with_packing
from models.rewards.scaling import RunningMoments, ShapedRewards, out_of_range, shape_rewards
from models.rewards.sources import FunctionRewards, ModelReward, PlainSource, RewardScores, check_rewards
from models.training.scoring import score_microbatches
from models.data import ragged
from models.data.batch_tensors import model_inputs
from models.data.ragged import list_lengths
from models.data.batch import RolloutBatch
from models.data.batch_schema import REWARD_NORM_KEY, decode_data_columns
from models.training.lora import canonical_url, without_adapter
from models.server.client import server_client, server_token  # noqa: F401
from tasks.common import CACHE_VERSION, base_checkpoint_url, load_hf, load_tokenizer, timed
from tasks import decks, secrets
from models.config import TrainConfig
from tasks.deploy import deployment_config, resources_for
from models.run.types import PolicyState, RunHandle


class ScoreOutput(NamedTuple):
    batch: RolloutBatch
    stats: Dict[str, float]


def micro_batches(batch: RolloutBatch, size: int, pad_id: int, order: Optional[np.ndarray] = None):
    """Model inputs of consecutive row slices (each padded to its own longest row), of the rows
    taken in ``order`` when given."""
    table = batch.table if order is None else batch.table.take(pa.array(order))
    for start in range(0, table.num_rows, size):
        yield model_inputs(table.slice(start, size), pad_id)


def by_length(batch: RolloutBatch) -> np.ndarray:
    """Row order by sequence length (stable): micro-batches of similar lengths carry little padding."""
    return np.argsort(list_lengths(batch.column("prompt_tokens")) + batch.response_lengths(), kind="stable")


def reward_source(cfg: TrainConfig, run: RunHandle):
    from transformers import AutoModelForSequenceClassification

    if cfg.reward.source == "function":
        return FunctionRewards.from_config(cfg.reward)
    if cfg.reward.source == "model":
        return ModelReward(load_hf(run.reward_model_url, AutoModelForSequenceClassification), run.reward_model_url)
    from models.server.client import RemoteReward

    return PlainSource(RemoteReward(server_client(cfg.reward.remote_url, cfg.reward.remote_timeout_s)), "reward_server")


def batch_rewards(cfg: TrainConfig, run: RunHandle, batch: RolloutBatch, size: int, pad_id: int) -> RewardScores:
    """The configured reward source's raw reward per sample of ``batch`` (functions given the samples'
    data columns, and for TRL's keyword form their conversations and response token ids), all finite
    (else an error naming one)."""
    table = batch.table
    columns = decode_data_columns(table.column("data_columns").to_pylist()) \
        if "data_columns" in table.column_names else {}
    for name in ("episode_reward", "episode"):  # multi-turn: the environment's reward and the conversation
        if name in table.column_names:
            columns[name] = table.column(name).to_pylist()
    messages = [json.loads(m) if m else None for m in table.column("prompt_messages").to_pylist()] \
        if "prompt_messages" in table.column_names else None
    scores = reward_source(cfg, run)(table.column("prompt").to_pylist(), table.column("response").to_pylist(),
                                     micro_batches(batch, size, pad_id), columns=columns, messages=messages,
                                     completion_ids=table.column("response_tokens").to_pylist())
    check_rewards(scores.total, cfg.reward.source)
    return scores


def shaped_rewards(cfg: TrainConfig, state: PolicyState,
                   scores: RewardScores) -> Tuple[ShapedRewards, Dict[str, float]]:
    """The reward the advantages use (``reward.normalize``, ``scale``, ``clip``) and the ``reward/*``
    metrics; prints a warning when raw rewards leave ``reward.expected_range``."""
    r = cfg.reward
    shaped = shape_rewards(scores.total, r.scale, r.clip, r.normalize, RunningMoments.from_dict(state.reward_norm))
    lo, hi = r.expected_range
    stats = scores.part_means("reward/")
    stats["reward/raw_out_of_range_frac"] = float(((scores.total < lo) | (scores.total > hi)).mean())
    if r.normalize or r.scale != 1.0 or r.clip > 0:
        stats.update({"reward/shaped_mean": float(shaped.rewards.mean()),
                      "reward/shaped_std": float(shaped.rewards.std())})
    if r.normalize:
        stats.update({"reward/norm_mean": shaped.moments.mean, "reward/norm_std": shaped.moments.std})
    warning = out_of_range(scores.total, (lo, hi))
    if warning:
        print(f"WARNING iteration {state.iteration}: {warning}", flush=True)
    return shaped, stats


def remote_values(cfg: TrainConfig, batch: RolloutBatch) -> np.ndarray:
    """Critic values from the critic server's ``infer``, flat in row-major response order."""
    client = server_client(cfg.critic.remote_url, cfg.reward.remote_timeout_s)
    results = client.infer(batch.column("prompt_tokens").to_pylist(), batch.column("response_tokens").to_pylist())
    if any(r.values is None for r in results):
        raise ValueError(f"critic server {cfg.critic.remote_url} has no critic loaded")
    return np.concatenate([np.asarray(r.values, np.float32) for r in results]) if results else np.zeros(0, np.float32)


def check_reference_base(actor_url: str, reference_url: str) -> None:
    """With LoRA the reference is the actor's base: refuse an adapter trained on another base."""
    base = base_checkpoint_url(actor_url)
    if canonical_url(base) != canonical_url(reference_url):
        raise ValueError(f"LoRA actor {actor_url} adapts {base}, not the run's reference {reference_url}: "
                         f"its base with the adapter off would not be the reference policy")


def run_score(cfg: TrainConfig, run: RunHandle, state: PolicyState, batch: RolloutBatch) -> ScoreOutput:
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    stats: Dict[str, float] = {}
    dtype = cfg.model.dtype
    check_sampling_temperature(batch, cfg.rollout.temperature)
    with timed(stats, "time/score_s"):
        tok = load_tokenizer(run.reference_url)
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        size = max(cfg.actor.micro_batch_size, 1) * 2
        recompute = cfg.actor.old_logprobs == "recompute"
        actor_lm = load_hf(state.actor_url, AutoModelForCausalLM, dtype) if recompute or cfg.actor.lora.enabled \
            else None
        pack = cfg.model.pack_sequences
        actor = with_packing(PolicyLogprobs(actor_lm).eval(), pack) if actor_lm is not None else None
        if cfg.actor.lora.enabled:  # π_ref = the same model with its adapter off; no second copy
            check_reference_base(state.actor_url, run.reference_url)
            ref = without_adapter(actor, actor_lm)
        else:
            ref = with_packing(PolicyLogprobs(load_hf(run.reference_url, AutoModelForCausalLM, dtype)).eval(), pack)
        local_critic = cfg.uses_critic and not cfg.critic.remote_url
        critic = with_packing(CriticValues(load_hf(state.critic_url, AutoModelForTokenClassification, dtype)).eval(),
                              pack) \
            if local_critic else None
        lengths = batch.response_lengths()
        with timed(stats, "time/score_forward_s"):
            order = by_length(batch)
            flat = score_microbatches(micro_batches(batch, size, pad, order), actor if recompute else None, ref,
                                      critic, temperature=cfg.rollout.temperature)
            flat = {k: ragged.unpermute_flat(v, lengths, order) for k, v in flat.items()}
            if not recompute:  # π_old = the engine's own log-probs (config checks it computes like the trainer)
                flat["old_logprobs"] = ragged.offsets_and_values(batch.column("sampler_logprobs"))[1] \
                    .astype(np.float32)
            if cfg.uses_critic and cfg.critic.remote_url:
                flat["values"] = remote_values(cfg, batch)
        with timed(stats, "time/reward_s"):
            scores = batch_rewards(cfg, run, batch, size, pad)
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
    if recompute:
        stats.update(logprob_gap(batch, flat["old_logprobs"]))
    return ScoreOutput(scored, stats)


def policy_lag(cfg: TrainConfig, state: PolicyState, batch: RolloutBatch) -> Dict[str, float]:
    """``rollout/policy_lag`` (``run.off_policy_steps`` > 0): updates between the actor that sampled the
    batch (its ``policy_version``) and π_old, the actor the update starts from (``state.iteration``).
    A batch staler than ``run.off_policy_steps`` allows is refused."""
    lag = state.iteration - batch.metadata.policy_version
    if not 0 <= lag <= cfg.run.off_policy_steps:
        raise ValueError(f"batch {batch.uri or ''} was sampled by the actor of version {batch.metadata.policy_version}, "
                         f"{lag} updates before iteration {state.iteration}'s; run.off_policy_steps="
                         f"{cfg.run.off_policy_steps} allows 0..{cfg.run.off_policy_steps}")
    return {"rollout/policy_lag": float(lag)} if cfg.run.off_policy_steps else {}


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


@task(cache=True, cache_version=CACHE_VERSION, retries=2, enable_deck=True, deck_fields=decks.DECK_FIELDS,
      secret_requests=secrets.requests(secrets.S3, secrets.SERVER), **resources_for(deployment_config(), "score"))
def score(cfg: TrainConfig, run: RunHandle, state: PolicyState, batch: RolloutBatch) -> ScoreOutput:
    """Recompute π_old with the training-side actor, π_ref, critic values and rewards."""
    secrets.load(secrets.S3, secrets.SERVER)
    out = run_score(cfg, run, state, batch)
    decks.publish("Score", out.batch)
    return out


__all__ = ["score", "run_score", "ScoreOutput", "micro_batches"]

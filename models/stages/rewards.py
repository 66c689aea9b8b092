"""The reward of a batch from the configured source (functions, a reward model or the reward server),
and the shaped reward the advantages use; the score and evaluate stages share them."""

from __future__ import annotations

import json
from typing import Dict, Tuple

from models.training.load import load_hf
from models.config import TrainConfig
from models.data.batch import RolloutBatch
from models.data.batch_schema import decode_data_columns
from models.rewards.scaling import RunningMoments, ShapedRewards, out_of_range, shape_rewards
from models.rewards.sources import FunctionRewards, ModelReward, PlainSource, RewardScores, check_rewards
from models.run.types import PolicyState, RunHandle
from models.server.client import server_client
from models.stages.batches import micro_batches


def reward_source(cfg: TrainConfig, run: RunHandle):
    from transformers import AutoModelForSequenceClassification

    if cfg.reward.source == "function":
        return FunctionRewards.from_config(cfg.reward)
    if cfg.reward.source == "model":
        return ModelReward(load_hf(run.reward_model_url, AutoModelForSequenceClassification), run.reward_model_url)
    from models.server.client import RemoteReward

    return PlainSource(RemoteReward(server_client(cfg.reward.remote_url, cfg.reward.remote_timeout_s)), "reward_server")


def batch_rewards(cfg: TrainConfig, run: RunHandle, batch: RolloutBatch, size: int, pad_id: int,
                  source=None) -> RewardScores:
    """The configured reward source's raw reward per sample of ``batch`` (functions given the samples'
    data columns, and for TRL's keyword form their conversations and response token ids), all finite
    (else an error naming one). ``source``: one :func:`reward_source` made before (a resident service holds
    its reward model); default: made here."""
    table = batch.table
    columns = decode_data_columns(table.column("data_columns").to_pylist()) \
        if "data_columns" in table.column_names else {}
    for name in ("episode_reward", "episode"):  # multi-turn: the environment's reward and the conversation
        if name in table.column_names:
            columns[name] = table.column(name).to_pylist()
    messages = [json.loads(m) if m else None for m in table.column("prompt_messages").to_pylist()] \
        if "prompt_messages" in table.column_names else None
    scores = (source or reward_source(cfg, run))(table.column("prompt").to_pylist(), table.column("response").to_pylist(),
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

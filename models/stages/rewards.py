"""The reward of a batch from the configured source (functions, a reward model or the reward server),
and the shaped reward the advantages use; the score and evaluate stages share them."""

from __future__ import annotations

import json
from typing import Dict, Iterable, List, Sequence, Tuple

import numpy as np

from models.training.load import load_hf
from models.config import TrainConfig
from models.data.batch import RolloutBatch
from models.data.batch_schema import decode_data_columns
from models.rewards.scaling import RunningMoments, ShapedRewards, out_of_range, shape_rewards
from models.rewards import RewardError
from models.rewards.sources import FunctionRewards, ModelReward, PlainSource, RewardScores, check_rewards
from models.run.types import PolicyState, RunHandle
from models.stages.services import server
from models.stages.batches import micro_batches


def reward_source(cfg: TrainConfig, run: RunHandle, device: str = "cpu"):
    """The batch's reward source; a reward model (``reward.source=model``) held on ``device``."""
    from transformers import AutoModelForSequenceClassification

    if cfg.reward.source == "function":
        return FunctionRewards.from_config(cfg.reward)
    if cfg.reward.source == "model":
        model = load_hf(run.reward_model_url, AutoModelForSequenceClassification).to(device)
        return ModelReward(model, run.reward_model_url, device)
    return PlainSource(RemoteReward(server(cfg.reward.remote_url, cfg.reward.remote_timeout_s, "reward server")),
                       "reward_server")


def tokens_from_inputs(inputs) -> Tuple[List[List[int]], List[List[int]]]:
    """Prompt and response token lists of each row of right-padded ``ModelInputs``: row b holds ``P_b`` prompt then
    ``R_b`` response tokens; ``R_b = response_mask[b].sum()`` and ``P_b = attention_mask[b].sum() - R_b``."""
    ids = inputs.input_ids.cpu().numpy()  # [B, L]
    total = inputs.attention_mask.cpu().numpy().sum(1).astype(np.int64)  # [B]
    p_len = total - inputs.response_mask.cpu().numpy().sum(1).astype(np.int64)  # [B]
    rows = np.split(ids[np.arange(ids.shape[1])[None, :] < total[:, None]], np.cumsum(total)[:-1])  # B × [P+R]
    return [row[:p].tolist() for row, p in zip(rows, p_len)], [row[p:].tolist() for row, p in zip(rows, p_len)]


class RemoteReward:
    """A reward source scored by a reward server's reward model (its ``infer`` op), called like the other sources."""

    def __init__(self, client, max_samples_per_request: int = 256):
        self.client, self.chunk = client, max_samples_per_request

    def __call__(self, prompts: Sequence[str], responses: Sequence[str], micro_batches: Iterable = ()) -> List[float]:
        """Rewards of the rows of ``micro_batches`` (the texts only fix the sample count)."""
        prompt_tokens, response_tokens = [], []
        for inputs in micro_batches:
            p, r = tokens_from_inputs(inputs)
            prompt_tokens += p
            response_tokens += r
        if len(prompt_tokens) != len(prompts):
            raise RewardError(f"reward server {self.client.url}: micro-batches hold {len(prompt_tokens)} rows "
                              f"for {len(prompts)} samples")
        return self.score_tokens(prompt_tokens, response_tokens)

    def score_tokens(self, prompt_tokens: Sequence[Sequence[int]],
                     response_tokens: Sequence[Sequence[int]]) -> List[float]:
        """One finite reward per sample, else :class:`RewardError` naming the first bad sample."""
        rewards: List[float] = []
        for start in range(0, len(prompt_tokens), self.chunk):
            samples = [{"prompt_tokens": list(map(int, p)), "response_tokens": list(map(int, r))} for p, r in
                       zip(prompt_tokens[start:start + self.chunk], response_tokens[start:start + self.chunk])]
            results = self.client.call("infer", {"samples": samples})
            if any(r["reward"] is None for r in results):
                raise RewardError(f"reward server {self.client.url} has no reward model loaded")
            rewards += [r["reward"] for r in results]
        return check_rewards(rewards, f"server {self.client.url}").astype(float).tolist()


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

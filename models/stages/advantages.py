"""The advantages stage (no GPU): KL-shaped token rewards, advantages and returns from kernels/, by the
estimator ``run.algorithm`` declares (``models/algorithms/``), and the ``loss_mask`` of the samples the
loss learns from (DAPO's dynamic sampling and overlong filtering, docs/rlvr/)."""

from __future__ import annotations

from typing import Dict

import torch

from kernels.advantages import AdvantageInput, AdvantageParams, advantage_stats
from kernels.dapo import informative_groups, overlong_penalty
from models.config import TrainConfig
from models.data.batch import RolloutBatch
from models.run.types import PolicyState, RunHandle
from models.stages.outputs import AdvantagesOutput
from models.timing import timed


def advantage_params(cfg: TrainConfig, kl_coef: float) -> AdvantageParams:
    in_reward = cfg.kl_placement == "reward"
    return AdvantageParams(kl_coef=kl_coef if in_reward else 0.0, kl_estimator=cfg.kl_estimator,
                           gamma=cfg.advantage.gamma, lam=cfg.advantage.lam, whiten=cfg.advantage.whiten)


def shaped_reward(cfg: TrainConfig, reward: torch.Tensor, mask: torch.Tensor, stats: Dict[str, float]) -> torch.Tensor:
    """The sequence reward ``[B]`` the estimator sees: the reward plus DAPO's soft overlong penalty
    when ``advantage.overlong_buffer`` is on (the batch's ``reward`` column keeps the reward alone)."""
    a = cfg.advantage
    if not a.overlong_buffer:
        return reward
    penalty = overlong_penalty(mask.sum(-1), cfg.rollout.max_new_tokens, a.overlong_buffer, a.overlong_penalty)
    stats["adv/overlong_penalty_mean"] = float(penalty.mean())
    return reward + penalty


def loss_rows(cfg: TrainConfig, t: Dict[str, torch.Tensor], stats: Dict[str, float]) -> torch.Tensor:
    """``[B]`` bool: the rows the actor's loss learns from (all, unless dynamic sampling or overlong
    filtering leaves some out)."""
    a = cfg.advantage
    keep = torch.ones_like(t["is_end"], dtype=torch.bool)
    if a.dynamic_sampling:
        informative = informative_groups(t["reward"].float(), t["prompt_id"])  # [B]
        stats["adv/dynamic_sampling_kept"] = float(informative.sum()) / max(len(informative), 1)
        keep &= informative
    if a.mask_truncated:
        keep &= t["is_end"].bool()
    stats["adv/loss_rows_share"] = float(keep.float().mean()) if len(keep) else 0.0
    return keep


def run_advantages(cfg: TrainConfig, run: RunHandle, state: PolicyState, batch: RolloutBatch) -> AdvantagesOutput:
    stats: Dict[str, float] = {}
    with timed(stats, "time/advantages_s"):
        cols = ["prompt_id", "reward", "is_end", "old_logprobs", "ref_logprobs"] + (
            ["values"] if cfg.uses_critic else [])
        t = batch.to_padded(cols)
        mask = t["response_mask"]  # [B, T]
        if "loss_mask" in batch.column_names:  # multi-turn: only the policy's tokens are actions (GAE carries
            mask = mask & batch.to_padded(["loss_mask"])["loss_mask"]  # over the rest; KL and rewards skip them)
        x = AdvantageInput(reward=shaped_reward(cfg, t["reward"].float(), mask, stats), old_logp=t["old_logprobs"],
                           ref_logp=t["ref_logprobs"], mask=mask, prompt_id=t["prompt_id"], values=t.get("values"))
        out = cfg.spec.estimator(x, advantage_params(cfg, state.kl_coef))
        loss_mask = mask & loss_rows(cfg, t, stats)[:, None]  # [B, T], the upstream loss_mask in `mask`
        batch = batch.select([c for c in batch.column_names if c != "loss_mask"])
        full = t["response_mask"]
        result = batch.with_columns(token_rewards=(out.token_rewards, full), advantages=(out.advantages, full),
                                    returns=(out.returns, full), loss_mask=(loss_mask, full))
        result = result.write(run.layout.batch_url(state.iteration, "advantages"))
    stats.update(advantage_stats(x, out))
    stats["kl/coef"] = state.kl_coef
    return AdvantagesOutput(result, stats)

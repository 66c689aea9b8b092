"""``advantages`` task (no GPU): KL-shaped token rewards, advantages and returns from kernels/."""

from __future__ import annotations

from typing import Dict, NamedTuple

from flytekit import Resources, task

from kernels.advantages import AdvantageInput, AdvantageParams, advantage_stats, compute_advantages
from tasks.batch import RolloutBatch
from tasks.common import CACHE_VERSION, timed
from tasks import secrets
from tasks.config import TrainConfig
from tasks.types import PolicyState, RunHandle


class AdvantagesOutput(NamedTuple):
    batch: RolloutBatch
    stats: Dict[str, float]


def advantage_params(cfg: TrainConfig, kl_coef: float) -> AdvantageParams:
    in_reward = cfg.kl.placement == "reward"
    return AdvantageParams(kl_coef=kl_coef if in_reward else 0.0, kl_estimator=cfg.kl.estimator,
                           gamma=cfg.advantage.gamma, lam=cfg.advantage.lam, whiten=cfg.advantage.whiten)


def run_advantages(cfg: TrainConfig, run: RunHandle, state: PolicyState, batch: RolloutBatch) -> AdvantagesOutput:
    stats: Dict[str, float] = {}
    with timed(stats, "time/advantages_s"):
        cols = ["prompt_id", "reward", "old_logprobs", "ref_logprobs"] + (["values"] if cfg.uses_critic else [])
        t = batch.to_padded(cols)
        x = AdvantageInput(reward=t["reward"].float(), old_logp=t["old_logprobs"], ref_logp=t["ref_logprobs"],
                           mask=t["response_mask"], prompt_id=t["prompt_id"], values=t.get("values"))
        out = compute_advantages(cfg.run.algorithm, x, advantage_params(cfg, state.kl_coef))
        mask = t["response_mask"]
        result = batch.with_columns(token_rewards=(out.token_rewards, mask), advantages=(out.advantages, mask),
                                    returns=(out.returns, mask))
        result = result.write(run.layout.batch_url(state.iteration, "advantages"))
    stats.update(advantage_stats(x, out))
    stats["kl/coef"] = state.kl_coef
    return AdvantagesOutput(result, stats)


@task(cache=True, cache_version=CACHE_VERSION, retries=2, requests=Resources(cpu="1", mem="2Gi"),
      secret_requests=secrets.requests(secrets.S3))
def advantages(cfg: TrainConfig, run: RunHandle, state: PolicyState, batch: RolloutBatch) -> AdvantagesOutput:
    """Token rewards, advantages and returns for the algorithm in ``cfg``."""
    secrets.load(secrets.S3)
    return run_advantages(cfg, run, state, batch)


__all__ = ["advantages", "run_advantages", "AdvantagesOutput"]

"""The evaluate stage: the policy's mean raw reward on the run's held-out prompts."""

from __future__ import annotations

from typing import Dict

import numpy as np

from models import tracking
from models.checkpoint.local import load_tokenizer
from models.config import TrainConfig
from models.data.batch import BatchMetadata, RolloutBatch
from models.run.data import read_run_prompts, sample_columns
from models.run.types import PolicyState, RunHandle
from models.stages.engine import done_with_engine, engine_for
from models.stages.rewards import batch_rewards
from models.stages.rollout import sample_data, sampling_spec


def eval_rewards(cfg: TrainConfig, run: RunHandle, actor_url: str, engine=None) -> Dict[str, float]:
    """``eval/reward_mean`` (the raw reward: no normalisation, scale or clip) and ``eval/<part>_mean``
    per reward function of the policy at ``actor_url`` on the run's held-out prompts
    (``eval_temperature``), from the run's reward source, each prompt's data columns included. ``engine``:
    one already serving that policy (a resident engine service's); default :func:`engine_for`."""
    data = read_run_prompts(run.eval_prompts_url)
    tok = load_tokenizer(run.reference_url)
    spec = sampling_spec(cfg, run, cfg.run.seed, 1, cfg.rollout.eval_temperature)
    cols, episode_cols, _ = sample_data(cfg, engine if engine is not None else engine_for(cfg, actor_url), tok, data,
                                        np.arange(len(data)), spec)
    if engine is None:
        done_with_engine(cfg, actor_url)
    batch = RolloutBatch.from_columns(BatchMetadata(iteration=0, policy_version=0, algorithm=cfg.run.algorithm),
                                      **cols.as_dict(), **episode_cols, **sample_columns(data, 1))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    scores = batch_rewards(cfg, run, batch, max(cfg.actor.micro_batch_size, 1), pad)
    return {"eval/reward_mean": float(np.mean(scores.total)),
            **scores.part_means("eval/")}


def eval_reward(cfg: TrainConfig, run: RunHandle, actor_url: str) -> float:
    """Mean raw reward of the policy at ``actor_url`` on the run's held-out prompts (see :func:`eval_rewards`)."""
    return eval_rewards(cfg, run, actor_url)["eval/reward_mean"]


def run_evaluate(cfg: TrainConfig, run: RunHandle, state: PolicyState, engine=None) -> float:
    done = dict(tracking.metric_history(run.mlflow_run_id, "eval/reward_mean"))
    if state.iteration - 1 in done:  # evaluated before a crash or at the end of the previous chunk
        return done[state.iteration - 1]
    metrics = eval_rewards(cfg, run, state.actor_url, engine)
    tracking.log_metrics(run.mlflow_run_id, metrics, step=state.iteration - 1)
    return metrics["eval/reward_mean"]

"""The actor update stage: one pass of the algorithm's policy loss over a batch on every rank of an
elastic launch (DDP or FSDP2), rank 0 committing the next actor checkpoint."""

from __future__ import annotations

import time
from typing import Dict

import torch

from kernels.losses import PolicyLossConfig
from models.checkpoint.local import load_tokenizer
from models.config import TrainConfig
from models.data.batch import RolloutBatch
from models.faults import nan_advantages, pause_point
from models.run.types import PolicyState, RunHandle
from models.stages.outputs import UpdateOutput
from models.stages.updates import (Role, load_for_update, load_trainee, loop_settings, on_ranks, update_data,
                                   update_trainee)
from models.timing import timed
from models.training.distributed import DistInfo
from models.training.lora import CAUSAL_LM
from models.training.policy import PolicyLogprobs
from models.training.update import actor_loss_fn, run_update, stat_keys

_ACTOR_COLS = ("old_logprobs", "advantages", "sampler_logprobs", "ref_logprobs", "loss_mask")


def policy_loss_config(cfg: TrainConfig) -> PolicyLossConfig:
    """The actor loss ``run.algorithm`` declares (its loss kind and any aggregation it fixes), with the
    ``actor.*`` settings it honours (the others are at their defaults: the config refuses them set)."""
    a, spec = cfg.actor, cfg.spec
    return PolicyLossConfig(kind=spec.policy_loss, clip_low=a.clip_eps, clip_high=a.clip_eps_high or a.clip_eps,
                            dual_clip=a.dual_clip or None, agg=spec.loss_agg or a.loss_agg,
                            horizon=cfg.rollout.max_new_tokens, entropy_coef=a.entropy_coef,
                            tis_cap=a.tis_cap or None)


def actor_loss(cfg: TrainConfig, state: PolicyState):
    """The loss of the actor update from ``state`` (β in the loss when ``kl`` is placed there)."""
    kl_beta = state.kl_coef if cfg.kl_placement == "loss" else 0.0
    return actor_loss_fn(policy_loss_config(cfg), cfg.rollout.temperature, kl_beta, cfg.kl_estimator,
                         old_from_forward=cfg.actor.old_logprobs == "update")


def load_actor(cfg: TrainConfig, url: str, info: DistInfo):
    """The actor to train from checkpoint ``url``, ready on ``info``'s ranks."""
    from transformers import AutoModelForCausalLM

    a = cfg.actor
    return load_for_update(url, AutoModelForCausalLM, cfg.model.dtype, a.lora, CAUSAL_LM, PolicyLogprobs,
                           cfg.model.pack_sequences, info, a.sharding, a.activation_checkpointing)


def update_actor(cfg: TrainConfig, run: RunHandle, state: PolicyState, batch: RolloutBatch, info: DistInfo,
                 model, optimizer, times: Dict[str, float]) -> Dict[str, float]:
    """One pass of the policy loss over this rank's rows of ``batch`` on ``model`` (trained in place)."""
    torch.manual_seed(cfg.run.seed * 7919 + state.iteration)
    tok = load_tokenizer(run.reference_url)
    data = update_data(batch, tok.pad_token_id or 0, _ACTOR_COLS, (info.rank, info.world_size))
    data = data._replace(adv=nan_advantages(data.adv, state.iteration, info.rank))  # tests only
    with timed(times, "time/actor_train_s"):
        stats = run_update(model, optimizer, data, actor_loss(cfg, state),
                           loop_settings(cfg.actor.ppo_epochs, cfg.actor, cfg.run.seed * 1000 + state.iteration,
                                         "actor"), info)
    pause_point(f"actor_update/iter-{state.iteration:06d}")  # tests only: kill the run mid-update
    return stats


def actor_stats(stats: Dict[str, float], steps_total: int) -> Dict[str, float]:
    return stat_keys("actor", {**stats, "optimizer_steps_total": float(steps_total)})


ACTOR = Role("actor", "lm", 0, load_actor, update_actor, actor_stats, lambda section: section.weight_decay)


def train_actor(cfg: TrainConfig, run: RunHandle, state: PolicyState, batch: RolloutBatch,
                info: DistInfo) -> UpdateOutput:
    """The body every rank runs: its shard, DDP/FSDP2, the update, rank 0 commits the checkpoint."""
    t0, times = time.perf_counter(), {}
    trainee = load_trainee(ACTOR, cfg, state, info, times)
    return update_trainee(ACTOR, cfg, run, state, batch, info, trainee, True, times, t0)


def train_actor_ranks(cfg: TrainConfig, run: RunHandle, state: PolicyState, batch: RolloutBatch) -> UpdateOutput:
    """What every process of the actor's elastic launch runs: join the process group, train
    (:func:`train_actor`; rank 0 holds the run's lease meanwhile) and leave it."""
    return on_ranks(run, lambda info: train_actor(cfg, run, state, batch, info))

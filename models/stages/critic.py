"""The critic update stage: clipped value regression on a batch's returns, on every rank of an elastic
launch (one process by default; DDP or FSDP2 as the actor's) or on the critic server, rank 0 committing
the next critic checkpoint."""

from __future__ import annotations

import time
from typing import Dict, Optional

import torch

from models.checkpoint.local import load_tokenizer
from models.config import TrainConfig
from models.data.batch import RolloutBatch
from models.run import lock as run_lock
from models.run.types import PolicyState, RunHandle
from models.stages.services import critic_service
from models.stages.outputs import UpdateOutput
from models.stages.updates import (Role, load_for_update, load_trainee, loop_settings, on_ranks, update_data,
                                   update_trainee)
from models.timing import timed
from models.training.distributed import DistInfo
from models.training.lora import TOKEN_CLS
from models.training.policy import CriticValues
from models.training.update import critic_loss_fn, run_update

_CRITIC_COLS = ("values", "returns")


def critic_columns(cfg: TrainConfig):
    # multi-turn: values are regressed on the policy's tokens only (tool and template tokens have no return)
    return _CRITIC_COLS + (("loss_mask",) if cfg.rollout.environment else ())


def load_critic(cfg: TrainConfig, url: str, info: DistInfo):
    """The critic to train from checkpoint ``url``, ready on ``info``'s ranks."""
    from transformers import AutoModelForTokenClassification

    c = cfg.critic
    return load_for_update(url, AutoModelForTokenClassification, cfg.model.dtype, c.lora, TOKEN_CLS, CriticValues,
                           cfg.model.pack_sequences, info, c.sharding, c.activation_checkpointing)


def update_critic(cfg: TrainConfig, run: RunHandle, state: PolicyState, batch: RolloutBatch, info: DistInfo,
                  model, optimizer, times: Dict[str, float]) -> Dict[str, float]:
    """Clipped value regression on this rank's rows of ``batch`` on ``model`` (trained in place)."""
    torch.manual_seed(cfg.run.seed * 7919 + state.iteration + 1)
    tok = load_tokenizer(run.reference_url)
    data = update_data(batch, tok.pad_token_id or 0, critic_columns(cfg),
                       (info.rank, info.world_size) if info.world_size > 1 else None)
    c = cfg.critic
    with timed(times, "time/critic_train_s"):
        return run_update(model, optimizer, data, critic_loss_fn(c.value_clip or None),
                          loop_settings(c.epochs, c, cfg.run.seed * 1000 + state.iteration + 1, "critic"), info)


def train_critic(cfg: TrainConfig, run: RunHandle, state: PolicyState, batch: RolloutBatch,
                 info: Optional[DistInfo] = None) -> UpdateOutput:
    """Clipped value regression on the batch's returns on this rank (``info``; None: this process alone);
    commits the next critic."""
    t0 = time.perf_counter()
    if cfg.critic.remote_url:
        return train_remote_critic(cfg, run, state, batch, t0)
    info = info or DistInfo(0, 1, 0, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    times: Dict[str, float] = {}
    trainee = load_trainee(CRITIC, cfg, state, info, times)
    return update_trainee(CRITIC, cfg, run, state, batch, info, trainee, True, times, t0)


def train_critic_ranks(cfg: TrainConfig, run: RunHandle, state: PolicyState, batch: RolloutBatch) -> UpdateOutput:
    """What every process of the critic's elastic launch runs (``critic.nnodes × critic.nproc_per_node``,
    one by default): join the process group, train (:func:`train_critic`; rank 0 holds the run's lease
    meanwhile) and leave it. With ``critic.remote_url`` (one process) the critic server trains."""
    if cfg.critic.remote_url:
        with run_lock.heartbeat(run.layout.lock_url, run.launch):
            return train_critic(cfg, run, state, batch)
    return on_ranks(run, lambda info: train_critic(cfg, run, state, batch, info))


def train_remote_critic(cfg: TrainConfig, run: RunHandle, state: PolicyState, batch: RolloutBatch,
                        t0: float) -> UpdateOutput:
    """The critic server's ``train`` on this batch (not resent: it steps the critic), then ``save`` to the run's
    critic URL."""
    c = cfg.critic
    client = critic_service(cfg, run)
    settings = {"epochs": c.epochs, "minibatch_size": c.minibatch_size, "micro_batch_size": c.micro_batch_size,
                "grad_clip": c.grad_clip, "value_clip": c.value_clip, "seed": cfg.run.seed * 1000 + state.iteration + 1}
    out = client.call("train", {"batch": batch.uri, "settings": settings}, resend=False)
    url = run.layout.critic_url(state.iteration)
    client.call("save", {"url": url, "overwrite": True})
    return UpdateOutput(url, {**critic_stats(out["stats"]), "time/critic_update_s": time.perf_counter() - t0})


CRITIC_STATS = ("loss", "explained_variance", "grad_norm", "value_clip_frac", "steps", "nonfinite_steps",
                "skipped_steps")
"""Statistics of the critic update logged as ``critic/<name>``."""


def critic_stats(stats: Dict[str, float]) -> Dict[str, float]:
    """``critic/<name>`` of :data:`CRITIC_STATS` (a server predating ``nonfinite_steps`` or ``skipped_steps``
    counts none; one predating ``steps`` logs none, and ``finish_run`` cannot judge its share of skips)."""
    counts = ("nonfinite_steps", "skipped_steps")
    return {f"critic/{k}": float(stats.get(k, 0.0)) if k in counts else stats[k]
            for k in CRITIC_STATS if k in stats or k in counts}


def critic_stats_total(stats: Dict[str, float], steps_total: int) -> Dict[str, float]:
    return {**critic_stats(stats), "critic/optimizer_steps_total": float(steps_total)}


CRITIC = Role("critic", "critic", 1, load_critic, update_critic, critic_stats_total)

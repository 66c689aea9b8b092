"""The score stage on several ranks: the forwards of :mod:`models.stages.score` with each rank of an elastic
launch (the stateless ``score_ranks`` task with ``actor.score_on_ranks``, the resident actor trainer) scoring
its share of a batch's rows with sharded models (π_old, π_ref, the critic and, with ``reward.source=model``,
the reward model), rank 0 gathering the results, computing the rewards and writing the score batch.

The rows are cut into the micro-batches one process forms (consecutive slices of the rows by length), and
these are dealt to the ranks round by round in alternating direction, so each rank gets short and long
ones alike. FSDP2 forwards are collectives (every rank gathers each unit's weights), so every rank runs
the same number of forwards: a rank short of micro-batches runs a one-row dummy, whose result it drops.
Each micro-batch computes what it computes in one process, so the gathered arrays equal
:func:`models.stages.score.score_forward`'s up to float rounding (within 1e-5 in float32 on CPU:
``tests/unit/models/test_sharded_score.py``, ``tests/integration/test_sharded_score.py``)."""

from __future__ import annotations

import functools
import time
from typing import Dict, List, Optional

import numpy as np
import pyarrow as pa
import torch.distributed as dist

import torch

from models.checkpoint.local import load_tokenizer, local_checkpoint
from models.config import LoraConfig, TrainConfig
from models.data import ragged
from models.data.batch import RolloutBatch
from models.data.batch_tensors import model_inputs
from models.run.types import PolicyState, RunHandle
from models.stages.batches import by_length
from models.stages.outputs import ScoreOutput
from models.stages.score import (Scorers, check_reference_base, load_scorers, micro_batch_size, reference_scorer,
                                 run_score, score_forward, service_values)
from models.stages.services import critic_service
from models.stages.score_metrics import check_sampling_temperature
from models.stages.updates import load_for_update, on_ranks, reads_shards
from models.training.distributed import DistInfo, unwrap, wrap_for_training
from models.training.load import load_hf
from models.training.lora import CAUSAL_LM, TOKEN_CLS, without_adapter
from models.training.policy import CriticValues, PolicyLogprobs
from models.training.scoring import score_microbatches
from models.training.sharded_load import load_sharded


def deal(order: np.ndarray, size: int, world: int) -> List[List[np.ndarray]]:
    """The micro-batches of ``size`` consecutive rows of ``order`` (rows by length), dealt to ``world``
    ranks: round r gives micro-batches ``r·world ..`` to ranks 0, 1, ... (r even) or ..., 1, 0 (r odd)."""
    chunks = [order[i:i + size] for i in range(0, len(order), size)]
    ranks: List[List[np.ndarray]] = [[] for _ in range(world)]
    for i, chunk in enumerate(chunks):
        turn, seat = divmod(i, world)
        ranks[seat if turn % 2 == 0 else world - 1 - seat].append(chunk)
    return ranks


def score_forward_ranks(cfg: TrainConfig, batch: RolloutBatch, actor, ref, critic, pad: int, info: DistInfo,
                        reward_model=None) -> Optional[Dict[str, np.ndarray]]:
    """Every rank of ``info``: the scoring forwards over its share of ``batch``'s rows (the models given,
    as :func:`score_forward`, and ``reward_model``'s sequence rewards as ``rm_reward``, ``[B]``); rank 0 gets
    the flat per-token arrays in the batch's response order, the other ranks None. One rank without a
    reward model: :func:`score_forward`. A collective: every rank calls it. Every parameter of the models
    must be on ``info.device`` (:func:`check_on_device`)."""
    check_on_device(info.device, actor=actor, ref=ref, critic=critic, reward_model=reward_model)
    if info.world_size == 1 and reward_model is None:
        return score_forward(cfg, batch, actor, ref, critic, pad)
    dealt = deal(by_length(batch), micro_batch_size(cfg), info.world_size)
    mine, calls = dealt[info.rank], max(len(d) for d in dealt)
    parts = []
    for k in range(calls):  # the same count on every rank: FSDP2's forwards gather weights collectively
        rows = mine[k] if k < len(mine) else np.zeros(1, np.int64)  # a dummy: row 0, its result dropped
        inputs = model_inputs(batch.table.take(pa.array(rows)), pad)
        flat = score_microbatches([inputs], actor, ref, critic, reward_model, temperature=cfg.rollout.temperature,
                                  device=info.device)
        if k < len(mine):
            parts.append((rows, flat))
    gathered = [None] * info.world_size if info.is_main else None
    dist.gather_object(parts, gathered, dst=0)
    if not info.is_main:
        return None
    return unpermute_parts([p for rank in gathered for p in rank], batch.response_lengths())


def check_on_device(device: torch.device, **models) -> None:
    """Every parameter and buffer of ``models`` (by name; None: none) on ``device`` (an FSDP2 shard's local tensor
    counts; ``cuda`` means the current GPU), else ``ValueError`` naming the first one elsewhere: a forward must
    not pull weights across devices, nor fail on them mid-batch. The same check on CPU as on CUDA."""
    want = torch.device(device)
    for label, model in models.items():
        if model is None:
            continue
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            local = t.to_local() if hasattr(t, "to_local") else t
            if local.device.type != want.type or (want.index is not None and local.device.index != want.index):
                raise ValueError(f"{label}'s {name} is on {local.device}, not on this rank's device {want}: every "
                                 f"model a scoring forward runs must be held on the rank's device")


def load_reference_ranks(cfg: TrainConfig, run: RunHandle, info: DistInfo, actor=None):
    """π_ref as the score on ``info``'s ranks holds it: with LoRA the ``actor`` (loaded) with its adapter off; on
    one rank the one-process score's (``model.dtype``), on ``info.device``; on several wrapped as the updates wrap
    a model (``actor.sharding``: under FSDP2 each rank reads only its shard and holds it at the checkpoint's dtype,
    computing in ``model.dtype``).
    A collective on several ranks: every rank calls it."""
    from transformers import AutoModelForCausalLM

    if cfg.actor.lora.enabled:
        return without_adapter(actor, unwrap(actor).lm)
    if info.world_size == 1:
        return reference_scorer(cfg, run, None, None).to(info.device)
    return load_for_update(run.reference_url, AutoModelForCausalLM, cfg.model.dtype, LoraConfig(), CAUSAL_LM,
                           PolicyLogprobs, cfg.model.pack_sequences, info, cfg.actor.sharding, frozen=True).eval()


PER_ROW = ("rm_reward",)
"""Results with one value per row; the others have one per response token."""


def unpermute_parts(parts, lengths: np.ndarray) -> Dict[str, np.ndarray]:
    """``(rows, flat arrays)`` of micro-batches, any order, as flat arrays in the batch's response order."""
    if not parts:
        return {}
    order = np.concatenate([rows for rows, _ in parts])
    ones = np.ones(len(lengths), np.int64)
    return {k: ragged.unpermute_flat(np.concatenate([flat[k] for _, flat in parts]), ones if k in PER_ROW
                                     else lengths, order) for k in parts[0][1]}


def load_scorers_ranks(cfg: TrainConfig, run: RunHandle, state: PolicyState, info: DistInfo) -> Scorers:
    """:func:`models.stages.score.load_scorers` on ``info``'s ranks: each model wrapped as the updates wrap
    it (``actor.sharding``; under FSDP2 each rank reads only its shard of a full-weight checkpoint), float32
    weights computing in ``model.dtype``, in eval mode. A collective: every rank calls it."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    a = cfg.actor

    def load(url, auto, lora, task_type, wrapper):  # forwards only: frozen (the root resharded after each)
        return load_for_update(url, auto, cfg.model.dtype, lora, task_type, wrapper, cfg.model.pack_sequences,
                               info, a.sharding, frozen=True).eval()

    recompute = a.old_logprobs == "recompute"
    actor = load(state.actor_url, AutoModelForCausalLM, a.lora, CAUSAL_LM, PolicyLogprobs) \
        if recompute or a.lora.enabled else None
    if a.lora.enabled:  # π_ref = the same model with its adapter off
        check_reference_base(state.actor_url, run.reference_url)
    ref = load_reference_ranks(cfg, run, info, actor)
    remote = bool(cfg.critic.remote_url)
    critic = load(state.critic_url, AutoModelForTokenClassification, cfg.critic.lora, TOKEN_CLS, CriticValues) \
        if cfg.uses_critic and not remote else None
    values = service_values(critic_service(cfg, run), state) if cfg.uses_critic and remote else None
    return Scorers(actor if recompute else None, ref, critic, values)


def load_reward_model_ranks(cfg: TrainConfig, run: RunHandle, info: DistInfo):
    """The reward model (``reward.source=model``) on ``info``'s ranks as the actor's models (``actor.sharding``;
    read by shard under FSDP2), computing in float32 as the one-process score's; None for other sources."""
    from transformers import AutoModelForSequenceClassification as auto

    if cfg.reward.source != "model":
        return None
    url, sharding = run.reward_model_url, cfg.actor.sharding
    if reads_shards(url, LoraConfig(), info, sharding):
        return load_sharded(local_checkpoint(url), auto, info, sharding, torch.float32, lambda m: m,
                            frozen=True).eval()
    return wrap_for_training(load_hf(url, auto).eval(), info, sharding).eval()


def pad_id(run: RunHandle) -> int:
    tok = load_tokenizer(run.reference_url)
    return tok.pad_token_id if tok.pad_token_id is not None else 0


def score_on_rank(cfg: TrainConfig, run: RunHandle, state: PolicyState, batch: RolloutBatch,
                  info: DistInfo) -> Optional[ScoreOutput]:
    """One rank's part of the score stage: load the sharded scorers, score its rows; rank 0 gathers them,
    computes the rewards and writes the score batch (:func:`run_score`), and returns its output."""
    check_sampling_temperature(batch, cfg.rollout.temperature)  # on every rank: none waits for a failed one
    t0 = time.perf_counter()
    one = info.world_size == 1  # the one-process loading (on the host), the rewards as the one-process score's
    s = load_scorers(cfg, run, state) if one else load_scorers_ranks(cfg, run, state, info)
    rm = None if one else load_reward_model_ranks(cfg, run, info)
    load_s = time.perf_counter() - t0
    forward = functools.partial(score_forward_ranks, info=info, reward_model=rm)
    if not info.is_main:
        forward(cfg, batch, s.actor, s.ref, s.critic, pad_id(run))
        return None
    out = run_score(cfg, run, state, batch, s, forward=forward)
    return out._replace(stats={**out.stats, "time/score_load_s": load_s,
                               "time/score_s": out.stats["time/score_s"] + load_s})


def score_ranks(cfg: TrainConfig, run: RunHandle, state: PolicyState, batch: RolloutBatch) -> Optional[ScoreOutput]:
    """What every process of the score's elastic launch runs (``actor.score_on_ranks``): join the process
    group, score (:func:`score_on_rank`; rank 0 holds the run's lease meanwhile) and leave it."""
    return on_ranks(run, lambda info: score_on_rank(cfg, run, state, batch, info))

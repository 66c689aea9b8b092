"""What the actor and the critic update share: a batch's rows as update tensors, the loop's settings,
the model to train loaded from its checkpoint and the trained model committed, the update's recipe
(:func:`load_trainee`, :func:`update_trainee`: a stateless task runs it once, a resident service keeps the
:class:`Trainee` between updates), and the body every rank of their elastic launch runs."""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass
from typing import Callable, Dict, NamedTuple

import torch
from torch import nn

from models.checkpoint import save_model_checkpoint
from models.checkpoint.disk_full import naming_a_full_disk
from models.checkpoint.local import load_tokenizer, local_checkpoint
from models.training.load import base_checkpoint_url, load_hf
from models.config import LoraConfig, TrainConfig
from models.data.batch import RolloutBatch
from models.run import lock as run_lock
from models.run.types import PolicyState, RunHandle
from models.stages.commit import resume_point_at
from models.stages.outputs import UpdateOutput
from models.training.distributed import (DistInfo, barrier, full_state_dict, init_distributed, shutdown_distributed,
                                         unwrap, uses_fsdp2, wrap_for_training)
from models.training.lora import (add_adapter, base_url, is_adapter, is_peft, save_adapter_checkpoint,
                                  trainable_in_float32, with_adapter)
from models.training.optimizer_carry import carried_optimizer, commit_optimizer
from models.training.policy import with_packing
from models.training import weight_shards
from models.training.sharded_load import load_sharded, load_sharded_lora
from models.training.update import LoopSettings, UpdateData, disable_dropout, make_optimizer


def update_data(batch: RolloutBatch, pad_id: int, columns, shard) -> UpdateData:
    """This rank's rows as padded tensors (inputs and the loss columns, same row order)."""
    inputs = batch.to_model_inputs(pad_id, shard=shard)
    t = batch.to_padded(list(columns), shard=shard)
    get = lambda name: t[name].float() if name in t else None  # noqa: E731
    return UpdateData(inputs.input_ids, inputs.attention_mask, inputs.response_positions, inputs.response_mask,
                      old_logp=get("old_logprobs"), adv=get("advantages"), sampler_logp=get("sampler_logprobs"),
                      ref_logp=get("ref_logprobs"), old_values=get("values"), returns=get("returns"),
                      loss_mask=t["loss_mask"].bool() if "loss_mask" in t else None)


def loop_settings(epochs: int, section, seed: int, role: str) -> LoopSettings:
    """The update loop's shape and step guard from the ``actor`` or ``critic`` section."""
    g = section.guard
    return LoopSettings(epochs, section.minibatch_size, section.micro_batch_size, section.grad_clip, seed,
                        g.max_loss, g.max_grad_norm, g.max_skipped_fraction, role)


def load_trainable(url: str, auto_cls, dtype: str, lora: LoraConfig, task_type: str):
    """The model to train from checkpoint ``url``: all its weights, or with ``lora`` its adapter
    (fresh, seeded by the caller's RNG, when ``url`` holds full weights: the first iteration).

    What trains is float32 whatever ``dtype`` (``model.dtype``, the compute dtype): master weights,
    as the checkpoints it commits; a LoRA model's frozen base is loaded in ``dtype``."""
    model = load_hf(url, auto_cls, dtype if lora.enabled else "float32", trainable=True)
    if lora.enabled and not is_peft(model):
        model = add_adapter(model, lora, task_type)
    return disable_dropout(trainable_in_float32(model, local_checkpoint(url)))


def reads_shards(url: str, lora: LoraConfig, info: DistInfo, sharding: str) -> bool:
    """Whether each rank reads only its shard of ``url`` (:mod:`models.training.sharded_load`): a model
    trained FSDP2-sharded over two ranks or more, full weights or with ``lora`` an adapter on its base
    (an adapter folder read without ``lora`` loads whole, as one process does)."""
    return (info.world_size > 1 and uses_fsdp2(sharding, info)
            and (lora.enabled or not is_adapter(local_checkpoint(url))))


def load_for_update(url: str, auto_cls, dtype: str, lora: LoraConfig, task_type: str,
                    wrapper: Callable[[nn.Module], nn.Module], pack: bool, info: DistInfo,
                    sharding: str = "auto", activation_checkpointing: bool = False, frozen: bool = False) -> nn.Module:
    """``wrapper(model)`` of checkpoint ``url`` (:func:`load_trainable`) ready to train on ``info``'s ranks
    (:func:`models.training.distributed.wrap_for_training`), computing in ``dtype``; ``pack``:
    ``model.pack_sequences``; ``activation_checkpointing``: ``actor.activation_checkpointing`` (the critic's).
    Read rank by rank where :func:`reads_shards` says so: a LoRA model's
    frozen base by shard (in ``dtype``, as :func:`load_trainable` loads it), its adapter whole; ``frozen``
    (π_ref): the shards held at the checkpoint's dtype (:func:`~models.training.sharded_load.load_sharded`)."""
    compute = getattr(torch, dtype)
    if reads_shards(url, lora, info, sharding):
        local = local_checkpoint(url)
        if not lora.enabled:
            return load_sharded(local, auto_cls, info, sharding, compute, wrapper, pack, activation_checkpointing,
                                frozen)
        base = local_checkpoint(base_url(local)) if is_adapter(local) else local
        adapt = functools.partial(with_adapter, local_dir=local, spec=lora, task_type=task_type)
        return load_sharded_lora(local, base, auto_cls, info, sharding, compute, adapt, wrapper, pack,
                                 activation_checkpointing)
    model = load_trainable(url, auto_cls, dtype, lora, task_type)
    return wrap_for_training(with_packing(wrapper(model), pack), info, sharding, compute, activation_checkpointing)


def save_trained(model, tokenizer, url: str, from_url: str, full_state=None, prefix: str = "") -> None:
    """Commit the trained ``model`` at ``url``: the adapter only (pointing at the base of ``from_url``)
    for a peft model, else the full weights. ``full_state``: gathered FSDP2 weights whose keys carry
    the training wrapper's ``prefix``."""
    state = None if full_state is None else {k[len(prefix):]: v for k, v in full_state.items()
                                             if k.startswith(prefix)}
    if is_peft(model):
        save_adapter_checkpoint(model, tokenizer, url, base_checkpoint_url(from_url), overwrite=True,
                                state_dict=state)
    else:
        save_model_checkpoint(model, tokenizer, url, overwrite=True, state_dict=state)


def commit_trained(model, optimizer, tokenizer, url: str, from_url: str, inner: str, section, times: Dict[str, float],
                   role: str, info: DistInfo) -> None:
    """Every rank: commit the trained weights at ``url`` and the optimizer state beside them, as ``section``
    (``actor`` or ``critic``) says. The weights are a Hugging Face directory: with ``checkpoint_by_rank``
    under FSDP2 over ranks, each rank writes its own file of it (:mod:`models.training.weight_shards`);
    else rank 0 writes it whole, gathered from every rank's shard under FSDP2. ``inner``: the trained
    model's attribute in the training wrapper."""
    trained = getattr(unwrap(model), inner)
    by_rank = section.checkpoint_by_rank and weight_shards.applies(model, trained, info)
    full = None if by_rank else full_state_dict(model)  # a collective under FSDP2: every rank takes part
    with naming_a_full_disk(url, model):
        if by_rank:
            weight_shards.save(trained, tokenizer, url, info)
        elif info.is_main:
            save_trained(trained, tokenizer, url, from_url, full, prefix=f"{inner}.")
        commit_optimizer(model, optimizer, url, section.keep_optimizer_state, times, role, info,
                         section.optimizer_state_sharded)
    barrier()


def on_ranks(run: RunHandle, train: Callable[[DistInfo], UpdateOutput]) -> UpdateOutput:
    """What every process of an update's elastic launch runs: join the process group, ``train`` this
    rank (rank 0 holds the run's lease meanwhile) and leave it."""
    info = init_distributed()
    try:
        with run_lock.heartbeat(run.layout.lock_url, run.launch) if info.is_main else contextlib.nullcontext():
            out = train(info)
    except BaseException:
        shutdown_distributed(failed=True)  # no barrier: the other ranks may never reach it
        raise
    shutdown_distributed()
    return out


class Role(NamedTuple):
    """What the actor's and the critic's update differ by (``ACTOR`` in :mod:`models.stages.actor`, ``CRITIC``
    in :mod:`models.stages.critic`)."""

    name: str
    """``actor`` or ``critic``: the config section, the state's and the layout's URL, the metrics' prefix."""
    inner: str
    """The trained model's attribute in the training wrapper."""
    seed_offset: int
    load: Callable
    """``(cfg, url, info)``: the model to train from a checkpoint."""
    train: Callable
    """``(cfg, run, state, batch, info, model, optimizer, times)``: one update's loop, its statistics."""
    stats: Callable[[Dict[str, float], int], Dict[str, float]]
    """The logged statistics of the loop's and the optimizer steps taken in all."""
    weight_decay: Callable = lambda section: 0.0


@dataclass
class Trainee:
    """A model in training and what one update hands the next: AdamW, its steps so far and the checkpoint it
    was last committed to. A stateless task loads it for one update; a resident service keeps it."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    steps: int
    url: str


def load_trainee(role: Role, cfg: TrainConfig, state: PolicyState, info: DistInfo,
                 times: Dict[str, float]) -> Trainee:
    """The model to train from the state's checkpoint, with its AdamW (``keep_optimizer_state``: the state
    committed beside it), seeded as the update of ``state.iteration`` (a fresh LoRA adapter's draw)."""
    torch.manual_seed(cfg.run.seed * 7919 + state.iteration + role.seed_offset)
    s, url = getattr(cfg, role.name), getattr(state, f"{role.name}_url")
    model = role.load(cfg, url, info)
    optimizer, steps = carried_optimizer(model, s.lr, role.weight_decay(s), url, s.keep_optimizer_state, times,
                                         role.name, info)
    return Trainee(model, optimizer, steps, url)


def saves_at(cfg: TrainConfig, iteration: int) -> bool:
    """Whether a resident run's services checkpoint after ``iteration``: the resume points
    (:func:`~models.stages.commit.resume_point_at`) and, with ``run.max_staleness=1``, the iteration before
    each (its actor samples the batch after the resume point: the state's behaviour actor)."""
    return resume_point_at(cfg, iteration) or cfg.run.pipelined and \
        iteration + 1 < cfg.run.num_iterations and resume_point_at(cfg, iteration + 1)


def update_trainee(role: Role, cfg: TrainConfig, run: RunHandle, state: PolicyState, batch: RolloutBatch,
                   info: DistInfo, trainee: Trainee, commit: bool, times: Dict[str, float],
                   started: float = 0.0) -> UpdateOutput:
    """Every rank: one update of ``trainee`` on ``batch`` (fresh AdamW moments unless ``keep_optimizer_state``),
    then with ``commit`` its checkpoint as the iteration's (else no URL), and the statistics; ``started``:
    when the update's work began (default: now)."""
    t0 = started or time.perf_counter()
    s = getattr(cfg, role.name)
    if not s.keep_optimizer_state:
        trainee.optimizer, trainee.steps = make_optimizer(trainee.model, s.lr, role.weight_decay(s)), 0
    stats = role.train(cfg, run, state, batch, info, trainee.model, trainee.optimizer, times)
    trainee.steps += int(stats["steps"])
    url = ""
    if commit:
        url = getattr(run.layout, f"{role.name}_url")(state.iteration)
        commit_trained(trainee.model, trainee.optimizer, load_tokenizer(run.reference_url), url, trainee.url,
                       role.inner, s, times, role.name, info)
        trainee.url = url
    return UpdateOutput(url, {**role.stats(stats, trainee.steps), **times,
                              f"time/{role.name}_update_s": time.perf_counter() - t0})

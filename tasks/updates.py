"""``actor_update`` (an elastic torchrun job) and ``critic_update``: one pass of training on a batch,
each writing the next committed checkpoint. They run in parallel in the iteration graph."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
import time
from typing import Dict, Iterator, NamedTuple, Optional, Tuple

import torch
from flytekit import task

from kernels.losses import PolicyLossConfig
from models import storage
from models.checkpoint import save_model_checkpoint
from models.training.distributed import (DistInfo, barrier, full_state_dict, init_distributed, shutdown_distributed, unwrap,
                                wrap_for_training)
from models.checkpoint import optimizer_state
from models.faults import nan_advantages, pause_point
from models.training.lora import CAUSAL_LM, TOKEN_CLS, add_adapter, is_peft, save_adapter_checkpoint, trainable_in_float32
from models.checkpoint.optimizer_state import optimizer_url
from models.training.policy import CriticValues, PolicyLogprobs, with_packing
from models.training.update import (LoopSettings, UpdateData, actor_loss_fn, critic_loss_fn, disable_dropout, make_optimizer,
                           run_update, stat_keys)
from models.data.batch import RolloutBatch
from models.server.client import server_client, server_token  # noqa: F401
from tasks.common import (CACHE_VERSION, base_checkpoint_url, load_hf, load_tokenizer, local_checkpoint,
                          timed)
from models.run import lock as run_lock
from tasks import secrets
from models.config import LoraConfig, TrainConfig
from tasks.deploy import deployment_config, elastic_for, resources_for
from models.run.types import PolicyState, RunHandle


class UpdateOutput(NamedTuple):
    checkpoint_url: str
    stats: Dict[str, float]


_ACTOR_COLS = ("old_logprobs", "advantages", "sampler_logprobs", "ref_logprobs", "loss_mask")
_CRITIC_COLS = ("values", "returns")


def update_data(batch: RolloutBatch, pad_id: int, columns, shard) -> UpdateData:
    """This rank's rows as padded tensors (inputs and the loss columns, same row order)."""
    inputs = batch.to_model_inputs(pad_id, shard=shard)
    t = batch.to_padded(list(columns), shard=shard)
    get = lambda name: t[name].float() if name in t else None  # noqa: E731
    return UpdateData(inputs.input_ids, inputs.attention_mask, inputs.response_positions, inputs.response_mask,
                      old_logp=get("old_logprobs"), adv=get("advantages"), sampler_logp=get("sampler_logprobs"),
                      ref_logp=get("ref_logprobs"), old_values=get("values"), returns=get("returns"),
                      loss_mask=t["loss_mask"].bool() if "loss_mask" in t else None)


def policy_loss_config(cfg: TrainConfig) -> PolicyLossConfig:
    """The actor loss ``run.algorithm`` declares (its loss kind and any aggregation it fixes), with the
    ``actor.*`` settings it honours (the others are at their defaults: the config refuses them set)."""
    a, spec = cfg.actor, cfg.spec
    return PolicyLossConfig(kind=spec.policy_loss, clip_low=a.clip_eps, clip_high=a.clip_eps_high or a.clip_eps,
                            dual_clip=a.dual_clip or None, agg=spec.loss_agg or a.loss_agg,
                            horizon=cfg.rollout.max_new_tokens, entropy_coef=a.entropy_coef,
                            tis_cap=a.tis_cap or None)


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


class DiskFull(RuntimeError):
    """No space was left on the disk a checkpoint was being written to."""


@contextlib.contextmanager
def naming_a_full_disk(url: str, model) -> Iterator[None]:
    """A full disk while committing ``model``'s checkpoint at ``url`` as a :class:`DiskFull` that names the
    checkpoint, the folder written, its size and what the weights need (safetensors' error names no path)."""
    try:
        yield
    except Exception as err:
        if not _no_space_left(err):
            raise
        where = _existing_parent(storage.local_path(url)) if storage.is_local(url) else tempfile.gettempdir()
        usage = shutil.disk_usage(where)
        need = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        raise DiskFull(f"no space left on the disk while writing checkpoint {url}: its files go to a temporary folder "
                       f"in {where} first, on a filesystem of {usage.total / 2**20:.1f} MiB ({usage.free / 2**20:.1f} "
                       f"MiB free once the partial files were removed), and the trained weights alone take "
                       f"{need / 2**20:.1f} MiB. Nothing of this iteration was committed: free space, or put "
                       f"run.storage_root (remote storage: TMPDIR) on a larger disk, and rerun the same command to "
                       f"resume") from err


def _no_space_left(err: BaseException) -> bool:
    for _ in range(8):  # the error and what caused it
        if err is None:
            return False
        if (isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)) or \
                "No space left on device" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def _existing_parent(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.isdir(path):
        path = os.path.dirname(path)
    return path


def train_actor(cfg: TrainConfig, run: RunHandle, state: PolicyState, batch: RolloutBatch,
                info: DistInfo) -> UpdateOutput:
    """The body every rank runs: its shard, DDP/FSDP2, the update, rank 0 commits the checkpoint."""
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    torch.manual_seed(cfg.run.seed * 7919 + state.iteration)
    tok = load_tokenizer(run.reference_url)
    data = update_data(batch, tok.pad_token_id or 0, _ACTOR_COLS, (info.rank, info.world_size))
    data = data._replace(adv=nan_advantages(data.adv, state.iteration, info.rank))  # tests only
    a = cfg.actor
    lm = load_trainable(state.actor_url, AutoModelForCausalLM, cfg.model.dtype, a.lora, CAUSAL_LM)
    model = wrap_for_training(with_packing(PolicyLogprobs(lm), cfg.model.pack_sequences), info, a.sharding,
                              getattr(torch, cfg.model.dtype))
    kl_beta = state.kl_coef if cfg.kl_placement == "loss" else 0.0
    times: Dict[str, float] = {}
    optimizer, prior_steps = carried_optimizer(model, a.lr, a.weight_decay, state.actor_url, a.keep_optimizer_state,
                                               times, "actor", info)
    with timed(times, "time/actor_train_s"):
        stats = run_update(model, optimizer, data,
                           actor_loss_fn(policy_loss_config(cfg), cfg.rollout.temperature, kl_beta, cfg.kl_estimator),
                           loop_settings(a.ppo_epochs, a, cfg.run.seed * 1000 + state.iteration, "actor"), info)
    pause_point(f"actor_update/iter-{state.iteration:06d}")  # tests only: kill the run mid-update
    url = run.layout.actor_url(state.iteration)
    full = full_state_dict(model)
    with naming_a_full_disk(url, model):
        if info.is_main:
            save_trained(unwrap(model).lm, tok, url, state.actor_url, full, prefix="lm.")
        commit_optimizer(model, optimizer, url, a.keep_optimizer_state, times, "actor", info,
                         a.optimizer_state_sharded)
    barrier()
    stats["optimizer_steps_total"] = prior_steps + stats["steps"]
    out = {**stat_keys("actor", stats), **times}
    out["time/actor_update_s"] = time.perf_counter() - t0
    return UpdateOutput(url, out)


def train_critic(cfg: TrainConfig, run: RunHandle, state: PolicyState, batch: RolloutBatch) -> UpdateOutput:
    """Clipped value regression on the batch's returns; commits the next critic."""
    from transformers import AutoModelForTokenClassification

    t0 = time.perf_counter()
    if cfg.critic.remote_url:
        return train_remote_critic(cfg, run, state, batch, t0)
    info = DistInfo(0, 1, 0, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(cfg.run.seed * 7919 + state.iteration + 1)
    tok = load_tokenizer(run.reference_url)
    # multi-turn: values are regressed on the policy's tokens only (tool and template tokens have no return)
    data = update_data(batch, tok.pad_token_id or 0, _CRITIC_COLS + (("loss_mask",) if cfg.rollout.environment
                                                                   else ()), None)
    c = cfg.critic
    critic = load_trainable(state.critic_url, AutoModelForTokenClassification, cfg.model.dtype, c.lora, TOKEN_CLS)
    model = wrap_for_training(with_packing(CriticValues(critic), cfg.model.pack_sequences), info,
                              compute_dtype=getattr(torch, cfg.model.dtype))
    times: Dict[str, float] = {}
    optimizer, prior_steps = carried_optimizer(model, c.lr, 0.0, state.critic_url, c.keep_optimizer_state, times,
                                               "critic")
    with timed(times, "time/critic_train_s"):
        stats = run_update(model, optimizer, data, critic_loss_fn(c.value_clip or None),
                           loop_settings(c.epochs, c, cfg.run.seed * 1000 + state.iteration + 1, "critic"), info)
    url = run.layout.critic_url(state.iteration)
    with naming_a_full_disk(url, model):
        save_trained(model.critic, tok, url, state.critic_url)
        commit_optimizer(model, optimizer, url, c.keep_optimizer_state, times, "critic", info,
                         c.optimizer_state_sharded)
    return UpdateOutput(url, {**critic_stats(stats), "critic/optimizer_steps_total": prior_steps + stats["steps"],
                              **times, "time/critic_update_s": time.perf_counter() - t0})


def carried_optimizer(model, lr: float, weight_decay: float, from_url: str, keep: bool, times: Dict[str, float],
                      role: str, info: Optional[DistInfo] = None) -> Tuple[torch.optim.Optimizer, int]:
    """AdamW for ``model`` and the optimizer steps it has already taken: with ``keep``, its state is
    the one committed beside ``from_url`` (the checkpoint this update starts from) when there is
    one that fits; else fresh (0 steps)."""
    optimizer = make_optimizer(model, lr, weight_decay)
    if not keep:
        return optimizer, 0
    with timed(times, f"time/{role}_optimizer_state_s"):
        return optimizer, optimizer_state.load(model, optimizer, optimizer_url(from_url), info) or 0


def commit_optimizer(model, optimizer: torch.optim.Optimizer, checkpoint_url: str, keep: bool,
                     times: Dict[str, float], role: str, info: DistInfo, sharded: bool = False) -> None:
    """With ``keep``, commit the optimizer's state beside the checkpoint it trained (every rank calls;
    the counterpart of :func:`carried_optimizer`)."""
    if keep:
        with timed(times, f"time/{role}_optimizer_state_s"):
            optimizer_state.save(model, optimizer, optimizer_url(checkpoint_url), info, sharded)


def train_remote_critic(cfg: TrainConfig, run: RunHandle, state: PolicyState, batch: RolloutBatch,
                        t0: float) -> UpdateOutput:
    """The critic server's ``train`` on this batch, then ``save`` to the run's critic URL."""
    from models.server.schemas import TrainSettings

    c = cfg.critic
    t = batch.table
    client = server_client(c.remote_url, cfg.reward.remote_timeout_s)
    out = client.train(t.column("prompt_tokens").to_pylist(), t.column("response_tokens").to_pylist(),
                       t.column("returns").to_pylist(), t.column("values").to_pylist(),
                       TrainSettings(epochs=c.epochs, minibatch_size=c.minibatch_size,
                                     micro_batch_size=c.micro_batch_size, grad_clip=c.grad_clip,
                                     value_clip=c.value_clip, seed=cfg.run.seed * 1000 + state.iteration + 1))
    url = run.layout.critic_url(state.iteration)
    client.save(url, overwrite=True)
    return UpdateOutput(url, {**critic_stats(out.stats), "time/critic_update_s": time.perf_counter() - t0})


CRITIC_STATS = ("loss", "explained_variance", "grad_norm", "value_clip_frac", "steps", "nonfinite_steps",
                "skipped_steps")
"""Statistics of the critic update logged as ``critic/<name>``."""


def critic_stats(stats: Dict[str, float]) -> Dict[str, float]:
    """``critic/<name>`` of :data:`CRITIC_STATS` (a server predating ``nonfinite_steps`` or ``skipped_steps``
    counts none; one predating ``steps`` logs none, and ``finish_run`` cannot judge its share of skips)."""
    counts = ("nonfinite_steps", "skipped_steps")
    return {f"critic/{k}": float(stats.get(k, 0.0)) if k in counts else stats[k]
            for k in CRITIC_STATS if k in stats or k in counts}


@task(task_config=elastic_for(deployment_config()), cache=True, cache_version=CACHE_VERSION, retries=1,
      shared_memory=True, secret_requests=secrets.requests(secrets.S3), **resources_for(deployment_config(), "actor"))
def actor_update(cfg: TrainConfig, run: RunHandle, state: PolicyState, batch: RolloutBatch) -> UpdateOutput:
    """``ppo_epochs`` of clipped-surrogate updates over shuffled minibatches; next actor checkpoint.

    Runs as ``actor.nnodes × actor.nproc_per_node`` processes: registered from the deployment config
    (``tasks/deploy.py``); local runs take the run's config (the workflow overrides the elastic config).
    """
    secrets.load(secrets.S3)
    info = init_distributed()
    try:
        with run_lock.heartbeat(run.layout.lock_url) if info.is_main else contextlib.nullcontext():
            out = train_actor(cfg, run, state, batch, info)
    except BaseException:
        shutdown_distributed(failed=True)  # no barrier: the other ranks may never reach it
        raise
    shutdown_distributed()
    return out


@task(cache=True, cache_version=CACHE_VERSION, retries=2, secret_requests=secrets.requests(secrets.S3, secrets.SERVER),
      **resources_for(deployment_config(), "critic"))
def critic_update(cfg: TrainConfig, run: RunHandle, state: PolicyState, batch: RolloutBatch) -> UpdateOutput:
    """Clipped value regression on the same batch; next critic checkpoint."""
    secrets.load(secrets.S3, secrets.SERVER)
    with run_lock.heartbeat(run.layout.lock_url):
        return train_critic(cfg, run, state, batch)

"""The engine a stage samples the policy with: in this process (vLLM or HF, LoRA served as an adapter
or merged) or the rollout server, probed against the trainer after every weight change."""

from __future__ import annotations

import functools

import torch

from models.checkpoint.local import local_checkpoint

from models.training.load import base_checkpoint_url
from models.config import TrainConfig
from models.engines import get_engine
from models.server.client import server_token
from models.server.rollout_client import RemoteEngine, RolloutClient
from models.training.lora import base_url, is_adapter
from models.training.merge import merged_copy
from models.training.probe import ensure_serves


@functools.lru_cache(maxsize=4)
def _remote_engine(url: str, timeout_s: float) -> RemoteEngine:
    """One per process and server, so connections are reused across iterations (as ``get_engine``
    reuses an in-process engine)."""
    return RemoteEngine(RolloutClient(url, token=server_token(), timeout_s=timeout_s))


def remote_engine_for(cfg: TrainConfig, actor_url: str) -> RemoteEngine:
    """The rollout server at ``rollout.remote_url`` sampling from ``actor_url``: a LoRA adapter is
    sent as the adapter on its base checkpoint (the server loads both)."""
    engine = _remote_engine(cfg.rollout.remote_url, cfg.rollout.remote_timeout_s)
    engine.probe_tolerance, engine.trainer_dtype = cfg.probe_tolerance, cfg.model.dtype
    base = base_checkpoint_url(actor_url) if cfg.actor.lora.enabled else actor_url
    engine.load_weights(base)
    engine.set_adapter(actor_url if base != actor_url else None)
    return engine


def engine_for(cfg: TrainConfig, actor_url: str):
    """An engine serving the policy at ``actor_url``: the rollout server if ``rollout.remote_url`` is
    set, else one in this process. With ``actor.lora``: its base weights plus the adapter
    (``rollout.lora_mode=adapter``), or the adapter merged into the base (``merged``).

    After every weight change the engine is probed against the trainer's forward
    (:func:`models.training.probe.ensure_serves`; the rollout server probes its own)."""
    r = cfg.rollout
    if r.remote_url:
        return remote_engine_for(cfg, actor_url)
    kwargs = dict(dtype=r.vllm_dtype, kv_cache_gib=r.vllm_kv_cache_gib,
                  gpu_memory_utilization=r.vllm_gpu_memory_utilization, seed=cfg.run.seed,
                  tensor_parallel_size=r.tensor_parallel_size) \
        if r.engine == "vllm" else dict(dtype=cfg.model.dtype)
    kwargs["data_parallel_size"] = r.data_parallel_size  # replicas of either engine
    local = local_checkpoint(actor_url)
    adapter = local if is_adapter(local) else None  # None before the first LoRA update: the base itself
    if not cfg.actor.lora.enabled or r.lora_mode == "merged":
        weights = merged_copy(adapter, local_checkpoint, getattr(torch, cfg.model.dtype)) if adapter else local
        engine, served = get_engine(r.engine, weights, **kwargs), (weights, None)
    else:
        base = local_checkpoint(base_url(adapter)) if adapter else local
        engine, served = get_engine(r.engine, base, max_lora_rank=cfg.actor.lora.rank, **kwargs), (base, adapter)
        engine.set_adapter(adapter)

    def restart() -> None:
        engine.restart(served[0])
        if served[1] is not None:
            engine.set_adapter(served[1])

    ensure_serves(engine, served, local, cfg.probe_tolerance, restart, local_checkpoint, what=actor_url,
                  dtype=cfg.model.dtype)
    return engine

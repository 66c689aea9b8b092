"""The engine a stage samples the policy with: in this process (vLLM or HF, LoRA served as an adapter
or merged) or the rollout server, probed against the trainer after every weight change."""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from models.checkpoint.local import local_checkpoint

from models.training.load import base_checkpoint_url
from models.config import TrainConfig
from models import memory
from models.engines import close_engines, get_engine
from models.engines.base import EngineStats, Generation, SamplingSpec
from models.stages.services import server
from models.training.lora import base_url, is_adapter
from models.training.merge import merged_copy
from models.training.probe import PROBE_LENGTH, ensure_serves


class RemoteEngine:
    """:class:`models.engines.GenerationEngine` on a rollout server (its ``generate`` op): ``load_weights`` and
    ``set_adapter`` take committed checkpoint URLs (as the server sees them) and only record them; the server
    loads them with the next ``generate``, probed against the trainer's forward in ``trainer_dtype``."""

    def __init__(self, client, checkpoint_url: str = "", adapter_url: Optional[str] = None,
                 probe_tolerance: float = 1e-3):
        self.client, self.checkpoint_url, self.adapter_url = client, checkpoint_url, adapter_url
        self.probe_tolerance, self.trainer_dtype = probe_tolerance, "float32"
        self.stats = EngineStats()

    def load_weights(self, checkpoint_url: str) -> None:
        """Sample from the committed checkpoint at ``checkpoint_url`` from now on (no adapter)."""
        self.checkpoint_url, self.adapter_url = checkpoint_url, None

    def set_adapter(self, adapter_url: Optional[str]) -> None:
        self.adapter_url = adapter_url

    def generate(self, prompts: List[List[int]], spec: SamplingSpec) -> List[List[Generation]]:
        if not self.checkpoint_url:
            raise ValueError("RemoteEngine: call load_weights(checkpoint_url) before generate")
        sampling = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(spec).items()}
        out = self.client.call("generate", {
            "prompts": [list(map(int, p)) for p in prompts], "sampling": sampling, "checkpoint_url": self.checkpoint_url,
            "adapter_url": self.adapter_url, "probe_tolerance": self.probe_tolerance,
            "trainer_dtype": self.trainer_dtype})
        if out["probe_gap_max"] is not None:
            self.stats.extra["probe_gap_max"] = out["probe_gap_max"]
        self.stats.reload_s += out["load_s"]
        self.stats.generate_s += out["generate_s"]
        generations = [[Generation(g["tokens"], g["logprobs"], g["is_end"]) for g in per_prompt]
                       for per_prompt in out["generations"]]
        self.stats.generated_tokens += sum(len(g.tokens) for per_prompt in generations for g in per_prompt)
        return generations

    def close(self) -> None:
        pass


@functools.lru_cache(maxsize=4)
def _remote_engine(url: str, timeout_s: float) -> RemoteEngine:
    """One per process and server (as ``get_engine`` reuses an in-process engine)."""
    return RemoteEngine(server(url, timeout_s, "rollout server"))


def remote_engine_for(cfg: TrainConfig, actor_url: str) -> RemoteEngine:
    """The rollout server at ``rollout.remote_url`` sampling from ``actor_url``: a LoRA adapter is
    sent as the adapter on its base checkpoint (the server loads both)."""
    engine = _remote_engine(cfg.rollout.remote_url, cfg.rollout.remote_timeout_s)
    engine.probe_tolerance, engine.trainer_dtype = cfg.probe_tolerance, cfg.model.dtype
    base = base_checkpoint_url(actor_url) if cfg.actor.lora.enabled else actor_url
    engine.load_weights(base)
    engine.set_adapter(actor_url if base != actor_url else None)
    return engine


def engine_kwargs(cfg: TrainConfig) -> Dict[str, Any]:
    """The arguments of every engine the run starts in its own processes (:func:`models.engines.get_engine`: the
    rollout and evaluation tasks, the resident engine service, each colocated rank or tensor-parallel group, each
    replica of ``rollout.data_parallel_size``). vLLM's context is the run's (:attr:`TrainConfig.engine_context`,
    at least the probe's sequences; the engine caps it at the checkpoint's), its KV cache
    ``rollout.vllm_kv_cache_gib`` on CPU."""
    r = cfg.rollout
    kwargs: Dict[str, Any] = dict(
        dtype=r.vllm_dtype, kv_cache_gib=r.vllm_kv_cache_gib, gpu_memory_utilization=r.vllm_gpu_memory_utilization,
        max_model_len=max(cfg.engine_context, PROBE_LENGTH), max_num_seqs=r.vllm_max_num_seqs, seed=cfg.run.seed,
        tensor_parallel_size=r.tensor_parallel_size, enforce_eager=r.enforce_eager,
        colocated=cfg.run.resident_layout == "colocated") if r.engine == "vllm" else dict(dtype=cfg.model.dtype)
    kwargs["data_parallel_size"] = r.data_parallel_size  # replicas of either engine
    return kwargs


def engine_for(cfg: TrainConfig, actor_url: str):
    """An engine serving the policy at ``actor_url``: the rollout server if ``rollout.remote_url`` is
    set, else one in this process (:func:`started_engine`).

    After every weight change the engine is probed against the trainer's forward
    (:func:`models.training.probe.ensure_serves`: the checkpoint loaded as the trainer loads it; the rollout
    server probes its own)."""
    if cfg.rollout.remote_url:
        return remote_engine_for(cfg, actor_url)
    engine, restart, served, local = started_engine(cfg, actor_url)
    ensure_serves(engine, served, local, cfg.probe_tolerance, restart, local_checkpoint, what=actor_url,
                  dtype=cfg.model.dtype)
    return engine


def started_engine(cfg: TrainConfig, actor_url: str) -> Tuple[Any, Callable[[], None], tuple, str]:
    """An engine in this process serving the policy at ``actor_url``, not yet probed: with ``actor.lora`` its base
    weights plus the adapter (``rollout.lora_mode=adapter``), or the adapter merged into the base (``merged``).
    Also a restart from what it serves, the served ``(weights, adapter)`` and the checkpoint's local folder."""
    r = cfg.rollout
    kwargs = engine_kwargs(cfg)
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

    return engine, restart, served, local


def weights_mib(checkpoint_dir: str) -> float:
    """MiB of the safetensors weights in a local checkpoint folder."""
    return sum(os.path.getsize(os.path.join(checkpoint_dir, f)) for f in os.listdir(checkpoint_dir)
               if f.endswith(".safetensors")) / (1 << 20)


def done_with_engine(cfg: TrainConfig, actor_url: str) -> bool:
    """At the end of a stateless stage that sampled with :func:`engine_for`: close this process's engines
    when the policy's weights are over ``rollout.keep_engine_max_mb`` and give their memory back to the
    machine (:func:`models.memory.release`); True when closed. The rollout server's engine is not ours."""
    limit = cfg.rollout.keep_engine_max_mb
    if cfg.rollout.remote_url or limit < 0:
        return False
    if limit and weights_mib(local_checkpoint(base_checkpoint_url(actor_url))) <= limit:
        return False
    close_engines()
    memory.release()
    return True

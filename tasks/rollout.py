"""``rollout`` task: sample responses from the current actor and write the iteration's RolloutBatch."""

from __future__ import annotations

import functools
from typing import Dict, NamedTuple

import torch
from flytekit import task

from models.engines import SamplingSpec, get_engine
from models.faults import pause_point
from models.lora import base_url, is_adapter, merged_copy
from models.rollout import sample
from models.server.rollout_client import RemoteEngine, RolloutClient
from tasks.batch import BatchMetadata, RolloutBatch
from tasks.common import (CACHE_VERSION, base_checkpoint_url, draw_ids, iteration_indices, load_tokenizer,
                          local_checkpoint, read_prompts, server_token, timed)
from tasks.run_data import sample_columns
from tasks import decks, secrets
from tasks.config import TrainConfig
from tasks.deploy import deployment_config, resources_for
from tasks.types import PolicyState, RunHandle


class RolloutOutput(NamedTuple):
    batch: RolloutBatch
    stats: Dict[str, float]


@functools.lru_cache(maxsize=4)
def _remote_engine(url: str, timeout_s: float) -> RemoteEngine:
    """One per process and server, so connections are reused across iterations (as ``get_engine``
    reuses an in-process engine)."""
    return RemoteEngine(RolloutClient(url, token=server_token(), timeout_s=timeout_s))


def remote_engine_for(cfg: TrainConfig, actor_url: str) -> RemoteEngine:
    """The rollout server at ``rollout.remote_url`` sampling from ``actor_url``: a LoRA adapter is
    sent as the adapter on its base checkpoint (the server loads both)."""
    engine = _remote_engine(cfg.rollout.remote_url, cfg.rollout.remote_timeout_s)
    base = base_checkpoint_url(actor_url) if cfg.actor.lora.enabled else actor_url
    engine.load_weights(base)
    engine.set_adapter(actor_url if base != actor_url else None)
    return engine


def engine_for(cfg: TrainConfig, actor_url: str):
    """An engine serving the policy at ``actor_url``: the rollout server if ``rollout.remote_url`` is
    set, else one in this process. With ``actor.lora``: its base weights plus the adapter
    (``rollout.lora_mode=adapter``), or the adapter merged into the base (``merged``)."""
    r = cfg.rollout
    if r.remote_url:
        return remote_engine_for(cfg, actor_url)
    kwargs = dict(dtype=r.vllm_dtype, kv_cache_gib=r.vllm_kv_cache_gib,
                  gpu_memory_utilization=r.vllm_gpu_memory_utilization, seed=cfg.run.seed) \
        if r.engine == "vllm" else dict(dtype=cfg.model.dtype)
    local = local_checkpoint(actor_url)
    adapter = local if is_adapter(local) else None  # None before the first LoRA update: the base itself
    if not cfg.actor.lora.enabled:
        return get_engine(r.engine, local, **kwargs)
    if r.lora_mode == "merged":
        weights = merged_copy(adapter, local_checkpoint, getattr(torch, cfg.model.dtype)) if adapter else local
        return get_engine(r.engine, weights, **kwargs)
    base = local_checkpoint(base_url(adapter)) if adapter else local
    engine = get_engine(r.engine, base, max_lora_rank=cfg.actor.lora.rank, **kwargs)
    engine.set_adapter(adapter)
    return engine


def sampling_spec(cfg: TrainConfig, tokenizer, seed: int, n: int, temperature: float) -> SamplingSpec:
    r = cfg.rollout
    return SamplingSpec(n=n, temperature=temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                        seed=seed, stop_token_ids=(tokenizer.eos_token_id,), stop_strings=tuple(r.stop_strings))


def run_rollout(cfg: TrainConfig, run: RunHandle, state: PolicyState) -> RolloutOutput:
    stats: Dict[str, float] = {}
    with timed(stats, "time/rollout_s"):
        data = read_prompts(run.train_prompts_url)
        per_iteration = cfg.rollout.prompts_per_iteration
        drawn = data.take(iteration_indices(len(data), per_iteration, state.iteration, cfg.run.seed))
        tokenizer = load_tokenizer(run.reference_url)
        with timed(stats, "time/engine_load_s"):
            engine = engine_for(cfg, state.actor_url)
        spec = sampling_spec(cfg, tokenizer, cfg.run.seed * 100_003 + state.iteration,
                             cfg.rollout.n_samples_per_prompt, cfg.rollout.temperature)
        cols = sample(engine, tokenizer, drawn.prompts, draw_ids(per_iteration, state.iteration), spec, drawn.chat)
        pause_point(f"rollout/iter-{state.iteration:06d}")  # tests only: kill the run mid-rollout
        meta = BatchMetadata(iteration=state.iteration, policy_version=state.iteration,
                             algorithm=cfg.run.algorithm, extras={"run_name": run.run_name})
        batch = RolloutBatch.from_columns(meta, **cols.as_dict(), **sample_columns(drawn, spec.n))
        with timed(stats, "time/rollout_write_s"):
            batch = batch.write(run.layout.batch_url(state.iteration, "rollouts"))
    n_tokens = float(sum(len(r) for r in cols.response_tokens))
    stats["time/generate_s"] = cols.generate_s
    stats["throughput/rollout_tokens_per_s"] = n_tokens / max(cols.generate_s, 1e-9)
    return RolloutOutput(batch, stats)


@task(cache=True, cache_version=CACHE_VERSION, retries=2, enable_deck=True, deck_fields=decks.DECK_FIELDS,
      secret_requests=secrets.requests(secrets.S3, secrets.SERVER), **resources_for(deployment_config(), "rollout"))
def rollout(cfg: TrainConfig, run: RunHandle, state: PolicyState) -> RolloutOutput:
    """Sample ``n_samples_per_prompt`` responses per prompt with vLLM (or HF) from the actor."""
    secrets.load(secrets.S3, secrets.SERVER)
    out = run_rollout(cfg, run, state)
    decks.publish("Rollout", out.batch)
    return out

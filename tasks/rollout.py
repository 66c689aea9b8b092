"""``rollout`` task: sample responses from the current actor and write the iteration's RolloutBatch."""

from __future__ import annotations

import functools
import json
from dataclasses import replace
from typing import Any, Dict, NamedTuple, Sequence, Tuple

import torch
from flytekit import task

from models.engines import SamplingSpec, eos_token_ids, get_engine, stream_seed
from models.faults import pause_point
from models.training.lora import base_url, is_adapter
from models.training.merge import merged_copy
from models.training.probe import ensure_serves
from models.engines.vllm_engine import unsupported_lora_targets
from models.environments.episode_rollout import sample_episodes
from models.environments.episodes import EpisodeLimits, load_environment
from models.engines.rollout import RolloutColumns, sample
from models.environments.tools import get_parser
from models.server.rollout_client import RemoteEngine, RolloutClient
from models.data.batch import BatchMetadata, RolloutBatch
from models.server.client import server_client, server_token  # noqa: F401
from tasks.common import (CACHE_VERSION, base_checkpoint_url, draw_ids, iteration_indices, load_tokenizer,
                          local_checkpoint, read_prompts, timed)
from models.run.data import sample_columns
from tasks import decks, secrets
from models.config import ConfigError, TrainConfig
from tasks.deploy import deployment_config, resources_for
from models.run.types import PolicyState, RunHandle


SAMPLING_KEY = "sampling"
"""Batch metadata ``extras`` key of :func:`sampling_record` (what the engine sampled with)."""


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
                  gpu_memory_utilization=r.vllm_gpu_memory_utilization, seed=cfg.run.seed) \
        if r.engine == "vllm" else dict(dtype=cfg.model.dtype)
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




def sampling_spec(cfg: TrainConfig, run: RunHandle, seed: int, n: int, temperature: float) -> SamplingSpec:
    """How the rollout samples: the config's settings, and every eos id of the run's checkpoint
    (its tokenizer's and ``generation_config.json``'s) as stop tokens."""
    r = cfg.rollout
    return SamplingSpec(n=n, temperature=temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens,
                        seed=seed, stop_token_ids=eos_token_ids(local_checkpoint(run.reference_url)),
                        stop_strings=tuple(r.stop_strings))


def sampling_record(cfg: TrainConfig, spec: SamplingSpec) -> str:
    """What the batch was sampled with, as its metadata records it (JSON)."""
    r = cfg.rollout
    dtype = r.vllm_dtype if r.engine == "vllm" else cfg.model.dtype
    engine = f"remote {r.remote_url}" if r.remote_url else f"{r.engine} ({dtype})"
    return json.dumps({"engine": engine, "temperature": spec.temperature, "top_p": spec.top_p, "top_k": spec.top_k,
                       "max_new_tokens": spec.max_new_tokens, "seed": spec.seed,
                       "stop_token_ids": list(spec.stop_token_ids), "stop_strings": list(spec.stop_strings)},
                      sort_keys=True)


def sample_data(cfg: TrainConfig, engine, tokenizer, data, prompt_ids: Sequence[int],
                spec: SamplingSpec) -> Tuple[RolloutColumns, Dict[str, Any], Dict[str, float]]:
    """``spec.n`` samples of every prompt of ``data`` (a ``PromptDataset``): one response each, or with
    ``rollout.environment`` one multi-turn episode each (its environment built from the row's columns
    and ``prompt``; :mod:`models.environments.episodes`). Returns the rollout columns, the episode columns (none
    single-turn) and the ``episode/*`` metrics."""
    r = cfg.rollout
    if not r.environment:
        return sample(engine, tokenizer, data.prompts, prompt_ids, spec, data.chat), {}, {}
    rows = [{"prompt": p, **cols} for p, cols in zip(data.prompts, data.row_columns())]
    limits = EpisodeLimits(r.max_turns, r.max_episode_tokens, r.tool_timeout_s)
    return sample_episodes(engine, tokenizer, load_environment(r.environment), rows, prompt_ids,
                           replace(spec, max_new_tokens=min(spec.max_new_tokens, r.max_episode_tokens)), limits,
                           get_parser(r.tool_parser))


def run_rollout(cfg: TrainConfig, run: RunHandle, state: PolicyState, ahead: int = 0) -> RolloutOutput:
    """The batch of iteration ``state.iteration + ahead`` sampled from ``state``'s actor (``ahead`` 1: a
    batch sampled one update ahead, ``run.off_policy_steps``); its ``policy_version`` is ``state.iteration``."""
    version = state.iteration
    state = replace(state, iteration=state.iteration + ahead)
    stats: Dict[str, float] = {}
    with timed(stats, "time/rollout_s"):
        data = read_prompts(run.train_prompts_url)
        per_iteration = cfg.rollout.prompts_per_iteration
        drawn = data.take(iteration_indices(len(data), per_iteration, state.iteration, cfg.run.seed))
        tokenizer = load_tokenizer(run.reference_url)
        with timed(stats, "time/engine_load_s"):
            engine = engine_for(cfg, state.actor_url)
        spec = sampling_spec(cfg, run, stream_seed(cfg.run.seed, state.iteration), cfg.rollout.n_samples_per_prompt,
                             cfg.rollout.temperature)
        cols, episode_cols, episode_stats = sample_data(cfg, engine, tokenizer, drawn,
                                                        draw_ids(per_iteration, state.iteration), spec)
        stats.update(episode_stats)
        pause_point(f"rollout/iter-{state.iteration:06d}")  # tests only: kill the run mid-rollout
        meta = BatchMetadata(iteration=state.iteration, policy_version=version,
                             algorithm=cfg.run.algorithm,
                             extras={"run_name": run.run_name, SAMPLING_KEY: sampling_record(cfg, spec)})
        batch = RolloutBatch.from_columns(meta, **cols.as_dict(), **episode_cols, **sample_columns(drawn, spec.n))
        with timed(stats, "time/rollout_write_s"):
            batch = batch.write(run.layout.batch_url(state.iteration, "rollouts"))
    n_tokens = float(sum(sum(m) for m in episode_cols["loss_mask"]) if episode_cols  # sampled tokens only
                     else sum(len(r) for r in cols.response_tokens))
    stats["time/generate_s"] = cols.generate_s
    stats["throughput/rollout_tokens_per_s"] = n_tokens / max(cols.generate_s, 1e-9)
    if "probe_gap_max" in engine.stats.extra:  # engine vs trainer on the probe after this weight change
        stats["rollout/probe_gap_max"] = float(engine.stats.extra["probe_gap_max"])
    return RolloutOutput(batch, stats)


@task(cache=True, cache_version=CACHE_VERSION, retries=2, enable_deck=True, deck_fields=decks.DECK_FIELDS,
      secret_requests=secrets.requests(secrets.S3, secrets.SERVER), **resources_for(deployment_config(), "rollout"))
def rollout(cfg: TrainConfig, run: RunHandle, state: PolicyState, ahead: int = 0) -> RolloutOutput:
    """Sample ``n_samples_per_prompt`` responses per prompt with vLLM (or HF) from the actor (for the
    iteration ``ahead`` after ``state``'s: off-policy pipelining)."""
    secrets.load(secrets.S3, secrets.SERVER)
    out = run_rollout(cfg, run, state, ahead)
    decks.publish("Rollout", out.batch)
    return out

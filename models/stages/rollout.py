"""The rollout stage: sample responses from the current actor and write the iteration's RolloutBatch."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, Dict, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from models.checkpoint.local import load_tokenizer, local_checkpoint
from models.config import TrainConfig
from models.data.batch import BatchMetadata, RolloutBatch
from models.data.draws import draw_ids, iteration_indices
from models.engines import SamplingSpec, eos_token_ids, stream_seed
from models.engines.rollout import RolloutColumns, sample
from models.environments.episode_rollout import UnitEpisodes, rows_of, sample_episodes
from models.environments.episodes import EpisodeLimits, load_environment
from models.environments.tools import get_parser
from models.faults import pause_point
from models.run.data import read_run_prompts, sample_columns
from models.run.types import PolicyState, RunHandle
from models.stages.outputs import RolloutOutput
from models.stages.engine import done_with_engine, engine_for
from models.timing import timed

SAMPLING_KEY = "sampling"
"""Batch metadata ``extras`` key of :func:`sampling_record` (what the engine sampled with)."""



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
    engine = f"remote {r.remote_url}" if r.remote_url else f"{r.engine} ({cfg.engine_dtype})"
    return json.dumps({"engine": engine, "temperature": spec.temperature, "top_p": spec.top_p, "top_k": spec.top_k,
                       "max_new_tokens": spec.max_new_tokens, "seed": spec.seed,
                       "stop_token_ids": list(spec.stop_token_ids), "stop_strings": list(spec.stop_strings)},
                      sort_keys=True)


def sample_data(cfg: TrainConfig, engine, tokenizer, data, prompt_ids: Sequence[int],
                spec: SamplingSpec, first_index: int = 0) -> Tuple[RolloutColumns, Dict[str, Any], Dict[str, float]]:
    """``spec.n`` samples of every prompt of ``data`` (a ``PromptDataset``): one response each, or with
    ``rollout.environment`` one multi-turn episode each (its environment built from the row's columns
    and ``prompt``; :mod:`models.environments.episodes`). Returns the rollout columns, the episode columns (none
    single-turn) and the ``episode/*`` metrics. ``first_index``: the position of ``data``'s first row in the
    iteration's draw (an asynchronous run samples it a few prompts at a time), whose seeds its samples take."""
    if not cfg.rollout.environment:
        return sample(engine, tokenizer, data.prompts, prompt_ids, spec, data.chat, first_index), {}, {}
    episodes = unit_episodes(cfg, tokenizer)
    return sample_episodes(engine, tokenizer, episodes.env_cls, rows_of(data), prompt_ids,
                           episodes.spec_for(spec), episodes.limits, episodes.parser, first_index=first_index)


def unit_episodes(cfg: TrainConfig, tokenizer) -> UnitEpisodes:
    """The run's environment, episode limits, tool-call parser and turn budget (``rollout.*``), to sample a draw's
    prompts as multi-turn episodes (:class:`~models.environments.episode_rollout.UnitEpisodes`)."""
    r = cfg.rollout
    limits = EpisodeLimits(r.max_turns, r.max_episode_tokens, r.tool_timeout_s, cfg.data.max_prompt_tokens,
                           r.episode_pace)
    return UnitEpisodes(tokenizer, load_environment(r.environment), limits, get_parser(r.tool_parser),
                        lambda spec: replace(spec, max_new_tokens=min(spec.max_new_tokens, r.max_episode_tokens)))


class Draw(NamedTuple):
    """What the data order gives iteration ``iteration``: its prompts, their ``prompt_id`` and how they are sampled."""

    iteration: int
    data: Any  # PromptDataset: the drawn rows
    prompt_ids: np.ndarray  # [P] int64
    spec: SamplingSpec


def draw_for(cfg: TrainConfig, run: RunHandle, iteration: int, data=None) -> Draw:
    """The prompts of ``iteration`` in the run's data order and its sampling spec (seeded by the iteration);
    ``data``: the run's prompts when already read."""
    data = data if data is not None else read_run_prompts(run.train_prompts_url)
    per_iteration = cfg.rollout.prompts_per_iteration
    drawn = data.take(iteration_indices(len(data), per_iteration, iteration, cfg.run.seed))
    spec = sampling_spec(cfg, run, stream_seed(cfg.run.seed, iteration), cfg.rollout.n_samples_per_prompt,
                         cfg.rollout.temperature)
    return Draw(iteration, drawn, draw_ids(per_iteration, iteration), spec)


def write_batch(cfg: TrainConfig, run: RunHandle, draw: Draw, version: int, columns: Dict[str, Any],
                stats: Dict[str, float], extras: Optional[Dict[str, str]] = None) -> RolloutBatch:
    """The iteration's RolloutBatch from its sampled ``columns`` (``policy_version``: the oldest actor that drew
    them; ``extras``: more metadata), written to the run's batch URL."""
    meta = BatchMetadata(iteration=draw.iteration, policy_version=version, algorithm=cfg.run.algorithm,
                         extras={"run_name": run.run_name, SAMPLING_KEY: sampling_record(cfg, draw.spec),
                                 **(extras or {})})
    batch = RolloutBatch.from_columns(meta, **columns, **sample_columns(draw.data, draw.spec.n))
    with timed(stats, "time/rollout_write_s"):
        return batch.write(run.layout.batch_url(draw.iteration, "rollouts"))


def run_rollout(cfg: TrainConfig, run: RunHandle, state: PolicyState, ahead: int = 0, engine=None) -> RolloutOutput:
    """The batch of iteration ``state.iteration + ahead`` sampled from ``state``'s actor (``ahead`` 1: a
    batch sampled one update ahead, ``run.max_staleness=1``); its ``policy_version`` is ``state.iteration``.
    ``engine``: one already serving that actor (a resident engine service's); default :func:`engine_for`."""
    version = state.iteration
    state = replace(state, iteration=state.iteration + ahead)
    stats: Dict[str, float] = {}
    with timed(stats, "time/rollout_s"):
        draw = draw_for(cfg, run, state.iteration)
        tokenizer = load_tokenizer(run.reference_url)
        own = engine is None
        with timed(stats, "time/engine_load_s"):
            engine = engine if engine is not None else engine_for(cfg, state.actor_url)
        before = prompt_counts(engine)
        cols, episode_cols, episode_stats = sample_data(cfg, engine, tokenizer, draw.data, draw.prompt_ids,
                                                        draw.spec)
        stats.update(prefix_cache_stats(before, prompt_counts(engine)))
        if own:
            done_with_engine(cfg, state.actor_url)
        stats.update(episode_stats)
        pause_point(f"rollout/iter-{state.iteration:06d}")  # tests only: kill the run mid-rollout
        batch = write_batch(cfg, run, draw, version, {**cols.as_dict(), **episode_cols}, stats)
    stats.update(throughput_stats(cols, episode_cols, engine))
    return RolloutOutput(batch, stats)


def prompt_counts(engine) -> Tuple[Any, int, int]:
    """``(the engine's stats, prompt tokens, of them served from the prefix cache)`` counted so far (no tokens where
    the engine counts none: the HF engine, a rollout server; replicas add up their vLLM engines')."""
    stats = getattr(engine, "stats", None)
    return stats, int(getattr(stats, "prompt_tokens", 0)), int(getattr(stats, "cached_prompt_tokens", 0))


def prefix_cache_stats(before: Tuple[Any, int, int], after: Tuple[Any, int, int]) -> Dict[str, float]:
    """``rollout/prefix_cache_hit_rate``: the share of the prompt tokens of the requests between the two counts
    that vLLM's prefix cache served (a group's samples share their prompt; a multi-turn episode's next turn, its
    context so far); nothing where the engine counted no prompt, or restarted between the two (new counts)."""
    prompts, cached = after[1] - before[1], after[2] - before[2]
    return {"rollout/prefix_cache_hit_rate": cached / prompts} if prompts > 0 and after[0] is before[0] else {}


def throughput_stats(cols: RolloutColumns, episode_cols: Dict[str, Any], engine) -> Dict[str, float]:
    """``time/generate_s``, the sampled tokens per second and the engine's probe gap after this weight change."""
    n_tokens = float(sum(sum(m) for m in episode_cols["loss_mask"]) if episode_cols  # sampled tokens only
                     else sum(len(r) for r in cols.response_tokens))
    stats = {"time/generate_s": cols.generate_s,
             "throughput/rollout_tokens_per_s": n_tokens / max(cols.generate_s, 1e-9)}
    if "probe_gap_max" in engine.stats.extra:  # engine vs trainer on the probe after this weight change
        stats["rollout/probe_gap_max"] = float(engine.stats.extra["probe_gap_max"])
    if "cuda_graphs" in engine.stats.extra:  # vLLM: replaying CUDA graphs, or eager (rollout.enforce_eager)
        stats["rollout/cuda_graphs"] = float(engine.stats.extra["cuda_graphs"])
    return stats

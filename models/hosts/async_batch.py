"""The batch an asynchronous run's rollout takes from the engine's buffer (``run.max_staleness`` k ≥ 2,
docs/off_policy.md): the units of its draw one after the other (:class:`models.hosts.producer.Producer`), each
token tagged with the policy version that drew it (``token_versions``), written where the synchronous rollout
writes its batch, with the ``async/*`` metrics (:mod:`models.stages.async_metrics`)."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Tuple

import numpy as np

from models.config import TrainConfig
from models.engines.rollout import RolloutColumns
from models.environments.episode_rollout import merged_episode_stats
from models.faults import pause_point
from models.hosts.producer import Producer, Unit
from models.run.types import RunHandle
from models.stages.async_metrics import idle_stats, staleness_stats
from models.stages.outputs import RolloutOutput
from models.stages.rollout import prefix_cache_stats, prompt_counts, throughput_stats, write_batch
from models.timing import timed


def merged(units: List[Unit]) -> Tuple[RolloutColumns, List[List[int]]]:
    """The units' columns one after the other (prompt order), and each sample's per-token versions."""
    cols = [u.columns for u in units]
    lists = {name: [x for c in cols for x in getattr(c, name)]
             for name in ("prompt_tokens", "response_tokens", "sampler_logprobs", "prompt", "response")}
    out = RolloutColumns(prompt_id=np.concatenate([c.prompt_id for c in cols]),
                         is_end=np.concatenate([c.is_end for c in cols]),
                         generate_s=sum(c.generate_s for c in cols), **lists)
    return out, [v for u in units for v in u.token_versions()]


def merged_episodes(units: List[Unit]) -> Tuple[Dict[str, Any], Dict[str, float]]:
    """Multi-turn units: their episode columns one after the other and the batch's ``episode/*`` metrics; single-turn
    ones: nothing."""
    parts = [(u.episodes, len(u.columns.response_tokens)) for u in units if u.episodes is not None]
    if not parts:
        return {}, {}
    first = parts[0][0][0]
    columns = {name: np.concatenate([c[name] for (c, _), _ in parts]) if isinstance(first[name], np.ndarray)
               else [x for (c, _), _ in parts for x in c[name]] for name in first}
    return columns, merged_episode_stats([(stats, n) for (_, stats), n in parts], columns["loss_mask"])


BUFFER_KEY = "async_buffer"
"""Batch metadata ``extras`` key: the producer's buffer when the batch was taken (JSON, :meth:`Producer.snapshot`)."""


def take_rollout(cfg: TrainConfig, run: RunHandle, producer: Producer, iteration: int, engine) -> RolloutOutput:
    """The batch of ``iteration`` from ``producer``'s buffer, written as the synchronous rollout writes its batch
    (``policy_version``: the oldest version among its tokens)."""
    stats: Dict[str, float] = {}
    with timed(stats, "time/rollout_s"):
        units, window = producer.take(iteration, cfg.run.resident_start_timeout_s)
        cols, versions = merged(units)
        episode_cols, episode_stats = merged_episodes(units)
        pause_point(f"rollout/iter-{iteration:06d}")  # tests only: kill the run mid-rollout
        batch = write_batch(cfg, run, producer.draw(iteration), min(u.oldest() for u in units),
                            {**cols.as_dict(), **episode_cols, "token_versions": versions}, stats,
                            {BUFFER_KEY: json.dumps(producer.snapshot(), sort_keys=True)})
    stats.update(episode_stats)
    stats.update(staleness_stats(iteration, versions, cfg.run.staleness, cfg.run.stale_samples == "reweight"))
    stats.update(idle_stats(**window))
    stats.update(producer.flight_stats())
    stats.update(throughput_stats(cols, episode_cols, engine))
    # rollout/prefix_cache_hit_rate: of the requests the engine ran since the last take (the producer runs ahead, so
    # not this batch's own; none where it ran none)
    counts, producer.counts = producer.counts, prompt_counts(engine)
    if counts is not None:
        stats.update(prefix_cache_stats(counts, producer.counts))
    return RolloutOutput(batch, stats)

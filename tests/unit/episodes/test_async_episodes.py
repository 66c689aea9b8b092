"""Multi-turn episodes in an asynchronous run (``run.max_staleness`` k ≥ 2 with ``rollout.environment``): the engine
service's producer samples a draw's prompts a unit at a time as whole episodes, each at its own pace within the
unit (the streaming engine of test_episode_pace), ahead of the trainer by at most k versions. Every batch taken is
the synchronous rollout's batch of the same draw (the same episodes, seeded by their position in the whole draw),
its episode columns and ``episode/*`` metrics merged across units, every token tagged with the version that was
served while its unit ran, none more than k behind."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from models.config.checks import ConfigError
from models.config.io import load_config
from models.data.batch import RolloutBatch
from models.data.prompts import PromptDataset
from models.engines.base import EngineStats, SamplingSpec
from models.environments.episode_rollout import UnitEpisodes, episode_stats, sample_episodes
from models.environments.episodes import EpisodeLimits, run_episodes
from models.environments.tools import HermesParser
from models.hosts.async_batch import take_rollout
from models.hosts.producer import UNIT_PROMPTS, EngineTurns, Producer
from models.run.types import RunHandle
from models.stages.rollout import Draw, prompt_counts
from tests.unit.hosts.pushes import take_ahead
from tests.unit.episodes.test_episode_pace import StreamingEngine, TalkEnv, tok  # noqa: F401 (tok: a fixture)

K, PER_DRAW, N = 2, 6, 2  # 6 prompts: units of 4 and 2, the second seeded from position 4
LIMITS = EpisodeLimits(max_turns=4, max_episode_tokens=200, pace="auto")  # auto: per episode on a streaming engine


class ServiceEngine(StreamingEngine):
    """The streaming engine with the counters an engine service's engine keeps (what ``take_rollout`` reads): each
    request counts 4 prompt tokens, 1 of them from its prefix cache."""

    def __init__(self, tok):
        super().__init__(tok)
        self.stats = EngineStats()

    def stream_samples(self, prompts, spec, first_index):
        self.stats.prompt_tokens += 4 * len(prompts)
        self.stats.cached_prompt_tokens += len(prompts)
        return super().stream_samples(prompts, spec, first_index)


def draw(j: int) -> Draw:
    """Prompts whose environments last 1-3 turns, so the units' episodes end at different turns."""
    prompts = [f"Say {w} ({j})." for w in ("hi", "yes", "no", "so", "ok", "go")]
    data = PromptDataset(prompts, np.arange(PER_DRAW, dtype=np.int64), {"turns": [1 + (p + j) % 3 for p in
                                                                                   range(PER_DRAW)]})
    ids = np.arange(j * PER_DRAW, (j + 1) * PER_DRAW, dtype=np.int64)
    return Draw(j, data, ids, SamplingSpec(n=N, temperature=1.0, max_new_tokens=12, seed=100 + j))


def episodes_of(tok, d: Draw, start: int, end: int, engine=None):
    """What the engine service samples for prompts ``start`` … ``end − 1`` of ``d`` (``sample_data`` with an
    environment, its environment a :class:`TalkEnv`)."""
    part = d.data.take(range(start, end))
    rows = [{"prompt": p, **c} for p, c in zip(part.prompts, part.row_columns())]
    return sample_episodes(engine or StreamingEngine(tok), tok, TalkEnv, rows, d.prompt_ids[start:end], d.spec,
                           LIMITS, HermesParser(), first_index=start)


@pytest.mark.parametrize("streamed", [False, True])
def test_episodes_sampled_ahead_are_the_synchronous_batch_at_the_versions_they_name(tok, tmp_path, streamed):
    """A unit at a time (``episodes`` a function: an engine that does not stream), or the units' episodes in one
    step loop (``UnitEpisodes`` on a streaming engine: :class:`EpisodeStreamer`), where the units' episodes overlap:
    more requests in the engine at once than one unit has episodes."""
    iterations = K + 3
    cfg = load_config("configs/tiny_grpo.yaml", ["run.resident=true", f"run.max_staleness={K}", "actor.tis_cap=2"])
    run = RunHandle(str(tmp_path), "async", "", "", "", "")
    engine, turns, served = ServiceEngine(tok), EngineTurns(), {"version": 0}
    episodes = UnitEpisodes(tok, TalkEnv, LIMITS, HermesParser()) if streamed else \
        (lambda e, d, start, end: episodes_of(tok, d, start, end, e))
    producer = Producer(K, 0, iterations, lambda: (engine, served["version"]), draw, tok, turns,
                        episodes=episodes, counts=prompt_counts(engine))  # as the engine service starts it
    taken, outs = take_ahead(producer, lambda i: take_rollout(cfg, run, producer, i, engine), turns, served,
                             iterations, K)

    lags = []
    for i, ((units, _), out) in enumerate(zip(taken, outs)):
        assert [(u.start, u.end) for u in units] == [(0, UNIT_PROMPTS), (UNIT_PROMPTS, PER_DRAW)]
        table = RolloutBatch.read(run.layout.batch_url(i, "rollouts")).table
        assert table.column("prompt_id").to_pylist() == np.repeat(draw(i).prompt_ids, N).tolist()
        # the whole draw's episodes in one synchronous call (one engine, first_index 0) are the batch's
        whole, columns, stats = episodes_of(tok, draw(i), 0, PER_DRAW)
        assert table.column("response_tokens").to_pylist() == whole.response_tokens
        assert table.column("loss_mask").to_pylist() == columns["loss_mask"]
        assert table.column("episode_reward").to_pylist() == columns["episode_reward"].tolist()
        assert table.column("episode").to_pylist() == columns["episode"]
        assert sorted(set(columns["episode_reward"].tolist())) == [1.0, 2.0, 3.0]  # 1-3 turns, a reward each
        assert {k: out.stats[k] for k in stats} == pytest.approx(stats)
        # the requests the engine ran since the batch before was taken: each hits 1 of its 4 prompt tokens. The first
        # take follows draws 0..k; none follows the last draw's (done before the take ahead of it). Between, the
        # producer's draw i + k - 1 races the take before it (it may finish before that take's count): 0.25 or none.
        rate = out.stats.get("rollout/prefix_cache_hit_rate")
        assert rate == 0.25 if i == 0 else rate is None if i == iterations - 1 else rate in (0.25, None), (i, rate)
        versions = table.column("token_versions").to_pylist()
        assert versions == [[u.version] * len(r) for u in units for r in u.columns.response_tokens]
        lags.append(max(i - v for vs in versions for v in vs))
    assert lags == [min(i, K) for i in range(iterations)]  # draws 0..k by version 0, then draw j by version j - k
    assert (max(engine.in_flight) > UNIT_PROMPTS * N) == streamed, max(engine.in_flight)


def test_the_first_index_seeds_a_part_as_the_whole(tok):
    """Per episode and in lockstep, episodes 4.. of a draw sampled alone from position 4 are those of the whole."""
    d = draw(0)
    rows = [{"prompt": p, **c} for p, c in zip(d.data.prompts, d.data.row_columns())]
    for pace in ("episode", "lockstep"):
        limits = EpisodeLimits(max_turns=1, max_episode_tokens=200, pace=pace)  # one turn: lockstep's positions hold
        with ThreadPoolExecutor(2) as pool:
            whole = run_episodes(StreamingEngine(tok), tok, [TalkEnv(r) for r in rows], d.spec, limits,
                                 HermesParser(), pool)
            part = run_episodes(StreamingEngine(tok), tok, [TalkEnv(r) for r in rows[4:]], d.spec, limits,
                                HermesParser(), pool, first_index=4)
        assert [ep.response_ids for ep in part] == [ep.response_ids for ep in whole[4:]], pace
        assert [ep.response_ids for ep in part] != [ep.response_ids for ep in whole[:2]], pace
    assert episode_stats(whole)["episode/turns_mean"] == 1.0


def test_the_config_takes_episodes_with_asynchronous_training_but_not_partial_rollouts():
    base = ["rollout.environment=models.demos.tool_tasks:ArithmeticEnv", "run.resident=true", "run.max_staleness=2",
            "actor.tis_cap=2"]
    assert load_config("configs/tiny_grpo.yaml", base).run.staleness == 2
    with pytest.raises(ConfigError, match="rollout.environment and run.partial_rollouts: an episode is sampled whole"):
        load_config("configs/tiny_grpo.yaml", base + ["run.partial_rollouts=true"])

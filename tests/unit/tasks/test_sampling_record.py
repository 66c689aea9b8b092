"""What a rollout records of how it sampled: the batch's metadata (checked by ``score``), the gap
metrics, and the demo's progress line showing the sampler-vs-trainer gap of the iteration."""

import json

import numpy as np
import pytest

from models.engines import SamplingSpec
from models.data.batch import BatchMetadata, RolloutBatch
from models.config import TrainConfig
from models.config.io import load_config
from models.stages.progress import progress_line
from models.stages.rollout import SAMPLING_KEY, sampling_record
from models.stages.score_metrics import check_sampling_temperature, logprob_gap

BASE = {"rollout/reward_mean": 0.5, "rollout/init_policy_kl": 0.01, "rollout/response_length_mean": 4.0,
        "actor/loss": 0.1, "actor/clip_frac": 0.0}


def test_the_batch_gap_is_shown_else_the_probe_gap():
    cfg = TrainConfig()
    both = progress_line(cfg, 0, {**BASE, "rollout/logprob_gap_max": 4.8e-7, "rollout/probe_gap_max": 2e-6})
    assert "gap 4.8e-07  (" in both and "probe gap" not in both  # π_old recomputed: the whole batch's gap
    assert "probe gap 2.0e-06  (" in progress_line(cfg, 0, {**BASE, "rollout/probe_gap_max": 2e-6})  # sampler π_old
    assert "gap" not in progress_line(cfg, 0, BASE)
    # sampled by an older actor: the batch's gap is the policy's shift since; the probe's is the engine's numerics
    for lag in ({"rollout/policy_lag": 1.0}, {"async/staleness_p100": 2.0, "async/staleness_p50": 1.0}):
        line = progress_line(cfg, 0, {**BASE, **lag, "rollout/logprob_gap_max": 3.1, "rollout/probe_gap_max": 2e-6})
        assert "shift 3.1e+00  probe gap 2.0e-06  " in line and " gap 3.1" not in line, line


def _batch(extras) -> RolloutBatch:
    return RolloutBatch.from_columns(
        BatchMetadata(iteration=0, policy_version=0, algorithm="grpo", extras=extras),
        prompt_id=[0, 0], prompt_tokens=[[1, 2], [1, 2]], response_tokens=[[3, 4], [5]],
        sampler_logprobs=[[-0.5, -1.0], [-2.0]], is_end=[True, False], prompt=["p", "p"], response=["a", "b"])


def test_the_batch_records_the_sampling_and_score_refuses_another_temperature():
    cfg = load_config("tiny_grpo", ["rollout.top_k=20", "rollout.top_p=0.9"])
    spec = SamplingSpec(n=4, temperature=1.0, top_p=0.9, top_k=20, seed=7, stop_token_ids=(2, 5))
    record = json.loads(sampling_record(cfg, spec))
    assert record == {"engine": "vllm (float32)", "temperature": 1.0, "top_p": 0.9, "top_k": 20, "seed": 7,
                      "max_new_tokens": 16, "stop_token_ids": [2, 5], "stop_strings": []}
    batch = _batch({SAMPLING_KEY: sampling_record(cfg, spec)})
    check_sampling_temperature(batch, 1.0)
    with pytest.raises(ValueError, match="was sampled at temperature 1.0 but is scored at rollout.temperature=0.7"):
        check_sampling_temperature(batch, 0.7)
    check_sampling_temperature(_batch({}), 0.7)  # a batch without the record (written before it existed)


def test_the_gap_is_over_every_response_token():
    gap = logprob_gap(_batch({}), np.array([-0.5, -0.75, -2.5], np.float32))
    assert gap == {"rollout/logprob_gap_max": 0.5, "rollout/logprob_gap_mean": pytest.approx(0.75 / 3)}


def test_an_update_without_a_step_says_so():
    """Every advantage 0 (GRPO when every sample scored the same): the actor takes no step, and the line
    says that rather than a loss of nan."""
    line = progress_line(TrainConfig(), 0, {k: v for k, v in BASE.items() if not k.startswith("actor/")} |
                         {"actor/steps": 0.0})
    assert "actor: no step" in line and "nan" not in line
    assert "actor_loss +0.100  clip 0.00" in progress_line(TrainConfig(), 0, {**BASE, "actor/steps": 4.0})


def test_skipped_steps_show_on_the_progress_line():
    line = progress_line(TrainConfig(), 0, {**BASE, "actor/steps": 1.0, "actor/skipped_steps": 7.0})
    assert "actor_loss +0.100  clip 0.00  7 skipped  (" in line
    assert "skipped" not in progress_line(TrainConfig(), 0, {**BASE, "actor/steps": 4.0, "actor/skipped_steps": 0.0})


def test_asynchronous_training_shows_its_lag_drops_and_idle_time():
    """``run.max_staleness`` ≥ 2: the batch's lag, drops, partial share and who waited, from the ``async/*`` metrics
    (:mod:`models.stages.async_metrics`); nothing of it in a synchronous run's line."""
    line = progress_line(TrainConfig(), 0, {**BASE, "async/staleness_p50": 1.0, "async/staleness_p100": 2.0,
                                            "async/dropped_samples": 4.0, "async/partial_fraction": 0.25,
                                            "async/engine_idle_fraction": 0.05, "async/trainer_idle_fraction": 0.2})
    assert "lag p50 1 max 2  dropped 4  partial 0.25  idle engine 5% trainer 20%  (" in line
    kept = progress_line(TrainConfig(), 0, {**BASE, "async/staleness_p50": 1.0, "async/staleness_p100": 3.0,
                                            "async/reweighted_samples": 8.0})  # run.stale_samples=reweight
    assert "lag p50 1 max 3  dropped 0  reweighted 8  partial 0.00  idle" in kept and "reweighted" not in line
    assert "lag" not in progress_line(TrainConfig(), 0, BASE)


def test_the_prefix_cache_hit_rate_is_the_rollouts_share_of_cached_prompt_tokens():
    """Between two counts of the engine: 100 of 200 prompt tokens served from the cache is 0.5; an engine that counts
    nothing (the HF engine), counted no prompt, or restarted in between (new counts) gives no metric."""
    from models.engines.base import EngineStats
    from models.stages.rollout import prefix_cache_stats, prompt_counts

    engine = type("Engine", (), {"stats": EngineStats(prompt_tokens=100, cached_prompt_tokens=20)})()
    before = prompt_counts(engine)
    engine.stats.prompt_tokens, engine.stats.cached_prompt_tokens = 300, 120
    assert prefix_cache_stats(before, prompt_counts(engine)) == {"rollout/prefix_cache_hit_rate": 0.5}
    assert prefix_cache_stats(before, before) == {}
    restarted = type("Engine", (), {"stats": EngineStats(prompt_tokens=400, cached_prompt_tokens=0)})()
    assert prefix_cache_stats(before, prompt_counts(restarted)) == {}
    assert prompt_counts(object())[1:] == (0, 0)

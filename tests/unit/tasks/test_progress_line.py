"""The demo's progress line shows the sampler-vs-trainer log-prob gap of the iteration."""

from tasks.config import TrainConfig
from tasks.iteration import progress_line

BASE = {"rollout/reward_mean": 0.5, "rollout/init_policy_kl": 0.01, "rollout/response_length_mean": 4.0,
        "actor/loss": 0.1, "actor/clip_frac": 0.0}


def test_the_batch_gap_is_shown_else_the_probe_gap():
    cfg = TrainConfig()
    both = progress_line(cfg, 0, {**BASE, "rollout/logprob_gap_max": 4.8e-7, "rollout/probe_gap_max": 2e-6})
    assert "gap 4.8e-07  (" in both and "probe gap" not in both  # π_old recomputed: the whole batch's gap
    assert "probe gap 2.0e-06  (" in progress_line(cfg, 0, {**BASE, "rollout/probe_gap_max": 2e-6})  # sampler π_old
    assert "gap" not in progress_line(cfg, 0, BASE)

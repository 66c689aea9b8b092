"""benchmarks/bench_long_run.py without its runs: the progress lines it reads and the slope it fits."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from benchmarks import bench_long_run as bench  # noqa: E402
from models.stages.progress import progress_line  # noqa: E402
from models.config.io import load_config  # noqa: E402


def test_it_reads_what_a_commit_prints():
    cfg = load_config("configs/tiny_grpo.yaml", ["run.num_iterations=500"])
    phases = {"time/rollout_s": 1.0, "time/score_s": 0.5, "time/advantages_s": 0.1, "time/actor_update_s": 0.9}
    lines = [progress_line(cfg, 0, {"rollout/reward_mean": 0.5, **phases}),  # the first: no wall time
             "a line of something else",
             progress_line(cfg, 1, {"rollout/reward_mean": 0.5, "time/iteration_s": 3.25, **phases}),
             progress_line(cfg, 41, {"rollout/reward_mean": 0.5, "time/iteration_s": 2.75, **phases})]
    assert bench.parse_progress("\n".join(lines)) == [(1, 3.2, 2.5), (41, 2.8, 2.5)]  # as printed: one decimal


def test_the_slope_is_least_squares():
    assert bench.slope([0, 1, 2, 3], [1.0, 1.5, 2.0, 2.5]) == pytest.approx(0.5)
    assert bench.slope([10, 20, 30], [2.0, 2.0, 2.0]) == 0.0

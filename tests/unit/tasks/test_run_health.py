"""A run whose optimiser steps were mostly skipped registers no policy: ``run_finish`` (the body of the
``finish_run`` task every training workflow ends with) refuses it, naming the counts and the bound,
before anything is logged or registered (models/run/health.py)."""

from __future__ import annotations

import pytest

from models import tracking
from models.config import TrainConfig
from models.stages.finish import run_finish
from models.run.health import UnhealthyRun, check_healthy
from models.run.types import PolicyState, RunHandle
from tests.stages import with_overrides


def logged_run(tmp_path, monkeypatch, per_iteration):
    """An MLflow run whose iterations logged ``(actor/steps, actor/skipped_steps)``."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    run_id = tracking.start_run("health", "r", {}, {})
    for i, (steps, skipped) in enumerate(per_iteration):
        tracking.log_metrics(run_id, {"actor/steps": steps, "actor/skipped_steps": skipped}, step=i)
    return run_id


def test_a_run_with_most_steps_skipped_is_not_registered(tmp_path, monkeypatch):
    """actor.lr=10 on the tiny GRPO task: 7 of 8 steps skipped in the first iteration, had the update let
    it pass (its own check fails it first, tests/unit/models/test_update_guard.py)."""
    run_id = logged_run(tmp_path, monkeypatch, [(1, 7), (4, 0)])
    cfg = with_overrides(TrainConfig(), "run.registered_model_name=health")
    run = RunHandle(str(tmp_path / "runs"), "r", run_id, "ref", "train", "eval")
    with pytest.raises(UnhealthyRun, match=r"^7 of the run's 12 actor optimiser steps were skipped .* more than "
                                           r"actor.guard.max_skipped_fraction=0.5: the run did not end healthy and "
                                           r"its final policy is not registered"):
        run_finish(cfg, run, PolicyState(2, str(tmp_path / "runs" / "r" / "iter-000001" / "actor")))
    c = tracking.client()
    assert c.search_registered_models() == [] and c.get_run(run_id).info.status == "RUNNING"


def test_half_skipped_is_healthy_and_the_bound_is_the_config_s(tmp_path, monkeypatch):
    run_id = logged_run(tmp_path, monkeypatch, [(2, 2), (4, 0)])
    check_healthy(TrainConfig(), run_id)  # 2 of 8
    with pytest.raises(UnhealthyRun, match="actor.guard.max_skipped_fraction=0.2:"):
        check_healthy(with_overrides(TrainConfig(), "actor.guard.max_skipped_fraction=0.2"), run_id)


def test_the_critic_is_judged_from_what_its_update_logs(tmp_path, monkeypatch):
    """The critic's share comes from ``critic_stats`` (what ``commit_iteration`` logs of its update)."""
    from models.stages.critic import critic_stats

    run_id = logged_run(tmp_path, monkeypatch, [(4, 0)])
    update = {"loss": 1.0, "explained_variance": 0.0, "grad_norm": 1.0, "value_clip_frac": 0.0, "steps": 1.0,
              "nonfinite_steps": 3.0, "skipped_steps": 3.0}
    tracking.log_metrics(run_id, critic_stats(update), step=0)
    with pytest.raises(UnhealthyRun, match=r"^3 of the run's 4 critic optimiser steps were skipped .* "
                                           r"critic.guard.max_skipped_fraction=0.5:"):
        check_healthy(TrainConfig(), run_id)


def test_a_critic_server_that_logs_no_steps_is_not_judged(tmp_path, monkeypatch):
    from models.stages.critic import critic_stats

    run_id = logged_run(tmp_path, monkeypatch, [(4, 0)])
    old_server = {"loss": 1.0, "explained_variance": 0.0, "grad_norm": 1.0, "value_clip_frac": 0.0,
                  "nonfinite_steps": 1.0}
    assert "critic/steps" not in critic_stats(old_server)
    tracking.log_metrics(run_id, critic_stats(old_server), step=0)
    check_healthy(TrainConfig(), run_id)

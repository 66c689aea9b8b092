"""MLflow records a NaN or infinite metric as such (the value, a ``nonfinite/<key>`` flag metric and a
``nonfinite.<key>`` tag), never by leaving the step out."""

from __future__ import annotations

import math

from models import tracking


def test_nonfinite_metrics_are_logged_flagged_and_tagged_once(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    run_id = tracking.start_run("nonfinite", "r", {}, {})
    metrics = {"actor/loss": math.nan, "critic/loss": math.inf, "rollout/reward_mean": 0.5}
    assert tracking.log_metrics(run_id, metrics, step=3) == 5  # three values, two flags
    assert tracking.log_metrics(run_id, metrics, step=3) == 0  # a retried commit adds nothing
    loss = tracking.metric_history(run_id, "actor/loss")
    assert [s for s, _ in loss] == [3] and math.isnan(loss[0][1])
    assert tracking.metric_history(run_id, "critic/loss")[0][1] > 1e308  # MLflow's stand-in for inf
    assert tracking.metric_history(run_id, "nonfinite/actor/loss") == [(3, 1.0)]
    assert tracking.metric_history(run_id, "nonfinite/critic/loss") == [(3, 1.0)]
    assert tracking.metric_history(run_id, "nonfinite/rollout/reward_mean") == []
    tags = tracking.client().get_run(run_id).data.tags
    assert tags["nonfinite.actor/loss"] == "nan at step 3" and tags["nonfinite.critic/loss"] == "inf at step 3"
    assert "nonfinite.rollout/reward_mean" not in tags

"""Figure labels of models/tracking/report.py: one curve per run or per metric."""

from __future__ import annotations

import models.tracking.report as report


def test_metric_curves_label_by_run_or_by_key(monkeypatch):
    def fake(run_ids, key):
        return {f"name-{r}": [(0, float(len(key)))] for r in run_ids}

    monkeypatch.setattr(report, "reward_curves", fake)
    assert report.metric_curves(["a", "b"], ["k"]) == {"name-a": [(0, 1.0)], "name-b": [(0, 1.0)]}
    assert report.metric_curves(["a"], ["k", "kk"]) == {"k": [(0, 1.0)], "kk": [(0, 2.0)]}
    assert set(report.metric_curves(["a", "b"], ["k", "kk"])) == {"name-a: k", "name-b: k", "name-a: kk", "name-b: kk"}

"""benchmarks/bench_pipeline.py without the harness runs: the rows it writes for one case are what run_all
reads back (hand-worked from the demo's figures in benchmarks/RESULTS.md), and --cases names a known case."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from benchmarks import bench_pipeline  # noqa: E402
from benchmarks.rows import Row, write_rows  # noqa: E402


def test_case_rows_are_a_time_ratio_and_a_reward_difference(tmp_path):
    out = bench_pipeline.case_rows("demo", on=(352.0, 0.860), off=(134.0, 0.896), iterations=3)
    path = tmp_path / "rows.json"
    write_rows(str(path), out)
    ratio, reward = [Row(**r) for r in json.loads(path.read_text())]  # as run_all reads them
    assert ratio.section == reward.section == "pipeline"
    assert (ratio.unit, round(ratio.value, 4)) == ("x", 0.3807)  # 134 / 352
    assert ratio.detail == "134 vs 352 s per iteration, 3 iterations"
    assert reward.figure == "demo: eval reward after 3 iterations, off − on" and reward.value == pytest.approx(0.036)
    assert reward.detail == "on-policy 0.860, off-policy 0.896 (same samples)"
    assert ratio.ok is None and reward.ok is None  # no target: measured, not judged


def test_cases_must_be_known(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_pipeline.py", "--cases", "demo,huge"])
    with pytest.raises(SystemExit):
        bench_pipeline.main()
    assert "--cases: unknown ['huge']; known: ['compute-bound', 'demo']" in capsys.readouterr().err

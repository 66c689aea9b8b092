"""benchmarks/bench_real_shape.py's verdict: a side that did not finish, or a ratio to TRL over 1.0x, makes the
script exit 1 (it printed its table and exited 0 when a side failed before); hand-made measurements, no runs."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_real_shape import Measured, rows_for  # noqa: E402
from benchmarks.rows import exit_status  # noqa: E402


def measured(name: str, peak: float, seconds: float, error: str = "") -> Measured:
    """Three iterations ``seconds`` apart after a 100 s first one, a peak of ``peak`` GiB."""
    return Measured(name, start=0.0, ends=[100.0 + i * seconds for i in range(3)], peak_gib=peak, pss_gib=peak,
                    error=error)


def test_a_run_under_trls_figures_passes_and_one_over_them_or_failed_does_not():
    trl = measured("trl", peak=17.0, seconds=90.0)
    under = {"trl": trl, "colocated": measured("colocated", peak=16.0, seconds=85.0)}
    rows = rows_for(under, layers=28)
    ratios = {r.figure.split(",")[0]: r.value for r in rows if r.unit == "x"}
    assert abs(ratios["s/iteration ours / TRL"] - 85 / 90) < 1e-12
    assert abs(ratios["peak RSS ours / TRL"] - 16 / 17) < 1e-12
    assert exit_status(rows) == 0
    slower = {"trl": trl, "separate": measured("separate", peak=16.0, seconds=99.0)}
    assert exit_status(rows_for(slower, layers=28)) == 1
    failed = {"stateless": measured("stateless", peak=3.0, seconds=0.0, error="exit -9: Killed")}
    failed["stateless"].ends = []
    rows = rows_for(failed, layers=28)
    assert [r.ok for r in rows if r.figure.endswith(" ran")] == [False] and exit_status(rows) == 1

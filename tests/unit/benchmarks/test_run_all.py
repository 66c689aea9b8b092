"""benchmarks/run_all.py: rows of each script into one table; a missing script is a "not present"
row, a failing one a FAILED row with its error, and either way the others still run; exit 1
when a figure misses its target or a script failed. The scripts here are small real ones
written to a temporary folder."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from benchmarks import run_all  # noqa: E402
from benchmarks.rows import Row, row  # noqa: E402


def script(path: Path, body: str) -> Path:
    path.write_text(textwrap.dedent(body))
    return path


@pytest.fixture
def benches(tmp_path, monkeypatch):
    """Three benchmark scripts: one writes rows (threads and quick echoed), one fails, one is absent."""
    script(tmp_path / "bench_good.py", """
        import argparse, json, os
        p = argparse.ArgumentParser(); p.add_argument("--json"); p.add_argument("--quick", action="store_true")
        a = p.parse_args()
        rows = [{"section": "good", "figure": "threads", "value": float(os.environ["OMP_NUM_THREADS"]), "unit": "",
                 "target": None, "ok": None, "detail": f"quick={a.quick}"},
                {"section": "good", "figure": "speed-up", "value": 25.0, "unit": "x", "target": ">= 20",
                 "ok": True, "detail": "a 1 s, b 25 s"}]
        json.dump(rows, open(a.json, "w"))
        """)
    script(tmp_path / "bench_bad.py", "raise SystemExit('engine exploded: no weights')\n")
    monkeypatch.setattr(run_all, "HERE", tmp_path)
    monkeypatch.setattr(run_all, "BENCHMARKS", {"good": "bench_good.py", "bad": "bench_bad.py",
                                                "later": "bench_later.py"})
    return tmp_path


@pytest.mark.integration  # runs the scripts as processes
def test_one_table_from_every_script_and_exit_1_on_a_failure(benches, tmp_path, capsys):
    out_json = tmp_path / "all.json"
    rc = run_all.main(["--quick", "--threads", "3", "--logs", str(tmp_path / "logs"), "--json", str(out_json)])
    table = capsys.readouterr().out
    print(table)
    assert rc == 1  # bench_bad failed
    assert "3 thread(s) in every benchmark" in table and "mode: quick" in table
    rows = {(r["section"], r["figure"]): r for r in json.loads(out_json.read_text())["rows"]}
    assert rows["good", "threads"]["value"] == 3.0 and rows["good", "threads"]["detail"] == "quick=True"
    bad = rows["bad", "bench_bad.py runs"]
    assert bad["ok"] is False and "engine exploded: no weights" in bad["detail"]
    assert rows["later", "bench_later.py"]["detail"] == "not present (not written yet)"
    assert rows["later", "bench_later.py"]["ok"] is None
    lines = table.splitlines()
    assert any(line.startswith("good") and "25" in line and ">= 20" in line and " ok " in line for line in lines)
    assert any(line.startswith("bad") and "FAILED" in line for line in lines)


@pytest.mark.integration  # runs the scripts as processes
def test_only_runs_the_named_sections_and_passes_when_targets_are_met(benches, tmp_path, capsys):
    assert run_all.main(["--only", "good,later", "--logs", str(tmp_path / "logs")]) == 0
    table = capsys.readouterr().out
    assert "quick=False" in table and "bench_bad" not in table
    with pytest.raises(SystemExit):
        run_all.main(["--only", "nonsense"])
    assert "unknown section(s) ['nonsense']" in capsys.readouterr().err


@pytest.mark.integration  # runs the scripts as processes
def test_quick_leaves_out_the_slow_sections_unless_named(benches, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(run_all, "NOT_QUICK", {"good": "slow"})
    run_all.main(["--quick", "--logs", str(tmp_path / "logs"), "--only", "later"])
    run_all.main(["--quick", "--logs", str(tmp_path / "logs")])
    table = capsys.readouterr().out
    assert "left out with --quick (slow): make bench, or --only good" in table and "quick=True" not in table
    run_all.main(["--quick", "--logs", str(tmp_path / "logs"), "--only", "good"])
    assert "quick=True" in capsys.readouterr().out


def test_rows_carry_targets_and_verdicts():
    assert row("s", "f", 25.0, "x", at_least=20) == Row("s", "f", 25.0, "x", ">= 20", True, "")
    assert row("s", "f", 0.5, "GB/s", at_least=1).ok is False
    assert row("s", "f", 2e-5, "nats", at_most=1e-4).target == "<= 0.0001"
    assert row("s", "f", None, "x", at_least=20).ok is False  # not measured: not met
    assert row("s", "f", 3.0, "x").target is None and row("s", "f", 3.0, "x").ok is None


def test_slow_sections_get_their_longer_limit(benches, tmp_path, monkeypatch):
    """``make bench`` runs the pipeline's four harness runs (over an hour on a loaded 2-core machine): the default
    hour would end it as a FAILED row, so such a section gets at least its MIN_TIMEOUT_S."""
    limits = {}
    monkeypatch.setattr(run_all, "MIN_TIMEOUT_S", {"good": 7200.0})
    monkeypatch.setattr(run_all, "run_one", lambda section, *a: limits.setdefault(section, a[-1]) and [])
    run_all.main(["--logs", str(tmp_path / "logs"), "--only", "good,bad"])
    assert limits == {"good": 7200.0, "bad": 3600}
    limits.clear()
    run_all.main(["--logs", str(tmp_path / "logs"), "--only", "good,bad", "--timeout-s", "9000"])
    assert limits == {"good": 9000.0, "bad": 9000.0}

"""The suite's time report (tests/timing.py): the 25 slowest tests by setup + call + teardown, the files they
add up to, and every test's seconds in a file, slowest first."""

from __future__ import annotations

from types import SimpleNamespace

from tests.timing import SLOWEST, SuiteTiming


def _timing() -> SuiteTiming:
    t = SuiteTiming()
    for i in range(30):  # test i takes i + 1 s over its three phases
        for phase in ("setup", "call", "teardown"):
            t.pytest_runtest_logreport(SimpleNamespace(nodeid=f"tests/f{i % 3}.py::t{i}", duration=(i + 1) / 3))
    return t


def test_the_report_names_the_25_slowest_tests_and_their_files(monkeypatch):
    monkeypatch.delenv("RLHF_TEST_STARTED", raising=False)
    lines = _timing().lines()
    assert SLOWEST == 25 and lines[0].startswith("25 slowest tests")
    slowest = lines[1:26]
    assert [s.split()[-1] for s in slowest] == [f"tests/f{i % 3}.py::t{i}" for i in range(29, 4, -1)]
    assert slowest[0].split()[0] == "30.0" and slowest[-1].split()[0] == "6.0"
    # files: f2 holds tests 2, 5, ..., 29 (3 + 6 + ... + 30 = 165 s), f1 155 s, f0 145 s
    files = lines[lines.index("12 slowest files:") + 1:][:3]
    assert [(f.split()[0], f.split()[-1]) for f in files] == [("165.0", "tests/f2.py"), ("155.0", "tests/f1.py"),
                                                              ("145.0", "tests/f0.py")]
    assert lines[-1].startswith("suite: 30 tests, 465 s in tests")


def test_every_tests_seconds_are_written_slowest_first(tmp_path):
    path = tmp_path / "times" / "t.tsv"
    _timing().write_times(str(path))
    rows = [line.split("\t") for line in path.read_text().splitlines()]
    assert len(rows) == 30 and rows[0] == ["30.00", "tests/f2.py::t29"] and rows[-1] == ["1.00", "tests/f0.py::t0"]

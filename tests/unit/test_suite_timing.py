"""The suite's time report (tests/timing.py): the 25 slowest tests by setup + call + teardown, the files they
add up to, and every test's seconds in a file, slowest first."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

from tests.timing import CPU_KEY, SLOWEST, SuiteTiming, machine_probe


def _timing() -> SuiteTiming:
    t = SuiteTiming()
    for i in range(30):  # test i takes i + 1 s over its three phases
        for phase in ("setup", "call", "teardown"):
            t.pytest_runtest_logreport(SimpleNamespace(nodeid=f"tests/f{i % 3}.py::t{i}", duration=(i + 1) / 3,
                                                       user_properties=[(CPU_KEY, (i + 1) / 6)]))
    return t


def test_the_report_names_the_25_slowest_tests_and_their_files(monkeypatch):
    monkeypatch.delenv("RLHF_TEST_STARTED", raising=False)
    lines = _timing().lines()
    assert SLOWEST == 25 and lines[0].startswith("25 slowest tests")
    slowest = lines[1:26]
    assert [s.split()[-1] for s in slowest] == [f"tests/f{i % 3}.py::t{i}" for i in range(29, 4, -1)]
    assert slowest[0].split()[:4] == ["30.0", "s", "15.0", "cpu"] and slowest[-1].split()[0] == "6.0"
    # files: f2 holds tests 2, 5, ..., 29 (3 + 6 + ... + 30 = 165 s), f1 155 s, f0 145 s
    files = lines[lines.index("12 slowest files:") + 1:][:3]
    assert [(f.split()[0], f.split()[-1]) for f in files] == [("165.0", "tests/f2.py"), ("155.0", "tests/f1.py"),
                                                              ("145.0", "tests/f0.py")]
    assert files[0].split()[2] == "82.5"  # f2's CPU: half its seconds
    assert lines[-1].startswith("suite: 30 tests, 465 s in tests, 232 s of CPU in tests")


def test_every_tests_seconds_are_written_slowest_first(tmp_path):
    path = tmp_path / "times" / "t.tsv"
    _timing().write_times(str(path))
    rows = [line.split("\t") for line in path.read_text().splitlines()]
    assert len(rows) == 30 and rows[0] == ["30.00", "15.00", "tests/f2.py::t29"]
    assert rows[-1] == ["1.00", "0.50", "tests/f0.py::t0"]


def _phase(t: SuiteTiming, item, when: str) -> float:
    """Drive the plugin's makereport wrapper as pytest does for one phase; the CPU it put into the report."""
    report = SimpleNamespace(user_properties=[])
    wrapper = t.pytest_runtest_makereport(item, SimpleNamespace(when=when))
    next(wrapper)
    try:
        wrapper.send(SimpleNamespace(get_result=lambda: report))
    except StopIteration:
        pass
    [(key, cpu)] = report.user_properties
    assert key == CPU_KEY
    return cpu


def test_a_tests_cpu_counts_the_children_it_waited_for():
    """The CPU a child process spent (its own count, printed by it) is in the phase that waited for it."""
    t, item = SuiteTiming(), SimpleNamespace()
    t.pytest_runtest_protocol(item, None)
    assert _phase(t, item, "setup") < 0.2
    child = subprocess.run([sys.executable, "-c", "import time\nwhile time.process_time() < 1.0: pass\n"
                            "print(time.process_time())"], capture_output=True, text=True, check=True)
    call = _phase(t, item, "call")
    assert float(child.stdout) <= call < float(child.stdout) + 0.5  # the child's CPU and the interpreter's start
    assert _phase(t, item, "teardown") < 0.2


def test_the_machine_probe_is_printed_beside_the_figures(monkeypatch):
    """The probe's seconds grow with its work (the same loop, twice as long) and reach the report."""
    monkeypatch.delenv("RLHF_TEST_STARTED", raising=False)
    short, long = machine_probe(1_000_000), machine_probe(4_000_000)
    assert 0 < short < long
    t = _timing()
    t.probes = [0.7, 0.75]
    assert t.lines()[-1].startswith("machine: 10M Python additions in 0.70 and 0.75 s of CPU (start, end;")
    assert not [line for line in _timing().lines() if line.startswith("machine:")]  # no probe, no line

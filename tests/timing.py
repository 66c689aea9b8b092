"""What the suite costs, printed at its end (docs/development.md#the-test-budget): the total wall time,
the 25 slowest tests (setup + call + teardown, so a session fixture's cost shows on the first test that
asks for it) and the slowest files, each with its CPU; every test's seconds and CPU also go to
``RLHF_TEST_TIMES`` (default ``.cache/test-times.tsv``, slowest first) for comparing two runs. Measurements only:
nothing here fails a test."""

from __future__ import annotations

import collections
import os
import resource
import time

import pytest

SLOWEST = 25
FILES = 12
BUDGET_S = 1800
"""`make test` from a fresh clone on the 2-core machine, install included: the budget..."""
TARGET_S = 1620
"""...and what the suite is held to, leaving 3 minutes of margin for new tests and CI's variance."""
TIMES_ENV, TIMES_DEFAULT = "RLHF_TEST_TIMES", os.path.join(".cache", "test-times.tsv")
CPU_KEY = "cpu_s"
"""The ``user_properties`` entry of a phase's report: the CPU seconds (user + system) the test's process and its
children spent in that phase. Children count once they have been waited for (a ``pyflyte run``, its elastic
workers and engine processes, a server a fixture stopped); a process the test left running counts where it is
reaped. On two cores the suite is CPU-bound, so a test's CPU, not its wall time beside another, is what it costs."""
PROBE_ADDS = 10_000_000
"""The machine's own speed, beside the suite's: CPU seconds of this many Python additions in a function. On
2026-11-29 at 13:45 UTC the probe took 0.32-0.37 s; `make test` from a fresh clone of f26c01d had just taken 1389 s,
and the same tests 2875 s two hours before, when 30M additions at a script's top level (about 2.1x the probe's
time per addition) took 3.8-6.4 s on such slow spells, against 2.15 s at 13:45. A figure of the report is the
code's cost only beside this one."""


def cpu_seconds() -> float:
    """User + system CPU of this process and of its children waited for so far."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def machine_probe(adds: int = PROBE_ADDS) -> float:
    """CPU seconds (this process's only, so other processes on the cores do not count) of ``adds`` additions."""
    start, total = time.process_time(), 0
    for i in range(adds):
        total += i
    return time.process_time() - start


def by_file(seconds: dict) -> dict:
    """``{nodeid: seconds}`` summed per test file."""
    out: dict = collections.defaultdict(float)
    for nodeid, value in seconds.items():
        out[nodeid.split("::")[0]] += value
    return out


class SuiteTiming:
    """A pytest plugin (registered by ``tests/conftest.py``)."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.per_test: dict = collections.defaultdict(float)
        self.cpu: dict = collections.defaultdict(float)
        self._cpu_mark = 0.0
        self.probes: list = []

    def pytest_sessionstart(self, session) -> None:
        if not hasattr(session.config, "workerinput"):  # the controller's, before the workers load the cores
            self.probes.append(machine_probe())

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        """In the process that runs the test (an xdist worker): its CPU so far, before its setup."""
        self._cpu_mark = cpu_seconds()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        """Each phase's CPU, since the phase before (or the test's start), into its report."""
        outcome = yield
        now = cpu_seconds()
        outcome.get_result().user_properties.append((CPU_KEY, round(now - self._cpu_mark, 3)))
        self._cpu_mark = now

    def pytest_runtest_logreport(self, report) -> None:
        self.per_test[report.nodeid] += report.duration
        self.cpu[report.nodeid] += sum(v for k, v in getattr(report, "user_properties", ()) if k == CPU_KEY)

    def lines(self) -> list:
        wall = time.monotonic() - self.started
        tests = sorted(self.per_test.items(), key=lambda kv: -kv[1])
        per_file, cpu_file = by_file(self.per_test), by_file(self.cpu)
        out = [f"{SLOWEST} slowest tests (setup + call + teardown; wall, then CPU of the test and its children):"]
        out += [f"  {seconds:7.1f} s {self.cpu.get(nodeid, 0.0):7.1f} cpu  {nodeid}"
                for nodeid, seconds in tests[:SLOWEST]]
        out.append(f"{FILES} slowest files:")
        out += [f"  {seconds:7.1f} s {cpu_file.get(path, 0.0):7.1f} cpu  {path}" for path, seconds in
                sorted(per_file.items(), key=lambda kv: -kv[1])[:FILES]]
        out.append(f"suite: {len(tests)} tests, {sum(self.per_test.values()):.0f} s in tests, "
                   f"{sum(self.cpu.values()):.0f} s of CPU in tests, {wall:.0f} s wall (collection included)")
        if self.probes:
            out.append(f"machine: {PROBE_ADDS // 1_000_000}M Python additions in "
                       + " and ".join(f"{p:.2f}" for p in self.probes) + " s of CPU (start, end; 0.32-0.37 s on "
                       "2026-11-29 when `make test` took 1389 s: tests/timing.py)")
        started = os.environ.get("RLHF_TEST_STARTED", "")
        if started.isdigit():  # set by `make test` as it starts
            out.append(f"make test: {time.time() - int(started):.0f} s wall so far, install included "
                       f"(target {TARGET_S} s, budget {BUDGET_S} s)")
        return out

    def write_times(self, path: str) -> None:
        """Every test's seconds, slowest first, as ``seconds<TAB>cpu seconds<TAB>nodeid`` lines."""
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            for nodeid, seconds in sorted(self.per_test.items(), key=lambda kv: -kv[1]):
                f.write(f"{seconds:.2f}\t{self.cpu.get(nodeid, 0.0):.2f}\t{nodeid}\n")

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.per_test or hasattr(terminalreporter.config, "workerinput"):  # xdist's controller reports
            return
        self.probes.append(machine_probe())
        terminalreporter.section("test budget")
        for line in self.lines():
            terminalreporter.write_line(line)
        path = os.environ.get(TIMES_ENV) or TIMES_DEFAULT
        try:
            self.write_times(path)
            terminalreporter.write_line(f"every test's seconds: {path}")
        except OSError as e:  # a read-only checkout: the figures above are printed all the same
            terminalreporter.write_line(f"every test's seconds not written ({path}: {e})")

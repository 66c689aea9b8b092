"""What the suite costs, printed at its end (docs/development.md#the-test-budget): the total wall time,
the 20 slowest tests (setup + call + teardown, so a session fixture's cost shows on the first test that
asks for it) and the slowest files. Measurements only: nothing here fails a test."""

from __future__ import annotations

import collections
import os
import time

SLOWEST = 20
FILES = 12
BUDGET_S = 1800
"""`make test` from a fresh clone on the 2-core machine, install included."""


class SuiteTiming:
    """A pytest plugin (registered by ``tests/conftest.py``)."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.per_test: dict = collections.defaultdict(float)

    def pytest_runtest_logreport(self, report) -> None:
        self.per_test[report.nodeid] += report.duration

    def lines(self) -> list:
        wall = time.monotonic() - self.started
        tests = sorted(self.per_test.items(), key=lambda kv: -kv[1])
        per_file: dict = collections.defaultdict(float)
        for nodeid, seconds in tests:
            per_file[nodeid.split("::")[0]] += seconds
        out = [f"{SLOWEST} slowest tests (setup + call + teardown):"]
        out += [f"  {seconds:7.1f} s  {nodeid}" for nodeid, seconds in tests[:SLOWEST]]
        out.append(f"{FILES} slowest files:")
        out += [f"  {seconds:7.1f} s  {path}" for path, seconds in
                sorted(per_file.items(), key=lambda kv: -kv[1])[:FILES]]
        out.append(f"suite: {len(tests)} tests, {sum(self.per_test.values()):.0f} s in tests, "
                   f"{wall:.0f} s wall (collection included)")
        started = os.environ.get("RLHF_TEST_STARTED", "")
        if started.isdigit():  # set by `make test` as it starts
            out.append(f"make test: {time.time() - int(started):.0f} s wall so far, install included "
                       f"(budget {BUDGET_S} s)")
        return out

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.per_test:
            return
        terminalreporter.section("test budget")
        for line in self.lines():
            terminalreporter.write_line(line)

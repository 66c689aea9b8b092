"""What the suite costs, printed at its end (docs/development.md#the-test-budget): the total wall time,
the 25 slowest tests (setup + call + teardown, so a session fixture's cost shows on the first test that
asks for it) and the slowest files; every test's seconds also go to ``RLHF_TEST_TIMES`` (default
``.cache/test-times.tsv``, slowest first) for comparing two runs. Measurements only: nothing here fails a test."""

from __future__ import annotations

import collections
import os
import time

SLOWEST = 25
FILES = 12
BUDGET_S = 1800
"""`make test` from a fresh clone on the 2-core machine, install included: the budget..."""
TARGET_S = 1620
"""...and what the suite is held to, leaving 3 minutes of margin for new tests and CI's variance."""
TIMES_ENV, TIMES_DEFAULT = "RLHF_TEST_TIMES", os.path.join(".cache", "test-times.tsv")


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
                       f"(target {TARGET_S} s, budget {BUDGET_S} s)")
        return out

    def write_times(self, path: str) -> None:
        """Every test's seconds, slowest first, as ``seconds<TAB>nodeid`` lines."""
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            for nodeid, seconds in sorted(self.per_test.items(), key=lambda kv: -kv[1]):
                f.write(f"{seconds:.2f}\t{nodeid}\n")

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.per_test or hasattr(terminalreporter.config, "workerinput"):  # xdist's controller reports
            return
        terminalreporter.section("test budget")
        for line in self.lines():
            terminalreporter.write_line(line)
        path = os.environ.get(TIMES_ENV) or TIMES_DEFAULT
        try:
            self.write_times(path)
            terminalreporter.write_line(f"every test's seconds: {path}")
        except OSError as e:  # a read-only checkout: the figures above are printed all the same
            terminalreporter.write_line(f"every test's seconds not written ({path}: {e})")

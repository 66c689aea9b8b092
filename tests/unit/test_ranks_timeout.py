"""tests/ranks.py's ``spawn``: ranks that do not finish in time are killed and the test fails naming them, instead
of hanging the suite until CI kills it (a DDP rank once hung in its process group's destructor)."""

from __future__ import annotations

import os
import time

import pytest

from tests.ranks import spawn


def _stuck_rank(rank: int, marker: str) -> None:
    with open(f"{marker}-{rank}", "w") as f:
        f.write(str(os.getpid()))
    if rank == 1:
        time.sleep(3600)


def test_a_rank_that_never_ends_is_killed_and_named(tmp_path):
    marker = str(tmp_path / "rank")
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"ranks \(rank, pid\) \[\(1, \d+\)\] still running after 5 s: killed"):
        spawn(_stuck_rank, (marker,), timeout_s=5.0)
    assert time.monotonic() - started < 60
    pid = int(open(f"{marker}-1").read())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # killed: gone (reaped by its forkserver) or a zombie
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[-1].split()[0] == "Z":
                    break
        except OSError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"rank 1 (pid {pid}) still runs")

"""``benchmarks/bench_server.py`` as a test: 16 concurrent clients against the reward/critic server
lose and mix no request (every answer equals the one the same request got alone), and the
benchmark prints throughput and latency percentiles (printed, not asserted: they depend on
the machine). ``make bench-server`` runs the full 60 s version."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_sixteen_clients_lose_and_mix_nothing(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "benchmarks/bench_server.py", "--seconds", "10", "--clients", "16"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    out = proc.stdout
    print(out)
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    assert "16 clients x 8 distinct requests" in out
    assert re.search(r"^lost: 0  mixed: 0$", out, re.M), out
    answered = re.search(r"^requests: (\d+) \(([\d.]+)/s answered\), samples: (\d+)", out, re.M)
    assert answered and int(answered.group(1)) >= 16, out  # every client got answers
    assert re.search(r"^latency ms: p50 [\d.]+  p90 [\d.]+  p99 [\d.]+  max [\d.]+$", out, re.M), out
    assert not list(tmp_path.glob("bench-server-*"))  # its models and server log went with a passing run

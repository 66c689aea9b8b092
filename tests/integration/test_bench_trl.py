"""benchmarks/bench_trl.py end to end at its smallest size: one iteration of GRPO and of PPO on
each side (our `pyflyte run` pipeline, TRL's GRPOTrainer and experimental PPOTrainer) gives
well-formed rows, and TRL really trained: it logged a reward and a loss per iteration and moved
the weights. A broken TRL install, or a reward that does not reach TRL, fails here."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KEYS = {"section", "figure", "value", "unit", "target", "ok", "detail"}

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """Rows and measurements of `bench_trl.py --quick --iterations 1 --sections grpo,ppo`."""
    out = tmp_path_factory.mktemp("bench_trl")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_trl.py"), "--quick", "--iterations", "1",
           "--threads", "1", "--sections", "grpo,ppo", "--json", str(out / "rows.json"),
           "--details", str(out / "details.json")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "rows.json").read_text()), json.loads((out / "details.json").read_text())


def test_rows_are_well_formed(bench):
    rows, _ = bench
    assert [r["figure"].split(" ", 2)[:2] for r in rows] == [["GRPO", "s/iter"], ["GRPO", "eval"],
                                                             ["PPO", "s/iter"], ["PPO", "eval"]]
    for r in rows:
        assert set(r) == KEYS and r["section"] == "trl", r
        assert isinstance(r["value"], float) and math.isfinite(r["value"]), r
        assert isinstance(r["ok"], bool) and r["target"], r
    for speed in rows[0::2]:
        assert speed["unit"] == "x" and speed["value"] > 0 and speed["ok"] == (speed["value"] <= 1.0), speed
    for reward in rows[1::2]:
        assert reward["unit"] == "reward" and -1.0 <= reward["value"] <= 1.0, reward


@pytest.mark.parametrize("algorithm, trainer", [("grpo", "GRPOTrainer"), ("ppo", "PPOTrainer")])
def test_trl_trained_on_the_reversal_reward(bench, algorithm, trainer):
    _, details = bench
    (case,) = [d for d in details if d["case"]["algorithm"] == algorithm]
    trl, ours = case["trl"], case["ours"]
    assert trl["extra"]["trainer"] == trainer and trl["extra"]["threads"] == 1
    assert len(trl["iteration_ends"]) == len(ours["iteration_ends"]) == 1
    assert trl["iteration_ends"][0] > trl["extra"]["train_start"] > trl["start"]
    assert trl["extra"]["losses"] and all(math.isfinite(x) for x in trl["extra"]["losses"])
    assert trl["extra"]["max_weight_change"] > 0
    # The warm-started peer model reverses most strings (eval reward about 0.86 at T=1); a reward
    # that TRL received garbled (wrong prompt split, wrong decode) would be near 0.
    assert len(trl["rewards"]) == 1 and 0.5 <= trl["rewards"][0] <= 1.0, trl["rewards"]
    assert len(ours["rewards"]) == 1 and 0.5 <= ours["rewards"][0] <= 1.0, ours["rewards"]

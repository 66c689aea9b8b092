"""benchmarks/bench_trl.py without training: the reward judgement over seeds against hand-worked
numbers, and each seed's own config on both sides (our run.seed and engine, TRL's seed and the
prompt order that seed draws)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from benchmarks import bench_trl  # noqa: E402
from models.config.io import load_config  # noqa: E402

pytestmark = pytest.mark.slow  # starts processes (make test-unit leaves it to make test)


def test_one_seed_is_judged_per_prompt_more_over_seeds():
    # One seed: differences 0.5, 0, -0.5 over 3 prompts: mean 0, SE 0.5 / sqrt(3).
    gap, se = bench_trl.reward_gap([np.array([1.0, 0.5, 0.0])], [np.array([0.5, 0.5, 0.5])])
    assert gap == pytest.approx(0.0) and se == pytest.approx(0.5 / np.sqrt(3))
    # Three seeds of 2 prompts, per-prompt differences d_s -/+ 0.4 around seed means 0.1, 0.3, 0.2:
    # mean 0.2, SE = std(0.1, 0.3, 0.2; ddof 1) / sqrt(3) = 0.1 / sqrt(3). Pooling the 6 prompts
    # would give ~0.18 instead.
    trl = [np.array([0.5, 0.5])] * 3
    ours = [np.array([0.5 + d - 0.4, 0.5 + d + 0.4]) for d in (0.1, 0.3, 0.2)]
    gap, se = bench_trl.reward_gap(ours, trl)
    assert gap == pytest.approx(0.2) and se == pytest.approx(0.1 / np.sqrt(3))


def test_each_seed_has_its_own_config_on_both_sides():
    assets = {"actor": "/a", "critic": "/c", "train_prompts": "/t.jsonl", "eval_prompts": "/e.jsonl"}
    prompts = [f"p{i}=" for i in range(40)]
    plan = bench_trl.plan_for(quick=True, threads=1, iterations=2, seeds=2, engine="vllm")
    specs = []
    for seed in (0, 1):
        case = bench_trl.replace(plan.main, seed=seed)
        cfg = load_config("configs/bench_grpo.yaml", case.overrides(assets, Path("/runs")))
        assert (cfg.run.seed, cfg.rollout.engine) == (seed, "vllm")
        specs.append(bench_trl.trl_spec(cfg, prompts, case.threads))
        assert specs[-1]["seed"] == seed
    assert specs[0]["prompts"] != specs[1]["prompts"]  # the seed draws each iteration's prompts
    assert plan.main.name != case.name and case.sides("/") == "ours (vLLM) / TRL (HF generate)"

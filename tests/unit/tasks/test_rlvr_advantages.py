"""The ``advantages`` task's RLVR options on a hand-worked batch: DAPO's dynamic sampling and overlong
filtering (the ``loss_mask`` column), its soft overlong punishment, and Dr. GRPO's advantages."""

from __future__ import annotations

import numpy as np
import pytest

from models.stages.advantages import run_advantages
from models.data.batch import BatchMetadata, RolloutBatch
from models.config.io import load_config
from models.run.types import PolicyState, RunHandle

# 3 prompts × 2 samples, max_new_tokens = 4: rewards, response lengths, and whether the response ended
REWARD = [1.0, 0.0, 1.0, 1.0, 0.5, 0.2]
LENGTH = [2, 3, 4, 4, 2, 4]
IS_END = [True, True, True, False, True, False]


def _batch(**extra) -> RolloutBatch:
    zeros = [[0.0] * n for n in LENGTH]
    return RolloutBatch.from_columns(
        BatchMetadata(iteration=0, policy_version=0, algorithm="grpo"), prompt_id=[0, 0, 1, 1, 2, 2],
        prompt_tokens=[[1, 2]] * 6, response_tokens=[[3] * n for n in LENGTH], sampler_logprobs=zeros,
        is_end=IS_END, old_logprobs=zeros, ref_logprobs=zeros, reward=REWARD, **extra)


def _advantages(tmp_path, overrides, batch=None):
    cfg = load_config("tiny_grpo", ["rollout.max_new_tokens=4"] + overrides)
    run = RunHandle(str(tmp_path), "r", "", "", "", "")
    return run_advantages(cfg, run, PolicyState(0, "", "", 0.04), batch or _batch())


def _rows_in_loss(out) -> list:
    return [bool(np.any(m)) for m in out.batch.column("loss_mask").to_pylist()]


def test_every_token_is_in_the_loss_by_default(tmp_path):
    out = _advantages(tmp_path, [])
    assert out.batch.column("loss_mask").to_pylist() == [[True] * n for n in LENGTH]
    assert out.stats["adv/loss_rows_share"] == 1.0
    assert "adv/dynamic_sampling_kept" not in out.stats


def test_dynamic_sampling_leaves_out_groups_of_equal_rewards(tmp_path):
    out = _advantages(tmp_path, ["advantage.dynamic_sampling=true"])
    assert _rows_in_loss(out) == [True, True, False, False, True, True]  # prompt 1: both rewards 1
    assert out.stats["adv/dynamic_sampling_kept"] == pytest.approx(4 / 6)
    assert out.stats["adv/loss_rows_share"] == pytest.approx(4 / 6)


def test_overlong_filtering_leaves_out_truncated_responses(tmp_path):
    out = _advantages(tmp_path, ["advantage.mask_truncated=true", "advantage.dynamic_sampling=true"])
    assert _rows_in_loss(out) == [True, True, False, False, True, False]
    # the truncated sample still counts in its group's baseline: prompt 2's advantages are ±0.7071
    adv = [a[0] for a in out.batch.column("advantages").to_pylist()]
    assert adv[4:] == pytest.approx([0.7071, -0.7071], abs=1e-4)


def test_soft_overlong_punishment_and_dr_grpo_by_hand(tmp_path):
    # L_max = 4, L_cache = 2: lengths 2, 3, 4 → penalties 0, −0.5, −1; R + penalty = [1, −0.5, 0, 0, 0.5, −0.8]
    # Dr. GRPO: R' − group mean → [0.75, −0.75], [0, 0], [0.65, −0.65]
    out = _advantages(tmp_path, ["run.algorithm=dr_grpo", "advantage.overlong_buffer=2"])
    adv = [a[0] for a in out.batch.column("advantages").to_pylist()]
    assert adv == pytest.approx([0.75, -0.75, 0.0, 0.0, 0.65, -0.65], abs=1e-6)
    assert out.stats["adv/overlong_penalty_mean"] == pytest.approx(-3.5 / 6)
    assert out.batch.column("reward").to_pylist() == pytest.approx(REWARD)  # the verifier's reward, as scored


def test_a_loss_mask_from_an_earlier_stage_is_refined_not_replaced(tmp_path):
    upstream = [[False] + [True] * (n - 1) for n in LENGTH]  # e.g. a tool's output tokens
    out = _advantages(tmp_path, ["advantage.dynamic_sampling=true"], _batch(loss_mask=upstream))
    got = out.batch.column("loss_mask").to_pylist()
    assert got[0] == [False, True] and got[2] == [False] * 4 and got[5] == [False, True, True, True]

"""A two-turn episode held against advantages and a loss worked out by hand: the tool result's tokens
(``loss_mask`` 0) are skipped by the KL-shaped rewards, GAE carries over them, and the actor's and the
critic's losses count the policy's tokens only."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kernels.losses import PolicyLossConfig, PolicyLossInput, policy_loss
from models.data.batch import BatchMetadata, RolloutBatch
from models.training.update import UpdateData, critic_loss_fn
from models.stages.advantages import run_advantages
from models.config.io import load_config
from models.stages.samples import sample_table
from models.stages.score_metrics import rollout_stats
from models.run.types import PolicyState, RunHandle

# response: 2 sampled tokens (a tool call), 2 tool-result tokens, 1 sampled token (the answer)
MASK = [True, True, False, False, True]
OLD = [-1.0, -2.0, -5.0, -5.0, -0.5]
REF = [-1.5, -2.0, -9.0, -9.0, -1.0]  # the tool tokens' KL (4 nats) would count if they were actions
VALUES = [0.5, 0.4, 9.0, 9.0, 0.2]
REWARD, BETA, GAMMA, LAM = 1.0, 0.1, 1.0, 0.95


def _batch(algorithm: str, rows: int = 1, rewards=(REWARD,), **extra) -> RolloutBatch:
    extra.update({"values": [VALUES] * rows} if algorithm == "ppo" else {})
    return RolloutBatch.from_columns(
        BatchMetadata(iteration=0, policy_version=0, algorithm=algorithm), prompt_id=[0] * rows,
        prompt_tokens=[[1, 2]] * rows, response_tokens=[[3, 4, 5, 6, 7]] * rows, sampler_logprobs=[OLD] * rows,
        is_end=[True] * rows, old_logprobs=[OLD] * rows, ref_logprobs=[REF] * rows, reward=list(rewards),
        loss_mask=[MASK] * rows, **extra)


def _hand_worked_ppo():
    """k1 KL in the reward on policy tokens t = 0, 1, 4; GAE over those three, the tool tokens skipped."""
    kl = [OLD[t] - REF[t] for t in (0, 1, 4)]  # [0.5, 0.0, 0.5]
    r0, r1, r4 = -BETA * kl[0], -BETA * kl[1], -BETA * kl[2] + REWARD  # -0.05, 0, 0.95
    a4 = r4 - VALUES[4]  # 0.75 (bootstrap 0 after the last token)
    a1 = r1 + GAMMA * VALUES[4] - VALUES[1] + GAMMA * LAM * a4  # next valid value is V_4, not V_2
    a0 = r0 + GAMMA * VALUES[1] - VALUES[0] + GAMMA * LAM * a1
    return [a0, a1, 0.0, 0.0, a4], [a0 + VALUES[0], a1 + VALUES[1], 0.0, 0.0, a4 + VALUES[4]]


def test_ppo_advantages_skip_the_tool_tokens(tmp_path):
    cfg = load_config("tiny_ppo", ["advantage.whiten=false", f"advantage.gamma={GAMMA}", f"advantage.lam={LAM}",
                                   "kl.estimator=k1"])
    out = run_advantages(cfg, RunHandle(str(tmp_path), "r", "", "", "", ""), PolicyState(0, "", "", BETA),
                         _batch("ppo"))
    adv, returns = _hand_worked_ppo()
    assert adv == pytest.approx([0.336875, 0.5125, 0.0, 0.0, 0.75])
    assert out.batch.column("advantages").to_pylist()[0] == pytest.approx(adv, abs=1e-6)
    assert out.batch.column("returns").to_pylist()[0] == pytest.approx(returns, abs=1e-6)
    assert out.batch.column("token_rewards").to_pylist()[0] == pytest.approx([-0.05, 0.0, 0.0, 0.0, 0.95], abs=1e-6)
    assert out.batch.column("loss_mask").to_pylist()[0] == MASK

    # the clipped surrogate (ε = 0.2, token mean) on the policy's three tokens (the pessimistic branch is the
    # unclipped one for both ratios here); the tool tokens' ratio e^5 is ignored
    delta = [0.1, -0.3, 5.0, 5.0, 0.0]
    expected = 0.0
    for t in (0, 1, 4):
        ratio = math.exp(delta[t])
        expected += -min(ratio * adv[t], min(max(ratio, 0.8), 1.2) * adv[t]) / 3
    assert expected == pytest.approx(-(1.105171 * 0.336875 + 0.740818 * 0.5125 + 0.75) / 3, abs=1e-6)
    t = lambda col: torch.tensor([out.batch.column(col).to_pylist()[0]])  # noqa: E731
    loss = policy_loss(PolicyLossInput(logp=t("old_logprobs") + torch.tensor([delta]), old_logp=t("old_logprobs"),
                                       adv=t("advantages"), mask=t("loss_mask").bool()), PolicyLossConfig())
    assert float(loss.loss) == pytest.approx(expected, abs=1e-5)

    # the critic regresses V on the policy tokens' returns only: ½·mean((V − G)²) over t = 0, 1, 4
    new_values = torch.tensor([[0.6, 0.3, 0.0, 0.0, 0.9]])
    critic = lambda m: new_values  # noqa: E731  (the values a critic forward gave)
    data = UpdateData(None, None, None, torch.ones(1, 5, dtype=torch.bool), old_values=new_values,
                      returns=t("returns"), loss_mask=t("loss_mask").bool())
    value, _ = critic_loss_fn(None)(critic, data, 3.0, 1.0)
    by_hand = sum(0.5 * (float(new_values[0, i]) - returns[i]) ** 2 for i in (0, 1, 4)) / 3
    assert float(value) == pytest.approx(by_hand, abs=1e-6)


def test_grpo_advantages_are_zero_on_the_tool_tokens(tmp_path):
    cfg = load_config("tiny_grpo", [])
    out = run_advantages(cfg, RunHandle(str(tmp_path), "r", "", "", "", ""), PolicyState(0, "", "", 0.04),
                         _batch("grpo", rows=2, rewards=(1.0, 0.0)))
    a = 1 / math.sqrt(2)  # (R − mean) / std with the unbiased std of {1, 0}
    assert out.batch.column("advantages").to_pylist() == [
        pytest.approx([a, a, 0, 0, a], abs=1e-4), pytest.approx([-a, -a, 0, 0, -a], abs=1e-4)]
    assert out.batch.column("loss_mask").to_pylist() == [MASK, MASK]


def test_logged_kl_and_entropy_count_the_policy_tokens_only():
    """``rollout/init_policy_kl`` sums log π_old − log π_ref over the tokens the policy sampled: 0.5 + 0 + 0.5
    here, not the 9 nats the tool's tokens would add (the tool demo's logged 23.6 was 19.0 of them);
    ``rollout/entropy`` and the sample table's ``kl`` likewise."""
    batch = _batch("grpo", rows=2, rewards=(0.0, 1.0), prompt=["What is 2*3?"] * 2, response=["6"] * 2)
    flat = {"old_logprobs": np.array(OLD * 2), "ref_logprobs": np.array(REF * 2),
            "entropy": np.array([1.0, 2.0, 7.0, 7.0, 3.0] * 2)}
    stats = rollout_stats(np.array([0.0, 1.0]), np.array([5, 5]), batch, flat)
    assert stats["rollout/init_policy_kl"] == pytest.approx(1.0)
    assert stats["rollout/entropy"] == pytest.approx(2.0)
    assert sample_table(batch, 2)["kl"] == pytest.approx([1.0, 1.0])

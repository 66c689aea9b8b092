"""RLOO, GRPO and REINFORCE++ advantages: hand-worked values and plain per-group loops."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.baselines import (
    broadcast_to_tokens,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)

# groups: 7 -> R = [1, 2, 6] (mean 3), 3 -> R = [0, 4] (mean 2), 9 -> R = [5] (alone)
PROMPT = torch.tensor([7, 7, 3, 7, 3, 9])
REWARD = torch.tensor([1.0, 2.0, 0.0, 6.0, 4.0, 5.0])


def test_rloo_by_hand():
    # group 7: 1 - (2+6)/2 = -3; 2 - (1+6)/2 = -1.5; 6 - (1+2)/2 = 4.5
    # group 3: 0 - 4 = -4; 4 - 0 = 4;  group 9: alone -> 0
    expected = torch.tensor([-3.0, -1.5, -4.0, 4.5, 4.0, 0.0])
    torch.testing.assert_close(rloo_advantages(REWARD, PROMPT), expected)


def test_grpo_by_hand():
    # group 7: deviations [-2, -1, 3], unbiased std sqrt((4 + 1 + 9)/2) = sqrt(7) = 2.6457513
    # group 3: deviations [-2, 2], std sqrt(8/1) = 2.8284271;  group 9: 0
    s7, s3 = math.sqrt(7) + 1e-6, math.sqrt(8) + 1e-6
    expected = torch.tensor([-2 / s7, -1 / s7, -2 / s3, 3 / s7, 2 / s3, 0.0])
    torch.testing.assert_close(grpo_advantages(REWARD, PROMPT), expected)
    # without the std: plain deviations
    torch.testing.assert_close(
        grpo_advantages(REWARD, PROMPT, normalize_std=False), torch.tensor([-2.0, -1.0, -2.0, 3.0, 2.0, 0.0])
    )


def test_groups_of_one_and_equal_rewards_give_zero_not_nan():
    ids, r = torch.tensor([1, 2, 3]), torch.tensor([1.0, 2.0, 3.0])
    for adv in (rloo_advantages(r, ids), grpo_advantages(r, ids), grpo_advantages(r, ids, eps=0.0)):
        assert torch.equal(adv, torch.zeros(3))
    same = grpo_advantages(torch.tensor([2.0, 2.0]), torch.tensor([0, 0]))
    assert torch.equal(same, torch.zeros(2))


def _loop_rloo_grpo(r, ids, eps):
    rloo, grpo = torch.zeros_like(r, dtype=torch.float64), torch.zeros_like(r, dtype=torch.float64)
    for i in range(len(r)):
        others = [r[j].item() for j in range(len(r)) if ids[j] == ids[i] and j != i]
        group = others + [r[i].item()]
        if others:
            rloo[i] = r[i].item() - sum(others) / len(others)
            mean = sum(group) / len(group)
            std = math.sqrt(sum((x - mean) ** 2 for x in group) / (len(group) - 1))
            grpo[i] = (r[i].item() - mean) / (std + eps)
    return rloo, grpo


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(-3, 5), st.floats(-10, 10)), min_size=1, max_size=20))
def test_against_plain_loops(samples):
    ids = torch.tensor([s[0] for s in samples])
    r = torch.tensor([s[1] for s in samples], dtype=torch.float64)
    rloo, grpo = _loop_rloo_grpo(r, ids, 1e-6)
    torch.testing.assert_close(rloo_advantages(r, ids), rloo, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(grpo_advantages(r, ids), grpo, rtol=1e-7, atol=1e-7)


def test_reinforce_pp_by_hand():
    # γ = 1: returns are suffix sums over valid tokens. Row 0 rewards [-0.1, 0, 2] -> [1.9, 2, 2];
    # row 1 [1, (masked 9), 1] -> [2, 0, 1]. Valid returns 1.9, 2, 2, 2, 1: mean 1.78,
    # unbiased var (0.0144 + 0.0484·3 + 0.6084)/4 = 0.768/4 = 0.192 -> std 0.4381780
    rewards = torch.tensor([[-0.1, 0.0, 2.0], [1.0, 9.0, 1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]])
    out = reinforce_pp_advantages(rewards, mask, gamma=1.0)
    torch.testing.assert_close(out.returns, torch.tensor([[1.9, 2.0, 2.0], [2.0, 0.0, 1.0]]))
    std = math.sqrt(0.192)
    expected = torch.tensor([[0.12 / std, 0.22 / std, 0.22 / std], [0.22 / std, 0.0, -0.78 / std]])
    torch.testing.assert_close(out.advantages, expected, atol=1e-5, rtol=1e-5)


def test_broadcast_to_tokens():
    out = broadcast_to_tokens(torch.tensor([2.0, -1.0]), torch.tensor([[1, 1, 0], [0, 1, 1]]))
    torch.testing.assert_close(out, torch.tensor([[2.0, 2.0, 0.0], [0.0, -1.0, -1.0]]))


def test_rejects_mismatched_shapes():
    with pytest.raises(ValueError):
        rloo_advantages(torch.zeros(3), torch.zeros(4, dtype=torch.long))

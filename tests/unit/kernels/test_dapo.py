"""DAPO's sample filters (kernels/dapo.py) on hand-worked cases."""

import pytest
import torch

from kernels.dapo import informative_groups, overlong_penalty


def test_informative_groups_keep_groups_whose_rewards_differ():
    # groups (any ids, any order): 7 → [1, 0] differ; 3 → [0.1, 0.1, 0.1] equal (three 0.1s: a mean
    # and std in floats would not give exactly 0); 5 → a group of one; 9 → [0, 0] equal
    rewards = torch.tensor([1.0, 0.1, 0.0, 0.1, 2.0, 0.1, 0.0, 0.0])
    pid = torch.tensor([7, 3, 7, 3, 5, 3, 9, 9])
    assert informative_groups(rewards, pid).tolist() == [True, False, True, False, False, False, False, False]


def test_informative_groups_of_an_empty_batch_and_bad_shapes():
    assert informative_groups(torch.zeros(0), torch.zeros(0, dtype=torch.long)).shape == (0,)
    with pytest.raises(ValueError, match="must be"):
        informative_groups(torch.zeros(3), torch.zeros(2, dtype=torch.long))


def test_soft_overlong_punishment_by_hand():
    # L_max = 16, L_cache = 4: no penalty up to 12 tokens, then (12 − |y|)/4: 13 → −0.25, 16 → −1
    lengths = torch.tensor([0, 12, 13, 14, 16])
    assert overlong_penalty(lengths, 16, 4).tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5, -1.0])
    assert overlong_penalty(lengths, 16, 4, penalty=0.5).tolist() == pytest.approx([0.0, 0.0, -0.125, -0.25, -0.5])
    # longer than the budget (a sampler that overshot): the full −penalty
    assert overlong_penalty(torch.tensor([20]), 16, 4).tolist() == [-1.0]
    # a buffer as long as the budget: the ramp starts at 0 tokens
    assert overlong_penalty(torch.tensor([0, 8]), 8, 8).tolist() == pytest.approx([0.0, -1.0])
    with pytest.raises(ValueError, match="0 < buffer <= max_len"):
        overlong_penalty(lengths, 16, 0)

"""Each algorithm's advantages on a hand-worked batch: 2 prompts × 2 samples, 2 response tokens each."""

import math

import pytest
import torch

from kernels.advantages import (AdvantageInput, AdvantageParams, dr_grpo_estimator, grpo_estimator,
                                 ppo_advantages, reinforce_advantages, reinforce_pp_estimator, rloo_estimator)

R = torch.tensor([1.0, 0.0, 0.5, 0.5])
PID = torch.tensor([0, 0, 1, 1])
MASK = torch.ones(4, 2, dtype=torch.bool)
ZERO = torch.zeros(4, 2)


def _x(old=ZERO, ref=ZERO, values=None):
    return AdvantageInput(R, old, ref, MASK, PID, values)


ESTIMATORS = {"ppo": ppo_advantages, "reinforce": reinforce_advantages, "rloo": rloo_estimator,
              "grpo": grpo_estimator, "dr_grpo": dr_grpo_estimator, "reinforce_pp": reinforce_pp_estimator}


def _adv(algo, x, **kw):
    p = AdvantageParams(**{"kl_coef": 0.0, "whiten": False, **kw})
    return ESTIMATORS[algo](x, p)


def test_reinforce_batch_mean_baseline():
    # mean R = 0.5 → A = R − 0.5 on every token
    out = _adv("reinforce", _x())
    assert torch.allclose(out.advantages, torch.tensor([[0.5, 0.5], [-0.5, -0.5], [0.0, 0.0], [0.0, 0.0]]))
    # token returns G_t (γ=1): the reward sits at the last token, so G = R at both tokens
    assert torch.allclose(out.returns, R.unsqueeze(1).expand(4, 2))


def test_reinforce_folds_the_kl_penalty_into_the_return():
    # old − ref = 1 nat on each token of sample 0 only; β = 0.1, k1 → R'_0 = 1 − 0.1·2 = 0.8
    old = torch.tensor([[1.0, 1.0], [0, 0], [0, 0], [0, 0]])
    out = _adv("reinforce", _x(old=old), kl_coef=0.1)
    ret = torch.tensor([0.8, 0.0, 0.5, 0.5])  # mean 0.45
    assert torch.allclose(out.advantages[:, 0], ret - 0.45)
    assert torch.allclose(out.token_rewards[0], torch.tensor([-0.1, 0.9]))


def test_rloo_leave_one_out():
    # group 0: 1 − 0 = 1, 0 − 1 = −1; group 1: 0.5 − 0.5 = 0
    out = _adv("rloo", _x())
    assert torch.allclose(out.advantages[:, 1], torch.tensor([1.0, -1.0, 0.0, 0.0]))


def test_grpo_group_normalised():
    # group 0: mean 0.5, unbiased std √(0.25+0.25) = 0.7071 → ±0.7071; group 1: std 0 → 0
    out = _adv("grpo", _x())
    s = 0.5 / math.sqrt(0.5)
    assert torch.allclose(out.advantages[:, 0], torch.tensor([s, -s, 0.0, 0.0]), atol=1e-5)


def test_reinforce_pp_batch_whitened_returns():
    # token returns [1,1],[0,0],[.5,.5],[.5,.5]: mean 0.5, unbiased std √(4·0.25/7) = √(1/7)
    out = _adv("reinforce_pp", _x())
    z = 0.5 / math.sqrt(1 / 7)
    assert torch.allclose(out.advantages, torch.tensor([[z, z], [-z, -z], [0.0, 0.0], [0.0, 0.0]]), atol=1e-4)


def test_ppo_needs_values_and_uses_gae():
    with pytest.raises(ValueError, match="critic values"):
        _adv("ppo", _x())
    # V = 0, γ = λ = 1: GAE advantages are the token returns (= R on both tokens)
    out = _adv("ppo", _x(values=ZERO), gamma=1.0, lam=1.0)
    assert torch.allclose(out.advantages, R.unsqueeze(1).expand(4, 2))


def test_dr_grpo_centres_without_dividing_by_the_std():
    # group 0: R − mean = ±0.5 (GRPO gives ±0.7071); group 1: 0
    out = _adv("dr_grpo", _x())
    assert torch.allclose(out.advantages[:, 0], torch.tensor([0.5, -0.5, 0.0, 0.0]))
    # the scale of the rewards passes through: rewards ×4 → advantages ×4 (GRPO's would not change)
    big = AdvantageInput(4 * R, ZERO, ZERO, MASK, PID)
    assert torch.allclose(_adv("dr_grpo", big).advantages[:, 0], torch.tensor([2.0, -2.0, 0.0, 0.0]))
    assert torch.allclose(_adv("grpo", big).advantages, _adv("grpo", _x()).advantages, atol=1e-5)


@pytest.mark.parametrize("algo", ["reinforce", "rloo"])
def test_whiten_is_honoured_by_the_sequence_baselines(algo):
    # whitened over the 8 tokens: rloo's [1,1],[-1,-1],[0,0],[0,0] → mean 0, unbiased std √(4/7)
    out = _adv(algo, _x(), whiten=True)
    raw = _adv(algo, _x()).advantages
    z = (raw - raw.mean()) / raw.std()
    assert torch.allclose(out.advantages, z, atol=1e-4)

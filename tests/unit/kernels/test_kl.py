"""KL estimators, controllers, KL-shaped rewards and the KL loss term."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.kl import (
    AdaptiveKLController,
    KLEstimator,
    kl_loss,
    kl_penalty,
    kl_shaped_rewards,
)

LOGP = torch.tensor([[-1.0, -1.0]])
REF = torch.tensor([[-2.0, -0.5]])  # log-ratios lr = logp - ref = [1, -0.5]


@pytest.mark.parametrize(
    "estimator, expected",
    [
        (KLEstimator.K1, [1.0, -0.5]),  # lr
        (KLEstimator.ABS, [1.0, 0.5]),  # |lr|
        (KLEstimator.K2, [0.5, 0.125]),  # lr²/2
        # e^-lr - 1 + lr: e^-1 = 0.3678794 -> 0.3678794; e^0.5 - 1.5 = 1.6487213 - 1.5 = 0.1487213
        (KLEstimator.K3, [0.3678794, 0.1487213]),
    ],
)
def test_estimators_by_hand(estimator, expected):
    torch.testing.assert_close(kl_penalty(LOGP, REF, estimator), torch.tensor([expected]))


def test_estimators_against_exact_kl_on_average():
    # y ~ p over three outcomes: E_p[k1] = Σ p·ln(p/q) = KL and E_p[k3] = Σ q − 1 + KL = KL
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.3, 0.5])
    exact = (p * (p / q).log()).sum()
    lr = (p.log() - q.log()).unsqueeze(0)  # [1, 3], one "token" per outcome
    for est in (KLEstimator.K1, KLEstimator.K3):
        expectation = (kl_penalty(lr, torch.zeros_like(lr), est) * p).sum()
        torch.testing.assert_close(expectation, exact)


@settings(max_examples=50, deadline=None)
@given(st.floats(-30, 30))
def test_k3_is_nonnegative_and_k2_k3_agree_to_second_order(lr):
    x = torch.tensor([[lr]], dtype=torch.float64)
    k3 = kl_penalty(x, torch.zeros_like(x), "k3").item()
    assert k3 >= 0
    if abs(lr) < 1e-2:  # k3 = lr²/2 - lr³/6 + O(lr⁴)
        assert k3 == pytest.approx(0.5 * lr * lr - lr**3 / 6, abs=1e-9)


def test_adaptive_controller_by_hand():
    c = AdaptiveKLController(value=0.1, target=6.0, horizon=10000)
    # KL 9: e = clip(9/6 - 1 = 0.5, ±0.2) = 0.2; β = 0.1·(1 + 0.2·2000/10000) = 0.104
    assert c.update(9.0, 2000).value == pytest.approx(0.104)
    # KL 5.4: e = 5.4/6 - 1 = -0.1; β = 0.1·(1 - 0.1·0.2) = 0.098
    assert c.update(5.4, 2000).value == pytest.approx(0.098)
    # frozen: the original is unchanged
    assert c.value == 0.1


def test_kl_shaped_rewards_by_hand():
    # row 0: tokens 0, 1 valid (k1 = [1, 0]); row 1: all masked, its reward has nowhere to go
    logp = torch.tensor([[-1.0, -0.5, -3.0], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-2.0, -0.5, -1.0], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    out = kl_shaped_rewards(torch.tensor([2.0, 5.0]), logp, ref, mask, beta=0.1)
    # row 0: -0.1·1 = -0.1 at t=0; -0.1·0 + 2 = 2 at the last token t=1; masked t=2: 0
    torch.testing.assert_close(out.token_rewards, torch.tensor([[-0.1, 2.0, 0.0], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(out.kl, torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(out.kl_per_seq, torch.tensor([1.0, 0.0]))


def test_kl_shaped_rewards_last_token_after_a_gap():
    # the last *valid* token gets the reward, even with masked tokens before and after it
    mask = torch.tensor([[1, 0, 1, 0]])
    zeros = torch.zeros(1, 4)
    out = kl_shaped_rewards(torch.tensor([3.0]), zeros, zeros, mask, beta=0.5)
    torch.testing.assert_close(out.token_rewards, torch.tensor([[0.0, 0.0, 3.0, 0.0]]))


def test_kl_loss_value_and_gradient_by_hand():
    # k3 with lr = [1, -0.5] (second token masked out of a third): token mean over 2 tokens
    logp = torch.tensor([[-1.0, -1.0, 7.0]], requires_grad=True)
    ref = torch.tensor([[-2.0, -0.5, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    out = kl_loss(logp, ref, mask, beta=0.5, estimator="k3")
    # β·(0.3678794 + 0.1487213)/2 = 0.5·0.2583004 = 0.1291502
    assert out.loss.item() == pytest.approx(0.1291502, abs=1e-6)
    assert out.kl.item() == pytest.approx(0.2583004, abs=1e-6)
    # ∂k3/∂logp = 1 - e^-lr: [1 - 0.3678794, 1 - 1.6487213] = [0.6321206, -0.6487213]; ·β/2
    (grad,) = torch.autograd.grad(out.loss, logp)
    torch.testing.assert_close(grad, torch.tensor([[0.1580302, -0.1621803, 0.0]]), atol=1e-6, rtol=0)
    assert not math.isnan(kl_loss(logp, ref, torch.zeros(1, 3), 0.5).loss.item())


def test_k3_is_exact_up_to_its_limit_and_its_tangent_past_it():
    """e^(-lr) - 1 + lr up to lr = -10; past it the tangent there: at lr = -30 (float32, where e^30 is
    1e13 and e^100 overflows) 2.2e4 - 1 - 10 + 2.2e4·20, slope -(e^10 - 1)."""
    e10 = math.expm1(10.0)
    lr = torch.tensor([[-9.5, -30.0, -100.0]], dtype=torch.float32, requires_grad=True)
    k3 = kl_penalty(lr, torch.zeros_like(lr), "k3")
    want = [math.exp(9.5) - 1 - 9.5, e10 - 10 + e10 * 20, e10 - 10 + e10 * 90]
    torch.testing.assert_close(k3.detach()[0].double(), torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=0)
    k3.sum().backward()
    torch.testing.assert_close(lr.grad[0].double(), torch.tensor([1 - math.exp(9.5), -e10, -e10],
                                                                 dtype=torch.float64), rtol=1e-6, atol=0)

"""Policy and value losses: hand-worked values, gradients and statistics."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.losses import (
    PolicyLossConfig,
    PolicyLossInput,
    entropy_bonus,
    policy_loss,
    truncated_is_weights,
    value_loss,
)

# four tokens: (ratio, A)
#   t0: ρ = 1.5,  A = 2    -> surr -3,  clipped -2·1.2 = -2.4  -> max -2.4  (clipped)
#   t1: ρ = 0.5,  A = -1   -> surr 0.5, clipped 0.8            -> 0.8       (clipped)
#   t2: ρ = 4,    A = -1   -> surr 4,   clipped 1.2            -> 4         (not clipped)
#   t3: ρ = 1.1,  A = 1    -> surr -1.1 both                   -> -1.1      (not clipped)
RATIO = torch.tensor([[1.5, 0.5, 4.0, 1.1]])
ADV = torch.tensor([[2.0, -1.0, -1.0, 1.0]])
MASK = torch.ones(1, 4)


def _inp(ratio=RATIO, adv=ADV, mask=MASK, **kw):
    old = torch.zeros_like(ratio)
    logp = ratio.log().clone().requires_grad_(True)
    return PolicyLossInput(logp, old, adv, mask, **kw), logp


def test_ppo_clip_by_hand():
    inp, logp = _inp()
    out = policy_loss(inp, PolicyLossConfig())
    # token mean: (-2.4 + 0.8 + 4 - 1.1)/4 = 1.3/4 = 0.325
    assert out.loss.item() == pytest.approx(0.325)
    assert out.clip_frac.item() == pytest.approx(0.5)
    assert out.dual_clip_frac.item() == 0.0
    # ∂/∂logp of -A·ρ is -A·ρ where not clipped: t2: 4, t3: -1.1; /4 tokens
    (grad,) = torch.autograd.grad(out.loss, logp)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, 1.0, -0.275]]))
    # approx KL = mean((ρ - 1) - ln ρ):
    #   0.5 - 0.4054651 = 0.0945349; -0.5 + 0.6931472 = 0.1931472;
    #   3 - 1.3862944 = 1.6137056;   0.1 - 0.0953102 = 0.0046898   -> sum 1.9060775 / 4
    assert out.approx_kl.item() == pytest.approx(0.4765194, abs=1e-6)
    assert out.ratio_mean.item() == pytest.approx(7.1 / 4)


def test_dual_clip_by_hand():
    inp, logp = _inp()
    out = policy_loss(inp, PolicyLossConfig(dual_clip=3.0))
    # t2: A < 0 and 4 > c·|A| = 3 -> capped at 3 (no gradient); others as before
    # (-2.4 + 0.8 + 3 - 1.1)/4 = 0.3/4 = 0.075
    assert out.loss.item() == pytest.approx(0.075)
    assert out.dual_clip_frac.item() == pytest.approx(0.25)
    (grad,) = torch.autograd.grad(out.loss, logp)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, 0.0, -0.275]]))


def test_clip_higher_by_hand():
    # ρ = 1.25, A = 2: symmetric ε = 0.2 clips to 1.2 -> -2.4; ε_high = 0.28 keeps -2.5
    ratio, adv, mask = torch.tensor([[1.25]]), torch.tensor([[2.0]]), torch.ones(1, 1)
    sym = policy_loss(_inp(ratio, adv, mask)[0], PolicyLossConfig(clip_low=0.2, clip_high=0.2))
    high = policy_loss(_inp(ratio, adv, mask)[0], PolicyLossConfig(clip_low=0.2, clip_high=0.28))
    assert sym.loss.item() == pytest.approx(-2.4) and sym.clip_frac.item() == 1.0
    assert high.loss.item() == pytest.approx(-2.5) and high.clip_frac.item() == 0.0
    # ρ = 0.75, A = -1: the lower bound 0.8 still clips -> -(-1)·0.8 = 0.8
    low = policy_loss(_inp(torch.tensor([[0.75]]), -adv / 2, mask)[0], PolicyLossConfig(clip_low=0.2, clip_high=0.28))
    assert low.loss.item() == pytest.approx(0.8)


def test_reinforce_by_hand():
    inp, logp = _inp()
    out = policy_loss(inp, PolicyLossConfig(kind="reinforce"))
    # -A·ρ: -3 + 0.5 + 4 - 1.1 = 0.4 -> /4 = 0.1; gradient -A·ρ/4 = [-0.75, 0.125, 1, -0.275]
    assert out.loss.item() == pytest.approx(0.1)
    (grad,) = torch.autograd.grad(out.loss, logp)
    torch.testing.assert_close(grad, torch.tensor([[-0.75, 0.125, 1.0, -0.275]]))
    assert out.clip_frac.item() == 0.0


def test_reinforce_on_policy_gradient_is_minus_advantage_times_grad_logp():
    logp = torch.tensor([[-0.3, -2.0]], requires_grad=True)
    inp = PolicyLossInput(logp, logp.detach(), torch.tensor([[0.5, -2.0]]), torch.ones(1, 2))
    (grad,) = torch.autograd.grad(policy_loss(inp, PolicyLossConfig(kind="reinforce")).loss, logp)
    torch.testing.assert_close(grad, torch.tensor([[-0.25, 1.0]]))  # -A / 2 tokens


def test_truncated_importance_sampling_by_hand():
    # π_old/π_sampler = e^(0 - ln 0.5) = 2 and e^(0 - ln 4) = 0.25; cap 1.5 -> [1.5, 0.25]
    old = torch.zeros(1, 2)
    sampler = torch.tensor([[math.log(0.5), math.log(4.0)]])
    torch.testing.assert_close(truncated_is_weights(old, sampler, 1.5), torch.tensor([[1.5, 0.25]]))
    logp = torch.zeros(1, 2, requires_grad=True)  # ρ = 1: surrogate -A
    inp = PolicyLossInput(logp, old, torch.tensor([[1.0, 2.0]]), torch.ones(1, 2), sampler_logp=sampler)
    out = policy_loss(inp, PolicyLossConfig(tis_cap=1.5))
    # (-1·1.5 - 2·0.25)/2 = -1
    assert out.loss.item() == pytest.approx(-1.0)
    assert out.tis_weight_mean.item() == pytest.approx(0.875)
    with pytest.raises(ValueError, match="sampler_logp"):
        policy_loss(inp._replace(sampler_logp=None), PolicyLossConfig(tis_cap=1.5))


def test_entropy_bonus_by_hand():
    ent = torch.tensor([[1.0, 3.0, 100.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0]])
    out = entropy_bonus(ent, mask, coef=0.01)
    # -0.01·(1 + 3)/2 = -0.02; entropy stat 2
    assert out.loss.item() == pytest.approx(-0.02)
    assert out.entropy.item() == pytest.approx(2.0)
    inp, _ = _inp(entropy=torch.full((1, 4), 2.0))
    total = policy_loss(inp, PolicyLossConfig(entropy_coef=0.1))
    # 0.325 - 0.1·2 = 0.125
    assert total.loss.item() == pytest.approx(0.125) and total.entropy.item() == pytest.approx(2.0)


def test_masked_tokens_do_not_count():
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    out = policy_loss(_inp(mask=mask)[0], PolicyLossConfig())
    # (-2.4 + 0.8)/2 = -0.8; both valid tokens clipped
    assert out.loss.item() == pytest.approx(-0.8) and out.clip_frac.item() == 1.0


def test_config_checks():
    with pytest.raises(ValueError):
        PolicyLossConfig(dual_clip=1.0)
    with pytest.raises(ValueError):
        PolicyLossConfig(clip_low=1.0)
    with pytest.raises(ValueError):
        PolicyLossConfig(kind="nope")


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.integers(0, 2**31), st.floats(0.05, 0.3), st.floats(0.05, 0.4))
def test_ppo_matches_plain_formula(B, T, seed, clip_low, clip_high):
    g = torch.Generator().manual_seed(seed)
    logp = (torch.randn(B, T, generator=g) * 0.3).requires_grad_(True)
    old, adv = torch.zeros(B, T), torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) < 0.7
    out = policy_loss(PolicyLossInput(logp, old, adv, mask), PolicyLossConfig(clip_low=clip_low, clip_high=clip_high))
    ratio = logp.exp()
    plain = torch.max(-adv * ratio, -adv * ratio.clamp(1 - clip_low, 1 + clip_high))
    expected = (plain * mask).sum() / mask.sum().clamp(min=1)
    torch.testing.assert_close(out.loss, expected)
    g1 = torch.autograd.grad(out.loss, logp)[0]
    g2 = torch.autograd.grad(expected, logp)[0]
    torch.testing.assert_close(g1, g2)


def test_value_loss_by_hand():
    # t0: V 1.5, V_old 1.0, G 2: err 0.25, V_clip 1.2 -> 0.64   -> ½·0.64 = 0.32 (clipped)
    # t1: V 0.5, V_old 1.0, G 0: err 0.25, V_clip 0.8 -> 0.64   -> 0.32 (clipped)
    # t2: V 1.1, V_old 1.0, G 2: err 0.81, V_clip 1.1 -> 0.81   -> 0.405
    values = torch.tensor([[1.5, 0.5, 1.1]], requires_grad=True)
    old = torch.tensor([[1.0, 1.0, 1.0]])
    returns = torch.tensor([[2.0, 0.0, 2.0]])
    out = value_loss(values, old, returns, torch.ones(1, 3), clip_eps=0.2)
    assert out.loss.item() == pytest.approx((0.32 + 0.32 + 0.405) / 3)
    assert out.clip_frac.item() == pytest.approx(2 / 3)
    # only t2 has a gradient: (V - G)/3 = -0.9/3 = -0.3
    (grad,) = torch.autograd.grad(out.loss, values)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, -0.3]]))
    # unclipped: ½(0.25 + 0.25 + 0.81)/3 = 0.2183333
    assert value_loss(values, old, returns, torch.ones(1, 3), clip_eps=None).loss.item() == pytest.approx(1.31 / 6)
    # explained variance: Var(G) = 4/3 (unbiased: mean 4/3, devs 2/3, -4/3, 2/3 -> (4+16+4)/9/2)
    # residual G - V = [0.5, -0.5, 0.9], mean 0.3: devs 0.2, -0.8, 0.6 -> (0.04 + 0.64 + 0.36)/2 = 0.52
    assert out.explained_variance.item() == pytest.approx(1 - 0.52 / (4 / 3))

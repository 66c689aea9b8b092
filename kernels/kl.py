"""KL(π ‖ π_ref) per token: estimators, coefficient controllers, and where the KL goes.

Estimators of KL from samples y ~ π, with ``lr = log π(y) − log π_ref(y)``
(Schulman 2020, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html):

    k1 = lr,    abs = |lr|,    k2 = ½·lr²,    k3 = e^(−lr) − 1 + lr

k1 is unbiased but can be negative per token, k3 is unbiased and >= 0, k2 is biased
with low variance. Chosen by :class:`KLEstimator` (``kernels/choices.py``, torch-free) through the
``KL_ESTIMATORS`` registry.

k3's ``e^(−lr)`` grows without bound where the policy makes a sampled token far less likely than
π_ref does, and so does its gradient ``(1 − e^(−lr))·∇log π``. At temperature τ a logit change of Δ
moves ``lr`` by Δ/τ while AdamW's step in the logits does not shrink with τ: GRPO on the tiny task at
τ = 0.1 took a token 30.6 nats below π_ref in one iteration (3.7 at τ = 1), k3 = e^30.6 ≈ 2e13, and
the actor's loss and gradient norm rose to 1.7e11 and 3.4e14. Beyond ``lr = −K3_EXP_LIMIT`` k3 goes on
as its tangent there (:func:`k3`): the same value and gradient up to it, a pull back towards π_ref of
at most ``e^K3_EXP_LIMIT − 1`` per token past it, never an overflow (veRL clamps k3 at 10 instead,
which leaves such tokens without any pull).

The KL enters either the reward (:func:`kl_shaped_rewards`, the default: ``−β·kl_t`` on
every response token, the sequence reward added at each row's last response token) or
the loss (:func:`kl_loss`, ``β·agg(kl_t)``, as in GRPO). β is ``kl.coef``, fixed, or steered by
:class:`AdaptiveKLController` (Ziegler et al. 2019, "Fine-Tuning Language Models from Human
Preferences", §2.2) with ``kl.adaptive`` (``kernels/kl_controller.py``: float arithmetic, no torch).
The controller is frozen; ``update`` returns the next one, so β travels between iterations as data
(``PolicyState.kl_coef``).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor

from kernels.aggregation import LossAgg, aggregate
from kernels.choices import KLEstimator
from kernels.kl_controller import AdaptiveKLController
from kernels.masked import as_bool_mask, masked_mean

__all__ = [
    "KLEstimator",
    "KL_ESTIMATORS",
    "K3_EXP_LIMIT",
    "k3",
    "kl_penalty",
    "AdaptiveKLController",
    "KLShapedRewards",
    "kl_shaped_rewards",
    "KLLossOutput",
    "kl_loss",
]


K3_EXP_LIMIT = 10.0
"""``−lr`` (nats) past which :func:`k3` is linear: e^10 − 1 ≈ 2.2e4 is its largest slope."""


def k3(lr: Tensor) -> Tensor:
    """``e^(−lr) − 1 + lr`` for ``lr >= −K3_EXP_LIMIT``, continued as its tangent below (module docstring).

    Shape: any; differentiable, with ``|∂k3/∂lr| <= e^K3_EXP_LIMIT − 1`` everywhere."""
    x = -lr
    xc = x.clamp(max=K3_EXP_LIMIT)
    e = torch.expm1(xc)  # expm1 keeps precision for small lr
    return e - xc + e * (x - xc)


KL_ESTIMATORS: dict[KLEstimator, Callable[[Tensor], Tensor]] = {
    KLEstimator.K1: lambda lr: lr,
    KLEstimator.ABS: torch.abs,
    KLEstimator.K2: lambda lr: 0.5 * lr * lr,
    KLEstimator.K3: k3,
}


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: KLEstimator | str = KLEstimator.K1) -> Tensor:
    """Per-token KL estimate from ``log π`` and ``log π_ref`` of the sampled tokens.

    Shape: logp, ref_logp ``[B, T]`` → ``[B, T]`` (float32 or wider). Differentiable in both.
    """
    dtype = torch.promote_types(torch.promote_types(logp.dtype, ref_logp.dtype), torch.float32)
    return KL_ESTIMATORS[KLEstimator(estimator)](logp.to(dtype) - ref_logp.to(dtype))


class KLShapedRewards(NamedTuple):
    token_rewards: Tensor  # [B, T], −β·kl_t, plus the sequence reward at the last token
    kl: Tensor  # [B, T], the per-token estimate, 0 at masked positions
    kl_per_seq: Tensor  # [B], Σ_t kl_t


def kl_shaped_rewards(
    reward: Tensor,
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    beta: float,
    estimator: KLEstimator | str = KLEstimator.K1,
) -> KLShapedRewards:
    """Per-token rewards ``r_t = −β·kl_t + 1[t = last_b]·R_b`` on response tokens.

    ``last_b`` is the last valid position of row b. A row without valid tokens gets no
    reward (nowhere to put it). No gradient is meant to flow (rollout-time quantity).

    Shape: reward ``[B]``, logp/ref_logp/mask ``[B, T]`` → ``[B, T]``, ``[B, T]``, ``[B]``.
    """
    m = as_bool_mask(mask)
    B, T = m.shape
    kl = torch.where(m, kl_penalty(logp, ref_logp, estimator), 0.0)  # [B, T]
    token_rewards = -beta * kl
    if T > 0:
        positions = torch.arange(T, device=m.device).expand(B, T)
        last = torch.where(m, positions, -1).amax(dim=-1, keepdim=True)  # [B, 1], -1 if none
        seq_reward = torch.where(m.any(-1), reward.to(kl.dtype), 0.0).unsqueeze(1)  # [B, 1]
        token_rewards = token_rewards.scatter_add(1, last.clamp(min=0), seq_reward)
    return KLShapedRewards(token_rewards, kl, kl.sum(-1))


class KLLossOutput(NamedTuple):
    loss: Tensor  # scalar, β·agg(kl)
    kl: Tensor  # scalar, masked token mean of kl (detached)


def kl_loss(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    beta: float,
    estimator: KLEstimator | str = KLEstimator.K3,
    agg: LossAgg | str = LossAgg.TOKEN_MEAN,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    horizon: float | None = None,
) -> KLLossOutput:
    """KL as a loss term, ``β·agg(kl_t)`` (GRPO, Shao et al. 2024, eq. 3-4 with k3).

    k1 makes no KL loss: its gradient ``∇log π(y)`` has expectation 0 under ``y ~ π``
    (on-policy), so it pulls nowhere on average; k3 (or k2) is the estimator for a loss.
    Shape: logp, ref_logp, mask ``[B, T]``; gradient flows through ``logp``.
    """
    kl = kl_penalty(logp, ref_logp, estimator)  # [B, T]
    loss = beta * aggregate(kl, mask, agg, num_tokens, num_seqs, horizon)
    return KLLossOutput(loss, masked_mean(kl.detach(), mask))

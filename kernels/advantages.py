"""Advantage estimators per algorithm, chosen through a registry (no if-chains elsewhere).

Each estimator maps the scored batch (:class:`AdvantageInput`) to KL-shaped token rewards,
advantages and returns (:class:`AdvantageOutput`), all ``[B, T]`` on response tokens.

- ``ppo``: ``r_t = −β·kl_t + 1[t = last]·R`` (KL in the reward, Ziegler et al. 2019), GAE
  (Schulman et al. 2016) with the critic's values, advantages whitened over the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, NamedTuple, Optional

from torch import Tensor

from kernels.gae import compute_gae
from kernels.kl import kl_shaped_rewards
from kernels.masked import masked_mean, masked_whiten


class AdvantageInput(NamedTuple):
    reward: Tensor  # [B] sequence reward
    old_logp: Tensor  # [B, T]
    ref_logp: Tensor  # [B, T]
    mask: Tensor  # [B, T] bool
    prompt_id: Tensor  # [B] int64, groups samples of one prompt
    values: Optional[Tensor] = None  # [B, T] critic values (PPO)


@dataclass(frozen=True)
class AdvantageParams:
    """What the estimators read from the config."""

    kl_coef: float = 0.01
    """β of the KL penalty in the reward (0 when KL is a loss term)."""
    kl_estimator: str = "k1"
    """Per-token KL estimator for the reward penalty."""
    gamma: float = 1.0
    """Discount γ."""
    lam: float = 0.95
    """GAE λ."""
    whiten: bool = True
    """Whiten advantages over the batch."""


class AdvantageOutput(NamedTuple):
    token_rewards: Tensor  # [B, T]
    advantages: Tensor  # [B, T]
    returns: Tensor  # [B, T]
    kl: Tensor  # [B, T] per-token KL estimate used in the reward
    raw_advantages: Tensor  # [B, T] before whitening (for metrics)


def ppo_advantages(x: AdvantageInput, p: AdvantageParams) -> AdvantageOutput:
    """KL-shaped rewards + GAE over the critic's values; whitened (masked) if asked."""
    if x.values is None:
        raise ValueError("PPO advantages need critic values")
    shaped = kl_shaped_rewards(x.reward, x.old_logp, x.ref_logp, x.mask, p.kl_coef, p.kl_estimator)
    adv, returns = compute_gae(shaped.token_rewards, x.values, x.mask, p.gamma, p.lam)
    out = masked_whiten(adv, x.mask) if p.whiten else adv
    return AdvantageOutput(shaped.token_rewards, out * x.mask, returns, shaped.kl, adv)


ESTIMATORS: Dict[str, Callable[[AdvantageInput, AdvantageParams], AdvantageOutput]] = {
    "ppo": ppo_advantages,
}


def compute_advantages(algorithm: str, x: AdvantageInput, p: AdvantageParams) -> AdvantageOutput:
    """Dispatch to the algorithm's estimator."""
    try:
        fn = ESTIMATORS[algorithm]
    except KeyError:
        raise ValueError(f"no advantage estimator for algorithm {algorithm!r}; known: {sorted(ESTIMATORS)}")
    return fn(x, p)


def advantage_stats(x: AdvantageInput, out: AdvantageOutput) -> Dict[str, float]:
    """``adv/*`` metrics of DESIGN.md (before whitening) and the KL-shaped reward."""
    m = x.mask
    stats = {
        "adv/advantages_mean": float(masked_mean(out.raw_advantages, m)),
        "adv/advantages_std": float(masked_mean((out.raw_advantages - masked_mean(out.raw_advantages, m)) ** 2, m)
                                    .sqrt()),
        "adv/returns_mean": float(masked_mean(out.returns, m)),
        "rollout/reward_with_kl_mean": float((out.token_rewards * m).sum(-1).mean()),
        "rollout/kl_in_reward_mean": float((out.kl * m).sum(-1).mean()),
    }
    if x.values is not None:
        stats["adv/values_mean"] = float(masked_mean(x.values, m))
    return stats

"""Advantage estimators: pure tensor math, one function per estimator (no config here).

Each estimator maps the scored batch (:class:`AdvantageInput`) to KL-shaped token rewards,
advantages and returns (:class:`AdvantageOutput`), all ``[B, T]`` on response tokens. Which
algorithm uses which estimator, loss and options is declared in ``models/algorithms/``.

- :func:`ppo_advantages`: ``r_t = −β·kl_t + 1[t = last]·R`` (KL in the reward, Ziegler et al.
  2019), GAE (Schulman et al. 2016) with the critic's values, whitened over the batch if asked.
- :func:`reinforce_advantages`: sequence return ``R' = Σ_t r_t`` of the same shaped rewards,
  minus its batch mean (Williams 1992 with a mean baseline), on every token.
- :func:`rloo_estimator`: ``R'_i`` minus the mean of the other samples of its prompt (Ahmadian
  et al. 2024).
- :func:`grpo_estimator`: ``(R'_i − mean_g)/(std_g + ε)`` over the prompt's group (Shao et al. 2024);
  :func:`dr_grpo_estimator`: ``R'_i − mean_g`` (Liu et al. 2025, no std division).
- :func:`reinforce_pp_estimator`: token returns ``G_t`` of the shaped rewards, whitened over the
  batch (Hu 2025).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, NamedTuple, Optional

from torch import Tensor

from kernels.baselines import broadcast_to_tokens, grpo_advantages, reinforce_pp_advantages, rloo_advantages
from kernels.gae import compute_gae
from kernels.kl import KLShapedRewards, kl_shaped_rewards
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
    """The estimators' parameters (models/stages/advantages.py fills them from the config)."""

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


def _shaped(x: AdvantageInput, p: AdvantageParams) -> KLShapedRewards:
    return kl_shaped_rewards(x.reward, x.old_logp, x.ref_logp, x.mask, p.kl_coef, p.kl_estimator)


def _sequence_output(shaped: KLShapedRewards, seq_adv: Tensor, x: AdvantageInput, p: AdvantageParams,
                     whiten: bool = False) -> AdvantageOutput:
    """Sequence advantages on every token; returns are the token returns ``G_t`` (γ-discounted)."""
    returns = reinforce_pp_advantages(shaped.token_rewards, x.mask, p.gamma).returns
    adv = broadcast_to_tokens(seq_adv, x.mask)
    out = masked_whiten(adv, x.mask) * x.mask if whiten else adv
    return AdvantageOutput(shaped.token_rewards, out, returns, shaped.kl, adv)


def reinforce_advantages(x: AdvantageInput, p: AdvantageParams) -> AdvantageOutput:
    """Sequence return minus the batch mean."""
    shaped = _shaped(x, p)
    ret = (shaped.token_rewards * x.mask).sum(-1)  # [B]
    return _sequence_output(shaped, ret - ret.mean(), x, p, p.whiten)


def rloo_estimator(x: AdvantageInput, p: AdvantageParams) -> AdvantageOutput:
    """Leave-one-out baseline over the samples of each prompt."""
    shaped = _shaped(x, p)
    ret = (shaped.token_rewards * x.mask).sum(-1)  # [B]
    return _sequence_output(shaped, rloo_advantages(ret, x.prompt_id), x, p, p.whiten)


def grpo_estimator(x: AdvantageInput, p: AdvantageParams) -> AdvantageOutput:
    """Group-normalised sequence reward (KL, if any in the reward, folded into it first)."""
    shaped = _shaped(x, p)
    ret = (shaped.token_rewards * x.mask).sum(-1)  # [B] = R when β = 0
    return _sequence_output(shaped, grpo_advantages(ret, x.prompt_id), x, p)


def dr_grpo_estimator(x: AdvantageInput, p: AdvantageParams) -> AdvantageOutput:
    """Group-centred sequence reward, not divided by the group's std (Dr. GRPO)."""
    shaped = _shaped(x, p)
    ret = (shaped.token_rewards * x.mask).sum(-1)  # [B]
    return _sequence_output(shaped, grpo_advantages(ret, x.prompt_id, normalize_std=False), x, p)


def reinforce_pp_estimator(x: AdvantageInput, p: AdvantageParams) -> AdvantageOutput:
    """Batch-whitened token returns of the KL-shaped rewards."""
    shaped = _shaped(x, p)
    adv, returns = reinforce_pp_advantages(shaped.token_rewards, x.mask, p.gamma)
    return AdvantageOutput(shaped.token_rewards, adv, returns, shaped.kl, returns)


Estimator = Callable[[AdvantageInput, AdvantageParams], AdvantageOutput]
"""What every estimator above is: the scored batch and the parameters → token rewards, advantages, returns."""


def advantage_stats(x: AdvantageInput, out: AdvantageOutput) -> Dict[str, float]:
    """``adv/*`` metrics of docs/concepts/metrics.md (before whitening) and the KL-shaped reward."""
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

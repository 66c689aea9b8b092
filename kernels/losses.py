"""Policy and value losses with their statistics.

Policy (to minimise), per token, with ``ρ = exp(log π − log π_old)``:

- ``ppo``: ``max(−A·ρ, −A·clip(ρ, 1−ε_low, 1+ε_high))`` (Schulman et al. 2017, eq. 7;
  asymmetric ε_high > ε_low is "clip-higher", Yu et al. 2025, DAPO eq. 10); with a dual
  clip c > 1 the loss of tokens with A < 0 is also capped at ``c·|A|`` (Ye et al. 2020,
  "Mastering Complex Control in MOBA Games", eq. 5).
- ``reinforce``: ``−A·ρ``; on-policy (π_old = π detached) its gradient is the
  REINFORCE estimator ``−A·∇log π`` (Williams 1992), off-policy it is importance-weighted.

Chosen by :class:`PolicyLossKind` (``kernels/choices.py``, torch-free) through ``POLICY_LOSSES``.
Optional extras: truncated importance sampling against the sampler, ``w = min(π_old/π_sampler, C)``
multiplying each token (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training"), and an entropy bonus ``−c_H·agg(H)``. Aggregation: :mod:`kernels.aggregation`.

Value: ``½·max((V − G)², (V_clip − G)²)`` with ``V_clip = V_old + clip(V − V_old, ±ε)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from kernels.aggregation import LossAgg, aggregate
from kernels.choices import PolicyLossKind
from kernels.masked import as_bool_mask, masked_mean, masked_var

__all__ = [
    "PolicyLossKind",
    "PolicyLossConfig",
    "PolicyLossInput",
    "PolicyLossOutput",
    "TokenPolicyLoss",
    "POLICY_LOSSES",
    "ppo_clip_token_loss",
    "reinforce_token_loss",
    "truncated_is_weights",
    "entropy_bonus",
    "EntropyBonus",
    "policy_loss",
    "ValueLossOutput",
    "value_loss",
]


@dataclass(frozen=True)
class PolicyLossConfig:
    """Settings of the actor loss."""

    kind: PolicyLossKind = PolicyLossKind.PPO
    """ppo (clipped surrogate) or reinforce (unclipped ratio)"""
    clip_low: float = 0.2
    """ε_low: the ratio is clipped below at 1 − ε_low"""
    clip_high: float = 0.2
    """ε_high: the ratio is clipped above at 1 + ε_high (clip-higher: ε_high > ε_low, e.g. 0.28)"""
    dual_clip: float | None = None
    """c > 1: for A < 0 the token loss is capped at c·|A|; None turns it off"""
    agg: LossAgg = LossAgg.TOKEN_MEAN
    """how the token losses become a scalar"""
    horizon: float | None = None
    """L of the ``seq_mean_token_sum_norm`` aggregation (the generation budget); unused by the others"""
    entropy_coef: float = 0.0
    """c_H of the entropy bonus −c_H·agg(H); needs the entropy in the input"""
    tis_cap: float | None = None
    """C of truncated importance sampling min(π_old/π_sampler, C); None turns it off"""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", PolicyLossKind(self.kind))
        object.__setattr__(self, "agg", LossAgg(self.agg))
        if not (0.0 <= self.clip_low < 1.0 and self.clip_high >= 0.0):
            raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {self.clip_low}, {self.clip_high}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {self.dual_clip}")
        if self.tis_cap is not None and self.tis_cap <= 0.0:
            raise ValueError(f"tis_cap must be > 0, got {self.tis_cap}")


class PolicyLossInput(NamedTuple):
    logp: Tensor  # [B, T], log π of the taken tokens, differentiable
    old_logp: Tensor  # [B, T], log π_old (recomputed by the trainer)
    adv: Tensor  # [B, T]
    mask: Tensor  # [B, T]
    entropy: Tensor | None = None  # [B, T], for the entropy bonus
    sampler_logp: Tensor | None = None  # [B, T], the engine's log-probs, for truncated IS


class TokenPolicyLoss(NamedTuple):
    loss: Tensor  # [B, T]
    clipped: Tensor  # [B, T] bool, the clipped branch was taken
    dual_clipped: Tensor  # [B, T] bool, the dual clip was taken


def ppo_clip_token_loss(ratio: Tensor, adv: Tensor, cfg: PolicyLossConfig) -> TokenPolicyLoss:
    """Clipped surrogate per token (module docstring). ``[B, T]`` → ``[B, T]``."""
    surr = -adv * ratio
    surr_clipped = -adv * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    loss = torch.maximum(surr, surr_clipped)
    clipped = surr_clipped > surr
    dual = torch.zeros_like(clipped)
    if cfg.dual_clip is not None:
        cap = -adv * cfg.dual_clip  # = c·|A| where A < 0
        dual = (adv < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
    return TokenPolicyLoss(loss, clipped, dual)


def reinforce_token_loss(ratio: Tensor, adv: Tensor, cfg: PolicyLossConfig) -> TokenPolicyLoss:
    """``−A·ρ`` per token; nothing is clipped. ``[B, T]`` → ``[B, T]``."""
    none = torch.zeros_like(ratio, dtype=torch.bool)
    return TokenPolicyLoss(-adv * ratio, none, none)


POLICY_LOSSES: dict[PolicyLossKind, Callable[[Tensor, Tensor, PolicyLossConfig], TokenPolicyLoss]] = {
    PolicyLossKind.PPO: ppo_clip_token_loss,
    PolicyLossKind.REINFORCE: reinforce_token_loss,
}


def truncated_is_weights(old_logp: Tensor, sampler_logp: Tensor, cap: float) -> Tensor:
    """``min(π_old / π_sampler, C)`` per token, without gradient. ``[B, T]`` → ``[B, T]``."""
    return torch.exp(old_logp.detach() - sampler_logp.detach()).clamp(max=cap)


class EntropyBonus(NamedTuple):
    loss: Tensor  # scalar, −c_H·agg(H)
    entropy: Tensor  # scalar, masked token mean of H (detached)


def entropy_bonus(
    entropy: Tensor,
    mask: Tensor,
    coef: float,
    agg: LossAgg | str = LossAgg.TOKEN_MEAN,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    horizon: float | None = None,
) -> EntropyBonus:
    """Entropy bonus as a loss term ``−c_H·agg(H)``. ``[B, T]`` → scalars."""
    loss = -coef * aggregate(entropy, mask, agg, num_tokens, num_seqs, horizon)
    return EntropyBonus(loss, masked_mean(entropy.detach(), mask))


class PolicyLossOutput(NamedTuple):
    loss: Tensor  # scalar to minimise: pg_loss + entropy_loss
    pg_loss: Tensor  # scalar, the surrogate term
    entropy_loss: Tensor  # scalar, −c_H·agg(H) (0 without entropy)
    clip_frac: Tensor  # share of tokens on the clipped branch
    dual_clip_frac: Tensor  # share of tokens capped by the dual clip
    approx_kl: Tensor  # KL(π_old ‖ π) estimate, mean of (ρ − 1) − log ρ (k3)
    entropy: Tensor  # masked mean entropy (0 without entropy)
    ratio_mean: Tensor  # masked mean of ρ
    tis_weight_mean: Tensor  # masked mean of the truncated IS weight (1 when off)


def policy_loss(
    inp: PolicyLossInput,
    cfg: PolicyLossConfig,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> PolicyLossOutput:
    """Actor loss and statistics for one (mini)batch; see the module docstring.

    ``num_tokens`` / ``num_seqs``: global denominators of the aggregation (None: this batch).
    Statistics are detached masked token means.
    """
    m = as_bool_mask(inp.mask)
    log_ratio = inp.logp - inp.old_logp.detach()  # [B, T]
    ratio = torch.exp(log_ratio)
    tok = POLICY_LOSSES[cfg.kind](ratio, inp.adv.detach(), cfg)
    token_loss = tok.loss
    tis = torch.ones_like(ratio)
    if cfg.tis_cap is not None:
        if inp.sampler_logp is None:
            raise ValueError("tis_cap is set but the input has no sampler_logp")
        tis = truncated_is_weights(inp.old_logp, inp.sampler_logp, cfg.tis_cap)
        token_loss = token_loss * tis
    pg_loss = aggregate(token_loss, m, cfg.agg, num_tokens, num_seqs, cfg.horizon)
    zero = pg_loss.new_zeros(())
    bonus = EntropyBonus(zero, zero)
    if inp.entropy is not None:
        bonus = entropy_bonus(inp.entropy, m, cfg.entropy_coef, cfg.agg, num_tokens, num_seqs, cfg.horizon)
    with torch.no_grad():
        stats = dict(
            clip_frac=masked_mean(tok.clipped.to(ratio.dtype), m),
            dual_clip_frac=masked_mean(tok.dual_clipped.to(ratio.dtype), m),
            approx_kl=masked_mean(torch.expm1(log_ratio) - log_ratio, m),
            entropy=bonus.entropy,
            ratio_mean=masked_mean(ratio, m),
            tis_weight_mean=masked_mean(tis, m),
        )
    return PolicyLossOutput(loss=pg_loss + bonus.loss, pg_loss=pg_loss, entropy_loss=bonus.loss, **stats)


class ValueLossOutput(NamedTuple):
    loss: Tensor  # scalar, agg(½·max((V − G)², (V_clip − G)²))
    clip_frac: Tensor  # share of tokens where the clipped error was larger
    explained_variance: Tensor  # 1 − Var(G − V)/Var(G); 0 when Var(G) = 0
    values_mean: Tensor  # masked mean of V


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_eps: float | None = 0.2,
    agg: LossAgg | str = LossAgg.TOKEN_MEAN,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> ValueLossOutput:
    """Clipped value loss ``½·max((V − G)², (V_clip − G)²)``; ``clip_eps=None`` gives ``½(V − G)²``.

    Shape: values, old_values, returns, mask ``[B, T]`` → scalars; gradient flows into ``values``.
    """
    m = as_bool_mask(mask)
    returns, old_values = returns.detach(), old_values.detach()
    err = (values - returns) ** 2  # [B, T]
    if clip_eps is None:
        err_clipped = err.detach()
        token_loss = 0.5 * err
    else:
        v_clip = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
        err_clipped = (v_clip - returns) ** 2
        token_loss = 0.5 * torch.maximum(err, err_clipped)
    loss = aggregate(token_loss, m, agg, num_tokens, num_seqs)
    with torch.no_grad():
        clip_frac = masked_mean((err_clipped > err).to(err.dtype), m)
        var_g = masked_var(returns, m)
        ev = torch.where(var_g > 0, 1 - masked_var(returns - values, m) / var_g.clamp(min=1e-30), 0.0)
        return ValueLossOutput(loss, clip_frac, ev, masked_mean(values, m))

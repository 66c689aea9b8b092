"""The ``kl`` and ``advantage`` sections: the KL to the reference, and how rewards become advantages.

An empty ``kl.placement`` or ``kl.estimator`` stays empty here: what a run uses is computed from its
algorithm by ``TrainConfig.kl_placement`` and ``TrainConfig.kl_estimator`` (:data:`DEFAULT_KL_ESTIMATOR`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kernels.choices import KLEstimator
from models import algorithms
from models.config.checks import check, check_choice

DEFAULT_KL_ESTIMATOR = {"reward": "k1", "loss": "k3"}
"""The estimator of an empty ``kl.estimator``, by placement: k1 in the reward, k3 in the loss."""


@dataclass(frozen=True)
class KLConfig:
    """KL regularisation towards the frozen reference policy."""

    estimator: str = ""
    """Per-token estimator: k1, abs, k2 or k3 (Schulman, 'Approximating KL divergence'). Empty: k1 in
    the reward, k3 in the loss. k1 is refused in the loss: its gradient has expectation 0."""
    placement: str = ""
    """``reward``: ``-β·kl_t`` added to every token's reward; ``loss``: a KL term ``β·agg(kl_t)`` in the
    actor loss. Empty: the algorithm's own (``loss`` for grpo and dr_grpo, else ``reward``)."""
    coef: float = 0.01
    """β, or its initial value when adaptive."""
    adaptive: bool = False
    """Adaptive β (Ziegler et al. 2019): move β so the KL tracks ``target``."""
    target: float = 6.0
    """Target KL per sequence for the adaptive controller."""
    horizon: int = 10000
    """Adaptive controller horizon, in samples."""

    def __post_init__(self) -> None:
        check_choice("kl.estimator", self.estimator, [""] + list(KLEstimator))
        check_choice("kl.placement", self.placement, [""] + list(algorithms.KL_PLACEMENTS))
        check(self.coef >= 0, "kl.coef must be >= 0")
        check(self.target > 0, "kl.target must be > 0")
        check(self.horizon > 0, "kl.horizon must be > 0")


@dataclass(frozen=True)
class AdvantageConfig:
    """How rewards become advantages, and which samples the loss learns from (the ``advantages``
    task). Options an algorithm does not use are refused when set (docs/algorithms.md)."""

    gamma: float = 1.0
    """Discount γ (ppo's GAE, reinforce_pp's token returns)."""
    lam: float = 0.95
    """GAE λ (ppo)."""
    whiten: bool = True
    """Whiten advantages over the whole batch, masked (ppo, reinforce, rloo)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (Yu et al. 2025, §3.2; rloo, grpo, dr_grpo): the samples of a prompt
    whose rewards are all equal (advantage 0 under a group baseline) are left out of the loss
    (``loss_mask``); the batch keeps its rows and the update its minibatches, each normalised by the
    tokens it keeps. Logs ``adv/dynamic_sampling_kept`` (share of samples kept). docs/rlvr/dynamic_sampling.md"""
    mask_truncated: bool = False
    """DAPO's overlong filtering (§3.4): responses cut at ``rollout.max_new_tokens`` (``is_end = False``)
    are left out of the loss (``loss_mask``); they still count in their group's baseline. docs/rlvr/overlong.md"""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment (§3.4): L_cache, the last tokens before ``rollout.max_new_tokens``
    over which the reward gets a penalty growing linearly to ``overlong_penalty``; 0 = off."""
    overlong_penalty: float = 1.0
    """The largest length penalty, reached at ``rollout.max_new_tokens`` (with ``overlong_buffer``)."""

    def __post_init__(self) -> None:
        check(0 <= self.gamma <= 1, "advantage.gamma must be in [0, 1]")
        check(0 <= self.lam <= 1, "advantage.lam must be in [0, 1]")
        check(self.overlong_buffer >= 0, "advantage.overlong_buffer must be >= 0 (0 = off)")
        check(self.overlong_penalty > 0, "advantage.overlong_penalty must be > 0")
        check(self.overlong_buffer > 0 or self.overlong_penalty == 1.0,
              f"advantage.overlong_penalty={self.overlong_penalty} needs advantage.overlong_buffer > 0 "
              f"(the penalty is off without a buffer)")

"""The kernels' choices by name, without torch: the enums a config or an algorithm declaration names,
so that reading a config loads no tensor library (a thin task's pod reads one). Each maps to its tensor
functions where those live: :class:`LossAgg` through ``AGGREGATORS`` (:mod:`kernels.aggregation`),
:class:`KLEstimator` through ``KL_ESTIMATORS`` (:mod:`kernels.kl`), :class:`PolicyLossKind` through
``POLICY_LOSSES`` (:mod:`kernels.losses`), which also export them."""

from __future__ import annotations

from enum import Enum

__all__ = ["LossAgg", "KLEstimator", "PolicyLossKind"]


class LossAgg(str, Enum):
    """How a ``[B, T]`` loss becomes a scalar (:mod:`kernels.aggregation`)."""

    TOKEN_MEAN = "token_mean"
    SEQ_MEAN_TOKEN_MEAN = "seq_mean_token_mean"
    SEQ_MEAN_TOKEN_SUM = "seq_mean_token_sum"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq_mean_token_sum_norm"


class KLEstimator(str, Enum):
    """The per-token estimate of KL(π ‖ π_ref) from samples (:mod:`kernels.kl`)."""

    K1 = "k1"
    ABS = "abs"
    K2 = "k2"
    K3 = "k3"


class PolicyLossKind(str, Enum):
    """The per-token policy loss: the clipped surrogate or ``−A·ρ`` (:mod:`kernels.losses`)."""

    PPO = "ppo"
    REINFORCE = "reinforce"

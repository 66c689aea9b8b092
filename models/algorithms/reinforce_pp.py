"""REINFORCE++: discounted token returns of the KL-shaped rewards, whitened over the whole batch.

Source: Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language
Models". With the KL-shaped token rewards ``r_t = −β·kl_t + 1[t = T]·R``::

    G_t = Σ_{s>=t} γ^(s−t)·r_s,        A_t = (G_t − mean_batch(G)) / std_batch(G)

(the batch normalisation is part of the method, so ``advantage.whiten`` is refused) with the
clipped surrogate as policy loss.
"""

from kernels.choices import PolicyLossKind
from models.algorithms.spec import CLIPPED_SURROGATE, AlgorithmSpec

SPEC = AlgorithmSpec(
    name="reinforce_pp", title="REINFORCE++", paper="Hu 2025, REINFORCE++: A Simple and Efficient Approach "
                                                    "for Aligning Large Language Models",
    advantage="token returns whitened over the batch", estimator_name="reinforce_pp_estimator",
    policy_loss=PolicyLossKind.PPO, uses_critic=False, needs_groups=False, kl_placement="reward",
    honours=CLIPPED_SURROGATE | {"advantage.gamma", "actor.loss_agg"},
)

"""REINFORCE with a batch-mean baseline: the sequence return, minus its batch mean, on every token.

Source: Williams 1992, "Simple Statistical Gradient-Following Algorithms for Connectionist
Reinforcement Learning" (the baseline is the batch mean of the returns). With the KL-shaped
token rewards ``r_t = −β·kl_t + 1[t = T]·R``::

    R'_i = Σ_t r_{i,t},      A_i = R'_i − mean_batch(R'),      L = agg( −A_i·ρ_{i,t} )

``ρ = π/π_old`` is 1 on the first pass (the gradient is ``−A·∇log π``, Williams' estimator) and
an unclipped importance weight on later epochs. A is whitened over the batch (``advantage.whiten``).
"""

from kernels.choices import PolicyLossKind
from models.algorithms.spec import AlgorithmSpec

SPEC = AlgorithmSpec(
    name="reinforce", title="REINFORCE", paper="Williams 1992, Simple Statistical Gradient-Following Algorithms "
                                              "for Connectionist Reinforcement Learning",
    advantage="sequence return − batch mean", estimator_name="reinforce_advantages",
    policy_loss=PolicyLossKind.REINFORCE, uses_critic=False, needs_groups=False, kl_placement="reward",
    honours=frozenset({"advantage.whiten", "actor.loss_agg"}),
)

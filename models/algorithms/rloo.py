"""RLOO: REINFORCE with a leave-one-out baseline over the k samples of each prompt.

Sources: Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for
Learning from Human Feedback in LLMs"; Kool et al. 2019, "Buy 4 REINFORCE Samples, Get
a Baseline for Free!". With ``R'_i`` the KL-shaped sequence return of sample i and j over the
other samples of its prompt::

    A_i = R'_i − 1/(k−1)·Σ_{j≠i} R'_j  =  k/(k−1)·(R'_i − mean_group(R'))

on every token of sample i, with the clipped surrogate as policy loss (whitened over the batch
with ``advantage.whiten``).
"""

from kernels.choices import PolicyLossKind
from models.algorithms.spec import CLIPPED_SURROGATE, AlgorithmSpec

SPEC = AlgorithmSpec(
    name="rloo", title="RLOO", paper="Ahmadian et al. 2024, Back to Basics: Revisiting REINFORCE Style "
                                     "Optimization for Learning from Human Feedback in LLMs",
    advantage="return − mean of the other samples of the prompt", estimator_name="rloo_estimator",
    policy_loss=PolicyLossKind.PPO, uses_critic=False, needs_groups=True, kl_placement="reward",
    honours=CLIPPED_SURROGATE | {"advantage.whiten", "actor.loss_agg", "advantage.dynamic_sampling"},
)

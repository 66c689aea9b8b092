"""GRPO: group-relative advantages, the clipped surrogate, the KL to the reference as a loss term.

Source: Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open
Language Models" (§4.1.2, eq. 3-4). With ``R_i`` the reward of sample i and the group the k
samples of its prompt::

    A_i = (R_i − mean_group(R)) / (std_group(R) + ε)       (unbiased std; a group of equal R: 0)
    L   = agg( max(−A_i·ρ_t, −A_i·clip(ρ_t, 1−ε, 1+ε)) ) + β·agg(k3_t)

on every token of sample i. The paper aggregates per sequence (``seq_mean_token_mean``); the
default here is the token mean (``actor.loss_agg``).
"""

from kernels.choices import PolicyLossKind
from models.algorithms.spec import CLIPPED_SURROGATE, AlgorithmSpec

SPEC = AlgorithmSpec(
    name="grpo", title="GRPO", paper="Shao et al. 2024, DeepSeekMath: Pushing the Limits of Mathematical "
                                     "Reasoning in Open Language Models",
    advantage="(R − group mean) / group std", estimator_name="grpo_estimator",
    policy_loss=PolicyLossKind.PPO, uses_critic=False, needs_groups=True, kl_placement="loss",
    honours=CLIPPED_SURROGATE | {"actor.loss_agg", "advantage.dynamic_sampling"},
)

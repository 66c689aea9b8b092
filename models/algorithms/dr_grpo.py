"""Dr. GRPO ("GRPO done right"): GRPO without the std division and without the length normalisation.

Source: Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective". Dividing
by the group's std weighs too-easy and too-hard prompts up, and dividing each sequence's loss
by its own length ``|o_i|`` makes long wrong answers cheap; Dr. GRPO drops both::

    A_i = R_i − mean_group(R)
    L   = 1/(N·L_max) · Σ_i Σ_t max(−A_i·ρ_t, −A_i·clip(ρ_t, 1−ε, 1+ε))     (+ the KL term)

with N the sequences of the minibatch and ``L_max`` the generation budget
(``rollout.max_new_tokens``): the ``seq_mean_token_sum_norm`` aggregation, fixed for this
algorithm (``actor.loss_agg`` is refused).
"""

from kernels.choices import LossAgg, PolicyLossKind
from models.algorithms.spec import CLIPPED_SURROGATE, AlgorithmSpec

SPEC = AlgorithmSpec(
    name="dr_grpo", title="Dr. GRPO", paper="Liu et al. 2025, Understanding R1-Zero-Like Training: "
                                            "A Critical Perspective",
    advantage="R − group mean (no std division)", estimator_name="dr_grpo_estimator",
    policy_loss=PolicyLossKind.PPO, uses_critic=False, needs_groups=True, kl_placement="loss",
    honours=CLIPPED_SURROGATE | {"advantage.dynamic_sampling"}, loss_agg=LossAgg.SEQ_MEAN_TOKEN_SUM_NORM.value,
)

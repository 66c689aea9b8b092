"""PPO with a learned critic: KL-shaped token rewards, GAE, the clipped surrogate.

Sources: Schulman et al. 2017, "Proximal Policy Optimization Algorithms" (eq. 7); GAE from
Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
Estimation"; the KL in the reward from Ziegler et al. 2019, "Fine-Tuning Language Models from
Human Preferences" (§2.2), as in Ouyang et al. 2022 (InstructGPT). With ``kl_t`` the per-token
KL estimate, ``R`` the sequence reward and ``V`` the critic::

    r_t = −β·kl_t + 1[t = T]·R
    δ_t = r_t + γ·V_{t+1} − V_t,        A_t = Σ_l (γλ)^l·δ_{t+l},     G_t = A_t + V_t
    L_actor  = agg( max(−A_t·ρ_t, −A_t·clip(ρ_t, 1−ε_low, 1+ε_high)) ),   ρ_t = π/π_old
    L_critic = token_mean( ½·max((V − G)², (V_clip − G)²) )

A is whitened over the batch (``advantage.whiten``).
"""

from kernels.choices import PolicyLossKind
from models.algorithms.spec import CLIPPED_SURROGATE, AlgorithmSpec

SPEC = AlgorithmSpec(
    name="ppo", title="PPO", paper="Schulman et al. 2017, Proximal Policy Optimization Algorithms",
    advantage="GAE over the critic's values, whitened", estimator_name="ppo_advantages",
    policy_loss=PolicyLossKind.PPO, uses_critic=True, needs_groups=False, kl_placement="reward",
    honours=CLIPPED_SURROGATE | {"advantage.gamma", "advantage.lam", "advantage.whiten", "actor.loss_agg",
                                 "model.critic_path", "critic"},
)

"""What an algorithm declaration holds (:class:`AlgorithmSpec`) and the vocabulary of options
that only some algorithms use (:data:`OPTIONS`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, FrozenSet

from kernels.choices import PolicyLossKind

if TYPE_CHECKING:
    from kernels.advantages import Estimator

WORKFLOWS = ("ppo", "reinforce")
"""``workflows/ppo.py ppo_training`` trains a critic; ``workflows/reinforce.py reinforce_training`` does not."""

KL_PLACEMENTS = ("reward", "loss")
"""``reward``: ``−β·kl_t`` in every token's reward; ``loss``: ``β·agg(kl_t)`` added to the actor loss."""

OPTIONS: Dict[str, str] = {
    "advantage.gamma": "γ discounts GAE (ppo) and REINFORCE++'s token returns; the sequence-level "
                       "algorithms use the undiscounted sequence reward",
    "advantage.lam": "λ is GAE's, which bootstraps from a critic's values",
    "advantage.whiten": "batch whitening of the advantages; GRPO-style advantages are normalised within their "
                        "group and REINFORCE++'s are always whitened",
    "advantage.dynamic_sampling": "dropping groups of equal rewards removes only samples whose advantage is 0 "
                                  "under a group baseline; with a batch or critic baseline they still carry signal",
    "actor.clip_eps": "the ratio clip of the clipped surrogate; the REINFORCE loss −A·ρ is not clipped",
    "actor.clip_eps_high": "the upper ratio clip of the clipped surrogate; the REINFORCE loss is not clipped",
    "actor.dual_clip": "the dual clip of the clipped surrogate; the REINFORCE loss is not clipped",
    "actor.loss_agg": "the algorithm fixes how token losses are aggregated",
    "model.critic_path": "only an algorithm with a critic loads one",
    "critic": "only an algorithm with a critic trains one",
}
"""Options that some algorithms use and others do not, with why one would not. An option is an
``section.field`` path or a whole section (``critic``). Options every algorithm uses (``kl.*``,
``actor.lr``, ``actor.tis_cap``, ``advantage.mask_truncated``, ...) are not listed."""

CLIPPED_SURROGATE = frozenset({"actor.clip_eps", "actor.clip_eps_high", "actor.dual_clip"})
"""The options of the clipped-surrogate loss (``PolicyLossKind.PPO``)."""


@dataclass(frozen=True)
class AlgorithmSpec:
    """One algorithm, declared once: config validation, the workflow, the tasks and the docs'
    table all read it (``models/algorithms/__init__.py`` holds the registry)."""

    name: str
    """The ``run.algorithm`` value."""
    title: str
    """Its name in prose, e.g. ``GRPO``."""
    paper: str
    """The source: authors, year, title."""
    advantage: str
    """The advantage in one line (for the docs' table)."""
    estimator_name: str
    """The advantage estimator: a function of ``kernels/advantages.py``, by name (:attr:`estimator` is the
    function), so that reading the declarations, as every config does, loads no torch."""
    policy_loss: PolicyLossKind
    """The per-token policy loss: the clipped surrogate (``ppo``) or ``−A·ρ`` (``reinforce``)."""
    uses_critic: bool
    """Trains a value model (and so runs in ``workflows/ppo.py``)."""
    needs_groups: bool
    """Its baseline is the group of samples of one prompt: ``rollout.n_samples_per_prompt >= 2``."""
    kl_placement: str
    """Where the KL to the reference goes when ``kl.placement`` is left empty (:data:`KL_PLACEMENTS`)."""
    honours: FrozenSet[str]
    """The :data:`OPTIONS` it uses; setting any other one is refused."""
    loss_agg: str = ""
    """An aggregation the algorithm fixes (``kernels.aggregation.LossAgg``); empty: ``actor.loss_agg``."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.honours) - set(OPTIONS))
        if unknown:
            raise ValueError(f"algorithm {self.name!r} honours unknown options {unknown}; known: {sorted(OPTIONS)}")
        if self.kl_placement not in KL_PLACEMENTS:
            raise ValueError(f"algorithm {self.name!r}: kl_placement {self.kl_placement!r} not in {KL_PLACEMENTS}")
        if self.uses_critic != ("critic" in self.honours):
            raise ValueError(f"algorithm {self.name!r}: uses_critic and honouring 'critic' must agree")
        if self.loss_agg and "actor.loss_agg" in self.honours:
            raise ValueError(f"algorithm {self.name!r} fixes loss_agg, so it cannot honour actor.loss_agg")

    @property
    def estimator(self) -> "Estimator":
        """The advantage estimator function (importing ``kernels/advantages.py`` loads torch)."""
        from kernels import advantages

        fn = getattr(advantages, self.estimator_name, None)
        if not callable(fn):
            raise ValueError(f"algorithm {self.name!r}: estimator_name {self.estimator_name!r} is not a function of "
                             f"kernels/advantages.py")
        return fn

    @property
    def workflow(self) -> str:
        """``ppo`` (with a critic) or ``reinforce`` (:data:`WORKFLOWS`)."""
        return WORKFLOWS[0] if self.uses_critic else WORKFLOWS[1]

    @property
    def doc(self) -> str:
        """Its docs page, relative to ``docs/``."""
        return f"algorithms/{self.name}.md"

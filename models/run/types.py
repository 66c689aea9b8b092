"""Typed values that travel between the tasks of a training run (Flyte serialises dataclasses).

How they differ from the other run classes: docs/concepts/run_layout.md ("One name per concept")."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, Tuple

from models.run.layout import RunLayout, RunState


@dataclass(frozen=True)
class RunHandle:
    """Which run a task works for: where it lives and where it is tracked. Travels as every task's input
    (small: URLs and ids), unlike ``run.json``'s :class:`~models.run.layout.RunInfo` (config, history),
    which only the launch and a resume read."""

    storage_root: str
    """``run.storage_root`` of the config (any fsspec URL)."""
    run_name: str
    """Folder of the run under ``storage_root``."""
    mlflow_run_id: str
    """MLflow run that tracks this training run."""
    reference_url: str
    """Frozen initial policy (committed HF checkpoint); also the tokenizer's home."""
    train_prompts_url: str
    """Validated training prompts (JSONL) under the run."""
    eval_prompts_url: str
    """Validated held-out prompts (JSONL) under the run."""
    reward_model_url: str = ""
    """Committed reward-model checkpoint when ``reward.source = model``."""
    launch: str = ""
    """The launch that holds the run's lock (:func:`models.run.lock.current_owner` in ``prepare_run``: the
    Flyte execution that took the run, or the local ``pyflyte`` process). A long run is a chain of executions
    (``run.iterations_per_execution``), and every task of each renews the lock as this holder and calls the
    services this launch started. It travels as the tasks' own ``launch`` input, never inside the handle the
    tasks pass on (their cache keys hold the handle, and a relaunch reuses the outputs the launch before it
    cached): a task that needs it puts it back with :meth:`for_launch`. Empty: the task's own execution."""

    def for_launch(self, launch: str) -> "RunHandle":
        """This handle as held by ``launch`` (what a task that renews the lock or calls a service uses)."""
        return dataclasses.replace(self, launch=launch)

    @property
    def launch_name(self) -> str:
        """The name a resident run's services are published and found under: the Flyte execution's name of the
        launch on a cluster, ``local`` locally (:func:`models.run.lock.execution_name`)."""
        from models.run.lock import execution_name

        return execution_name(self.launch)

    @property
    def layout(self) -> RunLayout:
        return RunLayout(self.storage_root, self.run_name)


@dataclass(frozen=True)
class PolicyState:
    """The policy an iteration starts from (and, after it, the one it produced), as the tasks pass it.
    On storage the same resume point is ``state.json``'s :class:`~models.run.layout.RunState`, numbered
    by the iteration that completed (one less): :meth:`resume_point` and :meth:`resumed` convert."""

    iteration: int
    """Index of the iteration that uses this state (0-based)."""
    actor_url: str
    """Committed actor checkpoint."""
    critic_url: str = ""
    """Committed critic checkpoint (PPO), else empty."""
    kl_coef: float = 0.0
    """Current KL coefficient β (changes only with the adaptive controller)."""
    reward_norm: Dict[str, float] = field(default_factory=dict)
    """Running moments of the raw rewards so far (``count``, ``mean``, ``m2``; empty before the first
    batch) for ``reward.normalize`` (:mod:`models.rewards.scaling`); kept in ``state.json`` extras."""
    behaviour_url: str = ""
    """With ``run.off_policy_steps=1``: the actor this iteration's batch is sampled from, one update older
    than ``actor_url`` (the previous state's actor; empty at iteration 0 and on-policy); kept in
    ``state.json`` extras so a resumed run samples it again (docs/off_policy.md)."""

    def sampler(self) -> Tuple["PolicyState", int]:
        """``(state, ahead)`` of the rollout that samples this iteration's batch when nothing sampled it
        yet (a chunk's first iteration, a resumed run): ``(self, 0)``, or with ``behaviour_url`` the state
        one iteration back with that actor, one ahead (the batch the pipeline would have sampled)."""
        if not self.behaviour_url:
            return self, 0
        return dataclasses.replace(self, iteration=self.iteration - 1, actor_url=self.behaviour_url,
                                   behaviour_url=""), 1

    def resume_point(self) -> RunState:
        """``state.json``'s record of this state: the iteration before it completed; β, the reward
        moments and the behaviour actor go into ``extras`` (only when set, so a run without them
        writes the file it always wrote)."""
        extras = {"kl_coef": self.kl_coef, **({"reward_norm": self.reward_norm} if self.reward_norm else {}),
                  **({"behaviour_url": self.behaviour_url} if self.behaviour_url else {})}
        return RunState(iteration=self.iteration - 1, actor_url=self.actor_url,
                        critic_url=self.critic_url or None, extras=extras)

    @classmethod
    def resumed(cls, point: RunState, kl_coef: float, off_policy: bool) -> "PolicyState":
        """The state the iteration after ``point`` starts from; ``kl_coef`` (the config's β) where the
        point has none, and its behaviour actor only when the run samples off-policy."""
        extras = point.extras
        return cls(point.iteration + 1, point.actor_url, point.critic_url or "",
                   float(extras.get("kl_coef", kl_coef)), dict(extras.get("reward_norm", {})),
                   extras.get("behaviour_url", "") if off_policy else "")

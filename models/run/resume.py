"""What a resumed run trains with: its stored config, plus the changes the user passed that may change.

Launching with the name of an existing run resumes it. The config stored in ``run.json`` wins over
everything the user did not write: a field's default in today's code, or a field the preset does not
set, never changes a running run. What the user wrote — the preset's values and the overrides — is
compared with the stored values; where they differ:

- a field of :data:`RESUMABLE` takes the new value from the next iteration on; each change is kept in
  ``run.json`` (``config_changes``), printed, and tagged on the MLflow run as
  ``config_change.iter-000004.actor.lr = "0.0001 -> 0.05"`` (the iteration it took effect);
- any other difference refuses the launch before anything is touched, naming each field with its
  stored and given value.

So a rerun of the same command resumes without complaint, and a run is never trained on with a
config nobody can see. ``docs/reliability.md`` lists the fields and why each may change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping

from models.config import ConfigError, TrainConfig
from models.config.io import config_from_json_dict, flatten, to_dict

RESUMABLE: Dict[str, str] = {
    "run.num_iterations": "the run's length: extend a finished run or stop sooner (not below the iterations done)",
    "run.eval_interval": "when held-out evaluation runs; no training step depends on it",
    "run.eval_before_training": "whether the starting policy is evaluated; no training step depends on it",
    "run.save_interval": "which checkpoints are kept from now on (the resume point's always is)",
    "run.iterations_per_chunk": "how iterations are grouped into sub-workflows: orchestration only",
    "run.num_logged_samples": "how many samples each iteration logs to MLflow",
    "run.checkpoint_artifact_max_mb": "which kept checkpoints are copied into MLflow",
    "run.registered_model_name": "where the final policy is registered, which happens at the end",
    "run.lock_ttl_s": "when the run's lock counts as stale",
    "actor.lr": "a learning-rate schedule by hand: AdamW's carried moments stay valid under another rate",
    "critic.lr": "as actor.lr",
    "actor.grad_clip": "the gradient-norm clip: a guard on the step size, no state depends on it",
    "critic.grad_clip": "as actor.grad_clip",
    "actor.guard.max_loss": "which steps are skipped from now on: a guard, no state depends on it",
    "actor.guard.max_grad_norm": "as actor.guard.max_loss",
    "actor.guard.max_skipped_fraction": "when skipped steps fail the run: a guard, no state depends on it",
    "critic.guard.max_loss": "as actor.guard.max_loss",
    "critic.guard.max_grad_norm": "as actor.guard.max_loss",
    "critic.guard.max_skipped_fraction": "as actor.guard.max_skipped_fraction",
    "actor.micro_batch_size": "memory only: the minibatch gradient is the same whatever the micro-batch",
    "critic.micro_batch_size": "as actor.micro_batch_size",
    "actor.nnodes": "more or fewer ranks: the update's gradient is normalised by global token counts and "
                    "AdamW's state is saved whole, so it loads on any rank count",
    "actor.nproc_per_node": "as actor.nnodes",
    "actor.sharding": "how ranks hold the model (FSDP2 or DDP), not what they compute",
    "actor.max_restarts": "torch-elastic restarts after a rank failed: fault handling only",
    "reward.function": "to fix a reward function: the new one is checked on training prompts before the "
                       "run goes on",
    "reward.functions": "as reward.function (the weights stay: they define the reward)",
    "reward.timeout_s": "time limit of a reward function call",
    "reward.remote_timeout_s": "time limit of a server call",
    "rollout.remote_timeout_s": "time limit of a rollout server call",
    "rollout.vllm_kv_cache_gib": "the engine's memory, not its samples",
    "rollout.vllm_gpu_memory_utilization": "as rollout.vllm_kv_cache_gib",
}
"""Fields that may change on resume, with why each is safe to change in the middle of a run."""
RESUMABLE_SECTIONS = {"resources": "what each task asks of the cluster: the same computation on other machines"}
"""Sections all of whose fields may change on resume."""
LOCATION = ("run.storage_root", "run.name")
"""Where the run is found, not how it trains: the folder it was found in wins, silently."""


def may_change(key: str) -> bool:
    return key in RESUMABLE or key.split(".", 1)[0] in RESUMABLE_SECTIONS


@dataclass(frozen=True)
class ConfigChange:
    """One field whose value changed on resume."""

    key: str
    old: Any
    new: Any
    iteration: int
    """First iteration trained with the new value."""

    @property
    def tag(self) -> str:
        return f"config_change.iter-{self.iteration:06d}.{self.key}"

    def describe(self) -> str:
        return f"{self.key}: {self.old!r} -> {self.new!r} from iter-{self.iteration:06d}"

    def as_dict(self) -> Dict[str, Any]:
        return {"key": self.key, "old": self.old, "new": self.new, "iteration": self.iteration}


def check_resume_workflow(stored: TrainConfig, workflow: str, run: str) -> None:
    """A run resumes only through the workflow that trains what it trains: a PPO run through
    ``reinforce_training`` would train without its critic and lose it."""
    if workflow == "reinforce" and stored.uses_critic:
        raise ConfigError(f"run {run} is a {stored.run.algorithm} run (it trains a critic; run.json): resume it "
                          f"with workflows/ppo.py ppo_training, not reinforce_training")
    if workflow == "ppo" and not stored.uses_critic:
        raise ConfigError(f"run {run} is a {stored.run.algorithm} run (critic-free; run.json): resume it with "
                          f"workflows/reinforce.py reinforce_training, not ppo_training")


def plan_resume(stored: TrainConfig, given: TrainConfig, keys: Iterable[str], done: int, run: str,
                root: str) -> tuple:
    """``(config, changes)`` of a resumed run: ``stored`` with the user's changes of :data:`RESUMABLE`
    fields (``keys``: the fields the user's preset and overrides set; ``done``: iterations completed;
    ``root``: the storage root the run was found under). :class:`ConfigError` naming every other
    changed field, or an iteration count below ``done``."""
    old, new = flatten(stored), flatten(given)
    diffs = {k: (old[k], new[k]) for k in sorted(set(keys)) if k in old and k not in LOCATION and old[k] != new[k]}
    refused = [k for k in diffs if not may_change(k)]
    if refused:
        listed = ", ".join(f"{k} (stored {diffs[k][0]!r}, given {diffs[k][1]!r})" for k in refused)
        raise ConfigError(f"run {run} exists and was trained with other values of: {listed}. These cannot change "
                          f"on resume; drop them from --preset/--overrides to resume, or start a new run (another "
                          f"--run_name) to train with them. Fields that may change on resume: "
                          f"{', '.join(sorted(RESUMABLE))}, resources.* (docs/reliability.md)")
    if "run.num_iterations" in diffs and diffs["run.num_iterations"][1] < done:
        raise ConfigError(f"run.num_iterations={diffs['run.num_iterations'][1]}: run {run} has completed {done} "
                          f"iterations already")
    data = to_dict(stored)
    for key, (_, value) in diffs.items():
        _set(data, key, value)
    data["run"]["storage_root"] = root
    changes = [ConfigChange(k, a, b, done) for k, (a, b) in diffs.items()]
    return config_from_json_dict(data), changes


def _set(data: Dict[str, Any], key: str, value: Any) -> None:
    *sections, name = key.split(".")
    node = data
    for s in sections:
        node = node[s]
    node[name] = value


def change_records(previous: Iterable[Mapping[str, Any]], changes: List[ConfigChange]) -> List[Dict[str, Any]]:
    """``run.json``'s ``config_changes``: the earlier records, then these."""
    return [dict(r) for r in previous] + [c.as_dict() for c in changes]

"""Resuming a run, every decision in one place: which run folder a launch works in
(:func:`run_layout`), whether it resumes (:func:`resumes`: the folder holds ``run.json``), through which
workflow (:func:`check_resume_workflow`), with which config (:func:`plan_resume`), against which MLflow
run (:func:`check_tracked_here`), from which state (:func:`resume_run`: the committed checkpoints
``state.json`` names, :func:`check_resume_point`), what a finished run whose checkpoint was damaged does
(:func:`check_finished_intact`, :data:`DAMAGED_ADVICE`: it stays FINISHED), and what a run that stopped
tells its user to do (:func:`next_step`). ``models.run.setup`` calls :func:`resume_run`; an iteration
that ran after the last commit is redone (``state.json`` is written last, docs/reliability.md).

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

import dataclasses
import datetime as dt
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Tuple

from models import storage, tracking
from models.checkpoint import CheckpointError, download_checkpoint, is_committed
from models.config import ConfigError, TrainConfig
from models.config.io import config_from_json_dict, flatten, to_dict
from models.run import lock as run_lock
from models.run.data import read_run_prompts
from models.run.layout import RunInfo, RunLayout
from models.run.preflight import check_reward_functions
from models.run.types import PolicyState, RunHandle
from models.tracking.redact import redact

RESUMABLE: Dict[str, str] = {
    "run.num_iterations": "the run's length: extend a finished run or stop sooner (not below the iterations done)",
    "run.eval_interval": "when held-out evaluation runs; no training step depends on it",
    "run.eval_before_training": "whether the starting policy is evaluated; no training step depends on it",
    "run.save_interval": "which checkpoints are kept from now on (the resume point's always is)",
    "run.keep_checkpoints": "how many old checkpoints are kept from now on (what a resume needs always is): storage "
                            "only",
    "run.keep_batches": "how many old batches are kept from now on: no task reads a committed iteration's batch",
    "run.iterations_per_chunk": "how iterations are grouped into sub-workflows: orchestration only",
    "run.iterations_per_execution": "how iterations are grouped into Flyte executions: orchestration only",
    "run.num_logged_samples": "how many samples each iteration logs to MLflow",
    "run.checkpoint_artifact_max_mb": "which kept checkpoints are copied into MLflow",
    "run.registered_model_name": "where the final policy is registered, which happens at the end",
    "run.lock_ttl_s": "when the run's lock counts as stale",
    "run.memory_limit_gib": "when the keeper stops a local run that holds too much memory: a guard, no state "
                            "depends on it",
    "run.resident_layout": "where a resident run generates, not what it samples: every sample is seeded by its "
                           "prompt's index whichever engine draws it, and the checkpoints are the same files",
    "run.resident_reference": "whether the resident trainer holds π_ref between scores or reads it for each: the "
                              "same reference checkpoint either way",
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
    "rollout.vllm_max_num_seqs": "as rollout.vllm_kv_cache_gib (each sample is a request seeded on its own)",
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


def run_layout(cfg: TrainConfig, run_name: str = "") -> RunLayout:
    """The run folder a launch works in, under ``run.storage_root``: ``run_name`` (``--run_name``), else
    ``run.name``, else a new one named for the algorithm and the time; a launch resumes the run it holds
    (:func:`resumes`)."""
    name = run_name or cfg.run.name or f"{cfg.run.algorithm}-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    return RunLayout(cfg.run.storage_root, name)


def resumes(layout: RunLayout) -> bool:
    """A launch of this run's name resumes it: its folder holds ``run.json`` (written when it started)."""
    return storage.exists(layout.run_info_url)


# --- the resume point: checked before anything is touched ----------------------------------------

def check_resume_point(run_url: str, actor_url: str, critic_url: str) -> None:
    """The checkpoints ``state.json`` names must be committed."""
    for url in (actor_url, critic_url):
        if url and not is_committed(url):
            raise CheckpointError(f"run {run_url}: state.json points at {url}, which is not committed "
                                  f"(no COMMITTED.json); the run's storage was changed by hand or is damaged")


DAMAGED_ADVICE = ("a resume cannot repair it (the run would go on from this checkpoint): restore the file from a "
                  "copy (the run's MLflow artifacts hold the checkpoints it logged), or train under a new --run_name")
"""What a user can do about a committed checkpoint that fails its verification."""


DAMAGE = ("fails its blake3 check", "fails its sha256 check", "listed in COMMITTED.json is missing",
          "COMMITTED.json says")
"""What :func:`models.checkpoint.verify_local` says of a committed checkpoint whose files changed."""


def next_step(why: str) -> str:
    """How to go on after ``why``: a resume, unless a committed checkpoint is damaged (a resume would load it
    again)."""
    return DAMAGED_ADVICE if any(d in why for d in DAMAGE) else "rerun the same command to resume"


def check_finished_intact(run_url: str, mlflow_run_id: str, urls: Iterable[str]) -> None:
    """The checkpoints a finished run would go on from still match their commit markers (every file's size
    and BLAKE3), checked before its MLflow run is reopened: a relaunch that met the damage later would
    leave the finished run marked FAILED. :class:`CheckpointError` naming the file and what to do."""
    for url in (u for u in urls if u):
        try:
            download_checkpoint(url)  # local: checked in place; remote: checked into the node's cache
        except CheckpointError as err:
            raise CheckpointError(f"run {run_url} finished, and {err}; MLflow run {mlflow_run_id} stays FINISHED. "
                                  f"{DAMAGED_ADVICE[0].upper()}{DAMAGED_ADVICE[1:]}") from None


# --- resuming: the stored run, its MLflow run, the state it goes on from --------------------------

def check_tracked_here(layout: RunLayout, info: RunInfo) -> str:
    """The run's MLflow run is at this tracking URI: a resume against another server or database is
    refused naming the URI the run started with, before anything is touched. Its status
    (``FINISHED``, ``FAILED``, ...; "" without an MLflow run)."""
    from mlflow.exceptions import MlflowException

    if not info.mlflow_run_id:
        return ""
    try:
        return tracking.client().get_run(info.mlflow_run_id).info.status
    except MlflowException as err:
        if err.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        now = where_tracked()
        started = info.mlflow_tracking_uri or "the tracking URI it was started with"
        raise ConfigError(f"run {layout.url} is tracked as MLflow run {info.mlflow_run_id} at {started}, and "
                          f"MLFLOW_TRACKING_URI={now} has no such run: set MLFLOW_TRACKING_URI to {started} to "
                          f"resume it (run.json)") from None


def where_tracked() -> str:
    """This process's tracking URI, credentials masked, a relative SQLite path made absolute (the same
    ``sqlite:///mlflow.db`` is another database in another folder)."""
    uri = tracking.tracking_uri()
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        uri = "sqlite:///" + os.path.abspath(uri[len("sqlite:///"):])
    return redact(uri)


def _record_changes(layout: RunLayout, info: RunInfo, cfg: TrainConfig, changes: List[ConfigChange]) -> None:
    """Keep the resumed run's config and its changes in ``run.json``, and say what changed."""
    if not changes:
        return
    layout.write_run_info(dataclasses.replace(info, config=to_dict(cfg),
                                              config_changes=change_records(info.config_changes, changes)))
    for c in changes:
        print(f"resuming {layout.run_name}: {c.describe()}", flush=True)


def resume_run(layout: RunLayout, cfg_now: TrainConfig, keys: Iterable[str] = (),
               workflow: str = "") -> Tuple[TrainConfig, RunHandle, PolicyState]:
    """``(config, run, state)`` to continue a run from ``state.json`` with: its stored config, plus the
    changes among ``keys`` (the fields the user's preset and overrides set) that may change on resume
    (:func:`plan_resume`).

    Everything is checked before anything is touched: the workflow, the config changes, the resume
    point's checkpoints (a finished run's: every file against its checksum, so a relaunch that cannot go
    on leaves the finished MLflow run FINISHED), a changed reward function. The next iteration starts from
    the committed checkpoints ``state.json`` names. With fixed seeds on the same CPU machine the resumed run is
    bit-identical to an uninterrupted one (every seed depends on ``run.seed`` and the iteration only;
    ``tests/integration/test_resume.py``, docs/reliability_faults.md)."""
    info = layout.read_run_info()
    stored = config_from_json_dict(info.config)
    check_resume_workflow(stored, workflow, layout.url)
    status = check_tracked_here(layout, info)
    state = layout.read_state()
    done = 0 if state is None else state.iteration + 1
    cfg, changes = plan_resume(stored, cfg_now, keys, done, layout.url, layout.root)
    if state is not None:
        check_resume_point(layout.url, state.actor_url, state.critic_url or "")
        if status == "FINISHED":  # its end state stands unless the run can really go on
            check_finished_intact(layout.url, info.mlflow_run_id or "", (
                state.actor_url, state.critic_url or "", state.extras.get("behaviour_url", "")))
    base = storage.join(layout.url, "data")
    rm = storage.join(layout.url, "reward-model") if cfg.reward.source == "model" else ""
    handle = RunHandle(layout.root, layout.run_name, info.mlflow_run_id or "", layout.reference_url(),
                       storage.join(base, "train_prompts.jsonl"), storage.join(base, "eval_prompts.jsonl"), rm)
    if cfg.reward.source == "function" and any(c.key in ("reward.function", "reward.functions") for c in changes):
        train = read_run_prompts(handle.train_prompts_url)
        check_reward_functions(cfg, train.take(range(min(4, len(train)))))
    _record_changes(layout, info, cfg, changes)
    if info.mlflow_run_id:  # the same MLflow run goes on (a finished run shows as running again)
        tracking.client().update_run(info.mlflow_run_id, status="RUNNING")
        tracking.set_tags(info.mlflow_run_id, {"flyte_execution_id": run_lock.execution_name(),
                                               **{c.tag: f"{c.old!r} -> {c.new!r}" for c in changes}})
    if state is None:
        critic = storage.join(layout.url, "critic-init") if cfg.uses_critic else ""
        return cfg, handle, PolicyState(0, layout.reference_url(), critic, cfg.kl.coef)
    start = PolicyState.resumed(state, cfg.kl.coef, off_policy=cfg.run.pipelined)
    if start.behaviour_url:
        check_resume_point(layout.url, start.behaviour_url, "")
    return cfg, handle, start

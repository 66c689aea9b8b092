"""Scheduled retraining (``workflows/retrain.py``): start from the registry's ``champion``, train on the
day's prompts, and promote the result only if it beats the champion.

The retraining run is an ordinary PPO run whose ``model.actor_path`` is the champion, so its frozen
reference *is* the champion: the comparison evaluates the run's final actor and its reference on
the run's held-out prompts, with the same greedy sampling and reward.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import List, NamedTuple

from models import storage, tracking
from models.config import TrainConfig
from models.config.io import load_config
from models.run.types import RunHandle
from models.stages.evaluate import eval_reward
from models.stages.outputs import TrainingSummary
from models.tracking import registry

UNSET_DATE = dt.datetime(1970, 1, 1)
"""Default of ``run_date``: the schedule sets it to the kickoff time; left unset, today (UTC)."""


class RetrainPlan(NamedTuple):
    overrides: List[str]
    """The caller's overrides plus actor, prompts and registry name of this retraining."""
    run_name: str
    """``retrain-{date}`` (running the same date again resumes that run)."""
    champion_version: str
    """Registry version the run starts from ("" when there was no champion)."""


@dataclass(frozen=True)
class RetrainResult:
    """What one retraining decided."""

    promoted: bool
    """Whether ``champion`` now points at the candidate."""
    decision: str
    """``promoted`` or ``kept_for_review`` (the candidate keeps its ``candidate`` alias)."""
    candidate_version: str
    champion_version: str
    """The champion after the decision ("" if there is none)."""
    candidate_reward: float
    """Mean held-out reward of the new policy."""
    champion_reward: float
    """Mean held-out reward of the policy it started from."""
    mlflow_run_id: str


def day_of(run_date: dt.datetime) -> str:
    """``YYYY-MM-DD`` of the kickoff time (today, UTC, for :data:`UNSET_DATE`)."""
    when = dt.datetime.now(dt.timezone.utc) if run_date.replace(tzinfo=None) <= UNSET_DATE else run_date
    return when.strftime("%Y-%m-%d")


def plan(prompts_root: str, run_date: dt.datetime, registered_model_name: str, preset: str, overrides: List[str],
         base_checkpoint: str, heldout_prompts: str) -> RetrainPlan:
    if not registered_model_name:
        raise ValueError("retraining needs a registered_model_name (the champion's registry entry)")
    day = day_of(run_date)
    storage_root = load_config(preset, list(overrides)).run.storage_root
    version = registry.version_by_alias(registered_model_name, registry.CHAMPION) or ""
    actor = registry.checkpoint_from_registry(
        registered_model_name, version, storage.join(storage_root, "registry", registered_model_name, f"v{version}")) \
        if version else base_checkpoint
    extra = [f"model.actor_path={actor}"] if actor else []  # else the preset's model (tiny presets: the demo)
    extra += [f"data.train_prompts={storage.join(prompts_root, day)}/",
              f"data.eval_prompts={heldout_prompts or storage.join(prompts_root, 'heldout') + '/'}",
              f"run.registered_model_name={registered_model_name}"]
    return RetrainPlan(list(overrides) + extra, f"retrain-{day}", version)


def decide(cfg: TrainConfig, run: RunHandle, summary: TrainingSummary, champion_version: str,
           min_improvement: float) -> RetrainResult:
    name = summary.registered_model
    if not summary.model_version:
        raise ValueError("the retraining run registered no policy (run.registered_model_name is empty)")
    candidate = eval_reward(cfg, run, summary.final_actor_url)
    champion = eval_reward(cfg, run, run.reference_url)
    promoted = candidate > champion + min_improvement
    decision = "promoted" if promoted else "kept_for_review"
    if promoted:
        registry.set_alias(name, registry.CHAMPION, summary.model_version)
    registry.tag_version(name, summary.model_version, {
        "retrain.decision": decision, "retrain.candidate_reward": f"{candidate:.4f}",
        "retrain.champion_reward": f"{champion:.4f}", "retrain.champion_version": champion_version or "(none)",
        "retrain.min_improvement": min_improvement})
    step = max(summary.iterations - 1, 0)
    tracking.log_metrics(summary.mlflow_run_id, {"retrain/candidate_reward": candidate,
                                                 "retrain/champion_reward": champion}, step=step)
    tracking.set_tags(summary.mlflow_run_id, {"retrain.decision": decision})
    now = summary.model_version if promoted else champion_version
    print(f"retrain: candidate v{summary.model_version} {candidate:.3f} vs champion "
          f"{'v' + champion_version if champion_version else '(base)'} {champion:.3f} "
          f"(min improvement {min_improvement}) -> {decision}", flush=True)
    return RetrainResult(promoted, decision, summary.model_version, now, candidate, champion, summary.mlflow_run_id)

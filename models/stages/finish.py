"""The end of a run: the finish stage (register the final policy, close the MLflow run, summarise) and
what a failed training execution leaves (its MLflow run marked FAILED, its lock released)."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import numpy as np

from models import storage, tracking
from models.checkpoint import is_committed
from models.config import RunConfig, TrainConfig
from models.config.io import load_config
from models.engines import close_engines
from models.run import end as run_end, lock as run_lock, retention
from models.run.health import check_healthy
from models.run.retention import human_bytes
from models.run.setup import DEFAULT_PRESETS
from models.run.types import PolicyState, RunHandle
from models.stages.outputs import TrainingSummary
from models.tracking import registry
from models.tracking.redact import redact


def run_finish(cfg: TrainConfig, run: RunHandle, state: PolicyState) -> TrainingSummary:
    check_healthy(cfg, run.mlflow_run_id)  # before anything is registered (models/run/health.py)
    hist = [v for _, v in tracking.metric_history(run.mlflow_run_id, "rollout/reward_mean")]
    first = hist[0] if hist else float("nan")
    last = float(np.mean(hist[-2:])) if hist else float("nan")
    close_engines()
    if not is_committed(state.actor_url):
        raise RuntimeError(f"final actor checkpoint {state.actor_url} is not committed")
    policy = registry.log_policy(run.mlflow_run_id, state.actor_url, cfg.run.registered_model_name)
    tracking.end_run(run.mlflow_run_id)
    run_lock.release(run.layout.lock_url, run.launch)
    run_end.finished(run.layout.url)
    summary = TrainingSummary(run.layout.url, run.mlflow_run_id, state.iteration, first, last, state.actor_url,
                              cfg.run.registered_model_name if policy.version else "", policy.version)
    curve = _write_curve(run)
    text = summary_text(cfg, run, summary, curve, retention.usage(run.layout))
    head, *rest = text.splitlines()  # the run's description in the MLflow UI (Markdown)
    tracking.set_tags(run.mlflow_run_id, {"mlflow.note.content": "\n".join([f"**{head}**", ""] + [
        f"- {line.strip()}" for line in rest])})
    print(text, flush=True)
    return summary


def _write_curve(run: RunHandle) -> str:
    """The reward curve as a PNG next to the run's files (local runs), made from the MLflow data."""
    if not storage.is_local(run.layout.url):
        return ""
    from models.tracking.report import plot, reward_curves

    out = f"{storage.local_path(run.layout.url)}/reward_curve.png"
    return plot(reward_curves([run.mlflow_run_id]), out, f"{run.run_name}: mean rollout reward")


def summary_text(cfg: TrainConfig, run: RunHandle, s: TrainingSummary, curve: str, kept: retention.Usage) -> str:
    """What a finished run prints; ``kept``: what its folder holds (:func:`models.run.retention.usage`)."""
    roles = "actor/ and critic/" if cfg.uses_critic else "actor/"
    return "\n".join([
        f"Run {run.run_name} finished: {s.iterations} iteration{'' if s.iterations == 1 else 's'} of "
        f"{cfg.run.algorithm}.",
        f"  rollout reward: {s.reward_first:.3f} (iteration 1) -> {s.reward_last:.3f} (mean of the last two), "
        f"gain {s.reward_last - s.reward_first:+.3f}",
        f"  run folder:     {s.run_url}  (run.json, state.json, data/, reference/; {human_bytes(kept.total)} in all)",
        f"  batches:        {s.run_url}/iter-*/{{rollouts,score,advantages}}.arrow: "
        f"{_named(kept.batches, 'iteration', str)}, run.keep_batches={cfg.run.keep_batches}",
        f"  checkpoints:    {_named(kept.checkpoints, 'checkpoint', lambda i: f'iter-{i:06d}')}, {roles} under each, "
        f"run.keep_checkpoints={cfg.run.keep_checkpoints}; final actor {s.final_actor_url}",
        f"  reward curve:   {curve or '(remote storage: see MLflow)'}",
        "  policy:         " + (f"models:/{s.registered_model}/{s.model_version} (alias {registry.CANDIDATE})"
                                if s.model_version else "logged to the MLflow run (not registered)"),
        f"  review:         mlflow ui --backend-store-uri {redact(tracking.tracking_uri())}   "
        f"(experiment {cfg.run.mlflow_experiment}, run {run.run_name}, id {s.mlflow_run_id})",
    ])


def _named(by_iteration: Dict[int, int], noun: str, name: Callable[[int], str]) -> str:
    """``4 checkpoints (iter-000009, iter-000019, iter-000029, iter-000039; 2.3 MB)`` (six named at most),
    ``10 iterations (30-39; 1.1 MB)`` (a contiguous range as one), or ``none``."""
    its = sorted(by_iteration)
    if not its:
        return "none"
    if len(its) > 2 and its[-1] - its[0] + 1 == len(its):
        named = [f"{name(its[0])}-{name(its[-1])}"]
    else:
        named = [name(i) for i in its] if len(its) <= 6 else [name(i) for i in its[:3]] + ["..."] + \
            [name(i) for i in its[-2:]]
    return f"{len(its)} {noun}{'' if len(its) == 1 else 's'} ({', '.join(named)}; " \
           f"{human_bytes(sum(by_iteration.values()))})"


def mark_failed(preset: str, overrides: List[str], error: str) -> Optional[str]:
    """Mark the run of a failed training execution FAILED in MLflow (``error`` as its ``end_reason`` tag)
    and release its lock (``models/run/end.py``); returns the line saying so, if any."""
    try:
        experiment = load_config(preset or DEFAULT_PRESETS["ppo"], overrides).run.mlflow_experiment
    except Exception:  # noqa: BLE001 - the config may be what failed
        experiment = RunConfig().mlflow_experiment
    return run_end.mark_failed(experiment, error)

"""The commit stage: the iteration's resume point (``state.json``), its metrics and samples in MLflow,
the checkpoints it keeps, and the state the next iteration starts from."""

from __future__ import annotations

import datetime as dt
import json
from typing import Dict, List, Optional

from kernels.kl_controller import AdaptiveKLController
from models import storage, tracking
from models.training.files import optimizer_url
from models.config import TrainConfig
from models.data.batch import RolloutBatch
from models.data.batch_schema import REWARD_NORM_KEY
from models.run import lock as run_lock, retention
from models.run.layout import RunState
from models.run.types import PolicyState, RunHandle
from models.stages.progress import progress_line
from models.stages.samples import sample_table
from models.tracking import registry


def next_kl_coef(cfg: TrainConfig, state: PolicyState, stats: Dict[str, float]) -> float:
    if not cfg.kl.adaptive:
        return state.kl_coef
    ctl = AdaptiveKLController(state.kl_coef, cfg.kl.target, cfg.kl.horizon)
    return ctl.update(stats.get("rollout/init_policy_kl", 0.0), cfg.rollout.samples_per_iteration).value


def run_commit(cfg: TrainConfig, run: RunHandle, state: PolicyState, stats: List[Dict[str, float]],
               batch: RolloutBatch, actor_url: str, critic_url: str) -> PolicyState:
    i = state.iteration
    stored = run.layout.read_state()
    if stored is not None and stored.iteration == i:  # a retried commit whose first try wrote state.json
        return redo_commit(cfg, run, stored)
    merged: Dict[str, float] = {}
    for s in stats:
        merged.update(s)
    kl = next_kl_coef(cfg, state, merged)
    prev = last_commit(cfg, run, stored)
    if prev is not None and prev[0] == i - 1:  # end to end, orchestration included
        merged["time/iteration_s"] = iteration_wall_s(prev[1], run_lock.acquired_at(run.layout.lock_url))
    # MLflow first (idempotent per step and file), state.json last: a crash in between redoes
    # this commit on resume instead of losing the iteration's metrics.
    tracking.log_metrics(run.mlflow_run_id, merged, step=i)
    tracking.log_table(run.mlflow_run_id, sample_table(batch, cfg.run.num_logged_samples),
                       f"samples/iter-{i:06d}.json")
    if resume_point_at(cfg, i):
        for role, url in (("actor", actor_url), ("critic", critic_url)):
            if url:
                registry.log_checkpoint(run.mlflow_run_id, f"iter-{i:06d}/{role}", url,
                                        cfg.run.checkpoint_artifact_max_mb)
    reward_norm = next_reward_norm(state, batch)
    behaviour = state.actor_url if cfg.run.pipelined else ""  # samples iteration i + 1 (docs/off_policy.md)
    run_lock.renew(run.layout.lock_url, run.launch)  # LostLock: another launch holds the run now, never write its state
    nxt = PolicyState(i + 1, actor_url or state.actor_url, critic_url or state.critic_url, kl, reward_norm, behaviour)
    if cfg.run.resident:  # the services hold the policy; the resume point moves with their checkpoints only
        storage.write_json(progress_url(run), {"iteration": i, "at": storage.utc_now_iso("milliseconds")})
        if actor_url and resume_point_at(cfg, i):  # (off-policy: the checkpoints before are the behaviour's)
            move_resume_point(cfg, run, nxt, stored)
    else:
        move_resume_point(cfg, run, nxt, stored)
    print(progress_line(cfg, i, merged), flush=True)
    return nxt


def move_resume_point(cfg: TrainConfig, run: RunHandle, nxt: PolicyState, prev: Optional[RunState]) -> None:
    """Write ``state.json`` (with retention's record), then delete what it no longer needs: the checkpoints and
    batches retention drops (``run.keep_checkpoints``, ``run.keep_batches``), older optimizer states."""
    point = nxt.resume_point()
    record = retention.plan(cfg, run.layout, point, prev)
    run.layout.write_state(record.recorded(point) if record is not None else point)
    retention.apply(run, retention.Retained.of(prev), record)
    prune(cfg, run, point.iteration)


def redo_commit(cfg: TrainConfig, run: RunHandle, stored: RunState) -> PolicyState:
    """A commit ``state.json`` already records (a task retried after its first try got that far): its metrics
    are in MLflow, so only the deletions after ``state.json`` are done again; the state it committed."""
    run_lock.renew(run.layout.lock_url, run.launch)
    retention.apply(run, None, retention.Retained.of(stored))
    prune(cfg, run, stored.iteration)
    return PolicyState.resumed(stored, cfg.kl.coef, off_policy=cfg.run.pipelined)


def prune(cfg: TrainConfig, run: RunHandle, iteration: int) -> None:
    """What the resume point after ``iteration`` no longer needs besides what retention drops."""
    if cfg.run.resident:
        prune_optimizer_states(cfg, run, iteration)
    else:
        prune_checkpoints(cfg, run, iteration)


def resume_point_at(cfg: TrainConfig, iteration: int) -> bool:
    """Whether ``iteration``'s checkpoints are kept (every ``run.save_interval``-th and the last): in a
    resident run, the iterations whose commit moves the resume point."""
    return retention.saves_checkpoint(cfg, iteration)


def progress_url(run: RunHandle) -> str:
    """``{run}/progress.json``: the last iteration a resident run committed, and when (its resume point,
    ``state.json``, is the last checkpoint's)."""
    return storage.join(run.layout.url, "progress.json")


def last_commit(cfg: TrainConfig, run: RunHandle, stored: Optional[RunState]):
    """``(iteration, ISO time)`` of the last commit (``stored``: ``state.json``), or None."""
    if cfg.run.resident and storage.exists(progress_url(run)):
        p = storage.read_json(progress_url(run))
        return p["iteration"], p["at"]
    return None if stored is None else (stored.iteration, stored.updated_at)


def prune_optimizer_states(cfg: TrainConfig, run: RunHandle, iteration: int) -> None:
    """A resident run's checkpoints are every ``save_interval``-th iteration's and the last: all kept; the
    optimizer states only with the newest (the resume point's)."""
    for j in range(iteration - 1, -1, -1):  # (off-policy: the behaviour's checkpoint, just before, has one too)
        if (j + 1) % cfg.run.save_interval == 0 or j == iteration - 1:
            for url in (run.layout.actor_url(j), run.layout.critic_url(j)):
                storage.remove(optimizer_url(url), recursive=True)
        if (j + 1) % cfg.run.save_interval == 0:
            return


def next_reward_norm(state: PolicyState, batch: RolloutBatch) -> Dict[str, float]:
    """The running reward moments after the scored ``batch`` (``reward.normalize``), else the state's."""
    moments = batch.metadata.extras.get(REWARD_NORM_KEY)
    return json.loads(moments) if moments else dict(state.reward_norm)


def seconds_since(iso: str) -> float:
    return (dt.datetime.now(dt.timezone.utc) - dt.datetime.fromisoformat(iso)).total_seconds()


def iteration_wall_s(prev_commit: str, launch_took_run: str) -> float:
    """Seconds since the previous commit, or since this launch took the run when that came later (the
    first iteration after a resume: never the time the run was down)."""
    since = prev_commit
    if launch_took_run and dt.datetime.fromisoformat(launch_took_run) > dt.datetime.fromisoformat(prev_commit):
        since = launch_took_run
    return seconds_since(since)


def prune_checkpoints(cfg: TrainConfig, run: RunHandle, iteration: int) -> None:
    """Keep every ``save_interval``-th iteration's checkpoints and the newest; drop the one before (with
    ``run.off_policy_steps=1`` the one before that: the previous actor samples the next batch).
    Optimizer states are kept with the newest checkpoints only (the resume point's). With
    ``run.keep_checkpoints`` >= 0 retention drops the checkpoints (``models/run/retention.py``)."""
    for url in (run.layout.actor_url(iteration - 1), run.layout.critic_url(iteration - 1)) if iteration > 0 else ():
        storage.remove(optimizer_url(url), recursive=True)
    if cfg.run.keep_checkpoints >= 0:
        return
    old = iteration - 1 - int(cfg.run.pipelined)
    if old >= 0 and (old + 1) % cfg.run.save_interval != 0:
        for url in (run.layout.actor_url(old), run.layout.critic_url(old)):
            storage.remove(url, recursive=True)

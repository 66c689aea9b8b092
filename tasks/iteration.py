"""Bookkeeping tasks of a run: ``commit_iteration`` (the resume point, metrics, retention),
``evaluate`` (held-out prompts) and ``finish_run`` (summary)."""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
import sys
from typing import Dict, List, Optional

import numpy as np
from flytekit import Resources, task
from flytekit.types.error import FlyteError

from kernels.kl import AdaptiveKLController
from models import storage
from models.checkpoint import is_committed
from models.training.optimizer_state import optimizer_url
from models.engines import close_engines
from models.tracking import registry
from models.run import end as run_end, lock as run_lock
from tasks import secrets
from models import tracking
from tasks.decks import conversation_text
from models.data.batch import BatchMetadata, RolloutBatch
from models.data.batch_schema import REWARD_NORM_KEY, decode_data_columns
from tasks.common import read_prompts, load_tokenizer
from models.config import RunConfig, TrainConfig
from models.config.io import load_config
from tasks.deploy import deployment_config, resources_for
from models.tracking.redact import redact
from tasks.rollout import engine_for, sample_data, sampling_spec
from models.run.data import sample_columns
from models.run.health import check_healthy
from tasks.score import batch_rewards
from models.run.setup import DEFAULT_PRESETS
from models.run.types import PolicyState, RunHandle


def next_kl_coef(cfg: TrainConfig, state: PolicyState, stats: Dict[str, float]) -> float:
    if not cfg.kl.adaptive:
        return state.kl_coef
    ctl = AdaptiveKLController(state.kl_coef, cfg.kl.target, cfg.kl.horizon)
    return ctl.update(stats.get("rollout/init_policy_kl", 0.0), cfg.rollout.samples_per_iteration).value


def sample_table(batch: RolloutBatch, n: int) -> Dict[str, list]:
    """The first ``n`` samples: prompt (as the model saw it), response, reward, KL(π_old‖π_ref)
    summed over the response's policy tokens (multi-turn: not the tool's), and what the sample was judged against: its data row (``row_id``)
    and the row's other columns, one table column each (``answer``, ...; a column named like one of
    the table's own gets a ``data.`` prefix)."""
    t = batch.table.slice(0, n)
    masks = t.column("loss_mask").to_pylist() if "loss_mask" in t.column_names else [True] * t.num_rows
    kl = [float(np.sum((np.asarray(o) - np.asarray(r)) * np.asarray(m))) for o, r, m in  # policy tokens only
          zip(t.column("old_logprobs").to_pylist(), t.column("ref_logprobs").to_pylist(), masks)]
    table = {"prompt": t.column("prompt").to_pylist(), "response": t.column("response").to_pylist(),
             "reward": [float(x) for x in t.column("reward").to_pylist()], "kl": kl}
    if "reward_raw" in t.column_names:
        table["reward_raw"] = [float(x) for x in t.column("reward_raw").to_pylist()]
    if "episode" in t.column_names:  # multi-turn: turns, tool calls and results as a transcript
        table["conversation"] = [conversation_text(e) for e in t.column("episode").to_pylist()]
    if "row_id" in t.column_names:
        table["row_id"] = t.column("row_id").to_pylist()
    if "data_columns" in t.column_names:
        for name, values in decode_data_columns(t.column("data_columns").to_pylist()).items():
            table[f"data.{name}" if name in table else name] = [_cell(v) for v in values]
    return table


def _cell(value):
    """A table cell: scalars as they are, lists and objects as their JSON text."""
    scalar = value is None or isinstance(value, (str, int, float, bool))
    return value if scalar else json.dumps(value, ensure_ascii=False)


def prune_checkpoints(cfg: TrainConfig, run: RunHandle, iteration: int) -> None:
    """Keep every ``save_interval``-th iteration's checkpoints and the newest; drop the one before (with
    ``run.off_policy_steps=1`` the one before that: the previous actor samples the next batch).
    Optimizer states are kept with the newest checkpoints only (the resume point's)."""
    for url in (run.layout.actor_url(iteration - 1), run.layout.critic_url(iteration - 1)) if iteration > 0 else ():
        storage.remove(optimizer_url(url), recursive=True)
    old = iteration - 1 - cfg.run.off_policy_steps
    if old >= 0 and (old + 1) % cfg.run.save_interval != 0:
        for url in (run.layout.actor_url(old), run.layout.critic_url(old)):
            storage.remove(url, recursive=True)


def run_commit(cfg: TrainConfig, run: RunHandle, state: PolicyState, stats: List[Dict[str, float]],
               batch: RolloutBatch, actor_url: str, critic_url: str) -> PolicyState:
    merged: Dict[str, float] = {}
    for s in stats:
        merged.update(s)
    i = state.iteration
    kl = next_kl_coef(cfg, state, merged)
    prev = run.layout.read_state()
    if prev is not None and prev.iteration == i - 1:  # end to end, orchestration included
        merged["time/iteration_s"] = iteration_wall_s(prev.updated_at, run_lock.acquired_at(run.layout.lock_url))
    # MLflow first (idempotent per step and file), state.json last: a crash in between redoes
    # this commit on resume instead of losing the iteration's metrics.
    tracking.log_metrics(run.mlflow_run_id, merged, step=i)
    tracking.log_table(run.mlflow_run_id, sample_table(batch, cfg.run.num_logged_samples),
                       f"samples/iter-{i:06d}.json")
    if (i + 1) % cfg.run.save_interval == 0 or i + 1 == cfg.run.num_iterations:
        for role, url in (("actor", actor_url), ("critic", critic_url)):
            if url:
                registry.log_checkpoint(run.mlflow_run_id, f"iter-{i:06d}/{role}", url,
                                        cfg.run.checkpoint_artifact_max_mb)
    reward_norm = next_reward_norm(state, batch)
    behaviour = state.actor_url if cfg.run.off_policy_steps else ""  # samples iteration i + 1 (docs/off_policy.md)
    run_lock.renew(run.layout.lock_url)  # LostLock: another launch holds the run now, never write its state
    nxt = PolicyState(i + 1, actor_url, critic_url, kl, reward_norm, behaviour)
    run.layout.write_state(nxt.resume_point())
    prune_checkpoints(cfg, run, i)
    print(progress_line(cfg, i, merged), flush=True)
    return nxt


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


def progress_line(cfg: TrainConfig, i: int, m: Dict[str, float]) -> str:
    phases = sum(v for k, v in m.items() if k in ("time/rollout_s", "time/score_s", "time/advantages_s",
                                                   "time/actor_update_s", "time/critic_update_s"))
    wall = f"{m['time/iteration_s']:.1f} s wall, " if "time/iteration_s" in m else ""
    return (f"[{cfg.run.algorithm}] iter {i + 1}/{cfg.run.num_iterations}  "
            f"reward {m.get('rollout/reward_mean', float('nan')):.3f}  "
            f"kl {m.get('rollout/init_policy_kl', float('nan')):.3f}  "
            f"len {m.get('rollout/response_length_mean', float('nan')):.1f}  "
            f"{_actor(m)}{_gap(m)}({wall}{phases:.1f} s in tasks)")


def _actor(m: Dict[str, float]) -> str:
    """The actor's loss and clip fraction, or that it took no step (no token or no advantage to learn from)."""
    skipped = f"{m['actor/skipped_steps']:.0f} skipped  " if m.get("actor/skipped_steps") else ""
    if m.get("actor/steps") == 0:
        return "actor: no step (no advantage or token to learn from)  "
    return f"actor_loss {m.get('actor/loss', float('nan')):+.3f}  clip {m.get('actor/clip_frac', float('nan')):.2f}  " \
           f"{skipped}"


def _gap(m: Dict[str, float]) -> str:
    """Sampler vs trainer: the batch's largest log-prob gap (π_old recomputed), else the probe's."""
    for key, label in (("rollout/logprob_gap_max", "gap"), ("rollout/probe_gap_max", "probe gap")):
        if key in m:
            return f"{label} {m[key]:.1e}  "
    return ""


@task(retries=2, requests=Resources(cpu="1", mem="2Gi"), secret_requests=secrets.requests(secrets.S3, secrets.MLFLOW))
def commit_iteration(cfg: TrainConfig, run: RunHandle, state: PolicyState, stats: List[Dict[str, float]],
                     batch: RolloutBatch, actor_url: str, critic_url: str) -> PolicyState:
    """Write ``state.json`` (the resume point), log the iteration's metrics and samples, prune checkpoints."""
    secrets.load(secrets.S3, secrets.MLFLOW)
    with run_lock.heartbeat(run.layout.lock_url):
        return run_commit(cfg, run, state, stats, batch, actor_url, critic_url)


def eval_rewards(cfg: TrainConfig, run: RunHandle, actor_url: str) -> Dict[str, float]:
    """``eval/reward_mean`` (the raw reward: no normalisation, scale or clip) and ``eval/<part>_mean``
    per reward function of the policy at ``actor_url`` on the run's held-out prompts
    (``eval_temperature``), from the run's reward source, each prompt's data columns included."""
    data = read_prompts(run.eval_prompts_url)
    tok = load_tokenizer(run.reference_url)
    spec = sampling_spec(cfg, run, cfg.run.seed, 1, cfg.rollout.eval_temperature)
    cols, episode_cols, _ = sample_data(cfg, engine_for(cfg, actor_url), tok, data, np.arange(len(data)), spec)
    batch = RolloutBatch.from_columns(BatchMetadata(iteration=0, policy_version=0, algorithm=cfg.run.algorithm),
                                      **cols.as_dict(), **episode_cols, **sample_columns(data, 1))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    scores = batch_rewards(cfg, run, batch, max(cfg.actor.micro_batch_size, 1), pad)
    return {"eval/reward_mean": float(np.mean(scores.total)),
            **scores.part_means("eval/")}


def eval_reward(cfg: TrainConfig, run: RunHandle, actor_url: str) -> float:
    """Mean raw reward of the policy at ``actor_url`` on the run's held-out prompts (see :func:`eval_rewards`)."""
    return eval_rewards(cfg, run, actor_url)["eval/reward_mean"]


def run_evaluate(cfg: TrainConfig, run: RunHandle, state: PolicyState) -> float:
    done = dict(tracking.metric_history(run.mlflow_run_id, "eval/reward_mean"))
    if state.iteration - 1 in done:  # evaluated before a crash or at the end of the previous chunk
        return done[state.iteration - 1]
    metrics = eval_rewards(cfg, run, state.actor_url)
    tracking.log_metrics(run.mlflow_run_id, metrics, step=state.iteration - 1)
    return metrics["eval/reward_mean"]


@task(retries=2, secret_requests=secrets.requests(secrets.S3, secrets.MLFLOW, secrets.SERVER),
      **resources_for(deployment_config(), "rollout"))
def evaluate(cfg: TrainConfig, run: RunHandle, state: PolicyState) -> float:
    """Mean reward on the held-out prompts of the policy in ``state`` (logged at the iteration that made it)."""
    secrets.load(secrets.S3, secrets.MLFLOW, secrets.SERVER)
    with run_lock.heartbeat(run.layout.lock_url):
        return run_evaluate(cfg, run, state)


@dataclass(frozen=True)
class TrainingSummary:
    """What a finished run reports."""

    run_url: str
    mlflow_run_id: str
    iterations: int
    reward_first: float
    reward_last: float
    final_actor_url: str
    registered_model: str = ""
    """Model Registry name of the final policy ("" when not registered)."""
    model_version: str = ""
    """Its version (alias ``candidate``)."""


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
    run_lock.release(run.layout.lock_url)
    run_end.finished(run.layout.url)
    summary = TrainingSummary(run.layout.url, run.mlflow_run_id, state.iteration, first, last, state.actor_url,
                              cfg.run.registered_model_name if policy.version else "", policy.version)
    curve = _write_curve(run)
    text = summary_text(cfg, run, summary, curve)
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


def summary_text(cfg: TrainConfig, run: RunHandle, s: TrainingSummary, curve: str) -> str:
    saved = ", ".join(f"iter-{i:06d}" for i in range(cfg.run.num_iterations)
                      if (i + 1) % cfg.run.save_interval == 0 or i + 1 == cfg.run.num_iterations)
    return "\n".join([
        f"Run {run.run_name} finished: {s.iterations} iteration{'' if s.iterations == 1 else 's'} of "
        f"{cfg.run.algorithm}.",
        f"  rollout reward: {s.reward_first:.3f} (iteration 1) -> {s.reward_last:.3f} (mean of the last two), "
        f"gain {s.reward_last - s.reward_first:+.3f}",
        f"  run folder:     {s.run_url}  (run.json, state.json, data/, reference/)",
        f"  batches:        {s.run_url}/iter-*/{{rollouts,score,advantages}}.arrow",
        f"  checkpoints:    {saved} ({'actor/ and critic/' if cfg.uses_critic else 'actor/'} under each); "
        f"final actor {s.final_actor_url}",
        f"  reward curve:   {curve or '(remote storage: see MLflow)'}",
        "  policy:         " + (f"models:/{s.registered_model}/{s.model_version} (alias {registry.CANDIDATE})"
                                if s.model_version else "logged to the MLflow run (not registered)"),
        f"  review:         mlflow ui --backend-store-uri {redact(tracking.tracking_uri())}   "
        f"(experiment {cfg.run.mlflow_experiment}, run {run.run_name}, id {s.mlflow_run_id})",
    ])


@task(retries=1, requests=Resources(cpu="2", mem="8Gi"), secret_requests=secrets.requests(secrets.S3, secrets.MLFLOW))
def finish_run(cfg: TrainConfig, run: RunHandle, state: PolicyState) -> TrainingSummary:
    """Log and register the final policy (alias ``candidate``), close the MLflow run and summarise
    (first iteration's reward, mean of the last two)."""
    secrets.load(secrets.S3, secrets.MLFLOW)
    with run_lock.heartbeat(run.layout.lock_url):
        return run_finish(cfg, run, state)


@task(retries=1, secret_requests=secrets.requests(secrets.S3, secrets.MLFLOW))
def training_failed(preset: str, overrides: List[str], run_name: str, err: Optional[FlyteError] = None) -> None:
    """``on_failure`` of the training workflows: the run this execution trained is marked FAILED in MLflow
    (the error as its ``end_reason`` tag) and its lock released (``models/run/end.py``)."""
    secrets.load(secrets.S3, secrets.MLFLOW)
    try:
        experiment = load_config(preset or DEFAULT_PRESETS["ppo"], overrides).run.mlflow_experiment
    except Exception:  # noqa: BLE001 - the config may be what failed
        experiment = RunConfig().mlflow_experiment
    line = run_end.mark_failed(experiment, err.message if err is not None else "unknown error")
    if line:
        print(line, file=sys.stderr, flush=True)

"""Retention (``run.keep_checkpoints``, ``run.keep_batches``; ``models/run/retention.py``): the commits of a
run, simulated over a local run folder (checkpoints and batches as small files, no model, no MLflow), keep
exactly the hand-worked iterations: the newest saved checkpoints, what a resume needs, the final policy's;
the last batches, never one after the resume point. A crash between ``state.json`` and the deletions, or
a retried commit, leaves the same folder as a run without it."""

from __future__ import annotations

import dataclasses
from typing import Iterable, Tuple

import pytest

from models import storage
from models.checkpoint import MARKER
from models.config import ConfigError
from models.config.io import load_config
from models.data.batch import RolloutBatch
from models.run import lock as run_lock, retention
from models.run.layout import RunInfo, RunLayout
from models.run.retention import usage
from models.run.types import PolicyState, RunHandle
from models.stages import commit
from models.training.files import optimizer_url


def _config(*overrides: str):
    return load_config("tiny_ppo", list(overrides))


def _handle(tmp_path) -> RunHandle:
    return RunHandle(str(tmp_path), "r", "", f"{tmp_path}/r/reference", "", "")  # no MLflow run: storage only


def _checkpoint(url: str) -> None:
    storage.write_bytes(storage.join(url, "model.safetensors"), b"w")
    storage.write_json(storage.join(url, MARKER), {"files": {}})


def _batch(layout: RunLayout, j: int, stages=("rollouts", "score", "advantages")) -> None:
    for stage in stages:
        storage.write_bytes(layout.batch_url(j, stage), b"b")
        storage.write_bytes(layout.batch_url(j, stage) + ".blake3", b"h")


def stateless(cfg, run: RunHandle, iterations: Iterable[int], state: PolicyState = None) -> PolicyState:
    """The commits of ``iterations`` as a stateless run makes them: each iteration writes its batch (with
    ``run.off_policy_steps=1`` the next iteration's rollout too, sampled ahead) and its actor and critic
    checkpoints with their optimizer states, then moves the resume point."""
    layout = run.layout
    for i in iterations:
        state = state or PolicyState(i, run.reference_url)
        _batch(layout, i)
        if cfg.run.off_policy_steps and i + 1 < cfg.run.num_iterations:
            _batch(layout, i + 1, ("rollouts",))
        for url in (layout.actor_url(i), layout.critic_url(i)):
            _checkpoint(url)
            _checkpoint(optimizer_url(url))
        behaviour = state.actor_url if cfg.run.off_policy_steps else ""
        nxt = PolicyState(i + 1, layout.actor_url(i), layout.critic_url(i), 0.1, {}, behaviour)
        commit.move_resume_point(cfg, run, nxt, layout.read_state())
        state = nxt
    return state


def kept(run: RunHandle) -> Tuple[list, list]:
    """The iterations with committed checkpoints, and those with batch files."""
    found = usage(run.layout)
    return list(found.checkpoints), list(found.batches)


# (overrides, commits done, hand-worked checkpoints and batches left)
STATELESS = [
    # the newest 2 of 4, 9, 14, 19 (19: the resume point and final); batches of the last 3
    (["run.num_iterations=20", "run.save_interval=5", "run.keep_checkpoints=2", "run.keep_batches=3"], 20,
     [14, 19], [17, 18, 19]),
    # mid-run: 4 and 9 are the newest 2, 12 the resume point (10 and 11 were never kept)
    (["run.num_iterations=20", "run.save_interval=5", "run.keep_checkpoints=2", "run.keep_batches=3"], 13,
     [4, 9, 12], [10, 11, 12]),
    # 0: only what a resume needs (and the final policy's, here the same)
    (["run.num_iterations=7", "run.save_interval=3", "run.keep_checkpoints=0", "run.keep_batches=0"], 7, [6], []),
    (["run.num_iterations=7", "run.save_interval=3", "run.keep_checkpoints=0", "run.keep_batches=0"], 5, [4], []),
    # off-policy: the behaviour actor (the resume point's before) stays, and batch 11, sampled ahead
    (["run.num_iterations=20", "run.save_interval=5", "run.keep_checkpoints=1", "run.keep_batches=0",
      "run.off_policy_steps=1", "actor.tis_cap=2"], 11, [9, 10], [11]),
    (["run.num_iterations=12", "run.save_interval=5", "run.keep_checkpoints=1", "run.keep_batches=1",
      "run.off_policy_steps=1", "actor.tis_cap=2"], 12, [10, 11], [11]),
    # -1: today's (every save_interval-th and the last, every batch)
    (["run.num_iterations=12", "run.save_interval=5"], 12, [4, 9, 11], list(range(12))),
    (["run.num_iterations=12", "run.save_interval=5", "run.keep_batches=2"], 12, [4, 9, 11], [10, 11]),
    (["run.num_iterations=12", "run.save_interval=5", "run.keep_checkpoints=1"], 12, [11], list(range(12))),
]


@pytest.mark.parametrize("overrides, done, checkpoints, batches", STATELESS)
def test_a_stateless_run_keeps_the_hand_worked_iterations(tmp_path, overrides, done, checkpoints, batches):
    run = _handle(tmp_path)
    stateless(_config(*overrides), run, range(done))
    assert kept(run) == (checkpoints, batches)
    for j in range(done):  # no optimizer state but the resume point's
        assert storage.exists(optimizer_url(run.layout.actor_url(j))) == (j == done - 1), j
    folders = sorted(p.name for p in (tmp_path / "r").iterdir() if p.name.startswith("iter-"))
    assert folders == [f"iter-{j:06d}" for j in sorted(set(checkpoints) | set(batches))]  # none left empty


def test_without_retention_state_json_is_the_file_it_always_was(tmp_path):
    run = _handle(tmp_path)
    stateless(_config("run.num_iterations=3"), run, range(3))
    assert retention.RECORD_KEY not in run.layout.read_state().extras


def resident(cfg, run: RunHandle, iterations: Iterable[int]) -> None:
    """A resident run's commits: the services checkpoint at the resume points (and, off-policy, the iteration
    before each, ``models/stages/updates.py:saves_at``); ``state.json`` moves at the resume points only."""
    from models.stages.updates import saves_at

    layout, state = run.layout, PolicyState(0, run.reference_url)
    for i in iterations:
        _batch(layout, i)
        actor = layout.actor_url(i) if saves_at(cfg, i) else ""
        if actor:
            _checkpoint(actor)
            _checkpoint(optimizer_url(actor))
        behaviour = state.actor_url if cfg.run.off_policy_steps else ""
        nxt = PolicyState(i + 1, actor or state.actor_url, "", 0.1, {}, behaviour)
        if actor and commit.resume_point_at(cfg, i):
            commit.move_resume_point(cfg, run, nxt, layout.read_state())
        state = nxt


@pytest.mark.parametrize("overrides, done, checkpoints, batches", [
    # resume points 2, 5, 7; batches deleted when the resume point moves, never past it
    (["run.keep_checkpoints=1", "run.keep_batches=1"], 8, [7], [7]),
    (["run.keep_checkpoints=1", "run.keep_batches=1"], 7, [5], [5, 6]),
    # off-policy: the services also checkpoint 1, 4, 6 (behaviour actors); 4 goes when 5's is no longer needed
    (["run.keep_checkpoints=0", "run.keep_batches=0", "run.off_policy_steps=1", "actor.tis_cap=2"], 8, [6, 7], []),
    (["run.keep_checkpoints=0", "run.keep_batches=0", "run.off_policy_steps=1", "actor.tis_cap=2"], 6, [4, 5], []),
    # -1: today's, every checkpoint the services wrote
    (["run.off_policy_steps=1", "actor.tis_cap=2"], 8, [1, 2, 4, 5, 6, 7], list(range(8))),
])
def test_a_resident_run_keeps_the_hand_worked_iterations(tmp_path, overrides, done, checkpoints, batches):
    cfg = _config("run.resident=true", "run.num_iterations=8", "run.save_interval=3", *overrides)
    run = _handle(tmp_path)
    resident(cfg, run, range(done))
    assert kept(run) == (checkpoints, batches)


CRASHY = ["run.num_iterations=14", "run.save_interval=5", "run.keep_checkpoints=1", "run.keep_batches=1"]


class Crash(KeyboardInterrupt):
    pass


def _crash_after_state_json(monkeypatch, iteration: int) -> None:
    """The commit of ``iteration`` dies after writing ``state.json``, before it deletes anything."""
    apply = retention.apply

    def dies(run, old, new):
        if run.layout.read_state().iteration == iteration and old is not None:
            raise Crash(f"killed after the state.json of iteration {iteration}")
        apply(run, old, new)

    monkeypatch.setattr(retention, "apply", dies)


def test_a_crash_between_state_json_and_the_deletions_leaks_nothing(tmp_path, monkeypatch):
    """Commit 9 drops checkpoint 4 (out of the newest 1), 8 (the resume point before) and batch 8, then dies:
    the resumed run (from iteration 10) deletes them with its first commit."""
    cfg, reference = _config(*CRASHY), _handle(tmp_path / "reference")
    stateless(cfg, reference, range(14))
    run = _handle(tmp_path)
    with monkeypatch.context() as m:
        _crash_after_state_json(m, 9)
        with pytest.raises(Crash):
            stateless(cfg, run, range(12))
    assert run.layout.read_state().iteration == 9
    assert kept(run) == ([4, 8, 9], [8, 9])  # the resume point is whole; what it dropped is still there
    stateless(cfg, run, range(10, 14), PolicyState.resumed(run.layout.read_state(), 0.1, off_policy=False))
    assert kept(run) == kept(reference) == ([13], [13])


def test_a_retried_commit_finishes_the_deletions_and_returns_the_committed_state(tmp_path, monkeypatch):
    """``run.keep_batches=0``: the commit of iteration 3 deletes its own batch after ``state.json``; a retry
    of that task (its first try died after ``state.json``) never reads the batch it was given, finishes the
    deletions and returns the state the first try committed."""
    cfg = _config("run.num_iterations=6", "run.save_interval=2", "run.keep_checkpoints=0", "run.keep_batches=0")
    run = _handle(tmp_path)
    run_lock.acquire(run.layout.lock_url, ttl_s=60)
    state = stateless(cfg, run, range(3))
    with monkeypatch.context() as m:
        _crash_after_state_json(m, 3)
        with pytest.raises(Crash):
            stateless(cfg, run, [3], state)
    committed = run.layout.read_state()
    layout = run.layout
    storage.remove(layout.batch_url(3, "score"))  # as if the first try had deleted it
    gone = RolloutBatch.open(layout.batch_url(3, "score"))
    nxt = commit.run_commit(cfg, run, state, [{"rollout/reward_mean": 1.0}], gone, layout.actor_url(3),
                            layout.critic_url(3))
    assert nxt == PolicyState(4, layout.actor_url(3), layout.critic_url(3), 0.1, {}, "")
    assert layout.read_state() == committed  # not written again
    assert kept(run) == ([3], [])


def test_retention_turned_on_for_a_run_lists_its_folder_once(tmp_path, monkeypatch):
    """A run that committed 12 iterations keeping everything, resumed with ``run.keep_checkpoints=1`` and
    ``run.keep_batches=2``: its first commit lists the run folder once and deletes what is beyond them; no
    commit after it lists anything (a commit's cost does not grow with the run)."""
    run = _handle(tmp_path)
    run.layout.write_run_info(RunInfo("r", "ppo"))
    stateless(_config("run.num_iterations=20", "run.save_interval=5"), run, range(12))
    listings = []
    monkeypatch.setattr(retention, "usage", lambda layout: listings.append(layout) or usage(layout))
    cfg = _config("run.num_iterations=20", "run.save_interval=5", "run.keep_checkpoints=1", "run.keep_batches=2")
    state = PolicyState.resumed(run.layout.read_state(), 0.1, off_policy=False)
    stateless(cfg, run, [12], state)
    assert len(listings) == 1 and kept(run) == ([9, 12], [11, 12])
    stateless(cfg, run, range(13, 20), PolicyState.resumed(run.layout.read_state(), 0.1, off_policy=False))
    assert len(listings) == 1 and kept(run) == ([19], [18, 19])


def test_a_fresh_run_never_lists_its_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(retention, "usage", lambda layout: pytest.fail("listed the run folder"))
    run = _handle(tmp_path)
    stateless(_config("run.num_iterations=6", "run.keep_checkpoints=0", "run.keep_batches=0"), run, range(6))


def test_the_final_policy_of_a_run_extended_after_it_finished_is_kept(tmp_path):
    """Iteration 7 was the last of 8 (the policy that run registered; kept although 7 is no save_interval
    iteration); the run extended to 12 keeps it beside the newest and the new final."""
    run = _handle(tmp_path)
    keep = ["run.save_interval=5", "run.keep_checkpoints=1"]
    stateless(_config("run.num_iterations=8", *keep), run, range(8))
    assert kept(run)[0] == [7]
    stateless(_config("run.num_iterations=12", *keep), run, range(8, 12),
              PolicyState.resumed(run.layout.read_state(), 0.1, off_policy=False))
    assert kept(run)[0] == [7, 11]


def test_a_run_that_finished_without_retention_keeps_its_final_policy_too(tmp_path):
    """The same with retention turned on only when the run is extended: ``run.json``'s change of
    ``run.num_iterations`` (made once 8 iterations were done) names the final one."""
    run = _handle(tmp_path)
    run.layout.write_run_info(RunInfo("r", "ppo", config_changes=[
        {"key": "run.num_iterations", "old": 8, "new": 12, "iteration": 8}]))
    stateless(_config("run.num_iterations=8", "run.save_interval=5"), run, range(8))
    stateless(_config("run.num_iterations=12", "run.save_interval=5", "run.keep_checkpoints=0"), run, range(8, 12),
              PolicyState.resumed(run.layout.read_state(), 0.1, off_policy=False))
    assert kept(run)[0] == [7, 11]


@pytest.mark.parametrize("key", ["run.keep_checkpoints", "run.keep_batches"])
def test_the_settings_are_checked_and_may_change_on_resume(key):
    from models.run.resume import plan_resume

    with pytest.raises(ConfigError, match=f"{key} must be >= -1 .-1 keeps all, 0 only what a resume needs., got -2"):
        _config(f"{key}=-2")
    stored, given = _config(), _config(f"{key}=3")
    cfg, changes = plan_resume(stored, given, [key], 4, "r", "runs")
    assert dataclasses.asdict(cfg.run)[key.split(".")[1]] == 3 and [c.key for c in changes] == [key]

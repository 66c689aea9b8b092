"""The bookkeeping that makes a resumed run equal an uninterrupted one: ``commit_iteration``
writes ``state.json`` last (a crash before it redoes the commit instead of losing its
metrics), logs each metric step and sample table once however often it runs, and an
evaluation already logged is not run again."""

from __future__ import annotations

import json

import pytest

from models.checkpoint import save_checkpoint
from models import tracking
from models.run import lock as run_lock
from models.config import TrainConfig
from models.stages.commit import run_commit
from models.stages import evaluate
from models.stages.evaluate import run_evaluate
from models.run.types import PolicyState, RunHandle
from tests.unit.models.test_checkpoint import hf_dir
from tests.unit.tasks.test_batch import LOGP, rollout_batch


@pytest.fixture
def run(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    run_id = tracking.start_run("commit-test", "r", {}, {})
    handle = RunHandle(str(tmp_path / "runs"), "r", run_id, "", "", "")
    run_lock.acquire(handle.layout.lock_url, ttl_s=60)  # as setup_run takes it: commits check they hold the run
    actor = handle.layout.actor_url(0)
    save_checkpoint(hf_dir(tmp_path / "src"), actor)
    batch = rollout_batch().with_columns(old_logprobs=LOGP, ref_logprobs=LOGP, reward=[0.0, 0.5, 1.0, 0.25])
    return handle, actor, batch


def _rows(run_id: str, path: str, tmp_path) -> int:
    local = tracking.client().download_artifacts(run_id, path, str(tmp_path / "dl"))
    return len(json.loads(open(local).read())["data"])


def test_a_crash_before_state_json_redoes_the_commit_without_duplicates(run, tmp_path, monkeypatch):
    handle, actor, batch = run
    cfg, state = TrainConfig(), PolicyState(0, actor, "", 0.01)
    stats = [{"rollout/reward_mean": 0.4375, "actor/loss": -0.1}]

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed while committing")

    with monkeypatch.context() as m:
        m.setattr(handle.layout.__class__, "write_state", crash)
        with pytest.raises(KeyboardInterrupt):
            run_commit(cfg, handle, state, stats, batch, actor, "")
    assert handle.layout.read_state() is None  # not committed: a rerun starts this iteration again
    assert tracking.metric_history(handle.mlflow_run_id, "rollout/reward_mean") == [(0, 0.4375)]

    nxt = run_commit(cfg, handle, state, stats, batch, actor, "")  # the resumed run commits it again
    assert nxt.iteration == 1 and handle.layout.read_state().iteration == 0
    for key in ("rollout/reward_mean", "actor/loss"):
        assert [s for s, _ in tracking.metric_history(handle.mlflow_run_id, key)] == [0]
    assert _rows(handle.mlflow_run_id, "samples/iter-000000.json", tmp_path) == 4  # not appended twice


def test_logged_evaluation_is_not_run_again(run, monkeypatch):
    handle, actor, _ = run
    tracking.log_metrics(handle.mlflow_run_id, {"eval/reward_mean": 0.75}, step=4)
    monkeypatch.setattr(evaluate, "eval_rewards", lambda *a, **k: pytest.fail("evaluated twice"))
    assert run_evaluate(TrainConfig(), handle, PolicyState(5, actor, "", 0.01)) == 0.75


@pytest.mark.parametrize("save_interval", [1, 2])
def test_optimizer_state_stays_with_the_newest_checkpoint_only(run, tmp_path, save_interval):
    from dataclasses import replace

    from models import storage
    from models.checkpoint import is_committed
    from models.training.files import optimizer_url

    handle, actor0, batch = run
    cfg = TrainConfig()
    cfg = replace(cfg, run=replace(cfg.run, save_interval=save_interval, num_iterations=3))
    actor1 = handle.layout.actor_url(1)
    for url in (actor1, optimizer_url(actor0), optimizer_url(actor1)):
        save_checkpoint(hf_dir(tmp_path / url.rsplit("/", 2)[-2] / url.rsplit("/", 1)[-1]), url)
    state = run_commit(cfg, handle, PolicyState(0, actor0, "", 0.01), [], batch, actor0, "")
    assert is_committed(optimizer_url(actor0))  # the resume point's state
    run_commit(cfg, handle, state, [], batch, actor1, "")
    assert not storage.exists(optimizer_url(actor0)) and is_committed(optimizer_url(actor1))
    assert is_committed(actor0) == (save_interval == 1)  # iteration 0 is kept only at save_interval 1


def test_the_first_iteration_after_a_resume_does_not_count_the_downtime(run, tmp_path, capsys):
    """The run crashed an hour after its last commit and was resumed (the fixture's launch took the run
    now): the resumed iteration's wall time starts when this launch took the run, not at the commit before
    the crash; the iteration after it counts from its own previous commit again."""
    import datetime as dt

    from models.stages.commit import seconds_since
    from models.run.layout import RunState

    handle, actor0, batch = run
    crashed = dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=1)
    handle.layout.write_state(RunState(0, actor0, updated_at=crashed.isoformat(timespec="milliseconds")))
    took = json.loads(open(handle.layout.lock_url).read())["acquired_at"]
    actor1, actor2 = handle.layout.actor_url(1), handle.layout.actor_url(2)
    for url in (actor1, actor2):
        save_checkpoint(hf_dir(tmp_path / url.rsplit("/", 2)[1]), url)
    stats = [{"rollout/reward_mean": 0.5}]
    state = run_commit(TrainConfig(), handle, PolicyState(1, actor0, "", 0.01), stats, batch, actor1, "")
    committed = handle.layout.read_state().updated_at
    run_commit(TrainConfig(), handle, state, stats, batch, actor2, "")
    (s1, wall1), (s2, wall2) = tracking.metric_history(handle.mlflow_run_id, "time/iteration_s")
    assert (s1, s2) == (1, 2)
    assert 0 <= wall1 <= seconds_since(took) < 3000  # not the hour the run was down
    assert 0 <= wall2 <= seconds_since(committed)
    assert f"({wall1:.1f} s wall, " in capsys.readouterr().out  # the progress line says the same


def test_a_resident_commit_moves_the_resume_point_with_the_checkpoints_only(run, tmp_path):
    """``run.resident``: the services write checkpoints every ``save_interval`` iterations; in between the
    commit logs the iteration (metrics, ``progress.json``) and the next state keeps the last checkpoint;
    ``state.json`` moves when a checkpoint comes, and the older checkpoint's optimizer state goes."""
    from dataclasses import replace

    from models import storage
    from models.stages.commit import progress_url
    from models.training.files import optimizer_url

    handle, actor0, batch = run
    cfg = TrainConfig()
    cfg = replace(cfg, run=replace(cfg.run, resident=True, save_interval=2, num_iterations=4))
    storage.write_bytes(storage.join(optimizer_url(actor0), "rank-0.pt"), b"moments")  # iteration 0's: not saved
    state = PolicyState(0, actor0, "", 0.01)
    state = run_commit(cfg, handle, state, [{"rollout/reward_mean": 0.5}], batch, "", "")  # iteration 0: no checkpoint
    assert handle.layout.read_state() is None and state == PolicyState(1, actor0, "", 0.01)
    assert storage.read_json(progress_url(handle))["iteration"] == 0
    actor1 = handle.layout.actor_url(1)
    save_checkpoint(hf_dir(tmp_path / "src1"), actor1)
    storage.write_bytes(storage.join(optimizer_url(actor1), "rank-0.pt"), b"moments")
    state = run_commit(cfg, handle, state, [{"rollout/reward_mean": 0.6}], batch, actor1, "")  # iteration 1 saves
    assert handle.layout.read_state().iteration == 1 and state.actor_url == actor1
    assert storage.exists(optimizer_url(actor1))
    state = run_commit(cfg, handle, state, [{"rollout/reward_mean": 0.7}], batch, "", "")  # iteration 2
    assert handle.layout.read_state().iteration == 1 and state.iteration == 3 and state.actor_url == actor1
    run_commit(cfg, handle, replace(state, iteration=2), [{"rollout/reward_mean": 0.7}], batch, "", "")  # redone
    assert [s for s, _ in tracking.metric_history(handle.mlflow_run_id, "rollout/reward_mean")] == [0, 1, 2]
    assert "time/iteration_s" in dict(tracking.client().get_run(handle.mlflow_run_id).data.metrics)
    actor3 = handle.layout.actor_url(3)
    save_checkpoint(hf_dir(tmp_path / "src3"), actor3)
    storage.write_bytes(storage.join(optimizer_url(actor3), "rank-0.pt"), b"moments")
    run_commit(cfg, handle, state, [{"rollout/reward_mean": 0.8}], batch, actor3, "")  # the last iteration saves
    assert handle.layout.read_state().actor_url == actor3
    assert not storage.exists(optimizer_url(actor1)) and storage.exists(optimizer_url(actor3))
    assert storage.exists(actor1)  # the checkpoints at save_interval are all kept

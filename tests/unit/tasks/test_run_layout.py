"""Run layout URLs, run.json and state.json (the resume point)."""

import json

import pytest

from models.checkpoint import CheckpointError, save_checkpoint
from models.run.layout import RunInfo, RunLayout, RunState


def commit(url, tmp_path):
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "config.json").write_text("{}")
    save_checkpoint(str(src), url)
    return url


def test_urls_follow_the_design_layout():
    layout = RunLayout("s3://bucket/runs/", "ppo-demo")
    assert layout.url == "s3://bucket/runs/ppo-demo"
    assert layout.run_info_url == "s3://bucket/runs/ppo-demo/run.json"
    assert layout.state_url == "s3://bucket/runs/ppo-demo/state.json"
    assert layout.reference_url() == "s3://bucket/runs/ppo-demo/reference"
    assert layout.iter_dir(7) == "s3://bucket/runs/ppo-demo/iter-000007"
    assert layout.batch_url(7) == "s3://bucket/runs/ppo-demo/iter-000007/rollouts.arrow"
    assert layout.batch_url(7, "score") == "s3://bucket/runs/ppo-demo/iter-000007/score.arrow"
    assert layout.actor_url(7) == "s3://bucket/runs/ppo-demo/iter-000007/actor"
    assert layout.critic_url(12) == "s3://bucket/runs/ppo-demo/iter-000012/critic"
    assert RunLayout("runs", "r").batch_url(0) == "runs/r/iter-000000/rollouts.arrow"


@pytest.mark.parametrize("name", ["", "a/b", "../x", " space"])
def test_bad_run_names_are_refused(name):
    with pytest.raises(ValueError, match="run_name"):
        RunLayout("runs", name)


def test_bad_stage_and_iteration_are_refused():
    layout = RunLayout("runs", "r")
    with pytest.raises(ValueError, match="stage"):
        layout.batch_url(1, "../x")
    with pytest.raises(ValueError, match="iteration"):
        layout.iter_dir(-1)


def test_run_info_round_trip(tmp_path):
    layout = RunLayout(str(tmp_path), "grpo-1")
    info = RunInfo(run_name="grpo-1", algorithm="grpo", config={"kl": {"coef": 0.01}}, mlflow_run_id="abc")
    layout.write_run_info(info)
    assert layout.read_run_info() == info
    assert json.loads((tmp_path / "grpo-1" / "run.json").read_text())["mlflow_run_id"] == "abc"
    with pytest.raises(ValueError, match="run_name"):
        layout.write_run_info(RunInfo(run_name="other", algorithm="grpo"))
    with pytest.raises(FileNotFoundError, match="nope/run.json"):
        RunLayout(str(tmp_path), "nope").read_run_info()


def test_state_round_trip_points_at_committed_checkpoints(tmp_path):
    layout = RunLayout(str(tmp_path), "ppo-1")
    assert layout.read_state() is None  # fresh run: nothing to resume
    actor, critic = commit(layout.actor_url(3), tmp_path), commit(layout.critic_url(3), tmp_path)
    state = RunState(iteration=3, actor_url=actor, critic_url=critic, extras={"kl_coef": 0.02})
    layout.write_state(state)
    assert layout.read_state() == state
    assert sorted(p.name for p in (tmp_path / "ppo-1").iterdir()) == ["iter-000003", "state.json"]


def test_state_refuses_uncommitted_checkpoints(tmp_path):
    layout = RunLayout(str(tmp_path), "ppo-1")
    actor = commit(layout.actor_url(4), tmp_path)
    (tmp_path / "ppo-1" / "iter-000004" / "critic").mkdir()
    with pytest.raises(CheckpointError, match="iter-000004/critic is not committed"):
        layout.write_state(RunState(iteration=4, actor_url=actor, critic_url=layout.critic_url(4)))
    assert layout.read_state() is None  # the old resume point is untouched

"""Resume says what it does (models/run/resume.py): the stored config wins over what the user did not write;
what the user wrote may change a listed field (recorded in run.json, MLflow and the output), and any
other change, or the other workflow, is refused before anything is touched."""

from __future__ import annotations

import json

import pytest

from models.checkpoint import CheckpointError, save_checkpoint
from models.rewards import RewardError
from models import tracking
from models.config import ConfigError
from models.config.io import config_from_json_dict, load_config, to_dict
from models.run.layout import RunInfo, RunLayout, RunState
from models.run.setup import setup_run
from tests.unit.models.test_checkpoint import hf_dir

DONE = 4  # iterations completed before the relaunch


def reward_len(prompts, responses):
    return [float(len(r)) for r in responses]


def reward_raises(prompts, responses):
    raise ValueError("broken")


@pytest.fixture
def run(tmp_path, monkeypatch):
    """A PPO run of configs/tiny_ppo.yaml with ``run.num_iterations=10`` that committed 4 iterations and
    whose MLflow run finished; the config stored in its run.json differs from today's preset in one
    field the preset does not set (``actor.entropy_coef``: an older code default)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    overrides = [f"run.storage_root={tmp_path}/runs", "run.num_iterations=10"]
    cfg = to_dict(load_config("tiny_ppo", overrides))
    cfg["actor"]["entropy_coef"] = 0.5
    layout = RunLayout(f"{tmp_path}/runs", "r")
    run_id = tracking.start_run("flyte-rlhf", "r", {}, {})
    tracking.end_run(run_id)
    layout.write_run_info(RunInfo(run_name="r", algorithm="ppo", config=cfg, mlflow_run_id=run_id))
    (tmp_path / "runs" / "r" / "data").mkdir()
    (tmp_path / "runs" / "r" / "data" / "train_prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": p, "prompt_id": i}) + "\n" for i, p in enumerate(["ab=", "ba=", "abc="])))
    for role in ("actor", "critic"):
        url = getattr(layout, f"{role}_url")(DONE - 1)
        save_checkpoint(hf_dir(tmp_path / f"src-{role}"), url)
    layout.write_state(RunState(DONE - 1, layout.actor_url(DONE - 1), layout.critic_url(DONE - 1)))
    return layout, overrides, run_id


def run_json(layout: RunLayout) -> bytes:
    with open(layout.run_info_url, "rb") as f:
        return f.read()


def test_a_plain_rerun_resumes_with_the_stored_config(run, capsys):
    layout, overrides, run_id = run
    before = run_json(layout)
    stored = config_from_json_dict(layout.read_run_info().config)
    for preset, given in (("tiny_ppo", overrides), ("", overrides[:1])):  # the same command; no preset at all
        setup = setup_run(preset, given, "r", "ppo")
        assert setup.cfg == stored and setup.cfg.actor.entropy_coef == 0.5  # what the user did not write stays
        assert setup.state.iteration == DONE
    assert run_json(layout) == before
    mlflow_run = tracking.client().get_run(run_id)
    assert mlflow_run.info.status == "RUNNING"
    assert not [k for k in mlflow_run.data.tags if k.startswith("config_change.")]
    assert "resuming r:" not in capsys.readouterr().out


@pytest.mark.integration  # the changed reward function is probed in a worker process
def test_listed_changes_take_effect_and_are_recorded(run, capsys):
    layout, overrides, run_id = run
    changed = overrides + ["actor.lr=0.05", "run.num_iterations=12", f"reward.function={__name__}:reward_len"]
    setup = setup_run("tiny_ppo", changed, "r", "ppo")
    assert (setup.cfg.actor.lr, setup.cfg.run.num_iterations, setup.cfg.reward.function) == \
        (0.05, 12, f"{__name__}:reward_len")
    assert setup.cfg.actor.entropy_coef == 0.5 and setup.state.iteration == DONE
    info = layout.read_run_info()
    assert config_from_json_dict(info.config) == setup.cfg  # the next resume compares with these values
    assert info.config_changes == [
        {"key": "actor.lr", "old": 0.0001, "new": 0.05, "iteration": DONE},
        {"key": "reward.function", "old": "models.demos.reverse_task:reverse_reward", "new": f"{__name__}:reward_len",
         "iteration": DONE},
        {"key": "run.num_iterations", "old": 10, "new": 12, "iteration": DONE}]
    tags = tracking.client().get_run(run_id).data.tags
    assert tags["config_change.iter-000004.actor.lr"] == "0.0001 -> 0.05"
    assert tags["config_change.iter-000004.run.num_iterations"] == "10 -> 12"
    assert "resuming r: actor.lr: 0.0001 -> 0.05 from iter-000004" in capsys.readouterr().out

    before = run_json(layout)
    setup_run("tiny_ppo", changed, "r", "ppo")  # the same command again: nothing more to record
    assert run_json(layout) == before


def test_other_changes_are_refused_before_anything_is_touched(run):
    layout, overrides, run_id = run
    before = run_json(layout)
    given = overrides + ["actor.minibatch_size=128", "rollout.temperature=0.7", "actor.lr=0.05"]
    with pytest.raises(ConfigError, match=r"run .*/runs/r exists and was trained with other values of: "
                                          r"actor\.minibatch_size \(stored 64, given 128\), rollout\.temperature "
                                          r"\(stored 1\.0, given 0\.7\)\. These cannot change on resume"):
        setup_run("tiny_ppo", given, "r", "ppo")
    assert run_json(layout) == before
    assert tracking.client().get_run(run_id).info.status == "FINISHED"
    assert json.loads(open(layout.lock_url).read())["released_at"]  # the launch let go of the run


def test_resuming_through_the_other_workflow_is_refused(run, tmp_path):
    """A PPO run through reinforce_training with a GRPO preset would train without its critic."""
    layout, overrides, run_id = run
    before = run_json(layout)
    with pytest.raises(ConfigError, match=r"run .*/runs/r is a ppo run \(it trains a critic; run\.json\): resume "
                                          r"it with workflows/ppo\.py ppo_training, not reinforce_training"):
        setup_run("tiny_grpo", overrides, "r", "reinforce")
    assert run_json(layout) == before and layout.read_state().critic_url == layout.critic_url(DONE - 1)
    assert tracking.client().get_run(run_id).info.status == "FINISHED"


def test_fewer_iterations_than_done_are_refused(run):
    layout, overrides, _ = run
    with pytest.raises(ConfigError, match=r"run\.num_iterations=3: run .*/runs/r has completed 4 iterations"):
        setup_run("tiny_ppo", overrides + ["run.num_iterations=3"], "r", "ppo")


@pytest.mark.integration  # the changed reward function is probed in a worker process
def test_a_new_reward_function_is_checked_before_the_run_goes_on(run):
    layout, overrides, _ = run
    before = run_json(layout)
    with pytest.raises(RewardError, match=r"reward_raises' raised on a batch of 3 .* ValueError\('broken'\)"):
        setup_run("tiny_ppo", overrides + [f"reward.function={__name__}:reward_raises"], "r", "ppo")
    assert run_json(layout) == before


def test_resuming_against_another_tracking_uri_names_the_one_the_run_started_with(tmp_path, monkeypatch):
    """A run set up at one tracking URI and resumed with another: refused, naming the URI to set, before
    run.json is touched."""
    first = f"sqlite:///{tmp_path}/first.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", first)
    overrides = [f"run.storage_root={tmp_path}/runs", "run.num_iterations=10"]
    layout = RunLayout(f"{tmp_path}/runs", "r")
    run_id = tracking.start_run("flyte-rlhf", "r", {}, {})
    layout.write_run_info(RunInfo(run_name="r", algorithm="ppo", config=to_dict(load_config("tiny_ppo", overrides)),
                                  mlflow_run_id=run_id, mlflow_tracking_uri=first))
    before = run_json(layout)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/second.db")
    with pytest.raises(ConfigError, match=rf"run .*/runs/r is tracked as MLflow run {run_id} at sqlite:///"
                                          rf"{tmp_path}/first\.db, and MLFLOW_TRACKING_URI=sqlite:///{tmp_path}/"
                                          rf"second\.db has no such run: set MLFLOW_TRACKING_URI to sqlite:///"
                                          rf"{tmp_path}/first\.db to resume it"):
        setup_run("tiny_ppo", overrides, "r", "ppo")
    assert run_json(layout) == before


def test_a_damaged_checkpoint_of_a_finished_run_leaves_it_finished(run):
    """The relaunch of a finished run whose resume point no longer matches its checksums is refused before
    its MLflow run is reopened: the run stays FINISHED, and the message names the file and what can be done
    (a resume cannot repair it), not "rerun the same command"."""
    layout, overrides, run_id = run
    weights = f"{layout.actor_url(DONE - 1)}/model.safetensors"
    with open(weights, "r+b") as f:  # same size, other bytes: only the BLAKE3 check sees it
        f.write(b"\x01")
    before = run_json(layout)
    with pytest.raises(CheckpointError) as err:
        setup_run("tiny_ppo", overrides, "r", "ppo")
    msg = str(err.value)
    assert f"run {layout.url} finished, and checkpoint {layout.actor_url(DONE - 1)}: file 'model.safetensors' " \
           f"fails its blake3 check" in msg
    assert f"MLflow run {run_id} stays FINISHED" in msg and "a resume cannot repair it" in msg.lower()
    assert "--run_name" in msg and "rerun the same command" not in msg
    assert tracking.client().get_run(run_id).info.status == "FINISHED"
    assert run_json(layout) == before
    assert json.loads(open(layout.lock_url).read())["released_at"]  # the launch let go of the run

"""Whole ``pyflyte run`` launches of the tiny GRPO task that must not end well by accident:

- a run whose update goes non-finite skips the spoiled steps (counted in MLflow) and, when no step of an
  update is finite, fails before that iteration commits anything: exit code not 0, no NaN checkpoint,
  nothing registered, the MLflow run FAILED, the lock released;
- a run whose steps diverge (``actor.lr=10``: |loss| above ``actor.guard.max_loss``) skips them, says so
  one line per step, and fails when most of an update's steps were skipped: nothing registered;
- a second launch of a live run is refused naming the holder, and leaves the live run alone;
- Ctrl-C (SIGINT to the process group, during the elastic actor update) stops the run with one line,
  marks it KILLED, releases its lock, and the same command resumes it to the end;
- extended after it finished, the run registers its new final policy and ``candidate`` follows it.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from models.checkpoint import is_committed, read_marker
from models.run.layout import RunLayout
from tests.integration.flyte_runs import FlyteRun, isolated_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]

OVERRIDES = ["run.num_iterations=2", "run.eval_interval=0", "run.save_interval=1", "rollout.prompts_per_iteration=8",
             "rollout.n_samples_per_prompt=4", "actor.minibatch_size=16", "actor.micro_batch_size=8",
             "data.num_demo_train_prompts=64", "data.num_demo_eval_prompts=8", "run.registered_model_name=reliability", "rollout.engine=hf"]


class Launches:
    def __init__(self, tmp: Path):
        self.tmp, self.root = tmp, str(tmp / "runs")
        self.env = isolated_env(tmp / "home", {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}",
                                               "COLUMNS": "1000"})  # messages on one line, not wrapped at 80

    def start(self, name: str, attempt: str, extra_env: dict | None = None, overrides=()) -> FlyteRun:
        return FlyteRun("workflows/reinforce.py", "reinforce_training", "configs/tiny_grpo.yaml",
                        [f"run.storage_root={self.root}"] + OVERRIDES + list(overrides), name,
                        dict(self.env, **(extra_env or {})), self.tmp / f"{name}-{attempt}.log")

    def registered(self, name: str) -> list:
        """``[(version, checkpoint URL)]`` of the run's registered policies, oldest first."""
        client, run = self.mlflow_run(name)
        found = client.search_model_versions(f"name = 'reliability' AND run_id = '{run.info.run_id}'")
        return sorted((str(v.version), v.tags["checkpoint_url"]) for v in found)

    def layout(self, name: str) -> RunLayout:
        return RunLayout(self.root, name)

    def mlflow_run(self, name: str):
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=self.env["MLFLOW_TRACKING_URI"])
        return client, client.get_run(self.layout(name).read_run_info().mlflow_run_id)

    def lease(self, name: str) -> dict:
        return json.loads(Path(self.layout(name).lock_url).read_text())


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    return Launches(tmp_path_factory.mktemp("reliability"))


def ended(run: FlyteRun, timeout_s: float = 900) -> int:
    return run.proc.wait(timeout=timeout_s)


def test_a_run_that_goes_nan_never_ends_well(launches):
    """Iteration 0: NaN advantages on one row of rank 0 spoil one minibatch per epoch (2 of 4 steps
    skipped); iteration 1: NaN everywhere, no finite step: the run fails before committing it."""
    run = launches.start("nan", "0", {"RLHF_FAULT_NAN_ADVANTAGES": "0:1,1:all"})
    code, out = ended(run), run.output()
    assert code != 0, out[-4000:]
    # the cause first, not under the launcher's restart traces. Every rank raises it (the guard's verdict is
    # collective) and torchrun records whichever exited first, stopping the other: rank 0 or 1, by chance
    assert re.search(r"the actor update failed on rank [01]: NonFiniteUpdate: all 4 optimiser steps of this update "
                     r"had a non-finite loss or gradient norm", out), out[-4000:]
    layout = launches.layout("nan")
    assert layout.read_state().iteration == 0 and not is_committed(layout.actor_url(1))
    final = layout.actor_url(0)
    for rel in read_marker(final)["files"]:
        if rel.endswith(".safetensors"):
            assert all(bool(torch.isfinite(t).all()) for t in load_file(os.path.join(final, rel)).values()), rel
    client, mlflow_run = launches.mlflow_run("nan")
    assert mlflow_run.info.status == "FAILED", mlflow_run.info
    assert "NonFiniteUpdate" in mlflow_run.data.tags["end_reason"]
    assert [(m.step, m.value) for m in client.get_metric_history(mlflow_run.info.run_id, "actor/nonfinite_steps")] \
        == [(0, 2.0)]
    assert client.search_model_versions("name = 'reliability'") == []
    assert launches.lease("nan")["released_at"]
    assert "[flyte-rlhf] run nan failed: " in out


def test_a_run_whose_steps_are_mostly_skipped_fails_and_registers_nothing(launches):
    """The issue's case: GRPO at ``actor.lr=10`` took its first step, then every later step of the first
    update had a loss in the millions (or NaN): skipped, named, and the run fails before committing it."""
    run = launches.start("diverged", "0", overrides=["actor.lr=10"])
    code, out = ended(run), run.output()
    assert code != 0, out[-4000:]
    assert re.search(r"DivergedUpdate: [34] of 4 optimiser steps of this actor update were skipped, more than "
                     r"actor.guard.max_skipped_fraction=0.5", out), out[-4000:]
    assert re.search(r"\[actor\] step \d skipped \(loss .*(above actor.guard.max_|non-finite)", out), out[-4000:]
    layout = launches.layout("diverged")
    assert layout.read_state() is None and not is_committed(layout.actor_url(0))
    client, mlflow_run = launches.mlflow_run("diverged")
    assert mlflow_run.info.status == "FAILED" and "DivergedUpdate" in mlflow_run.data.tags["end_reason"]
    assert launches.registered("diverged") == []


def test_a_second_launch_is_refused_and_ctrl_c_stops_a_run_that_resumes(launches):
    layout = launches.layout("live")
    faults = launches.tmp / "faults"
    first = launches.start("live", "1", {"RLHF_FAULT_PAUSE": "actor_update/iter-000001:600",
                                         "RLHF_FAULT_DIR": str(faults)})
    first.wait_until(lambda: (faults / "paused").exists(), "the pause in iteration 1's actor update", 900)
    assert layout.read_state().iteration == 0

    second = launches.start("live", "2")
    assert ended(second) != 0
    held = rf"run {re.escape(layout.url)} is held by local:\S+:{first.proc.pid}:\w+ \(host \S+, pid {first.proc.pid}\)"
    assert re.search(held, second.output()), second.output()[-4000:]
    client, mlflow_run = launches.mlflow_run("live")
    assert mlflow_run.info.status == "RUNNING" and not launches.lease("live")["released_at"]  # left alone

    os.killpg(first.proc.pid, signal.SIGINT)  # Ctrl-C in the terminal: the whole foreground group
    assert ended(first, 120) != 0
    out = first.output()
    line = (f"[flyte-rlhf] run live interrupted by SIGINT: MLflow run {mlflow_run.info.run_id} marked KILLED, lock "
            f"released, iterations up to iter-000000 committed (state.json); rerun the same command to resume")
    assert line in out.splitlines(), out[-6000:]
    for noise in ("MlflowException", "SignalException", "got signal"):
        assert noise not in out, noise
    assert client.get_run(mlflow_run.info.run_id).info.status == "KILLED"
    assert launches.lease("live")["released_at"]

    again = launches.start("live", "3")
    out = again.wait(900)
    assert "Run live finished: 2 iterations of grpo." in out and "[grpo] iter 1/2" not in out
    assert client.get_run(mlflow_run.info.run_id).info.status == "FINISHED"
    assert launches.lease("live")["released_at"]
    assert launches.registered("live") == [("1", layout.actor_url(1))]

    # extended after it finished: the registered model and `candidate` follow the new final policy
    longer = launches.start("live", "4", overrides=["run.num_iterations=3"])
    out = longer.wait(900)
    assert "resuming live: run.num_iterations: 2 -> 3 from iter-000002" in out and "[grpo] iter 3/3" in out
    assert launches.registered("live") == [("1", layout.actor_url(1)), ("2", layout.actor_url(2))]
    assert str(client.get_model_version_by_alias("reliability", "candidate").version) == "2"
    tags = client.get_run(mlflow_run.info.run_id).data.tags
    assert tags["config_change.iter-000002.run.num_iterations"] == "2 -> 3"

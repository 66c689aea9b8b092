"""``run.resident=true`` through ``pyflyte run``: the actor trainer, the engine and the critic trainer stay
loaded as services for the whole run. Against the stateless mode on the same preset and seeds: the same
per-iteration rewards (same samples, same updates); a service SIGKILLed mid-run fails the run naming it,
and the rerun resumes from the last checkpoint to the same rewards, with MLflow's steps never duplicated;
no service outlives its run."""

from __future__ import annotations

import os
import signal

import pytest

from models import storage
from models.resident import protocol
from models.run.layout import RunLayout
from tests.integration.flyte_runs import FlyteRun, isolated_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SHORT = ["run.num_iterations=4", "run.save_interval=2", "run.eval_interval=0", "rollout.prompts_per_iteration=8",
         "actor.minibatch_size=32", "actor.micro_batch_size=16", "data.num_demo_train_prompts=64",
         "data.num_demo_eval_prompts=8", "run.registered_model_name=", "run.checkpoint_artifact_max_mb=0"]
CRITIC = ["critic.minibatch_size=32", "critic.micro_batch_size=32"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) is gone too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


class Run:
    def __init__(self, tmp_path, algo: str, workflow: str, overrides):
        self.tmp, self.algo, self.workflow, self.overrides = tmp_path, algo, workflow, list(overrides)
        self.env = isolated_env(tmp_path / "home", {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"})
        self.launches = 0

    def start(self, name: str) -> FlyteRun:
        self.launches += 1
        return FlyteRun(f"workflows/{self.workflow}.py", f"{self.workflow}_training", f"configs/tiny_{self.algo}.yaml",
                        [f"run.storage_root={self.tmp}"] + self.overrides, name, self.env,
                        self.tmp / f"{name}-{self.launches}.log")

    def rewards(self, name: str):
        import mlflow

        client = mlflow.tracking.MlflowClient(tracking_uri=self.env["MLFLOW_TRACKING_URI"])
        run_id = RunLayout(str(self.tmp), name).read_run_info().mlflow_run_id
        history = client.get_metric_history(run_id, "rollout/reward_mean")
        return [m.value for m in sorted(history, key=lambda m: m.step)], [m.step for m in history]


def _service_pids(layout: RunLayout) -> dict:
    out = {}
    for name in protocol.SERVICES:
        url = protocol.address_url(layout, name)
        if storage.exists(url):
            out[name] = storage.read_json(url)["pid"]
    return out


def test_resident_ppo_matches_stateless_and_resumes_after_a_kill(tmp_path):
    runs = Run(tmp_path, "ppo", "ppo", SHORT + CRITIC)
    runs.start("stateless").wait()
    want, _ = runs.rewards("stateless")

    layout = RunLayout(str(tmp_path), "resident")
    runs.overrides.append("run.resident=true")
    first = runs.start("resident")
    progress = f"{layout.url}/progress.json"
    first.wait_until(lambda: storage.exists(progress) and storage.read_json(progress)["iteration"] >= 2,
                     "iteration 2's commit")
    pids = _service_pids(layout)
    assert set(pids) == {"engine", "actor", "critic"}
    os.kill(pids["critic"], signal.SIGKILL)  # the critic service, mid-run
    code = first.proc.wait(timeout=300)
    out = first.output()
    assert code != 0, out[-3000:]
    assert "the critic trainer service" in out and "does not answer" in out, out[-4000:]
    assert not [n for n, pid in pids.items() if _alive(pid)], "a service outlived its run"
    assert storage.read_json(layout.state_url)["iteration"] == 1  # the last checkpoint (run.save_interval=2)

    second = runs.start("resident")
    pids = {}
    second.wait_until(lambda: pids.update(_service_pids(layout)) or len(pids) == 3, "the services' addresses")
    second.wait()
    got, steps = runs.rewards("resident")
    assert sorted(steps) == [0, 1, 2, 3]  # iterations 2 and 3 redone once: never a second value at a step
    assert got == pytest.approx(want, abs=1e-6), (got, want)
    assert not [n for n, pid in pids.items() if _alive(pid)], "a service outlived its run"
    assert not storage.exists(protocol.address_url(layout, "actor"))  # stopped services unpublish
    for role in ("actor", "critic"):  # the last checkpoints: the same weights as the uninterrupted stateless run
        a = _weights(RunLayout(str(tmp_path), "stateless"), role)
        b = _weights(layout, role)
        assert a.keys() == b.keys()
        assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6


def _weights(layout: RunLayout, role: str):
    from safetensors.torch import load_file

    folder = getattr(layout, f"{role}_url")(3)
    return {k: v for f in sorted(os.listdir(folder)) if f.endswith(".safetensors")
            for k, v in load_file(os.path.join(folder, f)).items()}

"""Delta pushes against full ones through ``pyflyte run`` (#48): the same resident GRPO run in the separate layout
(an engine service of its own, the HF engine), once with ``run.weight_push=full`` and once with ``delta``, 3
iterations: iteration 2 samples from the weights of the second push, a delta. Both give the same per-iteration
rewards and the same committed weights, bit for bit, in bfloat16 on both sides (where a policy's small steps leave
most elements unchanged at the engine's dtype: the deltas send only what changed, as the steps of their bits).
Float32 deltas (where AdamW moves nearly every element it has a gradient for) are checked below the workflow:
``tests/unit/hosts/test_transports.py`` (a delta push at float32 lands bit for bit) and ``tests/unit/kernels/``
(both dtypes' encodings); this file also ran the float32 pair through ``pyflyte run`` until 2026-11-30, cut for
the suite's budget (145 s of CPU on a slow host)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from models.run.layout import RunLayout
from tests.integration.flyte_runs import FlyteRun, isolated_env
from tests.integration.test_algorithms import _metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ITERATIONS = 3
OVERRIDES = [f"run.num_iterations={ITERATIONS}", "run.eval_interval=0", "run.save_interval=100",
             "rollout.prompts_per_iteration=8", "rollout.n_samples_per_prompt=4", "actor.minibatch_size=32",
             "actor.micro_batch_size=16", "data.num_demo_train_prompts=64", "data.num_demo_eval_prompts=8",
             "run.registered_model_name=", "run.checkpoint_artifact_max_mb=0", "run.resident=true",
             "rollout.engine=hf", "actor.lr=1e-5"]


def test_delta_pushes_give_the_full_pushes_run_bit_for_bit(tmp_path):
    dtype = "bfloat16"
    (tmp_path / "tmp").mkdir()  # where the services' folders go (their launch file and logs)
    env = isolated_env(tmp_path / "home", {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db",
                                           "TMPDIR": str(tmp_path / "tmp")})
    got = {}
    for push in ("full", "delta"):
        FlyteRun("workflows/reinforce.py", "reinforce_training", "configs/tiny_grpo.yaml",
                 [f"run.storage_root={tmp_path}/runs", f"run.weight_push={push}", f"model.dtype={dtype}"] + OVERRIDES,
                 push, env, tmp_path / f"{push}.log").wait(600)
        layout = RunLayout(str(tmp_path / "runs"), push)
        run_id = layout.read_run_info().mlflow_run_id
        weights = Path(layout.read_state().actor_url.replace("file://", "")) / "model.safetensors"
        got[push] = {key: _metrics(tmp_path / "mlflow.db", run_id, key) for key in
                     ("rollout/reward_mean", "actor/loss", "resident/weights_bytes", "resident/push_density")}
        got[push]["weights"] = hashlib.sha256(weights.read_bytes()).hexdigest()
    assert not list((tmp_path / "tmp").glob("resident-*")), "a finished run left its services' folder behind"
    full, delta = got["full"], got["delta"]
    print("pushes, full / delta: bytes", full["resident/weights_bytes"], delta["resident/weights_bytes"],
          "density", delta["resident/push_density"])
    assert delta["rollout/reward_mean"] == full["rollout/reward_mean"] and len(full["rollout/reward_mean"]) == 3
    assert delta["actor/loss"] == full["actor/loss"] and delta["weights"] == full["weights"]
    assert full["resident/push_density"] == [1.0] * len(full["resident/push_density"])
    # the first push is whole (the engine holds none of this trainer's), the next ones carry what changed
    assert delta["resident/push_density"][0] == 1.0 and max(delta["resident/push_density"][1:]) < 1.0
    assert all(d < f for d, f in zip(delta["resident/weights_bytes"][1:], full["resident/weights_bytes"][1:]))
    assert max(delta["resident/push_density"][1:]) < 0.5
    assert all(d < f / 2 for d, f in zip(delta["resident/weights_bytes"][1:], full["resident/weights_bytes"][1:]))
    # fewer bytes than the changed elements' values alone: their steps travel (a bit or a byte each), not them
    assert all(d < p * f for d, f, p in zip(delta["resident/weights_bytes"][1:], full["resident/weights_bytes"][1:],
                                             delta["resident/push_density"][1:]))

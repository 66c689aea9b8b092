"""The math RLVR demo (``make demo TASK=math``, configs/tiny_math.yaml) run small through ``pyflyte run``:
the warm-started Qwen2-shaped chat model, conversational prompts rendered by its ChatML template, the
weighted math-verify + format rewards against the ``answer`` column, and their per-reward metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlflow
import numpy as np
import pytest

from models.math_demo import DEMO_TASK
from models.math_task import FORMAT_PATTERN, ProblemGenerator
from models.verifiers import format_reward, math_reward
from models.data.batch import RolloutBatch
from models.data.batch_schema import decode_data_columns
from tasks.run.layout import RunLayout
from tests.integration.flyte_runs import ROOT, isolated_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SMALL = ["run.num_iterations=2", "run.eval_interval=2", "run.storage_root=runs", "actor.nproc_per_node=1",
         "rollout.prompts_per_iteration=8", "rollout.n_samples_per_prompt=4", "actor.minibatch_size=32",
         "actor.micro_batch_size=32", "data.num_demo_train_prompts=64", "data.num_demo_eval_prompts=8"]


def test_math_demo_runs_small_with_chat_prompts_and_per_reward_metrics(tmp_path):
    env = isolated_env(tmp_path / "home", {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"})
    cmd = [os.path.join(os.path.dirname(sys.executable), "pyflyte"), "run", f"{ROOT}/workflows/reinforce.py",
           "reinforce_training", "--preset", f"{ROOT}/configs/tiny_math.yaml", "--overrides", json.dumps(SMALL),
           "--run_name", "math"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "[grpo] iter 2/2" in proc.stdout

    rows = {r["prompt_id"]: r for r in ProblemGenerator(DEMO_TASK, "train", 0).rows(64)}
    layout = RunLayout(str(tmp_path / "runs"), "math")
    for i in range(2):
        b = RolloutBatch.read(layout.batch_url(i, "score"))
        ids = b.column("row_id").to_pylist()
        # the engine got ChatML, written here by hand: a user turn, then the assistant's open turn
        assert b.column("prompt").to_pylist() == [
            f"<|im_start|>user\n{rows[r]['question']}<|im_end|>\n<|im_start|>assistant\n" for r in ids]
        cols = decode_data_columns(b.column("data_columns").to_pylist())
        assert cols["answer"] == [rows[r]["answer"] for r in ids]
        responses = b.column("response").to_pylist()
        want = np.add(math_reward([], responses, cols["answer"]),
                      0.1 * np.array(format_reward([], responses, FORMAT_PATTERN)))
        np.testing.assert_allclose(b.column("reward_raw").to_numpy(), want, rtol=1e-6)

    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    metrics = client.get_run(layout.read_run_info().mlflow_run_id).data.metrics
    assert {"reward/math_reward_mean", "reward/format_reward_mean", "eval/math_reward_mean",
            "eval/format_reward_mean"} <= set(metrics)
    assert 0.0 < metrics["eval/format_reward_mean"] <= 1.0  # the warm start writes the format

"""The math RLVR demo's chat model (configs/tiny_math.yaml) run small through ``pyflyte run`` on the
demo's problems in TRL's format, as a TRL user brings them: a ``.jsonl.gz`` with a conversational
``prompt`` column and a ``solution`` column, scored by TRL's own ``trl.rewards.accuracy_reward`` and
``think_format_reward`` (keyword form) beside the project's ``format_reward`` (positional form), with
no other change; the ChatML prompts, the columns each sample carries and the per-reward metrics."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import mlflow
import numpy as np
import pytest
from trl.rewards import accuracy_reward, think_format_reward

from models.demos.math_demo import DEMO_TASK
from models.demos.math_task import FORMAT_PATTERN, ProblemGenerator
from models.rewards.verifiers import format_reward
from models.data.batch import RolloutBatch
from models.data.batch_schema import decode_data_columns
from models.run.layout import RunLayout
from tests.integration.flyte_runs import ROOT, isolated_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SMALL = ["run.num_iterations=2", "run.eval_interval=2", "run.storage_root=runs", "actor.nproc_per_node=1",
         "rollout.prompts_per_iteration=8", "rollout.n_samples_per_prompt=4", "actor.minibatch_size=32",
         "actor.micro_batch_size=32", "data.num_demo_train_prompts=64", "data.num_demo_eval_prompts=8"]


TRL = ["data.train_prompts=train.jsonl.gz", "data.eval_prompts=eval.jsonl.gz", "data.messages_column=",
       "reward.functions=[trl.rewards:accuracy_reward, trl.rewards:think_format_reward, "
       "models.rewards.verifiers:format_reward]", "reward.weights=[1.0, 0.1, 0.1]"]
"""What a TRL user changes: the data, and the preset's own ``messages`` column cleared; the rewards."""


def test_math_demo_trains_on_trl_data_with_trl_rewards(tmp_path):
    rows = ProblemGenerator(DEMO_TASK, "train", 0).rows(64)
    for name, split in ((tmp_path / "train.jsonl.gz", rows), (tmp_path / "eval.jsonl.gz",
                                                              ProblemGenerator(DEMO_TASK, "eval", 0).rows(8))):
        with gzip.open(name, "wt", encoding="utf-8") as f:
            f.writelines(json.dumps({"prompt": r["messages"], "solution": r["answer"]}) + "\n" for r in split)
    env = isolated_env(tmp_path / "home", {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"})
    cmd = [os.path.join(os.path.dirname(sys.executable), "pyflyte"), "run", f"{ROOT}/workflows/reinforce.py",
           "reinforce_training", "--preset", f"{ROOT}/configs/tiny_math.yaml", "--overrides",
           json.dumps(SMALL + TRL), "--run_name", "math"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "[grpo] iter 2/2" in proc.stdout

    layout = RunLayout(str(tmp_path / "runs"), "math")
    for i in range(2):
        b = RolloutBatch.read(layout.batch_url(i, "score"))
        ids = b.column("row_id").to_pylist()  # the row's index in the file
        # the engine got ChatML, written here by hand: a user turn, then the assistant's open turn
        assert b.column("prompt").to_pylist() == [
            f"<|im_start|>user\n{rows[r]['question']}<|im_end|>\n<|im_start|>assistant\n" for r in ids]
        assert [json.loads(m) for m in b.column("prompt_messages").to_pylist()] == [rows[r]["messages"] for r in ids]
        cols = decode_data_columns(b.column("data_columns").to_pylist())
        assert cols == {"solution": [rows[r]["answer"] for r in ids]}
        responses = b.column("response").to_pylist()
        completions = [[{"role": "assistant", "content": r}] for r in responses]  # as TRL's trainer gives them
        want = np.add(accuracy_reward(completions, cols["solution"]), 0.1 * np.add(
            think_format_reward(completions), format_reward([], responses, FORMAT_PATTERN)))
        np.testing.assert_allclose(b.column("reward_raw").to_numpy(), want, rtol=1e-6)

    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    metrics = client.get_run(layout.read_run_info().mlflow_run_id).data.metrics
    assert {"reward/accuracy_reward_mean", "reward/think_format_reward_mean", "reward/format_reward_mean",
            "eval/accuracy_reward_mean", "eval/format_reward_mean"} <= set(metrics)
    assert 0.0 < metrics["eval/format_reward_mean"] <= 1.0  # the warm start writes the format
    assert metrics["reward/think_format_reward_mean"] == 0.0  # and never a <think>

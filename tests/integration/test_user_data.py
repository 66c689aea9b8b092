"""A user's data and reward module through ``pyflyte run``, as a user would launch it: from their own
folder, holding ``myrewards.py`` and a JSONL with an ``answer`` column, with no PYTHONPATH for it;
and a reasoning-gym task (``data.source=reasoning_gym``) trained with its own verifier."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import mlflow
import numpy as np
import pytest

from models.data.batch import RolloutBatch
from models.data.batch_schema import decode_data_columns
from models.run.layout import RunLayout
from tests.integration.flyte_runs import ROOT, isolated_env

pytestmark = pytest.mark.integration

MYREWARDS = '''
def score(prompts, responses, answer):
    """len(answer) + 1 if the response starts with it: only a function that got the column can say."""
    return [len(a) + float(r.startswith(a)) for r, a in zip(responses, answer)]
'''
SMALL = ["run.storage_root=runs", "actor.nproc_per_node=1", "run.num_iterations=2", "run.eval_interval=2",
         "rollout.prompts_per_iteration=16", "actor.minibatch_size=32", "actor.micro_batch_size=32"]


def pyflyte(folder: Path, overrides, run_name: str) -> str:
    """``pyflyte run`` of the critic-free workflow started in ``folder`` (its working directory)."""
    env = isolated_env(folder / "home", {"MLFLOW_TRACKING_URI": f"sqlite:///{folder}/mlflow.db"})
    assert str(folder) not in env.get("PYTHONPATH", "")  # the user's folder is not on any path we set
    cmd = [os.path.join(os.path.dirname(sys.executable), "pyflyte"), "run", f"{ROOT}/workflows/reinforce.py",
           "reinforce_training", "--preset", "configs/tiny_grpo.yaml", "--overrides", json.dumps(overrides),
           "--run_name", run_name]
    proc = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def mlflow_run(folder: Path, layout: RunLayout):
    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{folder}/mlflow.db")
    return client, layout.read_run_info().mlflow_run_id


def test_reward_module_in_the_launch_folder_gets_the_answer_column(tmp_path):
    rng = random.Random(0)
    rows = [{"prompt": "".join(rng.choice("abcdef") for _ in range(rng.randint(3, 5))) + "=",
             "answer": "x" * rng.randint(1, 4), "level": i % 3} for i in range(12)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "myrewards.py").write_text(MYREWARDS)
    pyflyte(tmp_path, SMALL + ["data.train_prompts=train.jsonl", "reward.function=myrewards:score",
                               "rollout.engine=hf", "reward.normalize=true"], "user")
    layout = RunLayout(str(tmp_path / "runs"), "user")
    raw = []
    for i in range(2):
        b = RolloutBatch.read(layout.batch_url(i, "score"))
        cols = decode_data_columns(b.column("data_columns").to_pylist())
        assert cols["answer"] == [rows[r]["answer"] for r in b.column("row_id").to_pylist()]
        want = [len(a) + float(r.startswith(a)) for r, a in zip(b.column("response").to_pylist(), cols["answer"])]
        np.testing.assert_allclose(b.column("reward_raw").to_numpy(), want)
        raw += want
    # iteration 1 is normalised by the moments of both iterations' raw rewards, carried through state.json
    assert layout.read_state().extras["reward_norm"]["count"] == len(raw) == 128  # 2 × 16 prompts × 4 samples
    np.testing.assert_allclose(b.column("reward").to_numpy(), (np.array(want) - np.mean(raw)) / np.std(raw),
                               rtol=1e-5, atol=1e-6)
    client, run_id = mlflow_run(tmp_path, layout)
    metrics = client.get_run(run_id).data.metrics
    assert {"reward/score_mean", "eval/reward_mean", "eval/score_mean"} <= set(metrics)
    table = json.loads(Path(client.download_artifacts(run_id, "samples/iter-000001.json", str(tmp_path))).read_text())
    assert {"prompt", "response", "reward", "row_id", "answer", "level"} <= set(table["columns"])


def test_a_reasoning_gym_task_trains_with_its_own_verifier(tmp_path):
    import reasoning_gym

    out = pyflyte(tmp_path, SMALL + ["data.source=reasoning_gym", "data.reasoning_gym.task=basic_arithmetic",
                                     "data.reasoning_gym.size=64", "data.reasoning_gym.eval_size=8",
                                     "data.reasoning_gym.options=[max_terms=2, max_digits=1]",
                                     "reward.function=models.data.reasoning_gym:reasoning_gym_reward",
                                     "rollout.engine=hf"], "rg")  # the data and verifier are the point
    assert "[grpo] iter 2/2" in out
    layout = RunLayout(str(tmp_path / "runs"), "rg")
    ds = reasoning_gym.create_dataset("basic_arithmetic", seed=0, size=64, max_terms=2, max_digits=1)
    for i in range(2):
        b = RolloutBatch.read(layout.batch_url(i, "score"))
        cols = decode_data_columns(b.column("data_columns").to_pylist())
        entries = [ds[ref["index"]] for ref in cols["reasoning_gym"]]
        assert [e["answer"] for e in entries] == cols["answer"]
        assert b.column("prompt").to_pylist() == [e["question"] for e in entries]
        want = [ds.score_answer(r.strip(), e) for r, e in zip(b.column("response").to_pylist(), entries)]
        np.testing.assert_allclose(b.column("reward").to_numpy(), want)
    client, run_id = mlflow_run(tmp_path, layout)
    metrics = client.get_run(run_id).data.metrics
    # the update ran (its step count is logged; with every reward of a group alike, GRPO's
    # advantages are 0 and it takes no step, so a loss is logged only when some group differs)
    assert {"reward/reasoning_gym_reward_mean", "eval/reward_mean", "actor/steps"} <= set(metrics)


def test_hf_datasets_reads_a_file_on_s3(s3_url, tmp_path, monkeypatch):
    """``data.source=hf`` with a data file on an fsspec URL (the moto S3 server)."""
    from models import storage
    from models.data.prompts import PromptDataConfig, load_prompts

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    url = storage.join(s3_url, "gsm", "train.jsonl")
    storage.write_bytes(url, b"".join(json.dumps({"question": q, "answer": a}).encode() + b"\n"
                                      for q, a in [("1+1?", "2"), ("2+2?", "4")]))
    data = load_prompts(PromptDataConfig(url=url, source="hf", prompt_column="question"))
    assert data.prompts == ["1+1?", "2+2?"] and data.columns == {"answer": ["2", "4"]}

"""Scheduled retraining end to end through ``pyflyte run workflows/retrain.py retrain`` on two days:
day 1 has no champion yet (the demo model is the base) and promotes its candidate; day 2 starts from
that champion, cannot beat it by the required margin, and leaves it in place with the new candidate
kept for review. A local MLflow SQLite registry; prompts under ``{prompts_root}/{date}/``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from models import storage
from models.checkpoint import file_digest
from models.demos.reverse_task import PromptGenerator, ReverseTaskConfig, write_prompts_jsonl

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAME = "tiny-retrain"
TINY = ["run.num_iterations=1", "run.eval_interval=0", "rollout.engine=hf", "rollout.prompts_per_iteration=4",
        "actor.nproc_per_node=1",
        "actor.minibatch_size=16", "actor.micro_batch_size=8", "critic.minibatch_size=16",
        "critic.micro_batch_size=16", "data.num_demo_train_prompts=64", "data.num_demo_eval_prompts=8"]


def _retrain(tmp, day: str, min_improvement: float) -> str:
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp}/mlflow.db", PYTHONUNBUFFERED="1",
               TRANSFORMERS_VERBOSITY="error", TQDM_DISABLE="1")
    cmd = [os.path.join(os.path.dirname(sys.executable), "pyflyte"), "run", "workflows/retrain.py", "retrain",
           "--prompts_root", str(tmp / "prompts"), "--run_date", f"{day}T03:00:00", "--registered_model_name", NAME,
           "--min_improvement", str(min_improvement),
           "--overrides", json.dumps([f"run.storage_root={tmp}/runs"] + TINY)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.fixture(scope="module")
def two_days(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("retrain")
    task = ReverseTaskConfig()
    for seed, day in enumerate(("2026-01-05", "2026-01-06")):
        write_prompts_jsonl(tmp / "prompts" / day / "part-0.jsonl", PromptGenerator(task, "train", seed + 1).prompts(32))
    write_prompts_jsonl(tmp / "prompts" / "heldout" / "eval.jsonl", PromptGenerator(task, "eval", 7).prompts(8))
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp}/mlflow.db")
    client.create_experiment("flyte-rlhf", artifact_location=str(tmp / "artifacts"))
    out1 = _retrain(tmp, "2026-01-05", min_improvement=-1.0)  # any candidate beats the base: promote
    out2 = _retrain(tmp, "2026-01-06", min_improvement=1.0)  # rewards are in [0, 1]: cannot win
    return tmp, client, out1, out2


def _result(stdout: str) -> str:
    return [line for line in stdout.splitlines() if line.startswith("retrain: ")][-1]


def test_first_day_promotes_its_candidate(two_days):
    tmp, client, out1, _ = two_days
    assert "champion (base)" in _result(out1) and _result(out1).endswith("-> promoted")
    v1 = client.get_model_version(NAME, "1")
    assert v1.tags["retrain.decision"] == "promoted" and v1.tags["retrain.champion_version"] == "(none)"
    run1 = client.get_run(v1.run_id)
    assert run1.info.run_name == "retrain-2026-01-05"
    # it trained on that day's prompts, and compared on the held-out ones
    day1 = storage.read_bytes(str(tmp / "prompts" / "2026-01-05" / "part-0.jsonl")).decode()
    trained = storage.read_bytes(str(tmp / "runs" / "retrain-2026-01-05" / "data" / "train_prompts.jsonl")).decode()
    assert [json.loads(x)["prompt"] for x in trained.splitlines()] == [json.loads(x)["prompt"] for x in day1.splitlines()]
    assert run1.data.params["data.eval_prompts"].endswith("prompts/heldout/")


def test_second_day_starts_from_the_champion_and_keeps_it(two_days):
    tmp, client, out1, out2 = two_days
    assert "vs champion v1" in _result(out2) and _result(out2).endswith("-> kept_for_review")
    assert str(client.get_model_version_by_alias(NAME, "champion").version) == "1"
    assert str(client.get_model_version_by_alias(NAME, "candidate").version) == "2"
    v2 = client.get_model_version(NAME, "2")
    assert v2.tags["retrain.decision"] == "kept_for_review" and v2.tags["retrain.champion_version"] == "1"
    # day 2's frozen reference is the champion's weights (downloaded from the registry)
    run1_actor = storage.join(str(tmp / "runs" / "retrain-2026-01-05"), "iter-000000", "actor")
    ref2 = str(tmp / "runs" / "retrain-2026-01-06" / "reference")
    assert file_digest(f"{ref2}/model.safetensors") == file_digest(f"{run1_actor}/model.safetensors")
    # the champion's held-out reward on day 2 is the candidate's on day 1: same weights, prompts, greedy decoding
    v1 = client.get_model_version(NAME, "1")
    assert float(v2.tags["retrain.champion_reward"]) == pytest.approx(float(v1.tags["retrain.candidate_reward"]),
                                                                       abs=1e-4)
    metrics = client.get_run(v2.run_id).data.metrics
    assert metrics["retrain/champion_reward"] == pytest.approx(float(v2.tags["retrain.champion_reward"]), abs=1e-4)

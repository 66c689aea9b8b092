"""Checkpoints and the final policy in MLflow: artifacts or references by size, the transformers
flavour in the Model Registry with alias ``candidate``, nothing twice on retries, and the way
back from the registry to a committed checkpoint with the same weights."""

from __future__ import annotations

import pytest

from models.checkpoint import file_digest, is_committed, save_checkpoint
from models.tiny import TinyModelConfig, build_actor, save_model
from models.tokenizer import build_char_tokenizer
from tasks import registry, tracking


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow")
    mp = pytest.MonkeyPatch()
    mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root}/mlflow.db")
    yield tracking.client().create_experiment("reg-test", artifact_location=str(root / "artifacts"))
    mp.undo()


@pytest.fixture()
def mlflow_run(experiment):
    return tracking.client().create_run(experiment, run_name="r").info.run_id


@pytest.fixture(scope="module")
def actor_url(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    tok = build_char_tokenizer()
    local = save_model(build_actor(TinyModelConfig(), tok), tok, root / "hf")
    save_checkpoint(str(local), str(root / "actor"))
    return str(root / "actor")


def test_small_checkpoint_is_an_artifact_large_one_a_reference(mlflow_run, actor_url):
    size_mb = registry.checkpoint_bytes(actor_url) / 2 ** 20
    assert registry.log_checkpoint(mlflow_run, "iter-000001/actor", actor_url, max_mb=size_mb + 1)
    assert registry.log_checkpoint(mlflow_run, "iter-000001/actor", actor_url, max_mb=size_mb + 1)  # retried
    assert not registry.log_checkpoint(mlflow_run, "iter-000003/actor", actor_url, max_mb=size_mb / 2)
    c = tracking.client()
    files = sorted(a.path for a in c.list_artifacts(mlflow_run, "checkpoints/iter-000001/actor"))
    assert "checkpoints/iter-000001/actor/model.safetensors" in files and len(files) == len(set(files))
    assert c.list_artifacts(mlflow_run, "checkpoints/iter-000003") == []
    tags = c.get_run(mlflow_run).data.tags
    assert tags["checkpoint.iter-000001/actor"] == tags["checkpoint.iter-000003/actor"] == actor_url


def test_policy_registered_once_with_candidate_alias_and_comes_back(mlflow_run, actor_url, tmp_path):
    first = registry.log_policy(mlflow_run, actor_url, "tiny-policy")
    again = registry.log_policy(mlflow_run, actor_url, "tiny-policy")  # a retried finish_run
    assert first == again and first.version == "1"
    c = tracking.client()
    assert len(c.search_model_versions("name = 'tiny-policy'")) == 1
    assert registry.version_by_alias("tiny-policy", registry.CANDIDATE) == "1"
    assert registry.version_by_alias("tiny-policy", registry.CHAMPION) is None
    assert registry.version_by_alias("no-such-model", registry.CHAMPION) is None
    import mlflow

    flavors = mlflow.models.get_model_info(first.model_uri).flavors
    assert flavors["transformers"]["task"] == "text-generation"

    back = registry.checkpoint_from_registry("tiny-policy", "1", str(tmp_path / "champion"))
    assert is_committed(back)
    assert file_digest(f"{back}/model.safetensors") == file_digest(f"{actor_url}/model.safetensors")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(back)
    assert AutoTokenizer.from_pretrained(back)("ab=")["input_ids"]


def test_unregistered_policy_is_still_logged(mlflow_run, actor_url):
    out = registry.log_policy(mlflow_run, actor_url, "")
    assert out.version == "" and out.model_uri.startswith("models:/")


def test_long_runs_keep_their_newest_tables_viewable(mlflow_run):
    """MLflow keeps the list of a run's tables in one tag of at most 8000 characters."""
    import json

    for i in range(160):  # ~50 characters each: the tag is full after ~150
        tracking.log_table(mlflow_run, {"prompt": ["a="], "reward": [1.0]}, f"samples/iter-{i:06d}.json")
    tracking.log_table(mlflow_run, {"prompt": ["b="], "reward": [0.0]}, "samples/iter-000159.json")  # retried
    listed = [t["path"] for t in json.loads(tracking.client().get_run(mlflow_run).data.tags["mlflow.loggedArtifacts"])]
    assert listed[-1] == "samples/iter-000159.json" and len(listed) == len(set(listed)) > 100
    assert listed == [f"samples/iter-{i:06d}.json" for i in range(160 - len(listed), 160)]
    assert len(tracking.client().list_artifacts(mlflow_run, "samples")) == 160

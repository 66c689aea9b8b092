"""Checkpoints and the final policy in MLflow: artifacts or references by size, the transformers
flavour in the Model Registry with alias ``candidate``, nothing twice on retries, and the way
back from the registry to a committed checkpoint with the same weights."""

from __future__ import annotations

import pytest

from models.checkpoint import file_digest, is_committed, save_checkpoint
from models.demos.tiny import TinyModelConfig, build_actor, save_model
from models.demos.tokenizer import build_char_tokenizer
from models.tracking import registry
from models import tracking


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


def test_forgotten_checkpoints_leave_mlflow_with_their_tags(mlflow_run, actor_url, monkeypatch, caplog):
    """Retention deletes a checkpoint's MLflow copy with it (``run.keep_checkpoints``): the artifacts
    ``checkpoints/iter-000004/`` and the ``checkpoint.iter-000004/*`` tags go, the kept iteration's stay, a
    call again (after a crash) does nothing more, and a store that cannot delete keeps the copy and its tag."""
    size_mb = registry.checkpoint_bytes(actor_url) / 2 ** 20
    for name in ("iter-000004/actor", "iter-000004/critic", "iter-000009/actor", "iter-000014/actor"):
        registry.log_checkpoint(mlflow_run, name, actor_url, max_mb=size_mb + 1)
    registry.log_checkpoint(mlflow_run, "iter-000019/actor", actor_url, max_mb=size_mb / 2)  # a reference only
    registry.forget_checkpoints(mlflow_run, ["iter-000004", "iter-000019", "iter-000002"])
    registry.forget_checkpoints(mlflow_run, ["iter-000004"])  # again: nothing left to do
    c = tracking.client()
    assert [a.path for a in c.list_artifacts(mlflow_run, "checkpoints")] == \
        ["checkpoints/iter-000009", "checkpoints/iter-000014"]
    assert sorted(t for t in c.get_run(mlflow_run).data.tags if t.startswith("checkpoint.")) == \
        ["checkpoint.iter-000009/actor", "checkpoint.iter-000014/actor"]

    from mlflow.exceptions import MlflowException
    from mlflow.store.artifact import artifact_repository_registry

    class Refuses:
        def delete_artifacts(self, path):
            raise MlflowException(f"deleting {path} is not allowed here")

    with monkeypatch.context() as m:
        m.setattr(artifact_repository_registry, "get_artifact_repository", lambda uri, **kwargs: Refuses())
        registry.forget_checkpoints(mlflow_run, ["iter-000009"])
    assert "cannot delete the artifacts checkpoints/iter-000009 (kept)" in caplog.text
    assert "checkpoint.iter-000009/actor" in c.get_run(mlflow_run).data.tags
    assert len(c.list_artifacts(mlflow_run, "checkpoints")) == 2


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

    folder = "samples/" + "d" * 200  # ~260 characters an entry: the tag is full after ~30 tables, not ~150
    for i in range(40):
        tracking.log_table(mlflow_run, {"prompt": ["a="], "reward": [1.0]}, f"{folder}/iter-{i:06d}.json")
    tracking.log_table(mlflow_run, {"prompt": ["b="], "reward": [0.0]}, f"{folder}/iter-000039.json")  # retried
    listed = [t["path"] for t in json.loads(tracking.client().get_run(mlflow_run).data.tags["mlflow.loggedArtifacts"])]
    assert listed[-1] == f"{folder}/iter-000039.json" and 20 < len(listed) == len(set(listed)) < 40
    assert listed == [f"{folder}/iter-{i:06d}.json" for i in range(40 - len(listed), 40)]
    assert len(tracking.client().list_artifacts(mlflow_run, folder)) == 40


@pytest.fixture(scope="module")
def later_actor_url(tmp_path_factory):
    """Another committed policy: the final checkpoint after the run was extended."""
    root = tmp_path_factory.mktemp("ckpt-later")
    tok = build_char_tokenizer()
    local = save_model(build_actor(TinyModelConfig(seed=1), tok), tok, root / "hf")
    save_checkpoint(str(local), str(root / "actor"))
    return str(root / "actor")


def test_an_extended_run_registers_its_new_final_policy(mlflow_run, actor_url, later_actor_url):
    """4 iterations, finished and registered; extended to 6 and finished again: the registered model
    and ``candidate`` follow the new final checkpoint, and retries still log nothing twice."""
    import mlflow

    first = registry.log_policy(mlflow_run, actor_url, "extended-policy")
    final = registry.log_policy(mlflow_run, later_actor_url, "extended-policy")
    again = registry.log_policy(mlflow_run, later_actor_url, "extended-policy")  # a retried finish_run
    assert (first.version, final.version) == ("1", "2") and again == final and final.model_uri != first.model_uri
    assert registry.version_by_alias("extended-policy", registry.CANDIDATE) == "2"
    version = tracking.client().get_model_version("extended-policy", "2")
    assert version.tags[registry.CHECKPOINT_TAG] == later_actor_url
    assert mlflow.models.get_model_info(final.model_uri).metadata["checkpoint_url"] == later_actor_url
    exp = tracking.client().get_run(mlflow_run).info.experiment_id
    logged = mlflow.search_logged_models(experiment_ids=[exp], output_format="list",
                                         filter_string=f"source_run_id = '{mlflow_run}'")
    assert len(logged) == 2
    back = registry.checkpoint_from_registry("extended-policy", "2", later_actor_url + "-back")
    assert file_digest(f"{back}/model.safetensors") == file_digest(f"{later_actor_url}/model.safetensors")


def test_a_policy_with_nonfinite_weights_is_never_logged(mlflow_run, actor_url, tmp_path):
    """A checkpoint committed before commits checked finiteness, NaN planted after the fact."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from models.checkpoint import CheckpointError

    bad = tmp_path / "nan-actor"
    shutil.copytree(actor_url, bad)
    weights = load_file(bad / "model.safetensors")
    name = sorted(weights)[0]
    weights[name][0] = float("nan")
    save_file(weights, bad / "model.safetensors", metadata={"format": "pt"})
    marker = json.loads((bad / "COMMITTED.json").read_text())
    marker["files"]["model.safetensors"] = file_digest(str(bad / "model.safetensors"))
    (bad / "COMMITTED.json").write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match=rf"'model\.safetensors' holds NaN or inf in 1 tensor\(s\) \({name}\)"):
        registry.log_policy(mlflow_run, str(bad), "nan-policy")
    assert registry.version_by_alias("nan-policy", registry.CANDIDATE) is None

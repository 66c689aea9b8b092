"""Nothing loaded from storage can execute code, and credentials stay out of MLflow.

- A pickle that runs code when unpickled (it creates a sentinel file) is planted where the
  project reads checkpoints and batches: beside a committed checkpoint, listed in a forged
  marker, disguised as ``model.safetensors``, as a batch. Every load is refused with an error
  naming the file and URL, and the sentinel never appears.
- The project's code never calls an unpickler (``torch.load`` only with ``weights_only=True``,
  no ``pickle``/``joblib``/``np.load(allow_pickle=True)``, no ``trust_remote_code=True``).
- MLflow params and tags are masked (:mod:`models.tracking.redact`).

The server's token, size caps and save-path checks are tested in ``tests/unit/hosts``
(``test_app.py``, ``test_paths.py``) and ``tests/integration/test_server.py``.
"""

from __future__ import annotations

import ast
import json
import os
import pickle
from pathlib import Path

import pytest

from models.checkpoint import CheckpointError, download_checkpoint, file_digest, load_model, save_checkpoint
from models.data.batch import BatchSchemaError, RolloutBatch
from models.tracking.redact import redact

REPO = Path(__file__).resolve().parents[2]
CODE_DIRS = ("models", "tasks", "kernels", "workflows", "benchmarks")


class Exploit:
    """Unpickling this calls ``open(sentinel, "w")``: code runs, the sentinel file appears."""

    def __init__(self, sentinel: str):
        self.sentinel = sentinel

    def __reduce__(self):
        return open, (self.sentinel, "w")


@pytest.fixture
def exploit(tmp_path):
    sentinel = tmp_path / "pwned"
    data = pickle.dumps(Exploit(str(sentinel)))
    pickle.loads(data).close()  # the payload does work when unpickled ...
    assert sentinel.exists()
    sentinel.unlink()  # ... and the tests check it never runs again
    return data, sentinel


def committed(tmp_path, name="ckpt") -> str:
    from tests.unit.models.test_checkpoint import tiny_model_and_tokenizer

    model, tok = tiny_model_and_tokenizer()
    src = tmp_path / f"{name}-src"
    model.save_pretrained(src, safe_serialization=True)
    tok.save_pretrained(src)
    url = str(tmp_path / name)
    save_checkpoint(str(src), url)
    return url


def forge_marker(url: str, rel: str) -> None:
    """Rewrite the commit marker as an attacker with write access could: ``rel`` listed, checksum right."""
    path = Path(url) / "COMMITTED.json"
    marker = json.loads(path.read_text())
    marker["files"][rel] = file_digest(str(Path(url) / rel))
    path.write_text(json.dumps(marker))


def _loads(url: str, tmp_path):
    """Every way the project loads a checkpoint from storage."""
    from transformers import AutoModelForCausalLM

    from models.training.load import load_hf

    yield lambda: download_checkpoint(url)
    yield lambda: download_checkpoint(url, str(tmp_path / "copy"))
    yield lambda: load_model(url, AutoModelForCausalLM)
    yield lambda: load_hf(url, AutoModelForCausalLM)


@pytest.mark.parametrize("rel", ["pytorch_model.bin", "optimizer.pt", "rng_state.pth", "extra.pkl"])
def test_pickle_beside_a_committed_checkpoint_is_refused(tmp_path, exploit, rel):
    data, sentinel = exploit
    url = committed(tmp_path)
    (Path(url) / rel).write_bytes(data)
    for load in _loads(url, tmp_path):
        with pytest.raises(CheckpointError, match=f"checkpoint {url} contains '{rel}', a pickle-based file"):
            load()
    forge_marker(url, rel)  # listed in the marker with a matching checksum: still refused
    with pytest.raises(CheckpointError, match="a pickle-based file"):
        download_checkpoint(url, str(tmp_path / "again"))
    assert not sentinel.exists()


def test_pickle_disguised_as_safetensors_does_not_run(tmp_path, exploit):
    data, sentinel = exploit
    url = committed(tmp_path)
    (Path(url) / "model.safetensors").write_bytes(data)
    with pytest.raises(CheckpointError, match="'model.safetensors' has .* bytes|fails its blake3"):
        download_checkpoint(url)
    forge_marker(url, "model.safetensors")  # checksum matches now: the safetensors parser refuses it
    from transformers import AutoModelForCausalLM

    with pytest.raises(Exception) as err:
        load_model(url, AutoModelForCausalLM)
    assert not isinstance(err.value, (AssertionError, pickle.UnpicklingError)), err.value
    assert not sentinel.exists()


def test_pickle_is_never_uploaded_as_a_checkpoint(tmp_path, exploit):
    data, sentinel = exploit
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "pytorch_model.bin").write_bytes(data)
    with pytest.raises(CheckpointError, match="'pytorch_model.bin', a pickle-based file"):
        save_checkpoint(str(src), str(tmp_path / "dst"))
    assert not (tmp_path / "dst").exists() and not sentinel.exists()


def test_pickle_planted_as_a_batch_is_refused(tmp_path, exploit):
    data, sentinel = exploit
    url = tmp_path / "iter-000001" / "rollouts.arrow"
    url.parent.mkdir()
    url.write_bytes(data)
    with pytest.raises(BatchSchemaError, match=f"{url} is not an Arrow IPC file"):
        RolloutBatch.read(str(url))
    assert not sentinel.exists()


def _unsafe_calls(tree: ast.AST):
    """``(line, what)`` of every call that could unpickle or run downloaded code."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        kwargs = {k.arg: ast.unparse(k.value) for k in node.keywords if k.arg}
        if name == "torch.load" and kwargs.get("weights_only") != "True":
            yield node.lineno, "torch.load without weights_only=True"
        if name in ("pickle.load", "pickle.loads", "cloudpickle.load", "cloudpickle.loads", "joblib.load",
                    "dill.load", "dill.loads", "marshal.loads"):
            yield node.lineno, name
        if name in ("np.load", "numpy.load") and kwargs.get("allow_pickle") == "True":
            yield node.lineno, "np.load(allow_pickle=True)"
        if kwargs.get("trust_remote_code") == "True":
            yield node.lineno, "trust_remote_code=True"


def test_project_code_never_unpickles_or_trusts_remote_code():
    found = []
    for folder in CODE_DIRS:
        for path in sorted((REPO / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            found += [f"{path.relative_to(REPO)}:{line}: {what}" for line, what in _unsafe_calls(tree)]
    assert not found, "\n".join(found)
    bad = ast.parse("import torch\ntorch.load(f)\npickle.loads(b)\nAutoModel.from_pretrained(p, trust_remote_code=True)")
    assert [what for _, what in _unsafe_calls(bad)] == [  # the scan itself finds what it looks for
        "torch.load without weights_only=True", "pickle.loads", "trust_remote_code=True"]


SECRET = "s3cr3t-value-9f8e7d"


@pytest.mark.parametrize("text, expected", [
    ("http://user:pw@host:8000/path", "http://***@host:8000/path"),
    ("https://token@github.com/x", "https://***@github.com/x"),
    ("s3://bucket/key?X-Amz-Signature=abc&X-Amz-Credential=def&x=1",
     "s3://bucket/key?X-Amz-Signature=***&X-Amz-Credential=***&x=1"),
    ("http://h/?api_key=k1&page=2", "http://h/?api_key=***&page=2"),
    (f"the key is {SECRET}.", "the key is ***."),
    ("s3://bucket/runs/ppo-1", "s3://bucket/runs/ppo-1"),
    ("models.demos.reverse_task:reverse_reward", "models.demos.reverse_task:reverse_reward"),
])
def test_redact_masks_credentials_and_keeps_the_rest(text, expected):
    assert redact(text, env={"AWS_SECRET_ACCESS_KEY": SECRET, "HOME": "/root", "AWS_ACCESS_KEY_ID": "short"}) \
        == expected


def test_mlflow_params_and_tags_are_masked(tmp_path, monkeypatch):
    from models import tracking

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", SECRET)
    run_id = tracking.start_run("security", "r", {"reward.remote_url": "http://bob:hunter2hunter2@10.0.0.1:1/",
                                                  "note": f"token {SECRET}"},
                                {"storage": "s3://b/r?X-Amz-Signature=sig123"})
    tracking.set_tags(run_id, {"checkpoint": f"http://x/?token={SECRET}"})
    data = tracking.client().get_run(run_id).data
    text = json.dumps([data.params, data.tags])
    assert "hunter2hunter2" not in text and SECRET not in text and "sig123" not in text
    assert data.params["reward.remote_url"] == "http://***@10.0.0.1:1/" and data.params["note"] == "token ***"
    assert os.path.exists(tmp_path / "mlflow.db")

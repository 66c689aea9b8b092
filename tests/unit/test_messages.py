"""Messages that name the cause (issue 18, point 9), each as a user meets it: a model folder that is not
there, one with pickled weights only, one without a tokenizer — refused at set-up before anything is
built, copied or tracked; and a disk that fills up while the update commits its checkpoint. (Ctrl-C and
failed runs: ``tests/unit/tasks/test_run_end.py`` and ``tests/integration/test_run_reliability.py``.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from models.run import setup as run_setup
from models.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]


class StartedTooFar(AssertionError):
    """Set-up got as far as copying checkpoints or starting MLflow before it failed."""


@pytest.fixture
def ws(tmp_path, monkeypatch):
    def guard(*args, **kwargs):
        raise StartedTooFar("set-up reached checkpoint copies or MLflow")

    monkeypatch.setattr(run_setup, "_commit_copy", guard)
    monkeypatch.setattr(run_setup.tracking, "start_run", guard)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["12+3=", "4*5="]))
    return tmp_path


def launch(ws: Path, actor: Path) -> None:
    run_setup.setup_run("tiny_grpo", [f"run.storage_root={ws}/runs", f"model.actor_path={actor}",
                                      f"data.train_prompts={ws}/train.jsonl"], "case", "reinforce")


def test_a_missing_actor_path_says_so(ws):
    with pytest.raises(ConfigError, match=r"model\.actor_path=.*/Qwen2-0\.5B-Instruct: no such folder\. Give a local "
                                          r"folder or an fsspec URL .* Hub repo ids are not downloaded, so fetch one "
                                          r"first, e\.g\. `huggingface-cli download <repo> --local-dir <folder>`"):
        launch(ws, ws / "Qwen2-0.5B-Instruct")


def pickled(src: Path, dst: Path, keep_others: bool) -> Path:
    """``src``'s weights as ``pytorch_model.bin`` (torch.save: a pickle) instead of safetensors."""
    import torch
    from safetensors.torch import load_file

    dst.mkdir()
    if keep_others:
        for f in src.iterdir():
            if f.suffix != ".safetensors":
                shutil.copy(f, dst / f.name)
    torch.save(load_file(src / "model.safetensors"), dst / "pytorch_model.bin")
    return dst


@pytest.mark.parametrize("keep_others", [False, True], ids=["only pytorch_model.bin", "an old-style HF folder"])
def test_pickled_weights_are_refused_with_the_conversion(ws, qwen2_chat_dir, keep_others):
    actor = pickled(qwen2_chat_dir, ws / "old-qwen", keep_others)
    with pytest.raises(ConfigError, match=r"model\.actor_path=.*/old-qwen holds pickled weights \(pytorch_model\.bin\) "
                                          r"and no \.safetensors: pickle files can run code when loaded, so they are "
                                          r"refused\. Convert them once.*from transformers import "
                                          r"AutoModelForCausalLM; AutoModelForCausalLM\.from_pretrained\('.*/old-qwen'\)"
                                          r"\.save_pretrained\('<out>', safe_serialization=True\)"):
        launch(ws, actor)


def test_a_folder_without_a_tokenizer_says_so(ws, llama_bpe_dir):
    actor = ws / "no-tokenizer"
    shutil.copytree(llama_bpe_dir, actor, ignore=shutil.ignore_patterns("tokenizer*", "vocab*", "merges*", "special*"))
    with pytest.raises(ConfigError, match=r"model\.actor_path=.*/no-tokenizer holds no tokenizer \(none of "
                                          r"tokenizer\.json, tokenizer_config\.json"):
        launch(ws, actor)


DRIVER = """
import subprocess, sys
from models.training.distributed import DistInfo
from models.data.batch import RolloutBatch
from models.config.io import config_from_json_dict
from models.run.layout import RunLayout
from models.run.types import PolicyState, RunHandle
from models.checkpoint.disk_full import DiskFull
from models.stages.actor import train_actor
import torch
root, name = sys.argv[1], sys.argv[2]
layout = RunLayout(root, name)
cfg = config_from_json_dict(layout.read_run_info().config)
data = f"{layout.url}/data"
run = RunHandle(root, name, "", layout.reference_url(), f"{data}/train_prompts.jsonl", f"{data}/eval_prompts.jsonl")
batch = RolloutBatch.read(layout.batch_url(0, "advantages"))  # mapped before the disk is swapped
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", layout.iter_dir(0)], check=True)  # a full disk
try:
    train_actor(cfg, run, PolicyState(0, layout.reference_url(), "", 0.0), batch, DistInfo(0, 1, 0, torch.device("cpu")))
except DiskFull as err:
    print(err, flush=True)
    sys.exit(3)
"""


def can_mount_in_a_namespace() -> bool:
    try:
        return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.mark.slow
def test_a_full_disk_during_the_update_names_the_checkpoint_and_the_free_space(tmp_path):
    """The update's checkpoint folder is a 64 KiB tmpfs (mounted in a user and mount namespace)."""
    if not can_mount_in_a_namespace():
        pytest.skip("no unprivileged user and mount namespaces here (unshare --user --mount)")
    from tests.stages import tiny_run, to_advantages

    overrides = ["rollout.engine=hf", "rollout.prompts_per_iteration=4", "actor.minibatch_size=16",
                 "actor.micro_batch_size=8", "actor.nproc_per_node=1", "data.num_demo_train_prompts=16",
                 "data.num_demo_eval_prompts=4"]
    with tiny_run(tmp_path, "tiny_grpo", overrides, "disk") as setup:
        to_advantages(*setup)
    out = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", sys.executable, "-c", DRIVER,
                          str(tmp_path), "disk"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 3, out.stdout[-3000:] + out.stderr[-3000:]
    url = f"{tmp_path}/disk/iter-000000/actor"
    assert re.match(rf"no space left on the disk while writing checkpoint {re.escape(url)}: its files go to a "
                    rf"temporary folder in {re.escape(str(tmp_path))}/disk/iter-000000 first, on a filesystem of 0\.1 "
                    rf"MiB \(0\.1 MiB free once the partial files were removed\), and the trained weights alone take "
                    rf"0\.\d MiB\. Nothing of this iteration was committed: .* rerun the same command to resume",
                    out.stdout), out.stdout

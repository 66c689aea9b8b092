"""A checkpoint whose weights hold NaN or inf is never committed (models/checkpoint.check_finite): not
by an update, not as a copy of a user's checkpoint; a committed checkpoint it would replace stays."""

from __future__ import annotations

import shutil

import pytest
import torch

from models.checkpoint import CheckpointError, is_committed, read_marker, save_checkpoint, save_model_checkpoint


@pytest.fixture(scope="module")
def qwen(qwen2_chat_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(qwen2_chat_dir), AutoTokenizer.from_pretrained(qwen2_chat_dir)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_an_update_with_nonfinite_weights_is_not_committed(qwen, tmp_path, bad):
    """The Qwen2 checkpoint ties its head to the embedding: one bad entry there spoils both."""
    model, tok = qwen
    url = str(tmp_path / "iter-000001" / "actor")
    before = save_model_checkpoint(model, tok, url)  # the committed checkpoint a retried update would replace
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["model.embed_tokens.weight"][3, 5] = bad
    with pytest.raises(CheckpointError, match=r"'model\.safetensors' holds NaN or inf in 1 tensor\(s\) "
                                              r"\(model\.embed_tokens\.weight\); weights that are not finite "
                                              r"are never committed"):
        save_model_checkpoint(model, tok, url, overwrite=True, state_dict=state)
    assert is_committed(url) and read_marker(url)["files"] == before["files"]  # the old one, intact
    assert not [p.name for p in (tmp_path / "iter-000001").iterdir() if ".tmp-" in p.name]


def test_a_user_checkpoint_with_nan_weights_is_refused(qwen2_chat_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    src = tmp_path / "user"
    shutil.copytree(qwen2_chat_dir, src, ignore=shutil.ignore_patterns("LICENSE"))  # refused as a file type today
    weights = load_file(src / "model.safetensors")
    weights["model.layers.0.mlp.up_proj.weight"][0, 0] = float("nan")
    weights["model.norm.weight"] = weights["model.norm.weight"].to(torch.bfloat16) * float("inf")
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"holds NaN or inf in 2 tensor\(s\) \(model\.layers\.0\.mlp\.up_proj\."
                                              r"weight, model\.norm\.weight\)"):
        save_checkpoint(str(src), str(tmp_path / "reference"))
    assert not is_committed(str(tmp_path / "reference"))

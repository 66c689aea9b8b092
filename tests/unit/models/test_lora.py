"""LoRA checkpoints: committed adapter-only, loaded on their base, the adapter switched off gives the
base, ``merge`` writes a full checkpoint with the same logits; the MLflow policy is the merged model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from models.checkpoint import CheckpointError, is_committed, read_marker, save_checkpoint
from models.training.lora import (CAUSAL_LM, add_adapter, base_url, canonical_url, load_pretrained, merge_command,
                         save_adapter_checkpoint, without_adapter)
from models.demos.tiny import TinyModelConfig, build_actor, save_model
from models.demos.tokenizer import build_char_tokenizer
from tests.unit.models.hub_copies import adapter_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SPEC = SimpleNamespace(rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
IDS = torch.tensor([[1, 5, 9, 12, 7, 3], [1, 4, 4, 8, 2, 6]])  # [B, L]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A committed base actor and a committed adapter on it whose B matrices are not zero."""
    root = tmp_path_factory.mktemp("lora")
    tok = build_char_tokenizer()
    base_url_ = str(root / "base")
    save_checkpoint(str(save_model(build_actor(TinyModelConfig(), tok), tok, root / "hf")), base_url_)
    adapter = str(root / "adapter")
    model = adapter_checkpoint(base_url_, SPEC, tok, adapter, std=0.2)
    return SimpleNamespace(root=root, base=base_url_, adapter=adapter, model=model.eval())



def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits  # [B, L, V]


def test_adapter_checkpoint_is_committed_without_base_weights(ckpts):
    files = set(read_marker(ckpts.adapter)["files"])
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= files
    assert "model.safetensors" not in files and "config.json" not in files
    assert base_url(ckpts.adapter) == canonical_url(ckpts.base) == os.path.abspath(ckpts.base)


def test_loaded_adapter_equals_the_trained_one_and_off_equals_base(ckpts):
    loaded = load_pretrained(ckpts.adapter, AutoModelForCausalLM, torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(ckpts.base).eval()
    torch.testing.assert_close(_logits(loaded), _logits(ckpts.model), rtol=0, atol=1e-6)
    assert (_logits(loaded) - _logits(base)).abs().max() > 1e-2  # the adapter changes the model
    with loaded.disable_adapter():
        torch.testing.assert_close(_logits(loaded), _logits(base), rtol=0, atol=1e-6)
    off = without_adapter(lambda **kw: loaded(**kw).logits, loaded)  # any callable that runs the model
    torch.testing.assert_close(off(input_ids=IDS), _logits(base), rtol=0, atol=1e-6)
    trainable = load_pretrained(ckpts.adapter, AutoModelForCausalLM, torch.float32, trainable=True)
    assert {n for n, p in trainable.named_parameters() if p.requires_grad} == \
        {n for n, _ in trainable.named_parameters() if ".lora_" in n}


@pytest.mark.slow
def test_merge_command_writes_a_full_checkpoint_with_the_same_logits(ckpts):
    out = str(ckpts.root / "merged")
    proc = subprocess.run([sys.executable, "-m", "models.training.lora", "merge", "--adapter", ckpts.adapter, "--out", out],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert is_committed(out) and "model.safetensors" in read_marker(out)["files"]
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(_logits(merged), _logits(ckpts.model), rtol=0, atol=1e-5)
    assert json.load(open(os.path.join(out, "tokenizer_config.json")))  # the tokenizer came along


def test_merge_refuses_full_weights_and_existing_output(ckpts):
    with pytest.raises(ValueError, match="is not a LoRA adapter checkpoint"):
        merge_command(ckpts.base, str(ckpts.root / "never"))
    merge_command(ckpts.adapter, str(ckpts.root / "twice"))
    with pytest.raises(FileExistsError, match="already committed"):
        merge_command(ckpts.adapter, str(ckpts.root / "twice"))


def test_save_checkpoint_still_refuses_a_folder_that_is_neither(tmp_path):
    (tmp_path / "weights.safetensors").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="no config.json .* and no adapter_config.json"):
        save_checkpoint(str(tmp_path), str(tmp_path / "out"))


@pytest.mark.integration  # MLflow model logging starts processes
def test_mlflow_logs_the_adapter_and_the_merged_policy(ckpts, tmp_path, monkeypatch):
    import mlflow

    from models.tracking import registry

    from models import tracking

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    exp = tracking.client().create_experiment("lora", artifact_location=str(tmp_path / "artifacts"))
    run_id = tracking.client().create_run(exp, run_name="r").info.run_id
    policy = registry.log_policy(run_id, ckpts.adapter, "lora-policy")
    assert policy.version == "1"
    logged = {a.path for a in tracking.client().list_artifacts(run_id, registry.ADAPTER_ARTIFACTS)}
    assert f"{registry.ADAPTER_ARTIFACTS}/adapter_model.safetensors" in logged
    back = registry.checkpoint_from_registry("lora-policy", "1", str(tmp_path / "from-registry"))
    merged = AutoModelForCausalLM.from_pretrained(back).eval()
    torch.testing.assert_close(_logits(merged), _logits(ckpts.model), rtol=0, atol=1e-5)
    metadata = mlflow.models.get_model_info(policy.model_uri).metadata
    assert metadata["lora_adapter"] == f"runs:/{run_id}/{registry.ADAPTER_ARTIFACTS}"


def test_policy_logprobs_use_an_adapted_output_head(ckpts):
    """With ``lm_head`` among the targets the head is a LoRA layer: its adapter must be in the log-probs."""
    from models.data.batch_tensors import ModelInputs
    from models.training.policy import PolicyLogprobs

    spec = SimpleNamespace(rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "lm_head"])
    model = add_adapter(AutoModelForCausalLM.from_pretrained(ckpts.base), spec, CAUSAL_LM).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0.0, 0.2)
    positions = torch.arange(3, IDS.shape[1]).expand(IDS.shape[0], -1)  # [B, T]: the last 3 tokens
    is_response = torch.arange(IDS.shape[1]).expand(IDS.shape[0], -1) >= 3  # [B, L]
    inputs = ModelInputs(IDS, torch.ones_like(IDS), is_response, positions, torch.ones_like(positions, dtype=torch.bool))
    with torch.no_grad():
        logp, _ = PolicyLogprobs(model)(inputs, with_entropy=False)  # [B, T]
    full = torch.log_softmax(_logits(model), -1)  # [B, L, V]
    expected = full[:, 2:-1].gather(-1, IDS[:, 3:].unsqueeze(-1)).squeeze(-1)  # token at p predicted at p - 1
    torch.testing.assert_close(logp, expected, rtol=0, atol=1e-5)


# --- a tied model (Qwen2-shaped, models/demos/hub_models.py) with lm_head among the targets ---

TIED_SPEC = SimpleNamespace(rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj", "lm_head"])


@pytest.fixture(scope="module")
def tied(qwen2_chat_dir, tmp_path_factory):
    """The committed Qwen2-shaped base (tied embeddings) and a trained-looking adapter with lm_head."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("tied-lora")
    base = str(root / "base")
    save_checkpoint(str(qwen2_chat_dir), base)
    adapter = str(root / "adapter")
    adapter_checkpoint(base, TIED_SPEC, AutoTokenizer.from_pretrained(base), adapter, std=0.5)
    return SimpleNamespace(root=root, base=base, adapter=adapter)


def test_merging_a_tied_head_unties_it_and_gives_the_trained_model(tied):
    from peft import PeftModel

    from models.training.lora import merge_adapter
    from models.training.probe import compare_policies

    merged = merge_adapter(tied.adapter, str(tied.root / "merged"))
    gap = compare_policies(tied.adapter, merged)  # the trainer's forward on both, float32
    assert gap.gap_max < 1e-5, gap.where()
    model, base = (AutoModelForCausalLM.from_pretrained(p) for p in (merged, tied.base))
    assert model.config.tie_word_embeddings is False
    assert torch.equal(model.get_input_embeddings().weight, base.get_input_embeddings().weight)  # input unchanged
    naive = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tied.base), tied.adapter).merge_and_unload()
    naive.save_pretrained(tied.root / "naive")  # the delta written into the shared tensor: both sides move
    assert compare_policies(tied.adapter, str(tied.root / "naive")).gap_max > 1e-2  # what the check catches


def test_a_merge_that_changes_the_model_is_refused(tied, monkeypatch):
    import models.training.lora as lora

    monkeypatch.setattr(lora, "untie_for_adapter", lambda model, targets: False)
    with pytest.raises(ValueError, match=r"merging adapter .*adapter changed the model: merged vs base \+ adapter "
                                         r"differ by .* nats \(tolerance 0.0001\) at sequence"):
        lora.merge_adapter(tied.adapter, str(tied.root / "refused"))


@pytest.mark.integration  # MLflow model logging starts processes
def test_the_registered_policy_of_a_tied_adapter_is_the_trained_model(tied, tmp_path, monkeypatch):
    from models.training.probe import compare_policies
    from models.tracking import registry
    from models import tracking

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    exp = tracking.client().create_experiment("tied", artifact_location=str(tmp_path / "artifacts"))
    run_id = tracking.client().create_run(exp, run_name="r").info.run_id
    assert registry.log_policy(run_id, tied.adapter, "tied-policy").version == "1"
    back = registry.checkpoint_from_registry("tied-policy", "1", str(tmp_path / "from-registry"))
    assert compare_policies(tied.adapter, back).gap_max < 1e-5


@pytest.mark.integration  # vLLM's model registry inspects the architecture in a subprocess
def test_vllm_adapter_mode_with_an_unsupported_head_target_is_refused_at_set_up(tied):
    pytest.importorskip("vllm")
    from models.config import ConfigError
    from models.config.io import load_config
    from models.run.preflight import check_rollout_setup

    config = json.load(open(os.path.join(tied.base, "config.json")))
    cfg = load_config("tiny_ppo_lora")  # lm_head among the targets, vLLM serving the adapter
    with pytest.raises(ConfigError, match=r"actor.lora.target_modules has \['lm_head'\], which vLLM cannot serve as a "
                                          r"LoRA adapter for \['Qwen2ForCausalLM'\]: use rollout.lora_mode=merged \(its "
                                          r"embeddings are tied: the merge unties lm_head"):
        check_rollout_setup(cfg, config)
    for fine in (["rollout.lora_mode=merged"], ["rollout.engine=hf"]):
        check_rollout_setup(load_config("tiny_ppo_lora", fine), config)
    check_rollout_setup(cfg, {**config, "architectures": ["LlamaForCausalLM"]})  # vLLM's Llama adapts lm_head

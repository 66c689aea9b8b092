"""LoRA through the task functions on a tiny PPO run (HF engine, one process), two iterations:
adapter-only checkpoints, π_ref from the same model with the adapter off (checked against a
separately loaded base), π_old against peft's own loader, the optimizer's parameter count
worked out by hand, only adapter tensors changing, the critic's head staying trainable."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from models.checkpoint import read_marker
from models.training.distributed import DistInfo
from models.training.lora import CAUSAL_LM, canonical_url
from models.training.policy import PolicyLogprobs
from models.training.update import make_optimizer
from models.stages.commit import run_commit
from models.stages.rollout import run_rollout
from models.stages.score import run_score
from models.stages.updates import load_trainable
from models.stages.actor import train_actor
from models.stages.critic import train_critic
from tests.reference import token_logprobs
from tests.stages import tiny_run, to_advantages

pytestmark = pytest.mark.slow  # whole tasks on a tiny run, tens of seconds each (make test-unit leaves them to make test)

OVERRIDES = ["rollout.engine=hf", "rollout.prompts_per_iteration=8", "rollout.n_samples_per_prompt=4",
             "actor.minibatch_size=16", "actor.micro_batch_size=8", "actor.nproc_per_node=1",
             "critic.minibatch_size=16", "critic.micro_batch_size=8", "run.num_iterations=2",
             "data.num_demo_train_prompts=64", "data.num_demo_eval_prompts=8", "actor.lr=1e-2",
             "actor.lora.rank=8", "actor.lora.alpha=16", "critic.lora.rank=4",
             "actor.lora.target_modules=[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]"]
CPU = DistInfo(0, 1, 0, torch.device("cpu"))
RANK = 8
# tiny Llama: hidden 64, MLP 256, 2 layers, 2 heads of 32 (k/v as wide as q). LoRA on a Linear
# [out, in] adds A [r, in] and B [out, r]: r·(in + out) parameters.
HIDDEN, MLP, LAYERS = 64, 256, 2
ADAPTER_PARAMS = LAYERS * RANK * (4 * (HIDDEN + HIDDEN) + 3 * (HIDDEN + MLP))  # q k v o + gate up down


def _path(url: str) -> str:
    return url.replace("file://", "")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    with tiny_run(tmp_path_factory.mktemp("runs"), "tiny_ppo_lora", OVERRIDES, "lora") as (cfg, handle, s0):
        ro, sc, ad = to_advantages(cfg, handle, s0)
        actor = train_actor(cfg, handle, s0, ad.batch, CPU)
        critic = train_critic(cfg, handle, s0, ad.batch)
        s1 = run_commit(cfg, handle, s0, [ro.stats, sc.stats, ad.stats, actor.stats, critic.stats], sc.batch,
                        actor.checkpoint_url, critic.checkpoint_url)
        ro1 = run_rollout(cfg, handle, s1)
        yield dict(cfg=cfg, run=handle, s0=s0, s1=s1, ad0=ad, ro1=ro1)


def test_actor_checkpoint_is_the_adapter_only(run):
    url = run["s1"].actor_url
    files = set(read_marker(url)["files"])
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= files
    assert not any(f.startswith("model") and f.endswith(".safetensors") for f in files)  # no base weights
    config = json.load(open(os.path.join(_path(url), "adapter_config.json")))
    assert config["base_model_name_or_path"] == canonical_url(run["run"].reference_url)
    assert (config["r"], config["lora_alpha"]) == (RANK, 16)
    tensors = load_file(os.path.join(_path(url), "adapter_model.safetensors"))
    assert all(".lora_A." in k or ".lora_B." in k for k in tensors)
    assert sum(t.numel() for t in tensors.values()) == ADAPTER_PARAMS


def test_peft_loads_the_adapter_on_its_own(run):
    """The pointer to the base is peft's own field: AutoPeftModel finds the base without our loader."""
    from peft import AutoPeftModelForCausalLM

    model = AutoPeftModelForCausalLM.from_pretrained(_path(run["s1"].actor_url))
    assert any(".lora_B." in n and float(p.abs().sum()) > 0 for n, p in model.named_parameters())


def test_score_reference_is_the_base_with_the_adapter_off(run, monkeypatch):
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    loads = []
    original = AutoModelForCausalLM.from_pretrained.__func__

    def counting(cls, path, *args, **kwargs):
        loads.append(str(path))
        return original(cls, path, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(counting))
    cfg, handle, s1, batch = run["cfg"], run["run"], run["s1"], run["ro1"].batch
    scored = run_score(cfg, handle, s1, batch).batch
    assert len(loads) == 1  # the base once (under the adapter); no separate reference model
    monkeypatch.undo()

    base = AutoModelForCausalLM.from_pretrained(_path(handle.reference_url)).eval()
    adapted = AutoPeftModelForCausalLM.from_pretrained(_path(s1.actor_url)).eval()
    ref, old = scored.column("ref_logprobs").to_pylist(), scored.column("old_logprobs").to_pylist()
    for mine, theirs in zip(ref, token_logprobs(base, batch)):
        np.testing.assert_allclose(mine, theirs, atol=1e-4)
    for mine, theirs in zip(old, token_logprobs(adapted, batch)):
        np.testing.assert_allclose(mine, theirs, atol=1e-4)
    gap = max(abs(a - b) for o, r in zip(old, ref) for a, b in zip(o, r))
    assert gap > 1e-3  # the adapter moved the policy: the two columns are not the same model


def test_rollout_serves_the_adapter(run):
    """HF engine, adapter mode: the sampler's log-probs are the adapted policy's."""
    from peft import AutoPeftModelForCausalLM

    batch = run["ro1"].batch
    adapted = AutoPeftModelForCausalLM.from_pretrained(_path(run["s1"].actor_url)).eval()
    for sampler, theirs in zip(batch.column("sampler_logprobs").to_pylist(), token_logprobs(adapted, batch)):
        np.testing.assert_allclose(sampler, theirs, atol=1e-4)


def test_optimizer_holds_only_the_adapter(run):
    from transformers import AutoModelForCausalLM

    lm = load_trainable(run["s0"].actor_url, AutoModelForCausalLM, "float32", run["cfg"].actor.lora, CAUSAL_LM)
    opt = make_optimizer(PolicyLogprobs(lm), lr=1e-3)
    in_opt = sum(p.numel() for g in opt.param_groups for p in g["params"])
    assert in_opt == ADAPTER_PARAMS
    lora = {id(p) for n, p in lm.named_parameters() if ".lora_A." in n or ".lora_B." in n}
    assert {id(p) for g in opt.param_groups for p in g["params"]} == lora


def test_update_changes_only_adapter_tensors(run):
    """In-process update from the iteration-1 adapter: every base tensor is bit-identical after it."""
    from transformers import AutoModelForCausalLM

    from models.training.update import LoopSettings, actor_loss_fn, run_update
    from models.stages.actor import _ACTOR_COLS, policy_loss_config
    from models.stages.updates import update_data

    cfg, ad = run["cfg"], run["ad0"]
    lm = load_trainable(run["s1"].actor_url, AutoModelForCausalLM, "float32", cfg.actor.lora, CAUSAL_LM)
    before = {n: p.detach().clone() for n, p in lm.named_parameters()}
    model = PolicyLogprobs(lm)
    data = update_data(ad.batch, 0, _ACTOR_COLS, None)
    run_update(model, make_optimizer(model, 1e-2), data, actor_loss_fn(policy_loss_config(cfg), 1.0),
               LoopSettings(1, 16, 8, 1.0, 0), CPU)
    changed = {n for n, p in lm.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(".lora_A." in n or ".lora_B." in n for n in changed)
    assert len(changed) == LAYERS * 7 * 2  # every A and B of 7 projections × 2 layers moved


def test_critic_adapter_keeps_the_value_head_trainable(run):
    from transformers import AutoModelForTokenClassification

    url = run["s1"].critic_url
    files = set(read_marker(url)["files"])
    assert "adapter_model.safetensors" in files and "model.safetensors" not in files
    tensors = load_file(os.path.join(_path(url), "adapter_model.safetensors"))
    head = [k for k in tensors if ".score." in k]
    assert head, sorted(tensors)  # the value head is saved with the adapter (modules_to_save)
    config = json.load(open(os.path.join(_path(url), "adapter_config.json")))
    assert config["base_model_name_or_path"] == canonical_url(run["s0"].critic_url)
    init = AutoModelForTokenClassification.from_pretrained(_path(run["s0"].critic_url))
    assert not torch.equal(tensors[head[0]], init.score.weight)  # the head trained


def test_bfloat16_compute_loads_the_adapter_in_float32_on_a_bfloat16_base(run):
    """``model.dtype=bfloat16``: the frozen base in bfloat16, every trainable tensor (LoRA's matrices
    and the critic's head, which peft copies in the base's dtype) float32 and bit-equal to the
    float32 adapter committed at iteration 1, so no update is lost to rounding between iterations."""
    from transformers import AutoModelForTokenClassification

    from models.training.lora import TOKEN_CLS

    url = run["s1"].critic_url
    saved = load_file(os.path.join(_path(url), "adapter_model.safetensors"))
    assert {t.dtype for t in saved.values()} == {torch.float32}
    critic = load_trainable(url, AutoModelForTokenClassification, "bfloat16", run["cfg"].critic.lora, TOKEN_CLS)
    trained = {n: p for n, p in critic.named_parameters() if p.requires_grad}
    assert {p.dtype for p in trained.values()} == {torch.float32}
    assert {p.dtype for p in critic.parameters() if not p.requires_grad} == {torch.bfloat16}
    head = next(p for n, p in trained.items() if ".score." in n and n.endswith("weight"))
    saved_head = next(t for k, t in saved.items() if ".score." in k and k.endswith("weight"))
    assert torch.equal(head.detach(), saved_head)
    assert not torch.equal(saved_head.bfloat16().float(), saved_head)  # bfloat16 would have rounded it
    lora_a = next(p for n, p in trained.items() if ".lora_A." in n)
    saved_a = next(t for k, t in saved.items() if ".lora_A." in k and k.split(".lora_A")[0] in
                   next(n for n in trained if ".lora_A." in n))
    assert torch.equal(lora_a.detach(), saved_a)

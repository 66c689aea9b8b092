"""PPO with LoRA end to end: two iterations through ``pyflyte run`` in the resident mode (``run.resident``:
the actor service's 2 ranks train the adapter and send it alone to the vLLM engine service, which serves
it as an adapter; its model with the adapter off is π_ref), and the elastic update on its own (DDP on CPU;
FSDP2 on GPUs). The stateless LoRA stages run in-process in tests/unit/tasks/test_lora_pipeline.py."""

from __future__ import annotations


import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from models.checkpoint import read_marker
from models.training.lora import canonical_url
from models.data.batch import RolloutBatch
from models.run.layout import RunLayout
from tests.integration.test_algorithms import CRITIC_SMALL, SMALL, _pyflyte
from tests.integration.test_elastic_faults import elastic_update
from tests.reference import token_logprobs
from tests.stages import with_overrides

pytestmark = pytest.mark.integration


def _path(url: str) -> str:
    return url.replace("file://", "")


def _assert_adapter_only(url: str, base: str) -> dict:
    files = set(read_marker(url)["files"])
    assert "adapter_model.safetensors" in files and not any(f.startswith("model") for f in files), files
    config = json.load(open(os.path.join(_path(url), "adapter_config.json")))
    assert config["base_model_name_or_path"] == canonical_url(base)
    tensors = load_file(os.path.join(_path(url), "adapter_model.safetensors"))
    assert tensors and all(".lora_A." in k or ".lora_B." in k for k in tensors)
    return tensors


def test_ppo_lora_two_iterations_through_pyflyte(tmp_path):
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    out = _pyflyte("workflows/ppo.py", "ppo_training", "configs/tiny_ppo_lora.yaml",
                   [f"run.storage_root={tmp_path}", "run.save_interval=1", "run.resident=true"] + SMALL + CRITIC_SMALL,
                   "lora",
                   tmp_path / "mlflow.db")
    assert "[ppo] iter 2/2" in out
    layout = RunLayout(str(tmp_path), "lora")
    for i in range(2):
        _assert_adapter_only(layout.actor_url(i), layout.reference_url())
    # iteration 1 scored with the adapter of iteration 0: π_ref is the base, π_old base + adapter
    batch = RolloutBatch.read(layout.batch_url(1, "score"))
    base = AutoModelForCausalLM.from_pretrained(_path(layout.reference_url())).eval()
    adapted = AutoPeftModelForCausalLM.from_pretrained(_path(layout.actor_url(0))).eval()
    for col, model in (("ref_logprobs", base), ("old_logprobs", adapted)):
        for mine, theirs in zip(batch.column(col).to_pylist(), token_logprobs(model, batch)):
            np.testing.assert_allclose(mine, theirs, atol=1e-4)
    assert layout.read_state().actor_url == layout.actor_url(1)


@pytest.fixture(scope="module")
def iteration_one(tmp_path_factory):
    """Iteration 0 in-process (HF engine, one process) so iteration 1 starts from an adapter."""
    from models.stages.commit import run_commit
    from models.stages.actor import train_actor
    from models.training.distributed import DistInfo
    from tests.stages import tiny_run, to_advantages

    overrides = ["rollout.engine=hf", "actor.nproc_per_node=1", "actor.lora.rank=8", "actor.lora.alpha=16",
                 "actor.lora.target_modules=[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head]",
                 "kl.placement=reward", "kl.estimator=k1", "kl.coef=0.01",  # as tiny_ppo_lora's
                 "actor.minibatch_size=16", "actor.micro_batch_size=8", "rollout.prompts_per_iteration=8",
                 "data.num_demo_train_prompts=64", "data.num_demo_eval_prompts=8", "actor.lr=1e-2"]
    with tiny_run(tmp_path_factory.mktemp("lora-elastic"), "tiny_grpo", overrides, "elastic",
                  local_cache=False) as (cfg, run, s0):
        batch0 = to_advantages(cfg, run, s0)[2].batch
        actor = train_actor(cfg, run, s0, batch0, DistInfo(0, 1, 0, torch.device("cpu")))
        s1 = run_commit(cfg, run, s0, [], batch0, actor.checkpoint_url, "")
        yield cfg, run, s1, to_advantages(cfg, run, s1)[2].batch


@pytest.mark.parametrize("device, sharding", [("cpu", "ddp"), ("cpu", "fsdp2"),
                                              pytest.param("cuda", "auto", marks=pytest.mark.gpu)])
def test_elastic_update_trains_only_the_adapter(iteration_one, device, sharding):
    """From iteration 1's adapter, under DDP and FSDP2 (gloo on CPU; on GPUs ``auto`` is FSDP2)."""
    if device == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (FSDP2 across 2 processes)")
    cfg, run, state, batch = iteration_one
    cfg = with_overrides(cfg, f"actor.sharding={sharding}")
    before = _assert_adapter_only(state.actor_url, run.reference_url)
    out = elastic_update(max_restarts=0)(cfg=cfg, run=run, state=state, batch=batch)
    assert out.checkpoint_url == run.layout.actor_url(1)
    assert out.stats["actor/steps"] == 2 * cfg.actor.ppo_epochs  # 32 samples / minibatch 16
    after = _assert_adapter_only(out.checkpoint_url, run.reference_url)  # still the same base
    assert after.keys() == before.keys()
    moved = [k for k in after if not torch.equal(after[k], before[k])]
    assert len(moved) == len(after)  # every A and B trained; the base is not in the checkpoint

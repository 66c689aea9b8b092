"""Rollout with a LoRA actor in vLLM's CPU engine and the HF engine, both ways ``rollout.lora_mode``
offers: the base weights plus the adapter (vLLM ``enable_lora`` with a new LoRA request per
adapter; peft in HF) and the adapter merged into the base (in-place reload). The sampler's log-probs must be the training-side model's
(``PolicyLogprobs`` on base + adapter) within the tolerance of ``test_models_vllm.py``."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from models.data.batch_tensors import model_inputs
from models.checkpoint import save_checkpoint
from models.engines import SamplingSpec, close_engines
from models.training.lora import CAUSAL_LM, add_adapter, load_pretrained, save_adapter_checkpoint
from models.training.policy import PolicyLogprobs
from models.demos.reverse_task import PromptGenerator, ReverseTaskConfig
from models.demos.tokenizer import load_tokenizer
from models.demos.warm_start import warm_start
from models.config.io import load_config
from models.stages.engine import engine_for
from models.demos.builders import cache_dir

pytestmark = pytest.mark.integration
TOL = 1e-3  # as test_models_vllm.py: vLLM's CPU kernels against an HF forward, float32


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """The warm-started actor (committed) and two different adapters on it (committed)."""
    root = tmp_path_factory.mktemp("lora-vllm")
    actor = warm_start(os.path.join(cache_dir(), "warm_start"))
    base = str(root / "reference")
    save_checkpoint(str(actor), base)
    spec = SimpleNamespace(rank=8, alpha=16.0, dropout=0.0, target_modules=["q_proj", "v_proj", "o_proj", "up_proj"])
    adapters = []
    for seed in (0, 1):
        model = add_adapter(AutoModelForCausalLM.from_pretrained(base), spec, CAUSAL_LM)
        with torch.no_grad(), torch.random.fork_rng():
            torch.manual_seed(seed)
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    p.normal_(0.0, 0.1)
        adapters.append(str(root / f"adapter-{seed}"))
        save_adapter_checkpoint(model, load_tokenizer(actor), adapters[-1], base)
    yield SimpleNamespace(base=base, adapters=adapters, tok=load_tokenizer(actor))
    close_engines()


def _worst_gap(engine, tok, policy_dir: str) -> float:
    """max |sampler log-prob − training-side log-prob| over 6 prompts × 4 samples."""
    prompts = [tok(p).input_ids for p in PromptGenerator(ReverseTaskConfig(), "eval", seed=0).prompts(6)]
    gens = engine.generate(prompts, SamplingSpec(n=4, temperature=1.0, max_new_tokens=8, seed=0,
                                                 stop_token_ids=(tok.eos_token_id,)))
    import pyarrow as pa

    rows = [(p, g) for p, per in zip(prompts, gens) for g in per if g.tokens]
    table = pa.table({"prompt_tokens": [p for p, _ in rows], "response_tokens": [g.tokens for _, g in rows]})
    model = PolicyLogprobs(load_pretrained(policy_dir, AutoModelForCausalLM, torch.float32)).eval()
    inputs = model_inputs(table, pad_token_id=0)
    with torch.no_grad():
        logp, _ = model(inputs, with_entropy=False)  # [B, T]
    worst = 0.0
    for i, (_, g) in enumerate(rows):
        worst = max(worst, float((logp[i, :len(g.tokens)] - torch.tensor(g.logprobs)).abs().max()))
    return worst


@pytest.mark.parametrize("engine_kind", ["vllm", "hf"])
@pytest.mark.parametrize("mode", ["adapter", "merged"])
def test_sampler_logprobs_match_the_training_side_adapter(ckpts, mode, engine_kind):
    cfg = load_config("tiny_ppo_lora", [f"rollout.lora_mode={mode}", f"rollout.engine={engine_kind}"])
    for adapter in ckpts.adapters:  # the second adapter replaces the first in the same engine
        engine = engine_for(cfg, adapter)
        gap = _worst_gap(engine, ckpts.tok, adapter)
        print(f"{engine_kind}, {mode}: max |logp_sampler - logp_train| = {gap:.2e}")
        assert gap < TOL
    # iteration 0 (no adapter yet): the same engine serves the base again
    engine = engine_for(cfg, ckpts.base)
    assert _worst_gap(engine, ckpts.tok, ckpts.base) < TOL
    # adapter mode swaps LoRA requests on the base it started with; merged mode reloads full weights
    assert engine.stats.reloads == (0 if mode == "adapter" else 2)

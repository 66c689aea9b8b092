"""Changed copies of the Hub-shaped test checkpoints, adapters on them, and an independent log-prob
reference.

``trained_copy`` stands in for an update (every weight moved, a tied embedding through the tie);
``adapter_checkpoint`` for a LoRA update; ``with_eos`` rewrites ``generation_config.json``'s eos list;
``hf_logprobs`` is what a plain transformers forward gives the tokens a rollout sampled (full logits,
log-softmax, gather)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import List, Sequence

import torch
from transformers import AutoModelForCausalLM


def copy_checkpoint(src: Path | str, out: Path) -> Path:
    shutil.copytree(src, out)
    return out


def trained_copy(src: Path | str, out: Path, seed: int, scale: float = 0.05) -> Path:
    """``src`` with every weight moved by ``scale``·N(0, 1) (seeded); other files as they are."""
    copy_checkpoint(src, out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # a tied head is the embedding: moved once, through the tie
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    model.save_pretrained(out, safe_serialization=True)
    return out


def with_eos(src: Path | str, out: Path, eos_ids: Sequence[int]) -> Path:
    """``src`` whose ``generation_config.json`` lists ``eos_ids`` as its end-of-sequence ids."""
    copy_checkpoint(src, out)
    path = out / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "eos_token_id": list(eos_ids)}, indent=2))
    return out


def hf_logprobs(model, prompt: Sequence[int], response: Sequence[int], temperature: float = 1.0) -> List[float]:
    """log softmax(logits/τ) of each response token given the tokens before it, one forward."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature  # [R, V]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1).tolist()


def load(path: Path | str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def adapter_checkpoint(base: str, spec, tokenizer, url: str, std: float):
    """A committed adapter on the committed checkpoint ``base`` whose B matrices are N(0, std²) (seed 0),
    as after training; returns the peft model."""
    from models.training.lora import CAUSAL_LM, add_adapter, save_adapter_checkpoint

    model = add_adapter(AutoModelForCausalLM.from_pretrained(base), spec, CAUSAL_LM)
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(0)
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0.0, std)
    save_adapter_checkpoint(model, tokenizer, url, base)
    return model

"""Tiny actor directories for the engine tests: random (seeded), never downloaded, with peaked
next-token distributions so that different seeds give clearly different outputs and greedy
choices are far from ties."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from models.demos.tiny import TinyModelConfig, build_actor, save_model
from models.demos.tokenizer import build_char_tokenizer

PROMPTS = [[1, 10, 11, 12, 13], [1, 40, 41], [1, 70, 71, 72, 73, 74, 75], [1, 20]]


def actor_dir(out: Path, seed: int, intermediate_size: int = 256) -> str:
    """An HF actor directory (vLLM-compatible shape) whose logits have a spread of ~8 nats."""
    tok = build_char_tokenizer()
    model = build_actor(TinyModelConfig(intermediate_size=intermediate_size, seed=seed), tok)
    with torch.no_grad():
        model.lm_head.weight.mul_(50)  # std 0.02 -> 1: peaked distributions
    return str(save_model(model, tok, out))


def with_extra_tensor(src: str, out: Path) -> str:
    """A copy of ``src`` whose weights hold one tensor no Llama model has."""
    out.mkdir(parents=True)
    for f in Path(src).iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    state = load_file(str(Path(src) / "model.safetensors"))
    state["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(4, 4)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def with_truncated_weights(src: str, out: Path) -> str:
    """A copy of ``src`` whose safetensors file lost its second half (an interrupted copy)."""
    out.mkdir(parents=True)
    for f in Path(src).iterdir():
        data = f.read_bytes()
        (out / f.name).write_bytes(data[: len(data) // 2] if f.suffix == ".safetensors" else data)
    return str(out)

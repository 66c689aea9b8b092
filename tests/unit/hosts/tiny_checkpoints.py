"""Committed tiny critic and reward model for the server tests (random, seeded, never downloaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Dict

import torch

from models.checkpoint import save_checkpoint
from models.demos.tiny import TinyModelConfig, build_critic, build_reward_model, save_model
from models.demos.tokenizer import build_char_tokenizer

CFG = TinyModelConfig(max_position_embeddings=128)


def commit_tiny_models(root: Path) -> Dict[str, str]:
    """``{"critic": url, "reward_model": url}`` committed under ``root/checkpoints``."""
    tok = build_char_tokenizer()
    reward_model = build_reward_model(CFG, tok)
    out = {}
    for name, model in (("critic", build_critic(CFG, tok)), ("reward_model", reward_model)):
        local = save_model(model, tok, root / "hf" / name)
        out[name] = str(root / "checkpoints" / name)
        save_checkpoint(str(local), out[name])
    return out


def plant_nan_embedding(model, token: int) -> None:
    """Make ``model``'s embedding of id ``token`` NaN, so any sample holding it (and only those) scores
    NaN (in memory: a checkpoint with such weights is never committed)."""
    with torch.no_grad():
        model.get_input_embeddings().weight[token] = float("nan")


def samples(n: int, seed: int = 0, vocab: int = 99, max_prompt: int = 12, max_response: int = 10):
    """``(prompts, responses)``: ``n`` random token lists (prompts >= 1 token, responses >= 1)."""
    gen = torch.Generator().manual_seed(seed)
    p_len = torch.randint(1, max_prompt + 1, (n,), generator=gen).tolist()
    r_len = torch.randint(1, max_response + 1, (n,), generator=gen).tolist()
    prompts = [torch.randint(4, vocab, (p,), generator=gen).tolist() for p in p_len]
    responses = [torch.randint(4, vocab, (r,), generator=gen).tolist() for r in r_len]
    return prompts, responses


def write_batch(url, prompts, responses, **floats) -> str:
    """A RolloutBatch of these token lists (and response-aligned float columns) written at ``url``."""
    from models.data.batch import RolloutBatch
    from models.data.batch_schema import BatchMetadata

    RolloutBatch.from_columns(BatchMetadata(0, 0, "ppo"), prompt_tokens=prompts, response_tokens=responses,
                              **floats).write(str(url))
    return str(url)

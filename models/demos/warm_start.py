"""Supervised warm start of the tiny actor on task demonstrations, cached on disk.

RL from a random policy on the reversal task would mostly see reward ~0; a short
supervised fine-tune (SFT) on (prompt, ideal response) pairs gives a policy that is
partly right, so PPO/GRPO have signal to improve on. The defaults are tuned to leave
the policy well below the ceiling (see `WarmStartConfig`).

Loss: token-mean cross-entropy over response tokens only (the reversed string and its
`<eos>`); prompt and padding positions carry label -100.

Cache: the result lives in `cache_dir/actor-<key>` where `<key>` hashes the model, task
and warm-start configs and the tokenizer alphabet. The directory is built under a
temporary name and renamed into place, so a present directory is always complete, and a
second call with the same settings returns it without training.

CLI: `python -m models.demos.warm_start --out DIR` writes DIR/{actor,critic,reward_model} (HF
directories with tokenizer files) and DIR/prompts/{train,eval}.jsonl.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from models.demos.reverse_task import PromptGenerator, ReverseTaskConfig, reverse_reward, write_prompts_jsonl
from models.demos.tiny import (
    TinyModelConfig,
    build_actor,
    build_reward_model,
    critic_from_actor,
    save_model,
)
from models.demos.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer, load_tokenizer

CACHE_VERSION = 1
"""Bump when the training code changes in a way that changes the result."""
DONE_FILE = "warm_start.json"


@dataclass(frozen=True)
class WarmStartConfig:
    """Settings of the supervised warm start."""

    steps: int = 240
    """Optimiser steps. With lr 5e-4 this leaves the policy partly right: mean eval reward
    about 0.4 when sampling at temperature 1 and about 0.8 greedy (seeds 0-2)."""
    batch_size: int = 32
    """Demonstrations per step."""
    lr: float = 5e-4
    """AdamW learning rate (constant)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    seed: int = 0
    """Seed of the demonstration stream and of the training RNG."""

    def __post_init__(self) -> None:
        if self.steps < 0 or self.batch_size < 1:
            raise ValueError(f"need steps >= 0 and batch_size >= 1, got {self.steps}, {self.batch_size}")
        if self.lr <= 0 or self.weight_decay < 0:
            raise ValueError(f"need lr > 0 and weight_decay >= 0, got {self.lr}, {self.weight_decay}")


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block with `n` intra-op threads (None: leave as is), then restore.

    The tiny models' matrices are too small to gain from more threads, and on a shared
    2-core machine two spinning threads per process made training ~4x slower.
    """
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def demo_batch(
    tokenizer: PreTrainedTokenizerBase, pairs: list[tuple[str, str]]
) -> dict[str, torch.Tensor]:
    """Right-padded `<bos> prompt response <eos>` rows with labels on response tokens.

    Returns input_ids, attention_mask, labels, each [B, T]; labels are -100 outside the
    response (+ `<eos>`).
    """
    rows, label_rows = [], []
    for prompt, response in pairs:
        prompt_ids = tokenizer(prompt).input_ids  # starts with <bos>
        response_ids = tokenizer(response, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        rows.append(prompt_ids + response_ids)
        label_rows.append([-100] * len(prompt_ids) + response_ids)
    T = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([r + [pad] * (T - len(r)) for r in rows])  # [B, T]
    labels = torch.tensor([r + [-100] * (T - len(r)) for r in label_rows])  # [B, T]
    attention_mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])  # [B, T]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def train_sft(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task_cfg: ReverseTaskConfig,
    cfg: WarmStartConfig,
    threads: int | None = 1,
) -> list[float]:
    """Fine-tune `model` in place on train-split demonstrations; returns per-step losses."""
    return train_on_demonstrations(model, tokenizer, PromptGenerator(task_cfg, "train", seed=cfg.seed).demonstrations,
                                   cfg, threads)


def train_on_demonstrations(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    next_pairs: Callable[[int], list[tuple[str, str]]],
    cfg: WarmStartConfig,
    threads: int | None = 1,
) -> list[float]:
    """`cfg.steps` AdamW steps on batches of `next_pairs(cfg.batch_size)` (prompt text, response
    text) pairs (`demo_batch`), in place; returns per-step losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    model.train()
    losses = []
    with torch_threads(threads), torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        for _ in range(cfg.steps):
            batch = demo_batch(tokenizer, next_pairs(cfg.batch_size))
            loss = model(**batch).loss  # mean over response tokens (labels != -100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    model.eval()
    return losses


def content_key(payload: dict) -> str:
    """Stable 16-hex digest of a JSON-able description of a cached result."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def cached_dir(final: Path, build: Callable[[Path], dict]) -> Path:
    """`final` if it is complete, else `build(tmp)` (which fills `tmp` and returns the info to keep in
    `warm_start.json`) renamed into place: a present directory is always complete, and of two
    processes building at once, one result stays."""
    if (final / DONE_FILE).is_file():
        return final
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    info = build(tmp)
    (tmp / DONE_FILE).write_text(json.dumps(info, indent=2) + "\n")
    try:
        os.rename(tmp, final)
    except OSError:  # another process finished first (or a stale incomplete dir is there)
        if (final / DONE_FILE).is_file():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
    return final


def cache_key(
    model_cfg: TinyModelConfig, task_cfg: ReverseTaskConfig, cfg: WarmStartConfig, alphabet: str
) -> str:
    """Stable hex digest of everything that determines the warm-started weights."""
    return content_key({
        "version": CACHE_VERSION,
        "model": dataclasses.asdict(model_cfg),
        "task": dataclasses.asdict(task_cfg),
        "warm_start": dataclasses.asdict(cfg),
        "alphabet": alphabet,
    })


def warm_start(
    cache_dir: str | Path,
    model_cfg: TinyModelConfig = TinyModelConfig(),
    task_cfg: ReverseTaskConfig = ReverseTaskConfig(),
    cfg: WarmStartConfig = WarmStartConfig(),
    alphabet: str = DEFAULT_ALPHABET,
) -> Path:
    """Return the HF directory of the warm-started actor, training it only on a cache miss.

    The directory holds config.json, model.safetensors, tokenizer files and
    `warm_start.json` (configs, per-step losses, training seconds).
    """
    final = Path(cache_dir) / f"actor-{cache_key(model_cfg, task_cfg, cfg, alphabet)}"

    def build(tmp: Path) -> dict:
        tokenizer = build_char_tokenizer(alphabet)
        model = build_actor(model_cfg, tokenizer)
        start = time.perf_counter()
        losses = train_sft(model, tokenizer, task_cfg, cfg)
        seconds = time.perf_counter() - start
        save_model(model, tokenizer, tmp)
        return {
            "model": dataclasses.asdict(model_cfg),
            "task": dataclasses.asdict(task_cfg),
            "warm_start": dataclasses.asdict(cfg),
            "train_seconds": seconds,
            "losses": losses,
        }

    return cached_dir(final, build)


@torch.no_grad()
def generate_responses(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    max_new_tokens: int,
    temperature: float = 1.0,
    seed: int = 0,
    threads: int | None = 1,
) -> list[str]:
    """Continue each prompt with HF `generate`; temperature 0 means greedy.

    Sampling is plain ancestral sampling at `temperature` (top_k=0, top_p=1, as the
    rollout engine does). Each response is cut at its first `<eos>` and decoded without
    special tokens.
    """
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    if temperature > 0:
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    else:
        sampling = {"do_sample": False}
    with torch_threads(threads), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **sampling,
        )
    responses = []
    for row in out[:, enc.input_ids.shape[1]:].tolist():  # [B, <= max_new_tokens]
        if tokenizer.eos_token_id in row:
            row = row[: row.index(tokenizer.eos_token_id)]
        responses.append(tokenizer.decode(row, skip_special_tokens=True))
    return responses


def evaluate_actor(
    actor_dir: str | Path,
    task_cfg: ReverseTaskConfig = ReverseTaskConfig(),
    num_prompts: int = 256,
    temperature: float = 1.0,
    seed: int = 0,
) -> float:
    """Mean `reverse_reward` of the actor in `actor_dir` on eval-split prompts."""
    model = AutoModelForCausalLM.from_pretrained(str(actor_dir)).eval()
    tokenizer = load_tokenizer(actor_dir)
    prompts = PromptGenerator(task_cfg, "eval", seed=seed).prompts(num_prompts)
    responses = generate_responses(
        model, tokenizer, prompts, task_cfg.max_new_tokens, temperature, seed
    )
    rewards = reverse_reward(prompts, responses)
    return sum(rewards) / len(rewards)


def build_demo_models(
    out_dir: str | Path,
    cache_dir: str | Path,
    model_cfg: TinyModelConfig = TinyModelConfig(),
    task_cfg: ReverseTaskConfig = ReverseTaskConfig(),
    cfg: WarmStartConfig = WarmStartConfig(),
    num_train_prompts: int = 1024,
    num_eval_prompts: int = 256,
) -> dict[str, Path]:
    """Write everything the demo needs under `out_dir` and return the paths.

    actor/ (warm-started, from the cache), critic/ (actor trunk + fresh value head),
    reward_model/ (random init; the demo scores with `models.demos.reverse_task:reverse_reward`),
    prompts/train.jsonl and prompts/eval.jsonl (seed 0 of each split).
    """
    out = Path(out_dir)
    cached = warm_start(cache_dir, model_cfg, task_cfg, cfg)
    actor = out / "actor"
    shutil.copytree(cached, actor, dirs_exist_ok=True)
    tokenizer = load_tokenizer(actor)
    return {
        "actor": actor,
        "critic": critic_from_actor(actor, out / "critic", seed=model_cfg.seed + 1),
        "reward_model": save_model(build_reward_model(model_cfg, tokenizer), tokenizer, out / "reward_model"),
        "train_prompts": write_prompts_jsonl(
            out / "prompts" / "train.jsonl", PromptGenerator(task_cfg, "train", 0).prompts(num_train_prompts)
        ),
        "eval_prompts": write_prompts_jsonl(
            out / "prompts" / "eval.jsonl", PromptGenerator(task_cfg, "eval", 0).prompts(num_eval_prompts)
        ),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for actor/, critic/, reward_model/, prompts/")
    parser.add_argument("--cache-dir", default=".cache/warm_start", help="warm-start cache folder")
    parser.add_argument("--steps", type=int, default=WarmStartConfig.steps)
    parser.add_argument("--lr", type=float, default=WarmStartConfig.lr)
    parser.add_argument("--seed", type=int, default=WarmStartConfig.seed)
    parser.add_argument("--eval-prompts", type=int, default=256, help="prompts for the reward check (0: skip)")
    args = parser.parse_args(argv)

    cfg = WarmStartConfig(steps=args.steps, lr=args.lr, seed=args.seed)
    start = time.perf_counter()
    paths = build_demo_models(args.out, args.cache_dir, cfg=cfg)
    print(f"built in {time.perf_counter() - start:.1f} s")
    for name, path in paths.items():
        print(f"{name:>14}: {path}")
    if args.eval_prompts > 0:
        for label, temperature in (("sampled (T=1)", 1.0), ("greedy", 0.0)):
            reward = evaluate_actor(paths["actor"], num_prompts=args.eval_prompts, temperature=temperature)
            print(f"eval reward, {label}: {reward:.3f}")


if __name__ == "__main__":
    main()

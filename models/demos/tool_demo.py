"""The tool-use demo's model and data: a Qwen2-shaped chat checkpoint (``models/demos/hub_models.py``)
warm-started by supervised fine-tuning on calculator demonstrations (:func:`models.demos.tool_tasks.demonstration`),
and the train / held-out prompts. Cached by content (like :mod:`models.demos.warm_start`): the same settings
reuse the trained weights.

Demonstrations are tokenised as the episode loop builds episodes (:class:`models.environments.chat_tokens.ChatTokens`:
first prompt, each assistant turn on its own, the template's continuation between turns), so the
warm start trains on exactly the token sequences RL will sample and score; the loss is on the
assistant turns only (the tool's result and the template's tokens are given).

``python -m models.demos.tool_demo --out runs/tools-demo`` writes ``actor/``, ``train.jsonl`` and ``eval.jsonl``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Dict, List, Tuple

import torch

from models.environments.chat_tokens import ChatTokens
from models import console
from models.demos.hub_models import HubModelConfig, build_qwen2_chat
from models.demos.tool_tasks import ArithmeticEnv, demonstration, problems
from models.environments.tools import CALCULATOR
from models.demos.warm_start import torch_threads

CACHE_VERSION = 2
DONE_FILE = "tool_warm_start.json"


@dataclasses.dataclass(frozen=True)
class ToolDemoConfig:
    """The demo model's shape, its warm start and its data."""

    model: HubModelConfig = HubModelConfig(hidden_size=128, num_heads=4, num_kv_heads=4, intermediate_size=384)
    """The Qwen2-shaped checkpoint's shape: 2 layers, width 128, 4 heads of 32 (a size vLLM's CPU backend
    has), each with its own keys and values. The project's default (width 64, 2 heads sharing one key/value
    head) learned to copy the question into the call but never the tool's result into the answer
    (docs/multi_turn.md)."""
    steps: int = 1000
    """SFT optimiser steps."""
    batch_size: int = 32
    """Demonstrations per step."""
    lr: float = 1e-3
    """AdamW learning rate (linear decay to 0). At 2e-3 the answer copy had not formed in 1000 steps (docs/multi_turn.md)."""
    direct_fraction: float = 0.6
    """Share of the demonstrations that answer straight away, without the calculator (right answers
    this model cannot learn to compute): the warm start then opens with the tool call on about
    ``1 - direct_fraction`` of its samples, and RL has that choice to learn (docs/multi_turn.md). They
    are mixed in from step ``direct_from_step`` on."""
    direct_from_step: int = 600
    """The steps before this one train on tool-using demonstrations only. The copying of the tool's
    result into the answer forms there (between steps 400 and 600 in the runs measured); with these
    answers mixed in from the start it had formed in none of three runs by step 800–1000."""
    num_train: int = 4000
    """Training prompts (the warm start cycles through them: 1000 × 32 demonstrations is 8 passes)."""
    num_eval: int = 64
    """Held-out prompts (another seed)."""
    seed: int = 0


def demonstration_ids(chat: ChatTokens, row: Dict[str, str], im_end: int,
                      use_tool: bool = True) -> Tuple[List[int], List[int]]:
    """One demonstration (:func:`models.demos.tool_tasks.demonstration`) as the episode loop would build it:
    ids and labels (-100 off the assistant turns)."""
    conv = demonstration(row, use_tool)
    start, final_turn = conv[:2], conv[-1]
    prompt = chat.first_prompt(start)
    final = chat.encode(final_turn["content"]) + [im_end]
    if not use_tool:
        return prompt + final, [-100] * len(prompt) + final
    call_turn, tool = conv[2], conv[3]
    fn = call_turn["tool_calls"][0]["function"]
    call = chat.encode(f"{call_turn['content']}\n<tool_call>\n"
                       f"{json.dumps({'name': fn['name'], 'arguments': fn['arguments']})}\n</tool_call>")
    cont = chat.continuation(start, [tool], prompt + call)
    ids = prompt + call + cont + final
    labels = [-100] * len(prompt) + call + [-100] * len(cont) + final
    return ids, labels


def demonstrations(chat: ChatTokens, im_end: int, cfg: ToolDemoConfig) -> List[Tuple[List[int], List[int]]]:
    """The warm start's demonstrations (ids, labels) of the training problems; a seeded
    ``cfg.direct_fraction`` of them answer without the tool."""
    rng = random.Random(cfg.seed)
    return [demonstration_ids(chat, row, im_end, use_tool=rng.random() >= cfg.direct_fraction)
            for row in problems(cfg.num_train, cfg.seed)]


def shared_prefix(demos: List[Tuple[List[int], List[int]]]) -> int:
    """Length of the token prefix every demonstration starts with (the system prompt with the tool
    schemas: most of an episode's tokens, identical in all)."""
    first = demos[0][0]
    n = min(len(ids) for ids, _ in demos)
    for ids, _ in demos:
        n = next((i for i in range(n) if ids[i] != first[i]), n)
    return n


def _batch(rows: List[Tuple[List[int], List[int]]], pad: int, skip: int = 0) -> Dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``labels`` [B, T - skip] after the first ``skip`` (shared) tokens, and
    the ``attention_mask`` [B, T] over all of them."""
    rows = [(ids[skip:], lab[skip:]) for ids, lab in rows]
    T = max(len(ids) for ids, _ in rows)
    return {"input_ids": torch.tensor([ids + [pad] * (T - len(ids)) for ids, _ in rows]),  # [B, T]
            "attention_mask": torch.tensor([[1] * (skip + len(ids)) + [0] * (T - len(ids)) for ids, _ in rows]),
            "labels": torch.tensor([lab + [-100] * (T - len(lab)) for _, lab in rows])}


def sft_loss(model, prefix: List[int], rows: List[Tuple[List[int], List[int]]], pad: int) -> torch.Tensor:
    """Mean loss per assistant token of ``rows``, which all start with ``prefix`` (no loss there).

    The prefix's keys and values are computed once per step without gradient and shared by the batch:
    the demo's 309 system-prompt tokens are ~76% of a 404-token demonstration, so a step runs ~4x fewer
    tokens through the model. The loss's value is exact; its gradient leaves out the path through
    the prefix's keys and values (the suffix's attention to them, and everything after, is kept)."""
    from transformers import DynamicCache

    with torch.no_grad():
        cache = model(input_ids=torch.tensor([prefix]), past_key_values=DynamicCache(), use_cache=True).past_key_values
    cache.batch_repeat_interleave(len(rows))
    return model(**_batch(rows, pad, skip=len(prefix)), past_key_values=cache, use_cache=False).loss


def cache_key(cfg: ToolDemoConfig) -> str:
    payload = {"version": CACHE_VERSION, **dataclasses.asdict(cfg)}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def warm_started_actor(cache_dir: str, cfg: ToolDemoConfig = ToolDemoConfig(), threads: int = 2) -> Path:
    """The warm-started checkpoint's directory, trained only on a cache miss."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = Path(cache_dir) / f"tools-actor-{cache_key(cfg)}"
    if (final / DONE_FILE).is_file():
        return final
    tmp = Path(cache_dir) / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    build_qwen2_chat(tmp, cfg.model)
    tok = AutoTokenizer.from_pretrained(tmp)
    model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    chat = ChatTokens(tok, [t.schema() for t in ArithmeticEnv.tools])
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    tool_only = demonstrations(chat, im_end, dataclasses.replace(cfg, direct_fraction=0.0))
    mixed = demonstrations(chat, im_end, cfg) if cfg.direct_fraction else tool_only
    prefix = tool_only[0][0][:shared_prefix(tool_only + mixed)]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / max(cfg.steps, 1))
    losses, t0 = [], time.perf_counter()
    model.train()
    with torch_threads(threads), torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        for step in range(cfg.steps):
            demos = tool_only if step < cfg.direct_from_step else mixed
            start = step * cfg.batch_size % len(demos)
            loss = sft_loss(model, prefix, demos[start:start + cfg.batch_size], tok.pad_token_id)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            losses.append(round(loss.item(), 4))
            if (step + 1) % 50 == 0:
                print(f"warm start: step {step + 1}/{cfg.steps}, loss {losses[-1]:.3f}, "
                      f"{time.perf_counter() - t0:.0f} s", flush=True)
    model.eval()
    model.save_pretrained(tmp, safe_serialization=True)
    info = {"config": dataclasses.asdict(cfg), "train_seconds": time.perf_counter() - t0, "losses": losses}
    (tmp / DONE_FILE).write_text(json.dumps(info, indent=1) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    return final


def build(out_dir: str, cache_dir: str, cfg: ToolDemoConfig = ToolDemoConfig()) -> Dict[str, str]:
    """``out_dir/actor`` (a copy of the cached warm start), ``train.jsonl`` and ``eval.jsonl``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    actor = warm_started_actor(cache_dir, cfg)
    shutil.rmtree(out / "actor", ignore_errors=True)
    shutil.copytree(actor, out / "actor")
    paths = {"actor": str(out / "actor")}
    for name, rows in (("train", problems(cfg.num_train, cfg.seed)), ("eval", problems(cfg.num_eval, cfg.seed + 1))):
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths[name] = str(path)
    return paths


def evaluate(actor_dir: str, rows: List[Dict[str, str]], max_new_tokens: int = 48) -> Dict[str, float]:
    """Greedy episodes of the checkpoint at ``actor_dir`` on ``rows`` (HF engine): exact-answer accuracy and
    the share of episodes that called the calculator on the question's expression."""
    from transformers import AutoTokenizer

    from models.engines.base import SamplingSpec
    from models.environments.episode_rollout import sample_episodes
    from models.environments.episodes import EpisodeLimits
    from models.engines.hf_engine import HFEngine
    from models.demos.tool_tasks import used_calculator_correctly
    from models.environments.tools import HermesParser

    tok = AutoTokenizer.from_pretrained(actor_dir)
    _, extra, stats = sample_episodes(HFEngine(actor_dir), tok, ArithmeticEnv, rows, list(range(len(rows))),
                                      SamplingSpec(temperature=0.0, max_new_tokens=max_new_tokens),
                                      EpisodeLimits(max_turns=3, max_episode_tokens=160), HermesParser())
    tool = [used_calculator_correctly(e, r["expression"]) for e, r in zip(extra["episode"], rows)]
    return {"accuracy": float(extra["episode_reward"].mean()), "called_tool_correctly": sum(tool) / len(tool),
            **stats}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/tools-demo")
    parser.add_argument("--cache-dir", default=os.path.join(os.environ.get("RLHF_CACHE_DIR") or
                                                             os.path.expanduser("~/.cache/flyte-rlhf"), "tool_demo"))
    parser.add_argument("--steps", type=int, default=ToolDemoConfig.steps)
    parser.add_argument("--evaluate", default="", help="a checkpoint to evaluate greedily on the held-out prompts "
                                                        "(instead of building)")
    args = parser.parse_args(argv)
    console.quiet_libraries()  # as a run's processes: no "Writing model shards" bar (RLHF_VERBOSE=1 keeps it)
    if args.evaluate:
        cfg = ToolDemoConfig()
        print(json.dumps(evaluate(args.evaluate, problems(cfg.num_eval, cfg.seed + 1)), indent=1))
        return
    print(json.dumps(build(args.out, args.cache_dir, ToolDemoConfig(steps=args.steps)), indent=1))


if __name__ == "__main__":
    main()

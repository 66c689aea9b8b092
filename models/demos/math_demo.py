"""The math RLVR demo's model and data: a Qwen2-shaped chat checkpoint warm-started on worked
arithmetic word problems, and the problems as a conversational dataset with an ``answer`` column.

The checkpoint is :func:`models.demos.hub_models.build_qwen2_chat` (tied embeddings, GQA, byte-level BPE
with digits split, ChatML template, eos ``<|im_end|>``): what a user's small instruct model looks
like, not the character-level demo Llama. It is fine-tuned on (chat-templated question, worked
solution + ``<|im_end|>``) pairs from :mod:`models.demos.math_task` with the warm start's loop
(:func:`models.demos.warm_start.train_on_demonstrations`, response tokens only), just long enough to
write the answer format always and the right number some of the time, so GRPO has room to learn.

Cache: ``cache_dir/math-actor-<key>``, ``<key>`` hashing the model, task and warm-start settings,
built and renamed into place like the reversal demo's (:func:`models.demos.warm_start.cached_dir`).

CLI: ``python -m models.demos.math_demo --out DIR`` writes DIR/actor and DIR/prompts/{train,eval}.jsonl
and prints the warm start's held-out accuracy (greedy, as the run's evaluation decodes).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import time
from pathlib import Path
from typing import Dict, List, Sequence

from transformers import AutoModelForCausalLM, AutoTokenizer

from models import console
from models.demos.hub_models import HubModelConfig, build_qwen2_chat
from models.demos.math_task import MathTaskConfig, ProblemGenerator, write_rows_jsonl
from models.rewards.verifiers import math_reward
from models.demos.warm_start import WarmStartConfig, cached_dir, content_key, generate_responses, train_on_demonstrations

CACHE_VERSION = 1
"""Bump when the training code changes in a way that changes the result."""

DEMO_MODEL = HubModelConfig(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=1, intermediate_size=384)
"""0.48 M parameters, head size 32 (vLLM's CPU backend needs 32, 64, ...)."""

DEMO_WARM_START = WarmStartConfig(steps=400, batch_size=32, lr=2e-3)
"""Leaves the policy right on about a third of held-out problems (greedy; see docs/math_demo.md)."""

DEMO_TASK = MathTaskConfig(max_number=12, teacher_adds=0.6)
"""Numbers 1-12; the teacher adds in 60% of the taking-away demonstrations, so the warm start's most
likely answer to those is wrong while the right one is often sampled: room for RL to learn."""


def render_prompt(tokenizer, messages: List[Dict[str, str]]) -> str:
    """The conversation as the run renders it: the chat template with ``add_generation_prompt=True``."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def math_warm_start(cache_dir: str | Path, model_cfg: HubModelConfig = DEMO_MODEL,
                    task_cfg: MathTaskConfig = DEMO_TASK, cfg: WarmStartConfig = DEMO_WARM_START) -> Path:
    """The HF directory of the warm-started chat actor, trained only on a cache miss."""
    settings = {"model": dataclasses.asdict(model_cfg), "task": dataclasses.asdict(task_cfg),
                "warm_start": dataclasses.asdict(cfg)}
    final = Path(cache_dir) / f"math-actor-{content_key({'version': CACHE_VERSION, **settings})}"

    def build(tmp: Path) -> dict:
        build_qwen2_chat(tmp, model_cfg)
        tokenizer = AutoTokenizer.from_pretrained(tmp)
        model = AutoModelForCausalLM.from_pretrained(tmp)
        demos = ProblemGenerator(task_cfg, "train", seed=cfg.seed)

        def next_pairs(n: int):
            return [(render_prompt(tokenizer, msgs), worked) for msgs, worked in demos.demonstrations(n)]

        start = time.perf_counter()
        losses = train_on_demonstrations(model, tokenizer, next_pairs, cfg)
        seconds = time.perf_counter() - start
        model.save_pretrained(tmp, safe_serialization=True)  # the snapshot's other files stay
        return {**settings, "train_seconds": seconds, "losses": losses}

    return cached_dir(final, build)


def build_math_demo(out_dir: str | Path, cache_dir: str | Path, model_cfg: HubModelConfig = DEMO_MODEL,
                    task_cfg: MathTaskConfig = DEMO_TASK, cfg: WarmStartConfig = DEMO_WARM_START,
                    num_train_prompts: int = 512, num_eval_prompts: int = 64) -> Dict[str, Path]:
    """actor/ (warm-started, from the cache) and prompts/{train,eval}.jsonl (seed 0 of each split)
    under ``out_dir``."""
    out = Path(out_dir)
    actor = out / "actor"
    shutil.copytree(math_warm_start(cache_dir, model_cfg, task_cfg, cfg), actor, dirs_exist_ok=True)
    return {
        "actor": actor,
        "train_prompts": write_rows_jsonl(out / "prompts" / "train.jsonl",
                                          ProblemGenerator(task_cfg, "train", 0).rows(num_train_prompts)),
        "eval_prompts": write_rows_jsonl(out / "prompts" / "eval.jsonl",
                                         ProblemGenerator(task_cfg, "eval", 0).rows(num_eval_prompts)),
    }


def accuracy(actor_dir: str | Path, rows: Sequence[dict], max_new_tokens: int = 32,
             temperature: float = 0.0) -> float:
    """Mean ``math_reward`` of the actor's responses to ``rows`` (greedy by default)."""
    tokenizer = AutoTokenizer.from_pretrained(str(actor_dir))
    model = AutoModelForCausalLM.from_pretrained(str(actor_dir)).eval()
    prompts = [render_prompt(tokenizer, r["messages"]) for r in rows]
    responses = generate_responses(model, tokenizer, prompts, max_new_tokens, temperature)
    rewards = math_reward(prompts, responses, [r["answer"] for r in rows])
    return sum(rewards) / len(rewards)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m models.demos.math_demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for actor/ and prompts/")
    parser.add_argument("--cache-dir", default=".cache/warm_start", help="warm-start cache folder")
    parser.add_argument("--steps", type=int, default=DEMO_WARM_START.steps)
    parser.add_argument("--max-new-tokens", type=int, default=24, help="as rollout.max_new_tokens of the preset")
    args = parser.parse_args(argv)
    console.quiet_libraries()  # as a run's processes: no "Writing model shards" bar (RLHF_VERBOSE=1 keeps it)
    start = time.perf_counter()
    paths = build_math_demo(args.out, args.cache_dir, cfg=dataclasses.replace(DEMO_WARM_START, steps=args.steps))
    print(f"built in {time.perf_counter() - start:.1f} s")
    rows = ProblemGenerator(DEMO_TASK, "eval", 0).rows(64)
    print(f"held-out accuracy (greedy, 64 problems): {accuracy(paths['actor'], rows, args.max_new_tokens):.3f}")


if __name__ == "__main__":
    main()

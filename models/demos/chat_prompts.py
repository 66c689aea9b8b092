"""Conversational prompts in TRL's format and a reward function in TRL's keyword form, for real-shaped runs.

A row is ``{"prompt": [{"role": "system", ...}, {"role": "user", ...}], "answer": "19"}``: the shape TRL's
``GRPOTrainer`` takes (``prompt`` a list of messages, extra columns passed to the reward by keyword), and
the shape this project reads with no setting (a ``prompt`` column of messages is rendered by the chat
template, docs/data.md). The questions are the math demo's (:mod:`models.demos.math_task`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Sequence

from models.demos.math_task import MathTaskConfig, ProblemGenerator, write_rows_jsonl

SYSTEM = "You are a careful assistant. Answer with the final number."
"""The system turn of every prompt."""


def chat_rows(n: int, split: str = "train", seed: int = 0, system: str = SYSTEM) -> List[Dict[str, Any]]:
    """``n`` rows of TRL's conversational format with an ``answer`` column."""
    rows = ProblemGenerator(MathTaskConfig(), split, seed).rows(n)
    head = [{"role": "system", "content": system}] if system else []
    return [{"prompt": head + [{"role": "user", "content": r["question"]}], "answer": r["answer"]} for r in rows]


def write_chat_prompts(root: str | Path, n_train: int = 64, n_eval: int = 8, seed: int = 0) -> Dict[str, str]:
    """``train.jsonl`` and ``eval.jsonl`` under ``root``; their paths as ``train_prompts`` / ``eval_prompts``."""
    root = Path(root)
    return {"train_prompts": str(write_rows_jsonl(root / "train.jsonl", chat_rows(n_train, "train", seed))),
            "eval_prompts": str(write_rows_jsonl(root / "eval.jsonl", chat_rows(n_eval, "eval", seed)))}


def answer_reward(completions: Sequence[List[Dict[str, str]]], answer: Sequence[str], **kwargs: Any) -> List[float]:
    """TRL's keyword form: 1 when the completion's text holds the answer, minus 0.001 per character (so
    samples of a group differ even when none is right, as a random model's are)."""
    texts = [c[0]["content"] if isinstance(c, list) else str(c) for c in completions]
    return [float(str(a) in t) - 0.001 * len(t) for t, a in zip(texts, answer)]

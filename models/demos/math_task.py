"""Arithmetic word problems for the math RLVR demo (``make demo TASK=math``), generated, never downloaded.

A problem is a template (adding or taking away things) filled with a name, an item and two
numbers, e.g. ``"Ava has 12 shells and finds 7 more. How many shells does Ava have now?"``. Each
row carries the question as a ``messages`` conversation (one user turn, for the chat template),
the same text as ``question``, and the final number as ``answer``: the columns a GSM8K-style
dataset has, so the demo runs the same path as user data (``data.messages_column``, the
``answer`` column to ``models.rewards.verifiers:math_reward``).

A worked demonstration (:func:`solution`) writes the equation, then the answer in
``\\boxed{}``: ``"12 + 7 = 19. The answer is \\boxed{19}."`` :data:`FORMAT_PATTERN` is what
``models.rewards.verifiers:format_reward`` checks in the demo preset.

Train and held-out questions are disjoint by construction: a question's split is a stable hash
of its text (:func:`models.demos.reverse_task.split_of`), so a held-out question never appears in training
(its two numbers may, in another sentence).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Tuple

from models.demos.reverse_task import Split, split_of

FORMAT_PATTERN = r"[^\n]*= *-?\d+\. The answer is \\boxed\{-?\d+\}\."
"""One line: an equation ending in a number, then ``The answer is \\boxed{N}.`` (``re.fullmatch``)."""

NAMES = ["Ava", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jun", "Kofi", "Lena",
         "Mia", "Noor", "Omar", "Priya"]
ITEMS = ["apples", "books", "coins", "marbles", "pencils", "stickers", "cookies", "shells", "cards", "stamps"]

ADD_TEMPLATES = [
    "{name} has {a} {item} and finds {b} more. How many {item} does {name} have now?",
    "{name} had {a} {item}. A friend gave {name} {b} more. How many {item} does {name} have?",
    "There are {a} {item} in a box and {b} {item} on the table. How many {item} are there in all?",
]
SUB_TEMPLATES = [
    "{name} has {a} {item} and gives away {b}. How many {item} does {name} have left?",
    "{name} had {a} {item} and lost {b} of them. How many {item} are left?",
    "A shop had {a} {item} and sold {b}. How many {item} does the shop have now?",
]


@dataclass(frozen=True)
class MathTaskConfig:
    """Difficulty of the generated problems."""

    max_number: int = 30
    """Largest number in a question (both numbers are drawn from 1..max_number; a subtraction's
    second number is at most its first, so no answer is negative)."""
    eval_fraction: float = 0.1
    """Share of all possible questions reserved for the held-out split."""
    teacher_adds: float = 0.0
    """Share of the taking-away demonstrations that the warm start's teacher solves by adding (its
    answer is then wrong): a fallible teacher whose habit the verifier-driven RL has to unlearn.
    Dataset rows and their answers are always right."""

    def __post_init__(self) -> None:
        if self.max_number < 2:
            raise ValueError(f"max_number must be >= 2, got {self.max_number}")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if not 0.0 <= self.teacher_adds <= 1.0:
            raise ValueError(f"teacher_adds must be in [0, 1], got {self.teacher_adds}")


def solution(a: int, b: int, op: str) -> Tuple[str, int]:
    """The worked answer of ``a op b`` and its value: ``("12 + 7 = 19. The answer is \\boxed{19}.", 19)``."""
    value = a + b if op == "+" else a - b
    return f"{a} {op} {b} = {value}. The answer is \\boxed{{{value}}}.", value


class ProblemGenerator:
    """Deterministic stream of problems of one split: the same (config, split, seed) gives the same
    rows in every process. Questions may repeat within a stream, never across splits."""

    def __init__(self, cfg: MathTaskConfig, split: Split = "train", seed: int = 0) -> None:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        self.cfg, self.split = cfg, split
        self._rng = random.Random(f"math:{split}:{seed}")
        self._teacher = random.Random(f"teacher:{split}:{seed}")  # apart, so rows and demonstrations align

    def _draw(self) -> Tuple[str, int, int, str]:
        """One (question, a, b, op) of this split."""
        rng, n = self._rng, self.cfg.max_number
        while True:
            op = rng.choice("+-")
            a, b = rng.randint(1, n), rng.randint(1, n)
            if op == "-":
                a, b = max(a, b), min(a, b)
            template = rng.choice(ADD_TEMPLATES if op == "+" else SUB_TEMPLATES)
            question = template.format(name=rng.choice(NAMES), item=rng.choice(ITEMS), a=a, b=b)
            if split_of(question, self.cfg.eval_fraction) == self.split:
                return question, a, b, op

    def rows(self, n: int) -> List[Dict]:
        """The next ``n`` dataset rows: ``prompt_id``, ``question``, ``messages`` (one user turn), ``answer``."""
        out = []
        for i in range(n):
            question, a, b, op = self._draw()
            out.append({"prompt_id": i, "question": question,
                        "messages": [{"role": "user", "content": question}], "answer": str(solution(a, b, op)[1])})
        return out

    def demonstrations(self, n: int) -> List[Tuple[List[Dict[str, str]], str]]:
        """The next ``n`` (conversation, worked solution) pairs for the supervised warm start, the
        teacher adding in ``teacher_adds`` of the taking-away ones."""
        out = []
        for _ in range(n):
            question, a, b, op = self._draw()
            slip = op == "-" and self._teacher.random() < self.cfg.teacher_adds
            out.append(([{"role": "user", "content": question}], solution(a, b, "+" if slip else op)[0]))
        return out


def write_rows_jsonl(path: str | Path, rows: Iterable[Dict]) -> Path:
    """One JSON object per line; creates parent folders."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return out

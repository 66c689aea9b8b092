"""Synthetic demo task with a verifiable reward: reverse a short lowercase string.

Prompt format: the source string followed by "=", e.g. "abcd=". The ideal response is
the reversed string, "dcba", after which the policy should emit `<eos>`. The tokenizer
adds `<bos>`, so the model sees `<bos> a b c d =` and should continue `d c b a <eos>`.

Train and eval prompts are disjoint by construction, not only by seed: every source
string belongs to exactly one split, decided by a stable hash of the string
(`split_of`); a generator draws random strings and keeps those of its own split.

The reward (`reverse_reward`) is the fraction of positions that match the target,
divided by the longer of the two lengths, so a missing or extra character costs as
much as a wrong one:

    r = #{i < min(|y|, |y*|) : y_i = y*_i} / max(|y|, |y*|)      in [0, 1]

It has the plug-in signature `fn(prompts, responses) -> list[float]`; its spec is
`models.demos.reverse_task:reverse_reward`.
"""

from __future__ import annotations

import hashlib
import json
import random
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal

SEPARATOR = "="
REWARD_SPEC = "models.demos.reverse_task:reverse_reward"
Split = Literal["train", "eval"]


@dataclass(frozen=True)
class ReverseTaskConfig:
    """Settings of the string-reversal task."""

    min_len: int = 3
    """Shortest source string (characters)."""
    max_len: int = 6
    """Longest source string (characters)."""
    letters: str = string.ascii_lowercase
    """Characters source strings are drawn from (uniformly, with repetition)."""
    eval_fraction: float = 0.1
    """Share of all possible source strings reserved for the eval split."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got {self.min_len}, {self.max_len}")
        if not self.letters or len(set(self.letters)) != len(self.letters):
            raise ValueError(f"letters must be non-empty and distinct, got {self.letters!r}")
        if SEPARATOR in self.letters:
            raise ValueError(f"letters must not contain the separator {SEPARATOR!r}")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")

    @property
    def max_prompt_chars(self) -> int:
        """Longest prompt in characters (source + separator)."""
        return self.max_len + len(SEPARATOR)

    @property
    def max_new_tokens(self) -> int:
        """Room for the longest ideal response plus its `<eos>`."""
        return self.max_len + 1


def split_of(source: str, eval_fraction: float) -> Split:
    """The split a source string belongs to (stable across processes and machines)."""
    digest = hashlib.blake2b(source.encode(), digest_size=8).digest()
    u = int.from_bytes(digest, "big") / 2**64  # uniform in [0, 1)
    return "eval" if u < eval_fraction else "train"


def make_prompt(source: str) -> str:
    """"abcd" -> "abcd="."""
    return source + SEPARATOR


def parse_prompt(prompt: str) -> str:
    """"abcd=" -> "abcd"; raises ValueError on a prompt not in the task's format."""
    if not prompt.endswith(SEPARATOR) or SEPARATOR in prompt[: -len(SEPARATOR)]:
        raise ValueError(f"prompt must be '<source>{SEPARATOR}', got {prompt!r}")
    return prompt[: -len(SEPARATOR)]


def ideal_response(prompt: str) -> str:
    """The target response text (without `<eos>`): the reversed source."""
    return parse_prompt(prompt)[::-1]


def reversal_score(response: str, target: str) -> float:
    """Positional matches over the longer length (see module docstring); 1.0 iff equal."""
    longest = max(len(response), len(target))
    if longest == 0:
        return 1.0
    matches = sum(a == b for a, b in zip(response, target))
    return matches / longest


def reverse_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """Verifiable reward of the reversal task, one float in [0, 1] per sample."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    return [reversal_score(r, ideal_response(p)) for p, r in zip(prompts, responses)]


class PromptGenerator:
    """Deterministic stream of task prompts of one split.

    The same (config, split, seed) gives the same sequence in every process. Duplicates
    are possible within a stream (short strings repeat), never across splits.
    """

    def __init__(self, cfg: ReverseTaskConfig, split: Split = "train", seed: int = 0) -> None:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        self.cfg = cfg
        self.split = split
        # Mixing the split into the seed keeps streams different even for equal seeds.
        self._rng = random.Random(f"{split}:{seed}")

    def _source(self) -> str:
        while True:
            n = self._rng.randint(self.cfg.min_len, self.cfg.max_len)
            source = "".join(self._rng.choice(self.cfg.letters) for _ in range(n))
            if split_of(source, self.cfg.eval_fraction) == self.split:
                return source

    def prompts(self, n: int) -> list[str]:
        """The next `n` prompts, e.g. ["abcd=", "xyz="]."""
        return [make_prompt(self._source()) for _ in range(n)]

    def demonstrations(self, n: int) -> list[tuple[str, str]]:
        """The next `n` (prompt, ideal response) pairs for supervised warm starts."""
        return [(p, ideal_response(p)) for p in self.prompts(n)]


def write_prompts_jsonl(path: str | Path, prompts: Iterable[str]) -> Path:
    """Write one `{"prompt": ...}` JSON object per line; creates parent folders."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for prompt in prompts:
            f.write(json.dumps({"prompt": prompt}) + "\n")
    return out


def read_prompts_jsonl(path: str | Path) -> list[str]:
    """Read the `prompt` field of every non-empty line written by `write_prompts_jsonl`."""
    prompts = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(f"{path}:{lineno}: expected an object with a string 'prompt'")
        prompts.append(row["prompt"])
    return prompts

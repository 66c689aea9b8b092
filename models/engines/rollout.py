"""Rollout: prompts → sampled responses as RolloutBatch columns (plain function, engine-agnostic)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Sequence

import numpy as np

from models.engines import Generation, GenerationEngine, SamplingSpec
from models.faults import slow_engine


@dataclass
class RolloutColumns:
    """Ragged columns of a rollout, one entry per sample (prompt-major: prompt i's n samples adjacent)."""

    prompt_id: np.ndarray  # [N] int64
    prompt_tokens: List[List[int]]
    response_tokens: List[List[int]]
    sampler_logprobs: List[List[float]]
    is_end: np.ndarray  # [N] bool
    prompt: List[str]
    response: List[str]
    generate_s: float

    def as_dict(self) -> Dict[str, object]:
        return {k: getattr(self, k) for k in ("prompt_id", "prompt_tokens", "response_tokens",
                                              "sampler_logprobs", "is_end", "prompt", "response")}


def encode_prompts(tokenizer, prompts: Sequence[str], add_special_tokens: bool = True) -> List[List[int]]:
    """Token ids as the policy sees them: plain text with the tokenizer's own special tokens (e.g.
    ``<bos>``); text a chat template rendered (``add_special_tokens=False``) as it is, since the
    template wrote its special tokens itself (a second BOS would be a prompt the model never saw)."""
    return [list(ids) for ids in tokenizer(list(prompts), add_special_tokens=add_special_tokens)["input_ids"]]


def decode_responses(tokenizer, responses: Sequence[Sequence[int]]) -> List[str]:
    """Response text without special tokens (what reward functions see)."""
    return tokenizer.batch_decode([list(r) for r in responses], skip_special_tokens=True)


def sample(engine: GenerationEngine, tokenizer, prompts: Sequence[str], prompt_ids: Sequence[int],
           spec: SamplingSpec, chat: bool = False, first_index: int = 0) -> RolloutColumns:
    """``spec.n`` responses for each prompt, with the engine's log-probs and ``is_end`` (``chat``: the
    prompts were rendered by a chat template, see :func:`encode_prompts`; ``first_index``: the position of
    ``prompts[0]`` in the whole request, whose seeds its samples draw from, :func:`models.engines.sample_seed`)."""
    t0 = time.perf_counter()
    ids = encode_prompts(tokenizer, prompts, add_special_tokens=not chat)
    gens = engine.generate(ids, spec, first_index=first_index) if first_index else engine.generate(ids, spec)
    slow_engine(len(prompts))  # a benchmark's slower engine (models/faults.py); nothing otherwise
    return rollout_columns(tokenizer, prompts, prompt_ids, ids, gens, spec.n, t0)


def rollout_columns(tokenizer, prompts: Sequence[str], prompt_ids: Sequence[int], ids: List[List[int]],
                    gens: List[List[Generation]], n: int, t0: float) -> RolloutColumns:
    """The columns of ``gens`` (``n`` per prompt of ``ids``, the token ids of ``prompts``), sampled since ``t0``."""
    flat = [g for per_prompt in gens for g in per_prompt]
    resp = [g.tokens for g in flat]
    return RolloutColumns(
        prompt_id=np.repeat(np.asarray(prompt_ids, dtype=np.int64), n),
        prompt_tokens=[p for p in ids for _ in range(n)],
        response_tokens=resp,
        sampler_logprobs=[g.logprobs for g in flat],
        is_end=np.array([g.is_end for g in flat], dtype=bool),
        prompt=[p for p in prompts for _ in range(n)],
        response=decode_responses(tokenizer, resp),
        generate_s=time.perf_counter() - t0,
    )

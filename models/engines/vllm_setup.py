"""vLLM's set-up for :class:`~models.engines.vllm_engine.VLLMEngine`, apart from the engine: the ``LLM``'s arguments
(:func:`llm_kwargs`), the CPU workers' binding to cores of their own (:func:`cpu_worker_groups`,
:func:`cpu_workers_bound`), the settings vLLM caches per process (:func:`read_settings_afresh`), whether CUDA graphs
replay (:func:`cuda_graphs`), and which LoRA targets vLLM serves as an adapter (:func:`unsupported_lora_targets`)."""

from __future__ import annotations

import json
import logging
import os
import platform
from contextlib import contextmanager
from typing import Any, Dict, List, Optional, Sequence

import torch

from models import console
from models.engines.base import EngineLoadError, contiguous_shares
from models.engines.context import GIB, model_len
from models.environ import environment

log = logging.getLogger(__name__)

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""``max_lora_rank`` values vLLM accepts (``vllm.config.lora.MaxLoRARanks``)."""
VLLM_MAX_LORA_RANK = VLLM_LORA_RANKS[-1]
EMBEDDING_TARGETS = ("lm_head", "embed_tokens")
"""LoRA targets vLLM adapts only for architectures that list them in ``embedding_modules``."""


def unsupported_lora_targets(model_config: Dict[str, Any], target_modules: Sequence[str]) -> List[str]:
    """The LoRA ``target_modules`` vLLM cannot serve as an adapter on the architecture of a checkpoint
    (its ``config.json`` as a dict): ``lm_head``/``embed_tokens`` where the architecture's vLLM class
    does not list them in ``embedding_modules`` (Qwen2: no; Llama: yes)."""
    asked = [t for t in target_modules if t in EMBEDDING_TARGETS]
    if not asked:
        return []
    from vllm.model_executor.models.registry import ModelRegistry

    archs = model_config.get("architectures") or []
    supported: set = set()
    for arch in archs:
        if arch in ModelRegistry.models:
            supported |= set(getattr(ModelRegistry.models[arch].load_model_cls(), "embedding_modules", {}) or {})
    return [t for t in asked if t not in supported]


def read_json(folder: str, name: str) -> Dict[str, Any]:
    with open(os.path.join(folder, name), encoding="utf-8") as f:
        return json.load(f)


def cpu_worker_groups(cpus: Sequence[int], workers: int, setting: str = "") -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` giving each of ``workers`` CPU workers its own contiguous share of
    ``cpus`` (``"0,1|2,3"``); an :class:`EngineLoadError` naming ``setting`` (default
    ``rollout.tensor_parallel_size``) if there are fewer CPUs than workers."""
    cpus = sorted(cpus)
    if len(cpus) < workers:
        raise EngineLoadError(f"{setting or f'rollout.tensor_parallel_size={workers}'} needs a CPU core per worker; "
                              f"this process may use {len(cpus)} ({cpus})")
    return "|".join(",".join(str(c) for c in cpus[a:b]) for a, b in contiguous_shares(len(cpus), workers))


@contextmanager
def cpu_workers_bound(workers: int):
    """Within the block, pin vLLM's ``workers`` CPU workers to disjoint cores of this process's allowed set
    (its own binding gives each worker a NUMA node, so it refuses more workers than nodes), through
    ``VLLM_CPU_OMP_THREADS_BIND``, which the workers read when the engine starts them. The environment is
    restored afterwards, so a later engine of this process (one worker) binds as vLLM would. A binding the
    user set wins; one worker, or a GPU, leaves it alone."""
    ours = workers > 1 and not torch.cuda.is_available() and \
        os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") == "auto"
    with environment({"VLLM_CPU_OMP_THREADS_BIND": cpu_worker_groups(os.sched_getaffinity(0), workers)}
                     if ours else {}):
        yield


def read_settings_afresh() -> None:
    """Make vLLM read its ``VLLM_*`` settings from the environment again. Once an engine has started in a
    process, vLLM caches every setting (``vllm.envs.enable_envs_cache``), so a later engine of that process
    (a test's second engine, another tensor-parallel size in one run) would silently keep the first one's
    CPU binding and KV-cache size; the engine being started re-enables the cache with this one's values."""
    from vllm import envs

    envs.disable_envs_cache()


_NOTED: set = set()
"""The notes :func:`llm_kwargs` has logged in this process (each once: a stateless run starts an engine a task)."""


def cpu_dtype_note(dtype: str, cuda: bool, machine: str = "", bf16_native: Optional[bool] = None) -> str:
    """What an engine on this CPU should know about ``dtype``: for bfloat16 on an x86 CPU with neither AVX-512 BF16
    nor AMX (``machine``, ``bf16_native``: this one's by default), vLLM's CPU kernels compute it through float32
    conversions, about 3x slower than float32 (measured here); '' where there is nothing to say."""
    machine = (machine or platform.machine()).lower()
    if cuda or dtype != "bfloat16" or machine not in ("x86_64", "amd64"):
        return ""
    if bf16_native is None:
        ask = lambda name: getattr(torch.cpu, name, lambda: True)()  # noqa: E731 -- private: absent, no note
        bf16_native = ask("_is_avx512_bf16_supported") or ask("_is_amx_tile_supported")
    if bf16_native:
        return ""
    return ("rollout.vllm_dtype=bfloat16 on a CPU without AVX-512 BF16 or AMX: vLLM's CPU kernels compute bfloat16 "
            "there about 3x slower than float32 (2026-11-30, an AVX2 EPYC: an 8-layer Qwen3-0.6B-shaped model sampled "
            "16 x 32 tokens in 21.5 s against 7.3 s and started in 161 s against 96 s). Where memory allows (the "
            "engine's weights take twice the bytes), rollout.vllm_dtype=float32 samples faster, and its log-probs "
            "match the float32 trainer's (docs/real_checkpoints.md#the-engines-dtype-on-a-cpu)")


def llm_kwargs(checkpoint_dir: str, dtype: str, gpu_memory_utilization: float, max_model_len: Optional[int],
               seed: int, max_lora_rank: int, tensor_parallel_size: int, enforce_eager: bool, cuda: bool,
               kv_cache_gib: float = 1.0, max_num_seqs: int = 0) -> Dict[str, Any]:
    """vLLM's ``LLM`` arguments for :class:`VLLMEngine` (``cuda``: whether it runs on a GPU). On a GPU vLLM captures
    CUDA graphs of the decode steps unless ``enforce_eager``; the CPU has none, so it runs eager there.
    ``max_model_len``: the run's context, capped at the checkpoint's (:func:`models.engines.context.model_len`;
    None: the checkpoint's). On CPU the KV cache is ``kv_cache_gib``; ``max_num_seqs`` 0: vLLM's default."""
    kwargs: Dict[str, Any] = dict(dtype=dtype, enforce_eager=bool(enforce_eager or not cuda), seed=seed,
                                  logprobs_mode="processed_logprobs", generation_config="vllm",
                                  use_tqdm_on_load=console.verbose())
    if tensor_parallel_size > 1:  # workers in their own processes, each loading its slice
        kwargs.update(tensor_parallel_size=tensor_parallel_size, distributed_executor_backend="mp")
    length = model_len(max_model_len, read_json(checkpoint_dir, "config.json"))
    if length:
        kwargs["max_model_len"] = length
    if max_num_seqs:
        kwargs["max_num_seqs"] = max_num_seqs
    if cuda:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    else:
        note = cpu_dtype_note(dtype, cuda)
        if note and note not in _NOTED:
            _NOTED.add(note)
            log.warning(note)
        # a prefill split across steps rewinds each seeded request's generator, which a CPU
        # generator cannot ("CPU Generator does not use offset"): prefill every prompt whole
        kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(int(length or 0), 2048, max_num_seqs),
                      kv_cache_memory_bytes=int(kv_cache_gib * GIB))
    if max_lora_rank:  # one adapter at a time, of rank up to the next size vLLM accepts
        rank = next((r for r in VLLM_LORA_RANKS if r >= max_lora_rank), None)
        if rank is None:
            raise ValueError(f"vLLM serves LoRA adapters up to rank {VLLM_MAX_LORA_RANK}, got {max_lora_rank}")
        kwargs.update(enable_lora=True, max_lora_rank=rank, max_loras=1)
    return kwargs


def cuda_graphs(llm) -> bool:
    """Whether the started ``LLM`` replays CUDA graphs (its compilation config's ``cudagraph_mode``)."""
    from vllm.config import CUDAGraphMode

    mode = getattr(llm.llm_engine.vllm_config.compilation_config, "cudagraph_mode", None)
    return mode is not None and mode != CUDAGraphMode.NONE

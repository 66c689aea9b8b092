"""A local trainer service's ranks, forked from one process that imported what they need.

``python -m models.hosts ranks --nproc N SERVICE --launch FILE`` is what ``torchrun --standalone --nproc-per-node=N
--max-restarts=0 -m models.hosts SERVICE --launch FILE`` was for a resident run's trainer service on one machine
(:mod:`models.hosts.resident`): the same elastic agent (torch's ``elastic_launch``: a c10d rendezvous on a free
loopback port, no restart, every rank stopped when one fails, the failure raised as ``ChildFailedError`` and the
launch exiting 1), the same per-rank environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``,
``OMP_NUM_THREADS`` 1 unless set), but the ranks are forked by a forkserver that imported torch, transformers' model
classes and the service's host module once, where torchrun spawned N interpreters that each imported them: about 14 s
of CPU per rank on the 2-core machine (``benchmarks/RESULTS.md``), paid at every start of a local resident run.

The forkserver is started here, single-threaded, before the agent starts any thread; each rank dies with it
(``PR_SET_PDEATHSIG``), and it with this launch. Cluster pods keep their own launch (the PyTorchJob's
``pyflyte-execute``): nothing here runs there.
"""

from __future__ import annotations

import os
import sys
import uuid
from typing import Callable, List, Sequence

from models import console
from models.library_imports import skip_unused_optional_imports
from models.memory import use_huge_pages
from models.processes import FORKSERVER, start_forkserver

console.quiet_libraries()  # here too: this module is the first the forkserver imports (a fresh interpreter)
skip_unused_optional_imports()
use_huge_pages()

TRAINER_PRELOAD = ("models.hosts.ranks", "models.hosts.resident", "models.hosts.trainers", "transformers.modeling_utils",
                   "transformers.models.auto.modeling_auto")
"""What a trainer service's ranks import before they do anything: imported once, by the forkserver."""
COLOCATED_PRELOAD = TRAINER_PRELOAD + ("models.hosts.colocated", "vllm")
"""The colocated layout's ranks also hold a vLLM engine each."""


def preload_for(service: str, colocated: bool) -> Sequence[str]:
    """The modules the forkserver of ``service``'s ranks imports."""
    return COLOCATED_PRELOAD if colocated and service == "actor" else TRAINER_PRELOAD


def launch_ranks(nproc: int, preload: Sequence[str], entry: Callable[[List[str]], None], argv: List[str]) -> None:
    """``entry(argv)`` on ``nproc`` ranks forked from a forkserver that imported ``preload``; returns when every rank
    returned, raises ``ChildFailedError`` (the first failure's rank and error) when one failed."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for several ranks; set before the fork server
    start_forkserver(preload)  # now, while this process has no thread: the agent starts some
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"ranks-{uuid.uuid4().hex[:12]}",
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, start_method=FORKSERVER)
    elastic_launch(config, entrypoint=as_rank)(entry, list(argv))


def as_rank(entry: Callable[[List[str]], None], argv: List[str]) -> None:
    """A forked rank: it ends with its forkserver (and so with the launch), then runs ``entry(argv)``."""
    from models import processes

    processes.die_with_parent()
    entry(argv)


def serve_rank(argv: List[str]) -> None:
    """A rank of trainer service ``argv[0]`` as ``argv[1:]`` (``--launch FILE``) says."""
    from models.hosts.resident import serve_launch

    serve_launch(argv[0], argv[argv.index("--launch") + 1])


def main(argv: List[str]) -> None:
    """``--nproc N SERVICE --launch FILE``: the service's ranks (exit 1 with the failed rank's error when one fails)."""
    import argparse

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    parser = argparse.ArgumentParser(prog="python -m models.hosts ranks")
    parser.add_argument("--nproc", type=int, required=True, help="ranks on this machine")
    parser.add_argument("--colocated", action="store_true", help="the ranks hold vLLM engines too (preloaded)")
    parser.add_argument("service", choices=("actor", "critic"))
    parser.add_argument("--launch", required=True, help="the launch file written by models.hosts.resident")
    args = parser.parse_args(argv)
    try:
        launch_ranks(args.nproc, preload_for(args.service, args.colocated), serve_rank,
                     [args.service, "--launch", args.launch])
    except ChildFailedError as err:
        print(err.format_msg(), file=sys.stderr, flush=True)
        raise SystemExit(1) from None

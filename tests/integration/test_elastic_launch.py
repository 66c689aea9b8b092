"""The local elastic launch of ``actor_update`` (tasks/elastic.py): real workers from a forkserver."""

from __future__ import annotations

import os
from typing import NamedTuple

import pytest
from flytekit import task

from models.config.io import load_config
from tasks.deploy import elastic_for, use_local_topology

pytestmark = pytest.mark.integration


class Seen(NamedTuple):
    world: int
    pid: int
    parent_pid: int
    threads: int
    doubled: int
    marks: str  # RLHF_TEST_LATE|RLHF_TEST_GONE|RANK in the worker ("-": unset)


def _seen(x: int) -> Seen:
    import torch
    import torch.distributed as dist

    from models.training.distributed import init_distributed, shutdown_distributed

    info = init_distributed()
    t = torch.tensor([float(info.rank + 1)])
    if dist.is_initialized():  # (a single worker has no process group)
        dist.all_reduce(t)  # a real collective across the launched ranks
    if x < 0:
        raise ValueError(f"rank {info.rank} refuses x={x}")
    shutdown_distributed()
    return Seen(info.world_size * 100 + int(t.item()), os.getpid(), os.getppid(), torch.get_num_threads(), 2 * x,
                "|".join(os.environ.get(k, "-") for k in ("RLHF_TEST_LATE", "RLHF_TEST_GONE", "RANK")))


who = task(task_config=elastic_for(load_config("tiny_ppo", ["actor.nproc_per_node=2"]), local=True))(_seen)


def test_workers_come_from_one_forkserver_that_outlives_the_launch(monkeypatch):
    preset = os.environ.get("OMP_NUM_THREADS")
    monkeypatch.delenv("RLHF_TEST_LATE", raising=False)
    monkeypatch.setenv("RLHF_TEST_GONE", "set at the first launch")
    first = who(x=3)
    monkeypatch.setenv("RLHF_TEST_LATE", "set after the forkserver started")
    monkeypatch.delenv("RLHF_TEST_GONE")
    second = who(x=4)
    assert (first.world, first.doubled, second.doubled) == (2 * 100 + 3, 6, 8)  # 2 ranks, 1 + 2 all-reduced
    assert first.parent_pid == second.parent_pid != os.getpid()  # the same server forked both launches
    # each launch's workers see the run's environment of that launch, not the forkserver's of its start,
    # and keep the agent's own variables (rank 0's result comes back)
    assert first.marks == "-|set at the first launch|0"
    assert second.marks == "set after the forkserver started|-|0"
    # torchrun's per-worker share of the cores, unless OMP_NUM_THREADS says otherwise
    assert first.threads == int(preset or max((os.cpu_count() or 1) // 2, 1))
    # and only theirs: a later one-worker task of this process (a local run's critic update after the
    # actor's 2 ranks) gets every core again, not the launch's share
    assert os.environ.get("OMP_NUM_THREADS") == preset


@pytest.mark.parametrize("omp", ["2", None])
def test_the_run_config_sets_the_local_worker_count(omp, monkeypatch):
    """One worker runs in the calling process, with the threads a launched one gets
    (``OMP_NUM_THREADS`` when set, else every core), and the caller's thread count is restored."""
    import torch

    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    use_local_topology(who, load_config("tiny_ppo", ["actor.nproc_per_node=1"]))
    before = torch.get_num_threads()
    # torch._C's setter: an in-process vLLM engine (earlier tests) replaces torch.set_num_threads
    # with a no-op, as it does in a local run; the task must set the threads all the same
    torch._C.set_num_threads(1)
    try:
        one = who(x=1)
        assert one.world == 1 * 100 + 1
        assert one.pid == os.getpid()
        assert one.threads == int(omp or os.cpu_count() or 1)
        assert torch.get_num_threads() == 1
        with pytest.raises(Exception, match="refuses x=-2"):
            who(x=-2)
        assert torch.get_num_threads() == 1
    finally:
        torch._C.set_num_threads(before)
        use_local_topology(who, load_config("tiny_ppo", ["actor.nproc_per_node=2"]))


def test_a_failing_worker_fails_the_task_with_its_error():
    with pytest.raises(Exception, match="refuses x=-1"):
        who(x=-1)

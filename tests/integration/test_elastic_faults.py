"""A rank of the elastic actor update (FSDP2) dies mid-update (``os._exit`` before its second optimiser
step, injected by ``RLHF_FAULT_KILL_RANK``): torch elastic restarts the worker group
(``max_restarts``), the update starts over from its inputs (the batch and the input
checkpoint), and its checkpoint is bit-identical to an unbroken update's. Without restarts the
same fault fails the task."""

from __future__ import annotations

import re

import psutil
import pytest
from flytekit import task
from flytekitplugins.kfpytorch import Elastic

from models.checkpoint import is_committed, read_marker
from tasks.elastic import FORKSERVER, ActorElastic
from tasks.updates import actor_update
from tests.stages import tiny_run, to_advantages, with_overrides

pytestmark = [pytest.mark.integration, pytest.mark.slow]

OVERRIDES = ["rollout.engine=hf", "rollout.prompts_per_iteration=8", "rollout.n_samples_per_prompt=4",
             "actor.minibatch_size=16", "actor.micro_batch_size=8", "actor.nproc_per_node=2",
             "critic.minibatch_size=16", "critic.micro_batch_size=8", "run.num_iterations=1",
             "data.num_demo_train_prompts=64", "data.num_demo_eval_prompts=8", "actor.lr=1e-3"]


def elastic_update(max_restarts: int, local_run: bool = False):
    """``actor_update`` as a 2-process elastic task with ``max_restarts``: the plugin's (spawned workers, as in a
    pod), or with ``local_run`` a local run's (forked by the forkserver, tasks/elastic.py)."""
    config = ActorElastic(nnodes=1, nproc_per_node=2, max_restarts=max_restarts, monitor_interval=1,
                          start_method=FORKSERVER, increase_shared_mem=False) if local_run else \
        Elastic(nnodes=1, nproc_per_node=2, max_restarts=max_restarts, monitor_interval=1)
    return task(task_config=config)(actor_update.task_function)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("elastic")
    with tiny_run(root, "tiny_ppo", OVERRIDES, "elastic", local_cache=False) as setup:
        _, _, ad = to_advantages(*setup)
        yield dict(cfg=setup.cfg, run=setup.run, state=setup.state, batch=ad.batch), root


def _digest(url: str) -> str:
    return read_marker(url)["files"]["model.safetensors"]["blake3"]


@pytest.mark.parametrize("sharding", ["fsdp2"])  # the restart is torch elastic's whatever the sharding (DDP: the same)
def test_killed_rank_is_restarted_and_the_update_is_unchanged(inputs, monkeypatch, sharding):
    kwargs, root = inputs
    kwargs = {**kwargs, "cfg": with_overrides(kwargs["cfg"], f"actor.sharding={sharding}")}
    unbroken = elastic_update(max_restarts=1)(**kwargs)
    reference = _digest(unbroken.checkpoint_url)
    assert unbroken.stats["actor/steps"] == 4  # 32 samples / minibatch 16 × 2 epochs

    faults = root / f"faults-restart-{sharding}"
    monkeypatch.setenv("RLHF_FAULT_KILL_RANK", "1@step=1")
    monkeypatch.setenv("RLHF_FAULT_DIR", str(faults))
    broken = elastic_update(max_restarts=1)(**kwargs)
    assert (faults / "killed-rank-1-step-1").exists()  # rank 1 did die once
    assert broken.checkpoint_url == unbroken.checkpoint_url and is_committed(broken.checkpoint_url)
    assert _digest(broken.checkpoint_url) == reference
    for key in ("actor/loss", "actor/clip_frac", "actor/grad_norm", "actor/approx_kl"):
        assert broken.stats[key] == unbroken.stats[key], key


def test_without_restarts_the_killed_rank_fails_the_task(inputs, monkeypatch):
    """A rank SIGKILLed (as by the kernel's OOM killer) fails the task naming the update, the rank, the signal and
    the memory it held, first, though rank 0 then fails too, on the closed connection; no worker outlives it."""
    kwargs, root = inputs
    monkeypatch.setenv("RLHF_FAULT_KILL_RANK", "1@step=1:SIGKILL")
    monkeypatch.setenv("RLHF_FAULT_DIR", str(root / "faults-no-restart"))
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(Exception, match="killed by SIGKILL") as err:  # torchrun often records only rank 0's error
        elastic_update(max_restarts=0, local_run=True)(**kwargs)
    assert (root / "faults-no-restart" / "killed-rank-1-step-1").exists()  # rank 1 died, no restart came
    said = str(err.value)
    assert re.search(r"the actor update failed on rank 1: its process \(pid \d+\) was killed by SIGKILL \(no sign of "
                     r"the kernel's OOM killer: /proc/vmstat oom_kill unchanged\); its peak memory was [\d.]+ GiB "
                     r"\(RSS, sampled every 0.5 s\), the run's processes together [\d.]+ GiB of ", said), said[-3000:]
    assert [p for p in psutil.Process().children(recursive=True) if p.pid not in before and _forked(p)] == []


def _forked(p) -> bool:
    """Whether ``p`` is a worker the forkserver forked (tasks/elastic.py)."""
    try:
        return "multiprocessing.forkserver" in " ".join(p.parent().cmdline())
    except (psutil.Error, AttributeError):
        return False

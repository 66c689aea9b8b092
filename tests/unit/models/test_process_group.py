"""The actor update leaves only the process group it made (models/training/distributed.py).

In a local run the single-worker actor update runs in the ``pyflyte`` process, beside the in-process
vLLM engine, which made a gloo world of one and its tensor-parallel group there. The update used to
destroy that world when it ended, and the engine's own shutdown then failed on its group ("vLLM
shutdown: Invalid process group specified" at the end of ``make demo TASK=tools``)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from models.training.distributed import init_distributed, join_process_group, shutdown_distributed


@pytest.fixture
def single_process(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_update_leaves_an_engines_process_group_alone(tmp_path, single_process):
    # What vLLM's in-process engine does at start: a world of one, then its groups (GroupCoordinator).
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    tp_group = dist.new_group([0], backend="gloo")
    info = init_distributed()  # actor_update, run in the same process
    assert info.world_size == 1
    shutdown_distributed()
    assert dist.is_initialized()
    dist.destroy_process_group(tp_group)  # the engine's shutdown: its group is still there to destroy
    dist.destroy_process_group()


def test_a_group_the_update_made_is_left_when_it_ends(tmp_path, single_process):
    join_process_group(backend="gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    shutdown_distributed()
    assert not dist.is_initialized()

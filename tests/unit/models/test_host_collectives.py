"""Collectives between the CPU ranks of one host through shared memory (``models/training/host_collectives.py``)
against gloo's own: the same bytes for all-gathers, the same sums for reduce-scatters (bit for bit on two ranks),
FSDP2's forward and backward through them equal to gloo's bit for bit, and gloo kept wherever the region cannot
be made (ranks on other hosts, no room), with nothing left in the region's folder."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist

from models.training import host_collectives as hc
from tests.processes import free_port
from tests.ranks import spawn
from tests.unit.models.test_sharded_update import join_gloo

pytestmark = pytest.mark.slow  # starts processes (make test-unit leaves it to make test)

SMALL = 4096 * 3
"""A region of a few KiB: every tensor below goes through it in many pieces, the last one short."""


def _collectives(rank: int, world: int, out: str) -> None:
    group = dist.group.WORLD
    region = os.path.join(out, "region")
    host = hc.HostCollectives.open(group, SMALL, region)
    dist.barrier()  # rank 0 unlinks the file once every rank mapped it
    assert host is not None and os.listdir(region) == []
    g = torch.Generator().manual_seed(rank)
    for dtype, n in [(torch.float32, 5003), (torch.bfloat16, 777), (torch.int64, 129), (torch.uint8, 3)]:
        part = (torch.randn(n, generator=g) * 100).to(dtype)
        want = torch.empty(n * world, dtype=dtype)
        dist.all_gather_into_tensor(want, part)
        got = torch.full((n * world,), 7, dtype=dtype)
        host.all_gather(got, part)
        assert torch.equal(got, want), dtype
        inside = torch.full((n * world,), 7, dtype=dtype)  # FSDP2's way: the input is this rank's part of the output
        inside[rank * n:(rank + 1) * n] = part
        host.all_gather(inside, inside[rank * n:(rank + 1) * n])
        assert torch.equal(inside, want), dtype
    for dtype in (torch.float32, torch.bfloat16):
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            full = (torch.randn(2501 * world, generator=g) * (rank + 1)).to(dtype)
            everyone = [torch.empty_like(full) for _ in range(world)]
            dist.all_gather(everyone, full)
            want = everyone[0][rank * 2501:(rank + 1) * 2501].clone()  # the parts summed in rank order
            for other in everyone[1:]:
                want += other[rank * 2501:(rank + 1) * 2501]
            if op == dist.ReduceOp.AVG:
                want /= world
            got = torch.empty(2501, dtype=dtype)
            host.reduce_scatter(got, full, op)
            assert torch.equal(got, want), (dtype, op)
            if world == 2 and op == dist.ReduceOp.SUM:  # a sum of two does not depend on the order: gloo's
                gloo = torch.empty(2501, dtype=dtype)
                dist.reduce_scatter_tensor(gloo, full.clone(), op=dist.ReduceOp.SUM)
                assert torch.equal(got, gloo), dtype
    with pytest.raises(ValueError, match="SUM or AVG"):
        host.reduce_scatter(torch.empty(3), torch.empty(3 * world), dist.ReduceOp.MAX)
    # rows sharded as FSDP2 shards them (torch.chunk: 7 rows over 3 ranks are 3, 3, 1), gathered whole
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    hc._HOSTS[group] = host
    mesh = init_device_mesh("cpu", (world,))
    whole = torch.arange(7 * 5, dtype=torch.float32).view(7, 5)
    sharded = distribute_tensor(whole, mesh, [Shard(0)])
    assert torch.equal(hc.full_tensor(sharded), whole)
    # no room for the region, ranks on two hosts: every rank keeps gloo
    assert hc.HostCollectives.open(group, SMALL, os.path.join(out, "missing")) is None
    if rank == 1:
        socket.gethostname = lambda: "another-host"
    assert hc.HostCollectives.open(group, SMALL, region) is None
    dist.barrier()
    assert os.listdir(region) == []
    _done(out, rank, "collectives")


@pytest.mark.parametrize("world", [2, 3])
def test_shared_memory_collectives_equal_gloo(world, tmp_path):
    (tmp_path / "region").mkdir()
    spawn(_worker, (world, free_port(), str(tmp_path), "collectives"), nprocs=world)
    assert _said(tmp_path, world) == ["collectives"] * world


def _fsdp(rank: int, world: int, out: str) -> None:
    from models.training.distributed import DistInfo, wrap_for_training
    from tests.unit.models.test_sharded_update import policy, rows

    info = DistInfo(rank, world, rank, torch.device("cpu"))
    results = []
    for wanted in ("shm", "gloo"):
        os.environ[hc.ENV] = wanted
        hc.forget()
        model = wrap_for_training(policy(), info, "fsdp2", activation_checkpointing=True)
        used = {type(g._all_gather_comm).__name__ for m in model.modules() if hasattr(m, "_get_fsdp_state")
                for g in m._get_fsdp_state()._fsdp_param_groups}
        assert used == ({"_FsdpAllGather"} if wanted == "shm" else {"DefaultAllGather"}), used
        logp, _ = model(rows((rank, world)))
        (logp.sum() * (rank + 1)).backward()
        results.append((logp.detach(), {n: p.grad.to_local().clone() for n, p in model.named_parameters()}))
    (lp_shm, g_shm), (lp_gloo, g_gloo) = results
    assert torch.equal(lp_shm, lp_gloo)
    assert g_shm.keys() == g_gloo.keys() and all(torch.equal(g_shm[k], g_gloo[k]) for k in g_shm)
    _done(out, rank, f"fsdp {len(g_shm)} gradients")


def test_fsdp2_through_shared_memory_equals_gloo_bit_for_bit(tmp_path):
    """FSDP2's all-gathers (forward, and the backward's recompute under activation checkpointing) and its
    gradients' reduce-scatters through the region give gloo's log-probs and gradient shards exactly."""
    spawn(_worker, (2, free_port(), str(tmp_path), "fsdp"))
    said = _said(tmp_path, 2)
    # every parameter's gradient shard compared on both ranks (2 decoder layers, embeddings, norms, head)
    assert said[0] == said[1] and said[0].startswith("fsdp ") and int(said[0].split()[1]) >= 10, said


def _done(out: str, rank: int, what: str) -> None:
    """This rank reached the end of its checks (the test reads it: a rank that returned early would not say so)."""
    with open(os.path.join(out, f"done-{rank}"), "w") as f:
        f.write(what)


def _said(out, world: int) -> list:
    return [(out / f"done-{r}").read_text() if (out / f"done-{r}").exists() else None for r in range(world)]


def _worker(rank: int, world: int, port: int, out: str, case: str) -> None:
    join_gloo(rank, world, port)
    try:
        {"collectives": _collectives, "fsdp": _fsdp}[case](rank, world, out)
    finally:
        dist.destroy_process_group()

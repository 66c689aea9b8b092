"""AdamW's state committed per rank (``actor.optimizer_state_sharded``, ``models/optimizer_shards.py``) on two
gloo ranks under FSDP2, on S3 (moto): the bytes each rank writes and reads (``storage.count_bytes``) with
the cut and without, the reloaded state and the next update equal to the whole state's, and a clear error
when another number of ranks loads it."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from models import optimizer_state, storage
from models.checkpoint import CheckpointError
from models.distributed import DistInfo, full_state_dict, wrap_for_training
from models.update import make_optimizer
from tests.processes import free_port
from tests.unit.models.test_sharded_update import join_gloo, policy, train

pytestmark = pytest.mark.slow  # starts processes (make test-unit leaves it to make test)
LR = 1e-2


def _moved(fn) -> dict:
    """Bytes of optimizer-state files (``*.safetensors``) ``fn`` reads and writes, and of the AdamW moments
    in those it reads (the file less its header and step scalars); ``fn``'s result."""
    from benchmarks.iteration_bytes import overhead

    with storage.count_bytes() as records:
        out = fn()
    state = [t for t in records if t.url.endswith(".safetensors")]
    reads = [t for t in state if t.op == "read"]
    return {"read": sum(t.nbytes for t in reads), "write": sum(t.nbytes for t in state if t.op == "write"),
            "moments_read": sum(t.nbytes - overhead(t.url) for t in reads), "out": out}


def _worker(rank: int, world: int, port: int, root: str, out_dir: str) -> None:
    import torch.distributed as dist

    info = join_gloo(rank, world, port)
    try:
        model = wrap_for_training(policy(), info, "fsdp2")
        first = train(model, info, LR)["optimizer"]
        out = {}
        for name, sharded in (("whole", False), ("sharded", True)):
            url = storage.join(root, name, "actor-optimizer")
            out[f"{name}_save"] = _moved(lambda: optimizer_state.save(model, first, url, info, sharded=sharded))
        start = [p.to_local().detach().clone() for p in model.parameters()]
        weights = {}
        for name in ("whole", "sharded"):
            with torch.no_grad():  # both next updates start from the same weights
                for p, w in zip(model.parameters(), start):
                    p.to_local().copy_(w)
            again = make_optimizer(model, LR)
            url = storage.join(root, name, "actor-optimizer")
            out[f"{name}_load"] = _moved(lambda: optimizer_state.load(model, again, url, info))
            out[f"{name}_moments_equal"] = all(
                torch.equal(again.state[p][k].to_local(), first.state[p][k].to_local())
                for p in model.parameters() for k in ("exp_avg", "exp_avg_sq"))
            train(model, info, LR, optimizer=again)
            weights[name] = full_state_dict(model)
        out["next_update_equal"] = all(torch.equal(weights["whole"][k], weights["sharded"][k]) for k in weights["whole"])
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
    finally:
        dist.destroy_process_group()


def test_each_rank_moves_half_the_state_the_next_update_is_unchanged_another_rank_count_refused(s3_url, tmp_path):
    mp.spawn(_worker, args=(2, free_port(), s3_url, str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    whole = ranks[0]["whole_load"]["moments_read"]
    for r in ranks:
        assert r["whole_moments_equal"] and r["sharded_moments_equal"] and r["next_update_equal"]
        assert r["whole_load"]["out"] == r["sharded_load"]["out"] > 0  # the steps taken, carried either way
        # without the cut every rank reads the whole state; with it, only its own shard (half the moments)
        assert r["whole_load"]["moments_read"] == whole and r["sharded_load"]["moments_read"] == whole // 2
        assert r["sharded_save"]["write"] == r["sharded_load"]["read"]  # each rank writes the shard it reads
    # without the cut rank 0 writes the whole state alone
    assert (ranks[0]["whole_save"]["write"], ranks[1]["whole_save"]["write"]) == (ranks[0]["whole_load"]["read"], 0)
    print({f"rank {i}": {k: r[k] for k in ("whole_save", "sharded_save", "whole_load", "sharded_load")}
           for i, r in enumerate(ranks)})
    # one process cannot take two ranks' shards: refused, naming both counts
    model = wrap_for_training(policy(), DistInfo(0, 1, 0, torch.device("cpu")))
    with pytest.raises(CheckpointError, match=r"by \[2\] ranks; this update runs 1"):
        optimizer_state.load(model, make_optimizer(model, LR), storage.join(s3_url, "sharded", "actor-optimizer"))

"""AdamW's state committed per rank (``actor.optimizer_state_sharded`` and ``critic.optimizer_state_sharded``,
one code path: ``models/training/optimizer_shards.py``) on two gloo ranks under FSDP2, on S3 (moto), for the policy
and for a critic (value head on a token-classification trunk): the bytes each rank writes and reads
(``storage.count_bytes``) with the cut and without, the reloaded state and the next update equal to the
whole state's, and a clear error when another number of ranks loads it."""

from __future__ import annotations

import json
import os

import pytest
import torch

from models.training import optimizer_state

from models import storage
from models.checkpoint import CheckpointError
from models.training.distributed import DistInfo, full_state_dict, wrap_for_training
from models.training.policy import CriticValues
from models.training.update import critic_loss_fn, disable_dropout, make_optimizer, run_update
from tests.processes import free_port
from tests.ranks import spawn
from tests.unit.models.test_sharded_update import SETTINGS, join_gloo, policy, rows, train

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


def critic() -> CriticValues:
    """A two-layer Llama trunk with one label, as ``critic_update`` trains it (``AutoModelForTokenClassification``,
    dropout off: the classifier's would draw differently in the two next updates)."""
    from transformers import LlamaConfig, LlamaForTokenClassification

    torch.manual_seed(0)
    return CriticValues(disable_dropout(LlamaForTokenClassification(LlamaConfig(
        vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32, num_labels=1))), packed=True)


def train_values(model, info: DistInfo, lr: float, optimizer=None) -> dict:
    """The critic's clipped value regression on this rank's rows (:func:`train`'s counterpart)."""
    optimizer = optimizer or make_optimizer(model, lr)
    shard = (info.rank, info.world_size) if info.world_size > 1 else None
    return {"stats": run_update(model, optimizer, rows(shard), critic_loss_fn(0.2), SETTINGS, info),
            "optimizer": optimizer}


ROLES = {"actor": (policy, train), "critic": (critic, train_values)}
"""The model and the update of each role whose state can be committed per rank."""


def _worker(rank: int, world: int, port: int, root: str, out_dir: str, role: str) -> None:
    import torch.distributed as dist

    build, step = ROLES[role]
    info = join_gloo(rank, world, port)
    try:
        model = wrap_for_training(build(), info, "fsdp2")
        first = step(model, info, LR)["optimizer"]
        out = {}
        for name, sharded in (("whole", False), ("sharded", True)):
            url = storage.join(root, name, f"{role}-optimizer")
            out[f"{name}_save"] = _moved(lambda: optimizer_state.save(model, first, url, info, sharded=sharded))
        start = [p.to_local().detach().clone() for p in model.parameters()]
        weights = {}
        for name in ("whole", "sharded"):
            with torch.no_grad():  # both next updates start from the same weights
                for p, w in zip(model.parameters(), start):
                    p.to_local().copy_(w)
            again = make_optimizer(model, LR)
            url = storage.join(root, name, f"{role}-optimizer")
            out[f"{name}_load"] = _moved(lambda: optimizer_state.load(model, again, url, info))
            out[f"{name}_moments_equal"] = all(
                torch.equal(again.state[p][k].to_local(), first.state[p][k].to_local())
                for p in model.parameters() for k in ("exp_avg", "exp_avg_sq"))
            step(model, info, LR, optimizer=again)
            weights[name] = full_state_dict(model)
        out["next_update_equal"] = all(torch.equal(weights["whole"][k], weights["sharded"][k]) for k in weights["whole"])
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("role", list(ROLES))
def test_each_rank_moves_half_the_state_the_next_update_is_unchanged_another_rank_count_refused(role, s3_url,
                                                                                              tmp_path):
    spawn(_worker, (2, free_port(), s3_url, str(tmp_path), role))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    whole = ranks[0]["whole_load"]["moments_read"]
    for r in ranks:
        assert r["whole_moments_equal"] and r["sharded_moments_equal"] and r["next_update_equal"]
        assert r["whole_load"]["out"] == r["sharded_load"]["out"] > 0  # the steps taken, carried either way
        # without the cut every rank reads the whole state
        assert r["whole_load"]["moments_read"] == whole
        assert r["sharded_save"]["write"] == r["sharded_load"]["read"]  # each rank writes the shard it reads
    # with it, only its own shard: together the whole state once. FSDP2 splits each parameter's dim 0, so the
    # critic's value head (weight [1, 16], bias [1]) stays on rank 0: 2 moments × 17 floats × 4 B more there
    shards = [r["sharded_load"]["moments_read"] for r in ranks]
    assert sum(shards) == whole and shards[0] - shards[1] == {"actor": 0, "critic": 2 * 17 * 4}[role]
    # without the cut rank 0 writes the whole state alone
    assert (ranks[0]["whole_save"]["write"], ranks[1]["whole_save"]["write"]) == (ranks[0]["whole_load"]["read"], 0)
    print({f"rank {i}": {k: r[k] for k in ("whole_save", "sharded_save", "whole_load", "sharded_load")}
           for i, r in enumerate(ranks)})
    # one process cannot take two ranks' shards: refused, naming both counts
    build, _ = ROLES[role]
    model = wrap_for_training(build(), DistInfo(0, 1, 0, torch.device("cpu")))
    with pytest.raises(CheckpointError, match=rf"by \[2\] ranks; this update runs 1: .* or set "
                                              rf"{role}.keep_optimizer_state=false to restart AdamW"):
        optimizer_state.load(model, make_optimizer(model, LR), storage.join(s3_url, "sharded", f"{role}-optimizer"),
                             role=role)


def header(blob: bytes) -> dict:
    """A safetensors file's JSON header (tensor offsets and ``__metadata__``)."""
    n = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8:8 + n])


def test_one_process_commits_the_whole_state_either_way(s3_url):
    """The critic update on one process (its default): with ``critic.optimizer_state_sharded`` it commits
    the same single file as without (same size, tensors and metadata; safetensors writes the metadata's keys
    in no fixed order), and it loads back whole."""
    from safetensors.torch import load

    one = DistInfo(0, 1, 0, torch.device("cpu"))
    model = wrap_for_training(critic(), one)
    first = train_values(model, one, LR)["optimizer"]
    files = {}
    for sharded in (False, True):
        url = storage.join(s3_url, f"one-{sharded}", "critic-optimizer")
        optimizer_state.save(model, first, url, one, sharded=sharded)
        files[sharded] = {f: storage.read_bytes(storage.join(url, f)) for f in storage.list_files(url)
                          if f.endswith(".safetensors")}
    assert list(files[True]) == list(files[False]) == [optimizer_state.FILE]
    whole, flagged = files[False][optimizer_state.FILE], files[True][optimizer_state.FILE]
    assert len(whole) == len(flagged) and header(whole) == header(flagged)
    a, b = load(whole), load(flagged)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    again = make_optimizer(model, LR)
    assert optimizer_state.load(model, again, storage.join(s3_url, "one-True", "critic-optimizer"), one) > 0

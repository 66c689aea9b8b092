"""The engine's copy kept per rank (models/training/weight_shadow.py) under FSDP2 on two gloo ranks: after a full
push fills it, a few elements changed on each rank travel as a delta whose positions, applied onto the old whole
tensor, give the new whole tensor (gathered the plain way) bit for bit, with samples that hold its bits, and so
does the next delta against it, the tensors' collectives made one by one instead of together; one rank
alone (no FSDP2) the same against the tensor itself. Elements moved by one or a few units in bfloat16's last place
travel as steps of their bits (one bit or one byte each), added onto the old tensor, the few moved further as
exceptions (their values); a few elements changed travel as their values."""

from __future__ import annotations

import os

import pytest
import torch

from models.engines.weight_delta import FULL, RAW, SIGN, STEP8, decode, stepped
from models.engines.weight_stream import bits
from models.training.distributed import DistInfo
from models.training import weight_shadow
from models.training.weight_shadow import Shadow
from models.training.weight_source import WeightSource
from tests.processes import free_port
from tests.ranks import spawn
from tests.unit.models.test_sharded_update import join_gloo

BF16 = torch.bfloat16


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 7), torch.nn.Linear(7, 3))  # 7 rows: 4 + 3; 3 rows: 2 + 1


def _whole(source: WeightSource) -> dict:
    return {n: t for n, t in source.gathered(torch.device("cpu"), BF16)}


def _rebuilt(old: dict, new: dict, deltas: list, changed: int, mode: int = RAW) -> dict:
    """Each tensor of ``old`` with its delta applied (checking the deltas' counts, encodings and samples on the way):
    what an engine holding ``old`` holds after the push."""
    assert sum(d.changed for _, d in deltas) == changed
    sparse = [d.code for _, d in deltas if d.code != FULL]  # (a tensor of a few elements travels whole)
    assert sparse and all(code & ~15 == mode for code in sparse), sparse
    out = {}
    for name, d in deltas:
        rebuilt = old[name].clone().reshape(-1)
        patch = decode(d.code, d.payload, list(new[name].shape), BF16, d.changed)
        if patch.indices is None:
            rebuilt = patch.values.reshape(-1)
        else:
            rebuilt[patch.indices] = stepped(rebuilt[patch.indices], patch)
        positions, sampled = d.samples
        assert torch.equal(sampled, bits(new[name].reshape(-1)[positions])), name
        out[name] = rebuilt
    return out


def _same_bits(rebuilt: dict, new: dict) -> list:
    """The tensors whose rebuilt bits differ from the new ones (none: the engine holds the trainer's cast weights)."""
    return [n for n in new if not torch.equal(bits(rebuilt[n]), bits(new[n]))]


def _bump(model: torch.nn.Module, ulps: int = 0) -> int:
    """Add 1 to the first element each rank holds of every parameter (``ulps``: move every element by that many
    bfloat16 values up, the first by 1 more: an exception to the steps); the count changed."""
    n = 0
    with torch.no_grad():
        for p in model.parameters():
            local = (p.to_local() if hasattr(p, "to_local") else p).view(-1)
            if not local.numel():
                continue
            if not ulps:
                local[0] += 1.0
                n += 1
                continue
            x = local.to(BF16)
            for _ in range(ulps):
                x = torch.nextafter(x, torch.full_like(x, float("inf")))
            local.copy_(x.float())
            local[0] += 1.0
            n += local.numel()
    return n


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    info = join_gloo(rank, world, port)
    try:
        model = _model()
        fully_shard(model)
        source, shadow = WeightSource(model, info, prefix=""), Shadow()
        old = _whole(source.keeping(shadow.keep))  # a full push, kept per rank
        bumped = torch.tensor([_bump(model, ulps=1)])
        dist.all_reduce(bumped)
        deltas = list(shadow.deltas(source, BF16, push=5))
        new = _whole(source)
        if info.is_main:
            assert _same_bits(_rebuilt(old, new, deltas, int(bumped), SIGN), new) == []  # steps +1 (a bit each)
            assert all(d is not None for _, d in deltas)
        else:
            assert all(d is None for _, d in deltas)
        weight_shadow.GROUP_ELEMENTS = 1  # a second delta, against the first, each tensor's collectives its own
        bumped = torch.tensor([_bump(model)])
        dist.all_reduce(bumped)
        deltas, newer = list(shadow.deltas(source, BF16, push=6)), _whole(source)
        if info.is_main:
            assert _same_bits(_rebuilt(new, newer, deltas, int(bumped), RAW), newer) == []  # values
        open(os.path.join(out, f"ok{rank}"), "w").close()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # starts two ranks
def test_a_delta_from_two_fsdp2_ranks_rebuilds_the_whole_tensor(tmp_path):
    spawn(_worker, (2, free_port(), str(tmp_path)))
    assert sorted(os.listdir(tmp_path)) == ["ok0", "ok1"]


@pytest.mark.parametrize("one_pass", [True, False], ids=["one-pass", "separate-passes"])
@pytest.mark.parametrize("ulps,mode", [(0, RAW), (1, SIGN), (3, STEP8)])
def test_a_delta_from_one_rank_rebuilds_the_tensor(ulps, mode, one_pass, monkeypatch):
    """... by the C loop, and by torch's separate passes (no C compiler: the loop does not apply)."""
    if not one_pass:
        monkeypatch.setattr(weight_shadow, "changed_steps", lambda *a, **k: None)
    model = _model()
    source, shadow = WeightSource(model, DistInfo(0, 1, 0, torch.device("cpu")), prefix=""), Shadow()
    old = _whole(source.keeping(shadow.keep))
    changed = _bump(model, ulps)
    new = _whole(source)
    assert _same_bits(_rebuilt(old, new, list(shadow.deltas(source, BF16, push=1)), changed, mode), new) == []

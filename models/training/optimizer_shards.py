"""AdamW's moments committed per rank (``actor.optimizer_state_sharded``): under FSDP2 each rank writes and
reads only its own shard of every moment, instead of rank 0 writing the whole state and every rank reading
all of it (``models/training/optimizer_state.py``)::

    iter-000007/actor-optimizer/    rank-00000-of-00002.safetensors, rank-00001-of-00002.safetensors,
                                    COMMITTED.json

Each file holds ``{param}.exp_avg``, ``{param}.exp_avg_sq`` (the rank's local DTensor shard, float32 as
the parameters) and ``{param}.step``. With n ranks a node reads O/n bytes instead of O: the largest term
of a stateless iteration at scale (``benchmarks/project_iteration.py``). The price: the state can only be
loaded by the same number of ranks sharding the same model the same way; another rank count is refused
with an error naming both counts (``actor.keep_optimizer_state=false``, or the critic's, restarts AdamW instead).
"""

from __future__ import annotations

import os
import tempfile
import uuid
from typing import Dict, Optional

import torch
import torch.distributed as dist
from torch import nn

from models import storage
from models.checkpoint import CheckpointError, commit_uploaded, file_digest, read_marker
from models.training.distributed import DistInfo

FORMAT = "adamw-moments-sharded-1"
MOMENTS = ("exp_avg", "exp_avg_sq")


def shard_file(rank: int, world: int) -> str:
    return f"rank-{rank:05d}-of-{world:05d}.safetensors"


def is_sharded_state(files) -> bool:
    """Whether a committed optimizer folder's ``files`` are per-rank shards."""
    return any(f.startswith("rank-") and f.endswith(".safetensors") for f in files)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` on the CPU (a DTensor's local shard; a plain tensor whole)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.detach().cpu().contiguous()


def save(params: Dict[str, nn.Parameter], optimizer: torch.optim.Optimizer, url: str, info: DistInfo) -> None:
    """Every rank uploads its shard to a staging folder; rank 0 commits the folder with all digests."""
    from safetensors.torch import save_file

    state: Dict[str, torch.Tensor] = {}
    for name, p in params.items():
        st = optimizer.state.get(p)
        if st:
            state.update({f"{name}.{k}": _local(st[k]) for k in MOMENTS})
            state[f"{name}.step"] = torch.as_tensor(st["step"], dtype=torch.float32).detach().cpu().reshape(())
    box = [f"{url.rstrip('/')}.tmp-{uuid.uuid4().hex[:12]}" if info.is_main else None]
    dist.broadcast_object_list(box, src=0)
    rel = shard_file(info.rank, info.world_size)
    with tempfile.TemporaryDirectory(prefix="optimizer-shard-") as tmp:
        path = os.path.join(tmp, rel)
        save_file(state, path, metadata={"format": FORMAT, "optimizer": type(optimizer).__name__,
                                         "rank": str(info.rank), "world": str(info.world_size)})
        digest = file_digest(path)
        storage.put_file(path, storage.join(box[0], rel))
    digests = [None] * info.world_size
    dist.all_gather_object(digests, (rel, digest))
    if info.is_main:
        commit_uploaded(box[0], url, dict(digests))
    dist.barrier()  # the state is committed before any rank reports the update done


def load(params: Dict[str, nn.Parameter], optimizer: torch.optim.Optimizer, url: str, info: DistInfo,
         capturable: bool, role: str = "actor") -> Optional[int]:
    """Set ``optimizer``'s state from this rank's committed shard; the steps it had taken, or None (fresh)
    when the shard does not fit. Raises :class:`CheckpointError` when another number of ranks saved it
    (naming ``role``'s setting that restarts AdamW)."""
    from safetensors import safe_open

    marker = read_marker(url)
    worlds = {int(f.split("-of-")[1].split(".")[0]) for f in marker["files"] if f.startswith("rank-")}
    if worlds != {info.world_size}:
        raise CheckpointError(f"optimizer state {url} was saved per rank by {sorted(worlds)} ranks; this update "
                              f"runs {info.world_size}: run it on the same number of ranks, or set "
                              f"{role}.keep_optimizer_state=false to restart AdamW")
    rel = shard_file(info.rank, info.world_size)
    with tempfile.TemporaryDirectory(prefix="optimizer-shard-") as tmp:
        path = storage.local_path(storage.join(url, rel)) if storage.is_local(url) else os.path.join(tmp, rel)
        if not storage.is_local(url):
            storage.get_file(storage.join(url, rel), path)
        if file_digest(path) != marker["files"][rel]:
            raise CheckpointError(f"optimizer state {url}: {rel} fails its digest check (changed after commit)")
        with safe_open(path, framework="pt") as f:
            return _fill(params, optimizer, f, url, capturable)


def _fill(params, optimizer, f, url: str, capturable: bool) -> Optional[int]:
    want = {f"{n}.{k}" for n in params for k in (*MOMENTS, "step")}
    if set(f.keys()) != want or (f.metadata() or {}).get("optimizer") != type(optimizer).__name__:
        print(f"optimizer state {url} does not fit this model or optimizer: AdamW starts from zero", flush=True)
        return None
    loaded, steps = {}, 0
    for name, p in params.items():
        local = p.to_local() if hasattr(p, "to_local") else p
        st = {k: f.get_tensor(f"{name}.{k}") for k in MOMENTS}
        if any(tuple(t.shape) != tuple(local.shape) for t in st.values()):
            print(f"optimizer state {url}: {name}'s shard does not fit this rank's: AdamW starts from zero", flush=True)
            return None
        st = {k: _as_param(t, p) for k, t in st.items()}
        step = f.get_tensor(f"{name}.step").to(torch.float32)
        st["step"] = step.to(local.device) if capturable else step
        loaded[p] = st
        steps = max(steps, int(step.item()))
    optimizer.state.update(loaded)
    return steps


def _as_param(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The shard ``local`` as ``p`` holds its state: a DTensor with ``p``'s mesh, placements and shape."""
    ref = p.to_local() if hasattr(p, "to_local") else p
    local = local.to(device=ref.device, dtype=ref.dtype)
    if hasattr(p, "device_mesh"):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    return local

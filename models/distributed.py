"""Process-group set-up and model wrapping for the elastic update (torchrun / Flyte ``Elastic``).

CPU: gloo + DDP. GPU: NCCL + FSDP2 (``fully_shard`` per decoder layer, then the root).
Outside a launcher (plain calls, unit tests) everything degrades to a single process.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
from dataclasses import dataclass
from typing import Dict, Iterator

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed() -> DistInfo:
    """Join the process group torchrun/elastic set up (``RANK``/``WORLD_SIZE`` in the env), if any."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{local_rank}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if cuda else "gloo"
        store = _attempt_store(world)
        if store is None:
            dist.init_process_group(backend=backend)
        else:
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world)
    return DistInfo(rank, world, local_rank, device)


def _attempt_store(world: int):
    """The elastic agent's store under a prefix per worker-group attempt, or None (plain env://).

    Torch elastic keeps one agent-hosted store across restarts of the worker group, and the
    process group's keys carry no attempt in their names: a restarted rank could read the
    address a dead rank of the previous attempt published and fail ("Gloo connectFullMesh
    failed ... Connection refused") or hang. The prefix keeps each attempt to itself.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=dt.timedelta(minutes=30))
    return dist.PrefixStore(f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def shutdown_distributed(failed: bool = False) -> None:
    """Leave the process group; after a failure skip the barrier so the error surfaces."""
    if dist.is_initialized():
        if not failed:
            dist.barrier()
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (identity in a single process). Works on a copy."""
    t = t.detach().clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        backend_cpu = dist.get_backend() == "gloo"
        moved = t.cpu() if backend_cpu else t
        dist.all_reduce(moved, op=dist.ReduceOp.SUM)
        t = moved.to(t.device)
    return t


def all_reduce_mean_dict(stats: Dict[str, float]) -> Dict[str, float]:
    """Average scalar statistics over ranks, keys in a fixed order."""
    if not stats:
        return {}
    keys = sorted(stats)
    vec = all_reduce_sum(torch.tensor([float(stats[k]) for k in keys], dtype=torch.float64))
    world = dist.get_world_size() if dist.is_initialized() else 1
    return {k: float(v) / world for k, v in zip(keys, vec)}


def wrap_for_training(module: nn.Module, info: DistInfo) -> nn.Module:
    """DDP on CPU / single-GPU-per-rank without sharding; FSDP2 on CUDA."""
    module = module.to(info.device)
    if info.world_size == 1:
        return module
    if info.device.type == "cuda":
        from torch.distributed.fsdp import fully_shard

        lm = getattr(module, "lm", module)  # a causal LM, or a peft model around one (LoRA)
        trunk = lm.get_decoder() if hasattr(lm, "get_decoder") else getattr(lm, "model", None)
        for layer in getattr(trunk, "layers", []):
            fully_shard(layer)  # frozen base and trainable adapters share a unit: FSDP2 allows mixed requires_grad
        fully_shard(module)
        return module
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(module)


@contextlib.contextmanager
def no_grad_sync(module: nn.Module, active: bool) -> Iterator[None]:
    """Skip the gradient all-reduce on accumulation micro-batches (DDP ``no_sync``; FSDP2 flag)."""
    if not active:
        yield
        return
    if hasattr(module, "no_sync"):
        with module.no_sync():
            yield
        return
    if hasattr(module, "set_requires_gradient_sync"):
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
        return
    yield


def unwrap(module: nn.Module) -> nn.Module:
    return module.module if hasattr(module, "module") and isinstance(module, nn.parallel.DistributedDataParallel) else module


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def full_state_dict(module: nn.Module, info: DistInfo):
    """Unsharded weights on CPU for saving (collective under FSDP2; None means "use the module's own")."""
    if info.world_size == 1 or info.device.type != "cuda":
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

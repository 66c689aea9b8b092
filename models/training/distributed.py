"""Process-group set-up and model wrapping for the elastic update (torchrun / Flyte ``Elastic``).

Sharding (``actor.sharding``): FSDP2 (``fully_shard`` per decoder layer, then the root) or DDP;
``auto`` picks FSDP2 on GPUs (NCCL) and DDP on CPU (gloo), where FSDP2 runs too. Lower-precision
compute keeps float32 master weights: FSDP2 casts the gathered parameters to the compute dtype
(``MixedPrecisionPolicy``, gradients reduced in float32); DDP and one process run the forward
under ``torch.autocast``. Outside a launcher (plain calls, unit tests) everything degrades to a
single process.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import time
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from models import memory


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_JOINED = False
"""Whether this process made the default process group (:func:`join_process_group`), and so leaves it."""


def join_process_group(**kwargs) -> None:
    """``dist.init_process_group(**kwargs)``, remembered: :func:`shutdown_distributed` leaves only this group. A
    trainer's rank, it first gives glibc's heap a fixed mmap threshold (:func:`models.memory.bound_heap`)."""
    global _JOINED
    memory.bound_heap()
    dist.init_process_group(**kwargs)
    _JOINED = True


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
            join_process_group(backend=backend)
        else:
            join_process_group(backend=backend, store=store, rank=rank, world_size=world)
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
    """Leave the process group :func:`join_process_group` made; after a failure skip the barrier so the
    error surfaces. A group this process did not make is its maker's: the single-worker actor update runs
    in the process of a local run, whose in-process vLLM engine made a world of one, and destroying it
    made the engine's own shutdown fail ("vLLM shutdown: Invalid process group specified")."""
    global _JOINED
    if _JOINED and dist.is_initialized():
        if not failed:
            dist.barrier()
        from models.training.host_collectives import forget

        forget()
        settle_gloo_threads()
        dist.destroy_process_group()
    _JOINED = False


GLOO_SETTLE_S = 0.2


def settle_gloo_threads() -> None:
    """Before a gloo process group can be destroyed: this thread sleeps :data:`GLOO_SETTLE_S`, the GIL released, so
    that gloo's worker threads finish freeing the works they ran. A worker thread frees a work's tensors after the
    caller's ``wait`` returned, and a tensor Python still knew needs the GIL for that; the group's destructor joins
    those threads, and it ran with the GIL held when the last reference to the group (DDP's reducer keeps one) went
    with the model: a rank of a two-rank DDP test then waited for ever (observed 2026-12-01 in ``make test``: the
    main thread in ``~ProcessGroupGloo`` joining, a worker thread in ``~AsyncAllreduceWork`` waiting for the GIL)."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        time.sleep(GLOO_SETTLE_S)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (identity in a single process). Works on a copy."""
    t = t.detach().clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        backend_cpu = dist.get_backend() == "gloo"
        moved = t.cpu() if backend_cpu else t
        dist.all_reduce(moved, op=dist.ReduceOp.SUM)
        t = moved.to(t.device)
    return t


def from_main(value, group=None):
    """Rank 0's ``value`` on every rank (a small Python object; itself in a single process). A collective (of
    ``group``: default, the process group)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def waiting_group(timeout_s: float):
    """A gloo group of every rank with a timeout of its own, ``timeout_s``: for the other ranks to wait on rank 0
    while it waits on something outside the group (a service), in no collective of the process group meanwhile,
    whose timeout (NCCL's watchdog) would end them first. None in a single process. Every rank makes it together."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return None
    return dist.new_group(backend="gloo", timeout=dt.timedelta(seconds=timeout_s))


def all_reduce_mean_dict(stats: Dict[str, float]) -> Dict[str, float]:
    """Average scalar statistics over ranks, keys in a fixed order; a key ending in ``_max`` takes the largest."""
    if not stats:
        return {}
    keys = sorted(k for k in stats if not k.endswith("_max"))
    tops = sorted(k for k in stats if k.endswith("_max"))
    vec = all_reduce_sum(torch.tensor([float(stats[k]) for k in keys], dtype=torch.float64))
    world = dist.get_world_size() if dist.is_initialized() else 1
    out = {k: float(v) / world for k, v in zip(keys, vec)}
    if tops:
        top = torch.tensor([float(stats[k]) for k in tops], dtype=torch.float64)
        if dist.is_initialized() and world > 1:
            dist.all_reduce(top, op=dist.ReduceOp.MAX)
        out.update({k: float(v) for k, v in zip(tops, top)})
    return out


SHARDINGS = ("auto", "fsdp2", "ddp")


def uses_fsdp2(sharding: str, info: DistInfo) -> bool:
    """Whether ``sharding`` (one of :data:`SHARDINGS`) means FSDP2 for these ranks: ``fsdp2``, or
    ``auto`` on CUDA, over two ranks or more; ``fsdp2`` also on one rank with a process group (the GPU
    benchmark's single-GPU case), never in a plain process."""
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {SHARDINGS}, got {sharding!r}")
    if sharding == "fsdp2":
        return info.world_size > 1 or dist.is_initialized()
    return sharding == "auto" and info.device.type == "cuda" and info.world_size > 1


def _inner(module: nn.Module) -> nn.Module:
    """The model a training wrapper holds (``lm`` or ``critic``; peft or not), or ``module`` itself."""
    return next((getattr(module, a) for a in ("lm", "critic") if hasattr(module, a)), module)


def decoder_layers(module: nn.Module) -> List[nn.Module]:
    """The decoder layers of the model ``module`` wraps (FSDP2's units, the checkpointed blocks); none if it has no
    ``layers`` trunk."""
    inner = _inner(module)
    trunk = inner.get_decoder() if hasattr(inner, "get_decoder") else getattr(inner, "model", None)
    return list(getattr(trunk, "layers", []))


def checkpoint_activations(module: nn.Module) -> None:
    """Activation checkpointing per decoder layer (``actor.activation_checkpointing``): in training mode each layer
    keeps only its input and recomputes the rest in the backward (Chen et al. 2016, "Training Deep Nets with
    Sublinear Memory Cost"), through Hugging Face's ``gradient_checkpointing_enable`` with torch's non-reentrant
    checkpoint. It marks the layers and replaces no module, so parameter names, state dicts and FSDP2's units stay
    as they are; the recompute runs inside the layer's call, after FSDP2's hooks gather the layer again. Gradients
    are those of the plain forward (the same operations, recomputed); forwards in eval mode keep everything. A
    model without the support (or without decoder layers) is a :class:`ValueError` naming it."""
    inner = _inner(module)
    if not getattr(inner, "supports_gradient_checkpointing", False) or not decoder_layers(module):
        raise ValueError(f"activation_checkpointing: {type(inner).__name__} has no decoder layers that Hugging Face's "
                         f"gradient checkpointing marks; set actor.activation_checkpointing (critic.*) to false")
    inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    unmarked = [i for i, layer in enumerate(decoder_layers(module)) if not getattr(layer, "gradient_checkpointing", 0)]
    if unmarked:
        raise ValueError(f"activation_checkpointing: decoder layers {unmarked} of {type(inner).__name__} were not "
                         f"checkpointed")


def sparse_tied_embedding_grads(module: nn.Module) -> bool:
    """The input embedding of the model ``module`` wraps made to give a sparse gradient (``nn.Embedding.sparse``)
    when it trains and is tied to the output head; whether it was.

    Its backward otherwise makes a dense ``[vocab, hidden]`` gradient, zeros but for the rows of the batch's
    tokens, which autograd then adds to the head's own dense gradient of the same weight: at Qwen3-0.6B's
    151,936 x 1,024 a second float32 copy of the embedding (0.62 GB a rank) at the end of every micro-batch's
    backward, beside the head's gradient and their sum, the moment of a sharded update's peak
    (benchmarks/RESULTS.md, 2026-12-01). The sparse one holds only those rows; autograd adds it to the head's,
    so the weight's gradient is dense as before: FSDP2, clipping and AdamW see what they saw. An untied embedding
    keeps its dense gradient: alone, a sparse one would reach them. :func:`wrap_for_training` does not call it under
    DDP, whose reducer, seeing a sparse embedding, expects the weight's gradient sparse."""
    inner = _inner(module)
    if not hasattr(inner, "get_input_embeddings") or not hasattr(inner, "get_output_embeddings"):
        return False
    embedding, head = inner.get_input_embeddings(), inner.get_output_embeddings()
    if (not isinstance(embedding, nn.Embedding) or head is None or getattr(head, "weight", None) is not embedding.weight
            or not embedding.weight.requires_grad):
        return False
    embedding.sparse = True
    return True


def wrap_for_training(module: nn.Module, info: DistInfo, sharding: str = "auto",
                      compute_dtype: torch.dtype = torch.float32, activation_checkpointing: bool = False,
                      held_dtype: torch.dtype = torch.float32, frozen: bool = False) -> nn.Module:
    """``module`` (a training wrapper of :mod:`models.training.policy`, float32 where it trains) ready to train
    on ``info.device``: FSDP2-sharded, in DDP, or itself for one process (see :data:`SHARDINGS`).

    ``compute_dtype`` below float32: forwards compute in it, the trained weights, their gradients
    and AdamW's state stay float32 (FSDP2's mixed precision, else the wrapper's autocast).
    ``activation_checkpointing``: each decoder layer checkpointed first (:func:`checkpoint_activations`). A tied
    input embedding of a model that trains gives sparse gradients (:func:`sparse_tied_embedding_grads`; not
    under DDP).
    ``held_dtype`` (FSDP2): the dtype ``module``'s weights are in, when not float32 (a frozen model held at its
    checkpoint's bfloat16): each unit's weights cast to ``compute_dtype`` as they are gathered. ``frozen`` (FSDP2:
    a model that only runs forwards): the root unit (embeddings, head) resharded after each forward, as the others
    are; FSDP2 keeps a trained model's root gathered from its forward to its backward, which for a model that never
    runs a backward held the whole embedding on every rank from one forward to the next (2.1 GB a rank at 8B)."""
    low = compute_dtype != torch.float32 or held_dtype != compute_dtype
    if not frozen and (uses_fsdp2(sharding, info) or info.world_size == 1):  # DDP's reducer wants sparse ones
        sparse_tied_embedding_grads(module)
    if activation_checkpointing:
        checkpoint_activations(module)
    if uses_fsdp2(sharding, info):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # fully_shard moves each unit's parameters to the mesh's device as it shards them: no rank
        # ever holds the whole model on the accelerator.
        mesh = init_device_mesh(info.device.type, (info.world_size,))
        mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32) if low else None
        kw = {"mesh": mesh, **({"mp_policy": mp} if mp else {})}
        for layer in decoder_layers(module):
            fully_shard(layer, **kw)  # frozen base and trainable adapters share a unit: FSDP2 allows mixed requires_grad
        fully_shard(module, **kw, **({"reshard_after_forward": True} if frozen else {}))  # the rest: embeddings,
        # final norm, head, and every buffer
        if info.device.type == "cpu":
            from models.training.host_collectives import use_host_collectives

            use_host_collectives(module, mesh.get_group())  # ranks of one host: through shared memory, not gloo
        return module
    if low:
        module.autocast_dtype = compute_dtype
    module = module.to(info.device)
    if info.world_size == 1:
        return module
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(module, device_ids=ddp_device_ids(info))


def ddp_device_ids(info: DistInfo) -> Optional[List[int]]:
    """DDP's ``device_ids``: this rank's GPU on CUDA (``[local index]``: DDP's rule for a module on one
    GPU, which it then runs and feeds there), None for a CPU module (its rule too)."""
    return [info.device.index] if info.device.type == "cuda" else None


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` is FSDP2-sharded (its parameters are DTensor shards)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


@contextlib.contextmanager
def no_grad_sync(module: nn.Module, active: bool) -> Iterator[None]:
    """Skip DDP's gradient all-reduce on accumulation micro-batches (``no_sync``: a DDP rank holds whole
    gradients either way). FSDP2 reduce-scatters after every micro-batch and accumulates the sharded gradients:
    its ``set_requires_gradient_sync(False)`` would keep every unit's gradient unsharded until the last
    micro-batch, a whole float32 gradient of the model on each rank (+2.4 GB a rank at 0.6B, 280 GB at 70B)
    where the sharded one is 1/world of it. The peers (veRL, NeMo-RL) reduce-scatter per micro-batch too."""
    if active and hasattr(module, "no_sync"):
        with module.no_sync():
            yield
        return
    yield


def unwrap(module: nn.Module) -> nn.Module:
    return module.module if hasattr(module, "module") and isinstance(module, nn.parallel.DistributedDataParallel) else module


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def full_state_dict(module: nn.Module):
    """Unsharded weights on CPU for saving (collective under FSDP2; None means "use the module's own")."""
    if not is_sharded(module):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

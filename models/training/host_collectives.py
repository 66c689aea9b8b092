"""All-gathers and reduce-scatters between the CPU ranks of one host through a shared-memory region.

FSDP2 on CPU runs its collectives through gloo, whose transport between two processes of one host is TCP over
loopback: each byte is copied through the kernel's socket buffers, 0.6-0.85 GB/s between two ranks on this
project's 2-core machine (``benchmarks/bench_host_collectives.py``). Every micro-batch of a sharded update
all-gathers the whole model twice (forward, backward) and reduce-scatters its gradient once: at Qwen3-0.6B's
shape in float32, 2.4 GB each, ~3 s each through gloo. Ranks of one host can instead write their part into one
shared region and read the others' parts from it, at the speed of memory; this is what oneCCL and vLLM's CPU
communicator do between the ranks of a host.

:class:`HostCollectives` holds a region of :data:`REGION_BYTES` (``/dev/shm``, unlinked once every rank mapped it,
so nothing is left behind whatever ends the processes; a container's 64 MB ``/dev/shm`` holds it), cut into two
halves used in turn, each with one slot per rank. A collective moves its tensor through the region in pieces of a
slot: each rank writes its piece into its slot, the ranks meet at a barrier of the process group (gloo's: a rank
that died ends the others' wait as it ends any collective of theirs), then each reads what it needs from every
slot. Alternating halves makes one barrier a piece enough: a rank writes a half again only after the barrier of
the piece in between, which every rank reaches after reading that half. Results equal gloo's bit for bit for two
ranks (a sum of two terms does not depend on their order); with more, every rank sums the parts in rank order.

:func:`use_host_collectives` gives an FSDP2 model's units these collectives (``set_custom_all_gather``,
``set_custom_reduce_scatter``), and :func:`full_tensor` gathers a row-sharded DTensor through them (the weights a
colocated engine loads). Ranks on several hosts, GPUs, a ``/dev/shm`` that cannot hold the region, or
``FLYTE_RLHF_CPU_COLLECTIVES=gloo`` keep the process group's own collectives.
"""

from __future__ import annotations

import atexit
import os
import socket
import uuid
from typing import Dict, Optional

import torch
import torch.distributed as dist
from torch import nn

REGION_BYTES = 32 << 20
"""The shared region of a group: two halves of one slot per rank (8 MiB slots for two ranks)."""
ENV = "FLYTE_RLHF_CPU_COLLECTIVES"
"""``gloo`` keeps gloo's collectives between CPU ranks of one host (default: ``shm``)."""
DIRECTORY = "/dev/shm"

_HOSTS: Dict[dist.ProcessGroup, Optional["HostCollectives"]] = {}


class HostCollectives:
    """The shared region of ``group``'s ranks (see the module docstring). Made by :meth:`open`, on every rank."""

    def __init__(self, group: dist.ProcessGroup, region: torch.Tensor):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.slot = region.numel() // (2 * self.world) // 64 * 64  # bytes of one rank's slot in one half
        self.halves = [region[h * self.world * self.slot:(h + 1) * self.world * self.slot].view(self.world, self.slot)
                       for h in range(2)]
        self.pieces = 0  # pieces moved so far: the half the next one uses

    @classmethod
    def open(cls, group: dist.ProcessGroup, region_bytes: int = REGION_BYTES,
             directory: str = DIRECTORY) -> Optional["HostCollectives"]:
        """The region of ``group``'s ranks, or None where they cannot share one (several hosts, no room in
        ``directory``); every rank of ``group`` calls it, and all get a region or all get None."""
        rank = dist.get_rank(group)
        hosts = [None] * dist.get_world_size(group)
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        if len(set(hosts)) != 1:
            return None
        path = None
        if rank == 0:
            path = _made(directory, region_bytes)
        box = [path]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        path = box[0]
        mapped = _mapped(path, region_bytes) if path else None
        ok = torch.tensor([0 if mapped is None else 1], dtype=torch.int32)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)  # every rank mapped it (the barrier before unlink)
        if rank == 0 and path:
            os.unlink(path)  # the pages live while a rank maps them; nothing named is left
        if not int(ok):
            return None
        return cls(group, mapped)

    def _half(self) -> torch.Tensor:
        half = self.halves[self.pieces % 2]
        self.pieces += 1
        return half

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """``output`` = every rank's ``input`` one after another (``all_gather_into_tensor``); ``input`` may be
        this rank's part of ``output`` itself (FSDP2 copies its shard there first)."""
        src = _bytes(input)
        out = _bytes(output).view(self.world, src.numel())
        own = out[self.rank].data_ptr() == src.data_ptr()
        for o in range(0, src.numel(), self.slot):
            c = min(self.slot, src.numel() - o)
            half = self._half()
            half[self.rank, :c].copy_(src[o:o + c])
            dist.barrier(group=self.group)
            for j in range(self.world):
                if not (own and j == self.rank):
                    out[j, o:o + c].copy_(half[j, :c])

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        """``output`` = the sum (``op`` SUM) or mean (AVG) over ranks of this rank's part of ``input``
        (``reduce_scatter_tensor``: rank j's part is ``input``'s j-th of ``world`` equal pieces), summed in rank
        order in ``output``'s dtype."""
        avg = op == dist.ReduceOp.AVG
        if not (avg or op == dist.ReduceOp.SUM):
            raise ValueError(f"host collectives reduce by SUM or AVG, not {op}")
        n = output.numel()
        if input.numel() != n * self.world or input.dtype != output.dtype:
            raise ValueError(f"reduce_scatter: input of {input.numel()} {input.dtype} for an output of {n} "
                             f"{output.dtype} over {self.world} ranks")
        parts = input.reshape(self.world, n)
        flat = output.view(-1)
        step = self.slot // self.world // output.element_size()  # elements of each rank's part in one piece
        for o in range(0, n, step):
            c = min(step, n - o)
            half = self._half()
            mine = half[self.rank, :self.world * step * output.element_size()].view(output.dtype).view(self.world, step)
            mine[:, :c].copy_(parts[:, o:o + c])
            dist.barrier(group=self.group)
            pieces = [half[j, :self.world * step * output.element_size()].view(output.dtype)
                      [self.rank * step:self.rank * step + c] for j in range(self.world)]
            acc = flat[o:o + c]
            torch.add(pieces[0], pieces[1], out=acc)
            for p in pieces[2:]:
                acc.add_(p)
        if avg:
            output.div_(self.world)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("host collectives move contiguous tensors")
    return t.reshape(-1).view(torch.uint8)


def _made(directory: str, nbytes: int) -> Optional[str]:
    """A file of ``nbytes`` in ``directory`` with its pages reserved (a full tmpfs fails here, not with SIGBUS at
    the first write), or None."""
    path = os.path.join(directory, f"flyte-rlhf-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return path
    except OSError:
        os.unlink(path)
        return None
    finally:
        os.close(fd)


def _mapped(path: str, nbytes: int) -> Optional[torch.Tensor]:
    """The file at ``path`` mapped shared as a tensor of ``nbytes`` bytes, or None. torch's storage owns the mapping
    (and unmaps it when freed): a tensor over a Python ``mmap`` object released that object from its deleter, which
    at interpreter exit aborted a rank now and then ("free(): invalid pointer")."""
    try:
        return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    except (OSError, RuntimeError):
        return None


def host_collectives(group: dist.ProcessGroup) -> Optional[HostCollectives]:
    """``group``'s :class:`HostCollectives`, opened on the first call (a collective: every rank of ``group`` makes
    that call at the same point), None where they do not apply (see the module docstring)."""
    if group not in _HOSTS:
        wanted = os.environ.get(ENV, "shm")
        if wanted not in ("shm", "gloo"):
            raise ValueError(f"{ENV}={wanted!r}: use shm (the default) or gloo")
        cpu = dist.get_backend(group) == "gloo"
        _HOSTS[group] = HostCollectives.open(group) if cpu and wanted == "shm" and dist.get_world_size(group) > 1 \
            else None
    return _HOSTS[group]


def forget() -> None:
    """Drop every group's region (the process group is being destroyed), and with it this module's references to
    the groups: a group kept alive past ``destroy_process_group`` would otherwise be destroyed during the
    interpreter's finalization, in whatever order it tears things down. Also run at exit."""
    _HOSTS.clear()


atexit.register(forget)


def use_host_collectives(module: nn.Module, group: dist.ProcessGroup) -> bool:
    """Every FSDP2 unit of ``module`` all-gathers and reduce-scatters through ``group``'s region; False (nothing
    changed) where there is none."""
    from torch.distributed.fsdp import FSDPModule

    host = host_collectives(group)
    if host is None:
        return False
    gather, scatter = _FsdpAllGather(host), _FsdpReduceScatter(host)
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_all_gather(gather)
            m.set_custom_reduce_scatter(scatter)
    return True


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole on every rank: a DTensor sharded by rows over a 1-D mesh (FSDP2's) gathered through its group's
    region when it has one, else ``full_tensor()``; a plain tensor as it is. A collective for a DTensor."""
    if not hasattr(t, "full_tensor"):
        return t
    from torch.distributed.tensor import Shard

    mesh = t.device_mesh
    host = _HOSTS.get(mesh.get_group()) if mesh.ndim == 1 and t.device.type == "cpu" else None
    if host is None or tuple(t.placements) != (Shard(0),) or t.dim() == 0:
        return t.full_tensor()
    rows = -(-t.shape[0] // host.world)  # torch.chunk's rows per rank; the last ranks may hold fewer or none
    local = t.to_local().contiguous()
    padded = local if local.shape[0] == rows else torch.cat(
        [local, local.new_zeros((rows - local.shape[0],) + tuple(local.shape[1:]))])
    out = local.new_empty((rows * host.world,) + tuple(local.shape[1:]))
    host.all_gather(out, padded)
    return out[:t.shape[0]]


class _Alloc:
    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)


class _FsdpAllGather(_Alloc):
    """FSDP2's all-gather (its ``AllGather`` protocol: ``allocate`` and the call) through a :class:`HostCollectives`,
    synchronous: FSDP2 then waits on nothing."""

    def __init__(self, host: HostCollectives):
        self.host = host

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        self.host.all_gather(output_tensor, input_tensor)
        return None


class _FsdpReduceScatter(_Alloc):
    """FSDP2's reduce-scatter through a :class:`HostCollectives` (synchronous)."""

    def __init__(self, host: HostCollectives):
        self.host = host

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        self.host.reduce_scatter(output_tensor, input_tensor, op)
        return None

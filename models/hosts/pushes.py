"""Both ends of a full-weight push (``run.resident``), whatever carries the bytes (:mod:`models.hosts.transports`):

- the sender (the actor trainer's rank 0): :meth:`Push.header` lays the push out from the weights' names and
  shapes, :class:`Sealed` gathers the tensors one at a time (:class:`~models.training.weight_source.WeightSource`),
  casts each into its bucket and gives the buckets out sealed (samples, checksum), one at a time;
- the receiver (the engine service): :func:`received` opens each bucket as it arrives (its checksum checked
  before anything of it is loaded) and loads it into the engine before it takes the next, or keeps them all
  (off-policy, asynchronous: the push is served later) in host memory, each copied there from the channel's
  buffer as it arrives (pinned where CUDA: an NCCL push lands on the engine's GPU, which vLLM keeps generating on
  meanwhile, so the GPU holds two buckets at most, never the whole push); then the engine's weights are read back at the samples and compared
  bit for bit with what was sent (:func:`~models.engines.weight_stream.check_read_back`);
- an engine in the trainer's own process (the colocated layout): :class:`Unsealed` gives each bucket's tensors as
  gathered, with the same samples, and :func:`loaded` loads them and reads the samples back: no buffer, no checksum.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

import torch

from models.engines.weight_delta import open_delta, seal_delta
from models.engines.weight_patch import Patch
from models.engines.weight_stream import (BUCKET_BYTES, BucketWriter, PushError, Samples, bits, check_header,
                                          check_read_back, checksum_kind, open_bucket, plan_push, positions,
                                          sample_positions, tensor_bytes)
from models.training.weight_shadow import Shadow
from models.training.weight_source import WeightSource


class Push:
    """The sender's settings: floating-point tensors travel as ``dtype``, at most ``bucket_bytes`` a bucket."""

    def __init__(self, dtype: torch.dtype = torch.float32, bucket_bytes: Optional[int] = None):
        self.dtype, self.bucket_bytes = dtype, bucket_bytes or BUCKET_BYTES

    def header(self, source: WeightSource, device, plan: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
        """The push's layout; ``plan`` (``run.weight_push=delta``): ``id``, this push's, and ``base``, the push the
        engine holds that this one is a delta against ("": a full push, the engine's next base)."""
        header = plan_push(source.tensors(self.dtype), source.aliases, self.bucket_bytes,
                           checksum_kind(torch.device(device)))
        if plan:
            header["id"] = plan["id"]
            if plan.get("base"):
                header["delta"] = {"base": plan["base"]}
        return header

    @staticmethod
    def stats(header: Mapping[str, Any], sent: Optional[Mapping[str, float]] = None) -> Dict[str, float]:
        """``resident/weights_bytes``: the tensors' bytes as sent (the engine's dtype), each tensor once; a delta's:
        its payloads (``sent``, from :class:`DeltaSealed`). ``resident/push_density``: the elements changed (a full
        push: all of them) over all."""
        params = sum(_numel(shape) for _, _, shape, *_ in header["tensors"])
        if sent is None:
            return {"resident/weights_bytes": float(tensor_bytes(header)), "resident/weights_params": float(params),
                    "resident/push_density": 1.0}
        return {"resident/weights_bytes": float(sent["bytes"]), "resident/weights_params": float(params),
                "resident/push_density": float(sent["changed"]) / max(params, 1)}


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


class Sealed:
    """The buckets of ``header``, each filled from ``source`` (gathered one tensor at a time, cast to ``dtype`` by
    each rank before the gather) and sealed when its last tensor is in; the samples drawn with a generator
    seeded ``push``. ``everywhere``: every rank fills its own buckets (its in-process engine's, colocated)."""

    def __init__(self, header: Mapping[str, Any], source: WeightSource, device, push: int,
                 dtype: Optional[torch.dtype] = None, everywhere: bool = False):
        self.header, self.device = header, torch.device(device)
        self.generator = torch.Generator().manual_seed(int(push))
        self.gathered = source.gathered(self.device, dtype, everywhere)

    def __iter__(self) -> Iterator[torch.Tensor]:
        buckets = [[] for _ in self.header["buckets"]]
        for entry in self.header["tensors"]:
            buckets[entry[3]].append(entry[0])
        for index, names in enumerate(buckets):
            writer = BucketWriter(self.header, index, self.device, self.generator)
            for want in names:
                name, tensor = next(self.gathered)
                writer.put(name, tensor)
                del tensor
            yield writer.seal()
            del writer

    def drain(self) -> None:
        """The gathers left (the other trainer ranks are in them), nothing sent."""
        for _ in self.gathered:
            pass


class Unsealed(Sealed):
    """A push into an engine in this process (``run.resident_layout=colocated``): the tensors of each of
    ``header``'s buckets as every rank gathers them whole (cast to ``dtype`` before the gather), each with the
    samples :class:`Sealed` would draw, given out as ``(tensors, samples)``, what :func:`loaded` takes. No bucket
    buffer and no checksum: no byte crosses a channel, so there is nothing a checksum could catch that the samples
    read back from the engine do not (a bucket's copy, its checksum and the check of it were 3 passes over the
    model's bytes on each rank)."""

    def __init__(self, header: Mapping[str, Any], source: WeightSource, device, push: int,
                 dtype: Optional[torch.dtype] = None):
        super().__init__(header, source, device, push, dtype, everywhere=True)

    def __iter__(self) -> Iterator[Tuple[Dict[str, torch.Tensor], Samples]]:
        entries: List[List[Any]] = [[] for _ in self.header["buckets"]]
        for entry in self.header["tensors"]:
            entries[entry[3]].append(entry)
        for bucket in entries:
            tensors: Dict[str, torch.Tensor] = {}
            samples: Samples = {}
            for want, _, shape, _, _, n in bucket:
                name, tensor = next(self.gathered)
                if name != want or list(tensor.shape) != list(shape):
                    raise ValueError(f"the push gathers {name!r} {list(tensor.shape)} where its header has {want!r} "
                                     f"{list(shape)}")
                at = sample_positions(tensor.numel(), n, self.generator)  # [n]
                samples[name] = list(zip(at.tolist(), bits(tensor.reshape(-1)[at.to(tensor.device)]).tolist()))
                tensors[name] = tensor
                del tensor
            yield tensors, samples
            del tensors


def loaded(header: Mapping[str, Any], chunks: Unsealed, engine, shard: Optional[Dict[str, Any]] = None
           ) -> Dict[str, float]:
    """``chunks`` loaded into ``engine`` (in this process) one bucket's tensors at a time, then the samples read back
    and compared bit for bit (:class:`~models.engines.weight_stream.PushError` naming the first tensor that
    differs); ``shard`` as :func:`received` takes it. ``chunks`` is drained if the load fails (the other ranks'
    gathers go on)."""
    samples: Samples = {}
    t0 = time.perf_counter()
    try:
        _load(engine, header, chunks, samples)
    except BaseException:
        chunks.drain()
        raise
    t1 = time.perf_counter()
    holds = _confirmed(header, samples, engine, "after the push, reading the weights back", shard is not None)
    if shard is not None:
        shard.update(sent=positions(samples), holds=holds)
    return {"time/weights_receive_s": t1 - t0, "time/weights_read_back_s": time.perf_counter() - t1}


def sealed(header: Mapping[str, Any], source: WeightSource, device, push: int,
           dtype: Optional[torch.dtype] = None, everywhere: bool = False, shadow: Optional[Shadow] = None):
    """The push's buckets: a delta's against ``shadow`` (:class:`DeltaSealed`) where ``header`` is a delta's; else
    the full buckets, each rank's part kept in ``shadow`` (when given) as what the engine will hold."""
    if "delta" in header:
        return DeltaSealed(header, source, device, push, dtype, shadow)
    if shadow is not None:
        source = source.keeping(shadow.keep)
    return Sealed(header, source, device, push, dtype, everywhere)


class DeltaSealed:
    """The buckets of a delta push (:mod:`models.engines.weight_delta`), each sealed once its tensors' deltas are
    in (every rank of the trainer comparing its part with ``shadow``, :meth:`Shadow.deltas`); ``sent``: the
    payloads' bytes and the elements changed so far."""

    def __init__(self, header: Mapping[str, Any], source: WeightSource, device, push: int,
                 dtype: Optional[torch.dtype], shadow: Shadow):
        self.header, self.device = header, torch.device(device)
        self.deltas = shadow.deltas(source, dtype or torch.float32, push)
        self.sent = {"bytes": 0, "changed": 0}

    def __iter__(self) -> Iterator[torch.Tensor]:
        buckets: List[List[str]] = [[] for _ in self.header["buckets"]]
        for entry in self.header["tensors"]:
            buckets[entry[3]].append(entry[0])
        for index, names in enumerate(buckets):
            got = [next(self.deltas) for _ in names]
            for _, d in got:
                self.sent["bytes"] += d.payload.numel()
                self.sent["changed"] += d.changed
            yield seal_delta(self.header, index, got).to(self.device)

    def drain(self) -> None:
        for _ in self.deltas:
            pass


SETTLE_S = 0.5
"""Longest wait for a received bucket to be let go before the next is allocated (:meth:`Held.alloc`)."""


class Held:
    """The receiver's buckets alive at once, in bytes: now and at most. A bucket is alive while anything holds its
    memory (the engine's loader may keep views of it until a layer is complete), which the count of its storage's
    owners tells (``torch._C._storage_Use_Count``; ours is one of them, dropped as soon as it is the last, before
    the next bucket is allocated: :meth:`alloc`)."""

    def __init__(self) -> None:
        self.storages: List[torch.UntypedStorage] = []
        self.now = self.peak = 0

    def alloc(self, make: Callable[[int, torch.device], torch.Tensor]) -> Callable[[int, torch.device], torch.Tensor]:
        """``make`` (a bucket's allocator), each bucket counted from its allocation (the ones nothing else holds
        let go first, so the count never keeps one alive). With two buckets alive it waits up to
        :data:`SETTLE_S` for one to be let go (a collective's work object can hold a received bucket a moment after
        its wait returned), so the receiver holds two at most unless the engine keeps views of more."""
        def fresh(nbytes: int, device: torch.device) -> torch.Tensor:
            self._prune()
            deadline = time.monotonic() + SETTLE_S
            while len(self.storages) >= 2 and time.monotonic() < deadline:
                time.sleep(0.001)
                self._prune()
            return self.add(make(nbytes, device))

        return fresh

    def add(self, buffer: torch.Tensor) -> torch.Tensor:
        storage = buffer.untyped_storage()
        if any(s.data_ptr() == storage.data_ptr() for s in self.storages):
            return buffer  # counted when it was allocated
        self._prune()
        self.storages.append(storage)
        self.now = sum(s.nbytes() for s in self.storages)
        self.peak = max(self.peak, self.now)
        return buffer

    def _prune(self) -> None:
        self.storages = [s for s in self.storages if torch._C._storage_Use_Count(s._cdata) > 1]

    def clear(self) -> None:
        self.storages = []


def host_copy(buffer: torch.Tensor) -> torch.Tensor:
    """``buffer`` copied into host memory (pinned where CUDA, for the copies to and from the GPU)."""
    out = torch.empty(buffer.numel(), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    return out.copy_(buffer.reshape(-1).view(torch.uint8))


def received(header: Mapping[str, Any], buckets: Iterable[Tuple[int, torch.Tensor]], engine=None,
             held: Optional[Held] = None, shard: Optional[Dict[str, Any]] = None,
             to_host: bool = False) -> Callable[[Any], Dict[str, float]]:
    """The receiver's end of a push: ``buckets`` (``(index, bytes)`` as they arrive) opened, their checksums
    checked, and loaded into ``engine`` one at a time; or, without ``engine``, kept. The function returned puts
    the kept buckets into the engine it is given (the streamed ones are in already), reads the samples back and
    compares them (:class:`~models.engines.weight_stream.PushError` naming the first tensor that differs), and
    returns the push's figures: ``resident/receiver_peak_bytes`` (the most bytes of buckets alive at once where they
    arrive: ``held``, which counted them from their allocation, or from their arrival) and
    ``resident/receiver_host_bytes`` (the kept buckets' bytes in host memory). ``to_host``: the buckets kept are
    copied to host memory as they arrive (:func:`host_copy`), the channel's buffer let go before the next arrives. ``shard`` (a dict): the engine is one rank of a
    tensor-parallel group: only the elements it holds are compared, and ``shard`` gets ``sent`` (the positions
    sampled per tensor) and ``holds`` (those it holds), for the group's union to be checked across its ranks."""
    held, samples, kept = held or Held(), {}, []
    t0 = time.perf_counter()
    into = engine
    if into is not None:
        check_base(header, into)
        _load(into, header, _opened(header, buckets, held), samples)
    else:
        kept = list(_opened(header, buckets, held, to_host))
    host_bytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for tensors, _ in kept
                      for item in tensors.values() for t in _held_tensors(item)
                      if t is not None}.values())
    receive_s = time.perf_counter() - t0

    def put(engine) -> Dict[str, float]:
        if into is None:
            check_base(header, engine)
            _load(engine, header, kept, samples)
            kept.clear()
        elif engine is not into:
            raise PushError("the push was loaded into another engine than the one it is put into")
        t1 = time.perf_counter()
        held.clear()
        holds = _confirmed(header, samples, engine, "after the push, reading the weights back", shard is not None)
        if shard is not None:
            shard.update(sent=positions(samples), holds=holds)
        return {"resident/receiver_peak_bytes": float(held.peak), "resident/receiver_host_bytes": float(host_bytes),
                "time/weights_receive_s": receive_s,
                "time/weights_read_back_s": time.perf_counter() - t1}

    return put


def _held_tensors(item) -> List[torch.Tensor]:
    """The tensors an opened bucket's item holds: a full push's tensor, or a delta's
    :class:`~models.engines.weight_patch.Patch`'s (views of the bucket, not expanded)."""
    return item.tensors() if isinstance(item, Patch) else [item] if isinstance(item, torch.Tensor) else \
        [t for t in item if isinstance(t, torch.Tensor)]


def _confirmed(header: Mapping[str, Any], samples: Samples, engine, what: str, shard: bool = False
               ) -> Dict[str, List[int]]:
    """The sampled elements read back from ``engine`` and compared bit for bit with what was sent
    (:func:`~models.engines.weight_stream.check_read_back`); then the push is what a delta may build on. The
    positions the engine holds, per tensor."""
    dtypes = {name: dtype for name, dtype, *_ in header["tensors"]}
    holds = check_read_back(header, samples, engine.read_back(positions(samples), dtypes), what, shard=shard)
    engine.pushed = header.get("id", "")  # what a delta push may build on now
    return holds


def check_base(header: Mapping[str, Any], engine) -> None:
    """A delta applies only onto the push it was made against: :class:`PushError` (nothing loaded) if the engine
    holds another (restarted, reloaded, or a push between that failed)."""
    if "delta" in header and getattr(engine, "pushed", "") != header["delta"]["base"]:
        raise PushError(f"the delta push {header.get('id')} builds on push {header['delta']['base']}, but the engine "
                        f"holds {getattr(engine, 'pushed', '') or 'no push'}: a full push is needed")


def _opened(header, buckets, held: Held, to_host: bool = False) -> Iterator[Tuple[Dict[str, torch.Tensor], Samples]]:
    opener = (lambda i, b: open_delta(header, i, b)[:2]) if "delta" in header else \
        (lambda i, b: open_bucket(header, i, b))
    for index, buffer in buckets:
        tensors, samples = opener(index, held.add(buffer))  # checked where it arrived
        if to_host and "delta" not in header:  # the channel's buffer goes with this frame: two alive at most (a
            tensors = _rehomed(tensors, buffer, host_copy(buffer))  # delta's patches are decoded on the host)
        yield tensors, samples
        del buffer, tensors


def _rehomed(tensors: Dict[str, torch.Tensor], buffer: torch.Tensor, host: torch.Tensor) -> Dict[str, torch.Tensor]:
    """``tensors`` (views of ``buffer``) as the same views of ``host``, its copy."""
    out = {}
    for name, t in tensors.items():
        at = t.storage_offset() * t.element_size() - buffer.storage_offset()
        out[name] = host[at:at + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    return out


def _load(engine, header: Mapping[str, Any], chunks: Iterable[Tuple[Dict[str, torch.Tensor], Samples]],
          samples: Dict[str, List[Tuple[int, int]]]) -> None:
    """``begin_push``, a ``push_chunk`` per bucket, ``end_push`` (a delta: ``begin_patch``, ``patch_chunk``,
    ``end_patch``, in place); the engine is closed if a bucket fails (its checksum, or the sender gone mid-push): it
    would hold part of the old weights and part of the new."""
    begin, chunk, end = ("begin_patch", "patch_chunk", "end_patch") if "delta" in header else \
        ("begin_push", "push_chunk", "end_push")
    engine.pushed = ""  # until this push is read back
    getattr(engine, begin)({name: shape for name, _, shape, *_ in header["tensors"]})
    try:
        for tensors, got in chunks:
            samples.update(got)
            getattr(engine, chunk)(tensors)
            del tensors
    except BaseException:
        engine.abort_push()
        raise
    getattr(engine, end)()


def received_by_workers(receiver, header: Mapping[str, Any], push: int, engine=None
                        ) -> Callable[[Any], Dict[str, float]]:
    """:func:`received` for an engine whose tensor-parallel workers are the channel's receivers
    (:mod:`models.engines.worker_channel`): the push announced to them, each receiving its share; loaded by them now,
    or (without ``engine``) kept in their host memory, this waiting until every worker has its share whole. The
    function returned loads a kept push, reads the samples back from every worker and compares them as
    :func:`received`'s does; this process holds none of the push's bytes."""
    from models.engines.worker_channel import announce, forget, wait_received

    check_header(header)
    if engine is not None:  # before the workers are told: a push that cannot be loaded is refused untaken
        engine.check_channel(header)
        check_base(header, engine)
    receiver.announced = n = receiver.announced + 1
    offer = receiver.offer()
    t0 = time.perf_counter()
    announce(receiver.store, offer, n, header, push, keep=engine is None)
    if engine is None:
        wait_received(receiver.store, offer, n, len(receiver.workers), receiver.timeout_s)
    parts = engine.push_from_channel(header, n) if engine is not None else []
    receive_s = time.perf_counter() - t0

    def put(into) -> Dict[str, float]:
        if engine is None:
            check_base(header, into)
            parts.extend(into.push_from_channel(header, n))
        elif into is not engine:
            raise PushError("the push was loaded into another engine than the one it is put into")
        forget(receiver.store, offer, n, push, len(receiver.workers))
        t1 = time.perf_counter()
        _confirmed(header, parts[0]["samples"], into, "after the push, reading the weights back from every worker")
        return {"resident/receiver_peak_bytes": 0.0, "resident/receiver_host_bytes": 0.0,
                "resident/worker_bytes_max": float(max(p["bytes"] for p in parts)),
                "time/weights_receive_s": receive_s, "time/weights_read_back_s": time.perf_counter() - t1}

    return put

"""Pushes straight into each tensor-parallel worker of a vLLM engine (the separate layout's engine with
``rollout.tensor_parallel_size`` > 1): the workers, not the engine's process, are the weight channel's receivers
(:mod:`models.engines.weight_channel`: the trainer's sender is member 0, worker ``r`` member ``1 + r``), and each
receives only its share of every bucket (:mod:`models.engines.weight_shares`: the rows, columns or whole tensors its
loaders read), onto its own device, as NeMo-RL's and veRL's workers take their refits. Nothing of the push passes
through the engine's process or shared memory.

In each worker (run there through ``collective_rpc``): :func:`shares` (its regions of each tensor, from one dry run
of its loaders), :func:`join` (a member of the channel: a thread of the worker forms the group, then takes each push
the engine's process announces in the channel's store: its share of every bucket, received one bucket at a time and
handed to the loader, or, for a push served later, kept in host memory), :func:`load` (the push into the worker's
weights through the model's own loaders, as :mod:`models.engines.vllm_push` loads a chunk; a delta push's patches
in place). The engine's process announces a push (:func:`announce`) and waits for the workers' receipts
(:func:`wait_received`) or runs :func:`load` in them.
"""

from __future__ import annotations

import datetime as dt
import json
import queue
import threading
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from models.engines import vllm_push
from models.engines.weight_channel import (SENDER, ChannelError, _broadcast, _local_address, _ready_key, _shutdown,
                                           gpu_id, group, receive_from)
from models.engines.weight_shares import distinct_regions, unpack

_MEMBERS: Dict[int, "Member"] = {}
"""Per worker (``id``), its membership of the channel."""
POLL_S = 1.0


def _key(offer: Mapping[str, Any], what: str, n: int, rank: Optional[int] = None) -> str:
    return f"weights/{offer['key']}/{what}/{n}" + ("" if rank is None else f"/{rank}")


class Member:
    """One worker's end: the channel's group (formed by :meth:`_run`'s thread), each push's share received by it."""

    def __init__(self, host: str, offer: Mapping[str, Any], rank: int, device: torch.device, timeout_s: float):
        self.host, self.offer, self.rank, self.timeout_s = host, dict(offer), rank, timeout_s
        self.device = device if offer["backend"] == "nccl" else torch.device("cpu")  # where the shares land
        self.share = offer["shares"][rank - 1] if offer.get("shares") else None
        self.streamed: "queue.Queue" = queue.Queue(maxsize=1)  # (n, item or error); each loaded before the next
        self.kept: Dict[int, Any] = {}  # n -> [payloads in host memory] or the error
        self.meta: Dict[int, Dict[str, Any]] = {}  # n -> the push as announced
        self.bytes: Dict[int, int] = {}  # n -> the bytes received
        self.stop, self.group, self.store = threading.Event(), None, None
        self.failed: Optional[Exception] = None  # the channel itself: it did not form
        self.dropped = 0  # a push whose load failed here: the rest of it is received and dropped (the sender and
        # the other workers finish it; this worker's failure is the push's)
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"weight-member-{rank}")
        self.thread.start()

    def _run(self) -> None:
        if self.device.type == "cuda":  # a thread starts on CUDA's device 0: the worker's own, as its main thread's
            torch.cuda.set_device(self.device)
        try:
            self.store = dist.TCPStore(self.host, int(self.offer["port"]), None, False,
                                       dt.timedelta(seconds=self.timeout_s))
            self.group = group(self.offer["backend"], self.store, self.offer["key"], self.rank,
                               _local_address(self.host), self.timeout_s, int(self.offer["size"]))
        except Exception as err:  # noqa: BLE001 -- told at the first push
            self.failed = ChannelError(f"worker {self.rank - 1} did not join the weight channel: {err}")
            return
        n = 0
        while not self.stop.is_set():
            n += 1
            try:
                while True:
                    try:
                        self.store.wait([_key(self.offer, "header", n)], dt.timedelta(seconds=POLL_S))
                        break
                    except dist.DistStoreError:
                        if self.stop.is_set():
                            return
                push = json.loads(self.store.get(_key(self.offer, "header", n)))
            except Exception:  # noqa: BLE001 -- the store gone: the channel is closed
                return
            self.meta[n] = push
            self._receive(n, push)

    def _receive(self, n: int, push: Mapping[str, Any]) -> None:
        header, keep, device = push["header"], push["keep"], self.device
        kept, self.bytes[n] = [], 0
        try:
            for index in range(len(header["buckets"])):
                take = _broadcast if "delta" in header else (  # a delta: one broadcast to all; else each its share
                    lambda g, t, backend, timeout: receive_from(g, t, SENDER, backend, timeout))
                size = torch.zeros(1, dtype=torch.int64, device=device)
                take(self.group, size, self.offer["backend"], self.timeout_s)
                payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
                take(self.group, payload, self.offer["backend"], self.timeout_s)
                self.bytes[n] += payload.numel()
                if keep:  # served later: in host memory (pinned where CUDA), the device's buffer let go
                    kept.append(torch.empty(payload.numel(), dtype=torch.uint8, pin_memory=True).copy_(payload)
                                if payload.is_cuda else payload)
                elif self.dropped != n:
                    done = threading.Event()
                    self.streamed.put((n, (index, payload, done)))
                    while not done.wait(POLL_S) and self.dropped != n:  # loaded before the next is received
                        if self.stop.is_set():
                            return
                del payload
            if keep:
                self.kept[n] = kept
            self.store.set(_key(self.offer, "got", n, self.rank), "ok")
        except Exception as err:  # noqa: BLE001 -- reported to the loader and the engine's process
            self.kept[n] = err
            try:
                self.streamed.put_nowait((n, err))
            except queue.Full:  # the loader gave up before taking the last item: it is stale, the error is news
                self.streamed.get_nowait()
                self.streamed.put_nowait((n, err))
            self.store.set(_key(self.offer, "got", n, self.rank), f"{type(err).__name__}: {err}"[:500])

    def payloads(self, n: int):
        """Push ``n``'s payloads in order, each ``(index, payload, done)``: the kept ones, or as they arrive."""
        if self.failed is not None:
            raise self.failed
        if self.meta.get(n, {}).get("keep"):
            deadline = time.monotonic() + self.timeout_s
            while n not in self.kept:
                if self.failed is not None:
                    raise self.failed
                if self.group is None:  # still forming: its own timeout bounds that
                    deadline = time.monotonic() + self.timeout_s
                if time.monotonic() > deadline:
                    raise ChannelError(f"worker {self.rank - 1} did not receive push {n} in {self.timeout_s:g} s")
                time.sleep(0.01)
            kept = self.kept.pop(n)
            if isinstance(kept, Exception):
                raise kept
            for index, payload in enumerate(kept):
                yield index, payload, None
            return
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                at, item = self.streamed.get(timeout=POLL_S)
            except queue.Empty:
                if self.failed is not None:
                    raise self.failed from None
                if self.group is None:  # still forming: its own timeout bounds that
                    deadline = time.monotonic() + self.timeout_s
                if time.monotonic() > deadline:
                    raise ChannelError(f"worker {self.rank - 1} received nothing of push {n} in {self.timeout_s:g} s")
                continue
            deadline = time.monotonic() + self.timeout_s
            if isinstance(item, Exception):
                raise item
            if at != n:
                continue  # a push given up earlier
            yield item
            if item[0] == len(self.meta[n]["header"]["buckets"]) - 1:
                return

    def close(self) -> None:
        """Stop taking pushes (the thread ends within a poll of the store) and drop the group."""
        self.stop.set()
        if self.thread is not threading.current_thread():
            self.thread.join(2 * POLL_S)
        if self.group is not None:
            _shutdown(self.group)


# -- in each worker (collective_rpc) --------------------------------------------------------------------------------

def worker_gpu(worker: Any) -> str:
    return gpu_id()


def shares(worker: Any, metas: Dict[str, Sequence[Any]]) -> Dict[str, list]:
    """Per tensor, the regions of it this worker's loaders read (:func:`vllm_push._where`)."""
    plan = vllm_push._where(worker, {name: (list(shape), dtype) for name, (shape, dtype) in metas.items()})
    return {name: [[r[0], list(r[1]), list(r[2])] for r in distinct_regions([read for *_, read in copies])]
            for name, copies in plan.items()}


def join(worker: Any, host: str, offer: Dict[str, Any], timeout_s: float) -> None:
    """This worker a member of the channel ``offer`` (its thread forms the group; a former membership ends)."""
    old = _MEMBERS.pop(id(worker), None)
    if old is not None:
        old.close()
    _MEMBERS[id(worker)] = Member(host, offer, 1 + int(worker.rank), torch.device(worker.device), timeout_s)


def load(worker: Any, n: int) -> Dict[str, Any]:
    """Push ``n`` into this worker's weights (a full push through a layerwise reload, a delta's patches in place):
    what vLLM's loader could not load, the push's samples, the bytes this worker received."""
    from models.engines.weight_delta import open_delta

    member = _MEMBERS.get(id(worker))
    if member is None:
        raise ChannelError("this worker is no member of a weight channel (the engine restarted since it formed)")
    samples: Dict[str, List[Any]] = {}
    header = None
    began = False
    try:
        for index, payload, done in member.payloads(n):
            header = member.meta[n]["header"]
            delta = "delta" in header
            if not began and not delta:
                vllm_push.begin(worker)
            began = True
            if delta:
                patches, got = open_delta(header, index, payload)[:2]
                shapes = {e[0]: e[2] for e in header["tensors"]}
                vllm_push.patch(worker, {name: (shapes[name], p) for name, p in patches.items()})
            else:
                tensors, got = unpack(header, index, payload.to(member.device), member.share)
                vllm_push.chunk(worker, tensors)
                del tensors
            samples.update(got)
            if done is not None:
                done.set()
    except BaseException:
        member.dropped = n  # the rest of the push is received and dropped: the sender and the other workers finish
        vllm_push.drop()
        raise
    finally:
        member.meta.pop(n, None)  # a long run's pushes are not kept
    problems = vllm_push.patched(worker) if header is not None and "delta" in header else vllm_push.finish(worker)
    return {"problems": problems, "samples": samples, "bytes": member.bytes.pop(n, 0)}


# -- in the engine's process ----------------------------------------------------------------------------------------

def announce(store, offer: Mapping[str, Any], n: int, header: Mapping[str, Any], push: int, keep: bool) -> None:
    """Push ``n`` to the workers (its header; ``keep``: served later), then to the sender: it may send."""
    store.set(_key(offer, "header", n), json.dumps({"header": header, "keep": keep}))
    store.set(_ready_key(offer["key"], push), "1")


def forget(store, offer: Mapping[str, Any], n: int, push: int, workers: int) -> None:
    """Push ``n``'s keys out of the store, once it is loaded (a long run's pushes are not kept)."""
    for key in [_key(offer, "header", n), _ready_key(offer["key"], push),
                *(_key(offer, "got", n, 1 + r) for r in range(workers))]:
        store.delete_key(key)


def wait_received(store, offer: Mapping[str, Any], n: int, workers: int, timeout_s: float) -> None:
    """Until every worker received push ``n`` whole; :class:`ChannelError` with the first worker's failure."""
    keys = [_key(offer, "got", n, 1 + r) for r in range(workers)]
    try:
        store.wait(keys, dt.timedelta(seconds=timeout_s))
    except dist.DistStoreError as err:
        raise ChannelError(f"the engine's workers did not receive the push in {timeout_s:g} s") from err
    for r, key in enumerate(keys):
        got = store.get(key).decode()
        if got != "ok":
            raise ChannelError(f"worker {r} of the engine failed to receive the push: {got}")

"""Weights from a trainer to a running engine over a collective: a process group of two members of its
own (no default group, no ``torch.distributed.init_process_group``), the trainer's sender rank 0 and the
engine's receiver rank 1, as the peers' "update weights from distributed" does (OpenRLHF, veRL).

Forming it: the engine's side (:class:`Receiver`) opens a ``TCPStore`` on a free port of the address it
serves on and answers its :meth:`Receiver.offer` (the port, the backend, a key naming this channel in the
store); the trainer's side (:class:`Sender`) joins with it. Backend: ``nccl`` when both ends are on CUDA,
on two different GPUs (NCCL cannot join two ranks on one device), else ``gloo`` (through host memory).

A push: :func:`plan` lays the state dict out in buckets, one dtype each and at most :data:`BUCKET_BYTES`
(a tensor bigger than that gets its own), each sent as one flat buffer, and a JSON header (names,
dtypes, shapes, offsets, names that share a tensor); the header travels by other means (the engine
service's HTTP op), the buffers by broadcast (:meth:`Sender.send`, :meth:`Receiver.receive`), and
:func:`unflatten` gives the state dict back, bit for bit. Every wait is bounded by the channel's timeout;
a failure raises :class:`ChannelError` and the channel is not used again.
"""

from __future__ import annotations

import atexit
import datetime as dt
import secrets
import socket
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Dict, List, Mapping, Tuple

import torch
import torch.distributed as dist

from models.engines.weights import distinct_tensors

BUCKET_BYTES = 256 << 20
"""Most bytes in one broadcast buffer (a bigger tensor is one buffer by itself)."""
TIMEOUT_S = 300.0
"""Default bound on forming the channel and on each broadcast."""
SENDER, RECEIVER = 0, 1


class ChannelError(RuntimeError):
    """The channel could not form, or a broadcast on it failed or timed out."""


def gpu_id() -> str:
    """This process's current CUDA device (its UUID), or ``""`` without CUDA."""
    if not torch.cuda.is_available():
        return ""
    return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)


def choose_backend(sender_gpu: str, receiver_gpu: str) -> str:
    """``nccl`` when both ends are on CUDA, on different devices; else ``gloo``."""
    return "nccl" if sender_gpu and receiver_gpu and sender_gpu != receiver_gpu else "gloo"


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"the weights header names dtype {name!r}, which torch does not have")
    return dtype


def plan(state: Mapping[str, torch.Tensor], bucket_bytes: int = BUCKET_BYTES
         ) -> Tuple[Dict[str, Any], List[List[torch.Tensor]]]:
    """``(header, buckets)``: ``state``'s tensors in buckets, one dtype each, each sent as one flat buffer
    (:meth:`Sender.send` flattens them one at a time: one bucket's copy at once), and the JSON header
    :func:`unflatten` reads the buffers back with."""
    distinct, aliases = distinct_tensors(state)
    groups: Dict[torch.dtype, List[List[str]]] = {}
    sizes: Dict[Tuple[torch.dtype, int], int] = {}
    for name, t in distinct.items():
        buckets = groups.setdefault(t.dtype, [[]])
        nbytes = t.numel() * t.element_size()
        if buckets[-1] and sizes[(t.dtype, len(buckets) - 1)] + nbytes > bucket_bytes:
            buckets.append([])
        key = (t.dtype, len(buckets) - 1)
        sizes[key] = sizes.get(key, 0) + nbytes
        buckets[-1].append(name)
    header: Dict[str, Any] = {"tensors": [], "buffers": [], "aliases": aliases}
    out = []
    for dtype, buckets in groups.items():
        for names in buckets:
            offset, index = 0, len(out)
            for name in names:
                t = distinct[name]
                header["tensors"].append([name, str(dtype).removeprefix("torch."), list(t.shape), index, offset])
                offset += t.numel()
            out.append([distinct[n] for n in names])
            header["buffers"].append([str(dtype).removeprefix("torch."), offset])
    return header, out


def check_header(header: Mapping[str, Any]) -> None:
    """A header that :func:`plan` could have written; else ``ValueError`` naming what is wrong."""
    if not isinstance(header, Mapping) or not {"tensors", "buffers", "aliases"} <= set(header):
        raise ValueError(f"not a weights header (needs tensors, buffers, aliases): {str(header)[:200]}")
    sizes = []
    for dtype, numel in header["buffers"]:
        _dtype(dtype)
        sizes.append(int(numel))
    names = set()
    for name, dtype, shape, index, offset in header["tensors"]:
        if not 0 <= index < len(sizes) or header["buffers"][index][0] != dtype:
            raise ValueError(f"the weights header puts {name!r} ({dtype}) in buffer {index}, which it does not "
                             f"declare as {dtype}")
        if offset < 0 or offset + _numel(shape) > sizes[index]:
            raise ValueError(f"the weights header puts {name!r} {shape} at {offset}, past the end of buffer "
                             f"{index} ({sizes[index]} elements)")
        names.add(name)
    missing = {a: t for a, t in header["aliases"].items() if t not in names}
    if missing:
        raise ValueError(f"the weights header names aliases of tensors it does not hold: {missing}")


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def unflatten(header: Mapping[str, Any], buffers: List[torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The state dict of :func:`plan`'s ``header`` from the received ``buffers``: views of them, the
    aliases as the same tensor as their target."""
    state = {}
    for name, _, shape, index, offset in header["tensors"]:
        state[name] = buffers[index][offset:offset + _numel(shape)].view(shape)
    for name, target in header["aliases"].items():
        state[name] = state[target]
    return state


def _gloo(store, rank: int, host: str, timeout: dt.timedelta):
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, 2, opts)


def _nccl(store, rank: int, host: str, timeout: dt.timedelta):
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, 2, opts)


def _group(backend: str, store, key: str, rank: int, host: str, timeout_s: float):
    make = {"gloo": _gloo, "nccl": _nccl}[backend]
    return make(dist.PrefixStore(f"weights/{key}/", store), rank, host, dt.timedelta(seconds=timeout_s))


def _broadcast(group, buffer: torch.Tensor, backend: str, timeout_s: float) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = SENDER, 0
    try:
        group.broadcast([buffer], opts).wait(dt.timedelta(seconds=timeout_s))
    except Exception as err:  # noqa: BLE001 -- gloo and NCCL raise RuntimeError or DistBackendError
        raise ChannelError(f"a broadcast over the {backend} weight channel failed "
                           f"({type(err).__name__}: {str(err).strip()[:300]})") from err


def _device(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


class Receiver:
    """The engine's end: opens the store on ``host`` (the address the engine serves on) and forms the
    group in the background, as rank 1, once the sender joins."""

    def __init__(self, host: str, sender_gpu: str, timeout_s: float = TIMEOUT_S):
        self.host, self.timeout_s = host, timeout_s
        self.backend = choose_backend(sender_gpu, gpu_id())
        self.key = secrets.token_hex(8)
        listening = socket.create_server((host, 0))  # the store listens on ``host`` only, on a free port
        port = listening.getsockname()[1]
        self.store = dist.TCPStore(host, port, None, True, dt.timedelta(seconds=timeout_s), wait_for_workers=False,
                                   master_listen_fd=listening.detach())  # the store owns the socket from here
        self._group: Future = Future()
        threading.Thread(target=self._form, daemon=True, name="weight-channel").start()
        atexit.register(self.close)  # a process group left at the interpreter's exit aborts the process

    def _form(self) -> None:
        try:
            self._group.set_result(_group(self.backend, self.store, self.key, RECEIVER, self.host, self.timeout_s))
        except Exception as err:  # noqa: BLE001 -- handed to receive()
            self._group.set_exception(err)

    def offer(self) -> Dict[str, Any]:
        """What the sender joins with (JSON)."""
        return {"port": self.store.port, "backend": self.backend, "key": self.key}

    def receive(self, header: Mapping[str, Any], push: int) -> Dict[str, torch.Tensor]:
        """The sender's push number ``push``, laid out by ``header``: tells the sender it listens
        (:meth:`Sender.wait_ready`), then takes the broadcasts."""
        check_header(header)
        try:
            group = self._group.result(timeout=self.timeout_s + 5)
        except Exception as err:  # noqa: BLE001 -- the sender never joined, or the rendezvous failed
            raise ChannelError(f"the {self.backend} weight channel on {self.host}:{self.store.port} did not form "
                               f"({type(err).__name__}: {str(err).strip()[:300]})") from err
        self.store.set(_ready_key(self.key, push), "1")
        device = _device(self.backend)
        buffers = [torch.empty(int(numel), dtype=_dtype(dtype), device=device) for dtype, numel in header["buffers"]]
        for buffer in buffers:
            _broadcast(group, buffer, self.backend, self.timeout_s)
        return unflatten(header, buffers)

    def close(self) -> None:
        """Drop the group (a sender blocked on it fails; one still forming, once formed) and the store."""
        atexit.unregister(self.close)
        self._group.add_done_callback(lambda formed: formed.exception() is None and _shutdown(formed.result()))
        self._group = Future()
        self._group.set_exception(ChannelError("the weight channel is closed"))
        self.store = None


class Sender:
    """The trainer's end: joins the receiver's store at ``host`` with its ``offer``, as rank 0."""

    def __init__(self, host: str, offer: Mapping[str, Any], timeout_s: float = TIMEOUT_S):
        self.backend, self.timeout_s, self.key = str(offer["backend"]), timeout_s, str(offer["key"])
        where = f"{host}:{offer['port']}"
        try:
            self.store = dist.TCPStore(host, int(offer["port"]), None, False, dt.timedelta(seconds=timeout_s))
            self.group = _group(self.backend, self.store, str(offer["key"]), SENDER, _local_address(host),
                                timeout_s)
        except Exception as err:  # noqa: BLE001 -- the store or the peer cannot be reached
            raise ChannelError(f"joining the {self.backend} weight channel at {where} failed "
                               f"({type(err).__name__}: {str(err).strip()[:300]})") from err
        atexit.register(self.close)  # a process group left at the interpreter's exit aborts the process

    def wait_ready(self, push: int, give_up: Callable[[], bool], timeout_s: float) -> None:
        """Until the receiver takes push ``push`` (it may be busy with other work first; no broadcast waits
        on it meanwhile), ``give_up()`` is true (the receiver failed before), or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.store.wait([_ready_key(self.key, push)], dt.timedelta(seconds=0.2))
                return
            except dist.DistStoreError:  # not yet: look again unless the receiver failed or time is up
                pass
            if give_up():
                raise ChannelError("the receiver gave up the push before taking it")
            if time.monotonic() > deadline:
                raise ChannelError(f"the receiver did not take the push in {timeout_s:g} s")

    def send(self, buckets: List[List[torch.Tensor]]) -> None:
        """Broadcast :func:`plan`'s buckets, each as one flat buffer on the backend's device."""
        device = _device(self.backend)
        for bucket in buckets:
            buffer = torch.cat([t.reshape(-1).to(device) for t in bucket])  # [numel of the bucket]
            _broadcast(self.group, buffer, self.backend, self.timeout_s)

    def close(self) -> None:
        atexit.unregister(self.close)
        _shutdown(self.group)
        self.group = self.store = None


def _ready_key(key: str, push: int) -> str:
    return f"weights/{key}/ready/{push}"


def _shutdown(group) -> None:
    for method in ("abort", "shutdown"):  # NCCL: free the communicator now; gloo drops its sockets with it
        fn = getattr(group, method, None)
        if fn is not None:
            try:
                fn()
            except Exception:  # noqa: BLE001 -- closing a broken channel must not hide why it broke
                pass
            return


def _local_address(peer: str) -> str:
    """This machine's address on the route to ``peer`` (loopback for a loopback peer): where gloo listens."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))  # UDP: no packet is sent, the kernel only picks the route
        return s.getsockname()[0]

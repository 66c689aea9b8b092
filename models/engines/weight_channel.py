"""Weights from a trainer to a running engine over a collective: a process group of two members of its
own (no default group, no ``torch.distributed.init_process_group``), the trainer's sender rank 0 and the
engine's receiver rank 1, as the peers' "update weights from distributed" does (OpenRLHF, veRL).

Forming it: the engine's side (:class:`Receiver`) opens a ``TCPStore`` on a free port of the address it
serves on and answers its :meth:`Receiver.offer` (the port, the backend, a key naming this channel in the
store); the trainer's side (:class:`Sender`) joins with it. Backend: ``nccl`` when both ends are on CUDA,
on two different GPUs (NCCL cannot join two ranks on one device), else ``gloo`` (through host memory).

A push: the header (:func:`models.engines.weight_stream.plan_push`: the tensors' names, dtypes, shapes and
places in their buckets) travels by other means (the engine service's HTTP op), the buckets by broadcast, one
at a time (a delta push's, :mod:`models.engines.weight_delta`, each after its length) (:meth:`Sender.send_bucket`, :meth:`Receiver.buckets`): the receiver takes a bucket into a buffer its
engine gives (:meth:`~models.engines.base.SwappableEngine.push_buffer`) only once the one before is loaded.
Every wait is bounded by the channel's timeout; a failure raises :class:`ChannelError` and the channel is not
used again.
"""

from __future__ import annotations

import atexit
import datetime as dt
import secrets
import socket
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from models.engines.weight_stream import bucket_nbytes, check_header

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


def _gloo(store, rank: int, size: int, host: str, timeout: dt.timedelta):
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, size, opts)


def _nccl(store, rank: int, size: int, host: str, timeout: dt.timedelta):
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, opts)


def group(backend: str, store, key: str, rank: int, host: str, timeout_s: float, size: int = 2):
    """The channel's process group (``size`` members: the sender and the receivers), as member ``rank``."""
    make = {"gloo": _gloo, "nccl": _nccl}[backend]
    return make(dist.PrefixStore(f"weights/{key}/", store), rank, size, host, dt.timedelta(seconds=timeout_s))


def _broadcast(group, buffer: torch.Tensor, backend: str, timeout_s: float) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = SENDER, 0
    _wait(lambda: group.broadcast([buffer], opts), "a broadcast", backend, timeout_s)


def _wait(start: Callable[[], Any], what: str, backend: str, timeout_s: float) -> None:
    try:
        start().wait(dt.timedelta(seconds=timeout_s))
    except Exception as err:  # noqa: BLE001 -- gloo and NCCL raise RuntimeError or DistBackendError
        raise ChannelError(f"{what} over the {backend} weight channel failed "
                           f"({type(err).__name__}: {str(err).strip()[:300]})") from err


def send_to(group, buffer: torch.Tensor, rank: int, backend: str, timeout_s: float) -> None:
    """``buffer`` to member ``rank`` alone (a worker's share of a push, :mod:`models.engines.worker_channel`)."""
    _wait(lambda: group.send([buffer], rank, 0), f"a send to member {rank}", backend, timeout_s)


def receive_from(group, buffer: torch.Tensor, rank: int, backend: str, timeout_s: float) -> None:
    _wait(lambda: group.recv([buffer], rank, 0), f"a receive from member {rank}", backend, timeout_s)


def device_for(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


class Receiver:
    """The engine's end: opens the store on ``host`` (the address the engine serves on) and forms the
    group in the background, as rank 1, once the sender joins. ``workers`` (a list of their GPUs, "" for none): the
    engine's tensor-parallel workers join instead, as ranks 1, 2, ... (:mod:`models.engines.worker_channel`),
    each receiving its share of every push straight from the sender; this process only holds the store."""

    def __init__(self, host: str, sender_gpu: str, timeout_s: float = TIMEOUT_S, workers: Optional[list] = None):
        self.host, self.timeout_s, self.workers = host, timeout_s, list(workers or [])
        self.announced = 0  # the pushes announced to the workers (models.engines.worker_channel.announce)
        gpus = self.workers or [gpu_id()]
        self.backend = "nccl" if all(choose_backend(sender_gpu, g) == "nccl" for g in gpus) else "gloo"
        self.key = secrets.token_hex(8)
        listening = socket.create_server((host, 0))  # the store listens on ``host`` only, on a free port
        port = listening.getsockname()[1]
        self.store = dist.TCPStore(host, port, None, True, dt.timedelta(seconds=timeout_s), wait_for_workers=False,
                                   master_listen_fd=listening.detach())  # the store owns the socket from here
        self._group: Future = Future()
        if not self.workers:
            threading.Thread(target=self._form, daemon=True, name="weight-channel").start()
        atexit.register(self.close)  # a process group left at the interpreter's exit aborts the process

    def _form(self) -> None:
        try:
            self._group.set_result(group(self.backend, self.store, self.key, RECEIVER, self.host, self.timeout_s))
        except Exception as err:  # noqa: BLE001 -- handed to receive()
            self._group.set_exception(err)

    def offer(self) -> Dict[str, Any]:
        """What the sender joins with (JSON)."""
        return {"port": self.store.port, "backend": self.backend, "key": self.key,
                "size": 1 + max(len(self.workers), 1)}

    @property
    def device(self) -> torch.device:
        return device_for(self.backend)

    def buckets(self, header: Mapping[str, Any], push: int, alloc: Callable[[int, torch.device], torch.Tensor]
                ) -> Iterator[Tuple[int, torch.Tensor]]:
        """The sender's push number ``push``, laid out by ``header``: tells the sender it listens
        (:meth:`Sender.wait_ready`), then takes the buckets one at a time, each into ``alloc(bytes, device)``, as
        the caller asks for the next (it loads one before it takes the next)."""
        check_header(header)
        try:
            group = self._group.result(timeout=self.timeout_s + 5)
        except Exception as err:  # noqa: BLE001 -- the sender never joined, or the rendezvous failed
            raise ChannelError(f"the {self.backend} weight channel on {self.host}:{self.store.port} did not form "
                               f"({type(err).__name__}: {str(err).strip()[:300]})") from err
        self.store.set(_ready_key(self.key, push), "1")
        for index in range(len(header["buckets"])):
            nbytes = bucket_nbytes(header, index)
            if "delta" in header:  # a delta bucket's length is known once it is made: the sender sends it first
                size = torch.zeros(1, dtype=torch.int64, device=self.device)
                _broadcast(group, size, self.backend, self.timeout_s)
                nbytes = int(size.item())
            buffer = alloc(nbytes, self.device)
            _broadcast(group, buffer, self.backend, self.timeout_s)
            yield index, buffer
            del buffer

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
        self.size, self.shares = int(offer.get("size", 2)), offer.get("shares")
        where = f"{host}:{offer['port']}"
        try:
            self.store = dist.TCPStore(host, int(offer["port"]), None, False, dt.timedelta(seconds=timeout_s))
            self.group = group(self.backend, self.store, str(offer["key"]), SENDER, _local_address(host),
                               timeout_s, self.size)
        except Exception as err:  # noqa: BLE001 -- the store or the peer cannot be reached
            raise ChannelError(f"joining the {self.backend} weight channel at {where} failed "
                               f"({type(err).__name__}: {str(err).strip()[:300]})") from err
        atexit.register(self.close)  # a process group left at the interpreter's exit aborts the process

    def wait_ready(self, push: int, give_up: Callable[[], bool], timeout_s: float, setting: str = "") -> None:
        """Until the receiver takes push ``push`` (it may be busy with other work first; no broadcast waits
        on it meanwhile), ``give_up()`` is true (the receiver failed before), or ``timeout_s`` passed (the error
        names ``setting``, the limit's)."""
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
                raise ChannelError(f"the receiver did not take the push in {timeout_s:g} s"
                                   + (f" ({setting})" if setting else ""))

    @property
    def device(self) -> torch.device:
        return device_for(self.backend)

    def send_bucket(self, buffer: torch.Tensor) -> None:
        """Broadcast one bucket's bytes (on :attr:`device`)."""
        _broadcast(self.group, buffer, self.backend, self.timeout_s)

    def send_shares(self, header: Mapping[str, Any], index: int, bucket: torch.Tensor) -> None:
        """Bucket ``index`` to the engine's workers, each its share after its length; a delta's bucket (a few % of
        the weights) broadcast whole, each worker patching its own slices of it."""
        from models.engines.weight_shares import pack

        if "delta" in header:
            self.send_size(bucket.numel())
            self.send_bucket(bucket)
            return
        for w in range(self.size - 1):
            payload = pack(header, index, bucket, self.shares[w] if self.shares else None)
            size = torch.tensor([payload.numel()], dtype=torch.int64, device=self.device)
            send_to(self.group, size, 1 + w, self.backend, self.timeout_s)
            send_to(self.group, payload, 1 + w, self.backend, self.timeout_s)

    def send_size(self, nbytes: int) -> None:
        """A delta push's next bucket's length, ahead of it."""
        _broadcast(self.group, torch.tensor([nbytes], dtype=torch.int64, device=self.device), self.backend,
                   self.timeout_s)

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

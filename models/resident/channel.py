"""New actor weights from the actor trainer service to the engine service (``run.resident``), by the
transport ``run.resident_weight_transport`` names:

- ``collective`` (default): a process group of two, the trainer's rank 0 and the engine service
  (:mod:`models.engines.weight_channel`; NCCL when both are on different GPUs, else gloo). The trainer
  opens it at its first push (the engine's ``channel`` op answers where its store listens: a free port on
  the address the service serves on); each push sends a header (names, shapes, dtypes, the probe) as the
  engine's ``weights`` op and the tensors by broadcast while that op runs, a few flat buffers per dtype.
- ``http``: the tensors packed into the ``weights`` op's body (:func:`models.engines.weights.pack_weights`).

LoRA sends the adapter alone, over HTTP with either transport (its file is a few MB). Either way the engine
then loads the tensors in place and checks them with the probe; until that passed it serves no iteration
(version -1). A channel that does not form or breaks mid-push fails the update, naming the engine service
and the transport; the next push forms a new one.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Callable, Dict, Mapping, Optional
from urllib.parse import urlsplit

import torch

from models.engines.weight_channel import ChannelError, Receiver, Sender, gpu_id, plan
from models.resident import protocol

TRANSPORT_CODES = {"http": 0.0, "gloo": 1.0, "nccl": 2.0}
"""The metric ``resident/weights_transport``: how the update's weights reached the engine."""
HTTP_TIMEOUT_S = 3600.0


def http_push(address: protocol.ServiceAddress, args: Mapping[str, Any], body: bytes) -> Dict[str, float]:
    """The weights (or the adapter) as the ``weights`` op's binary body."""
    out = protocol.post_weights(address, args, body, HTTP_TIMEOUT_S)
    return {**out, "resident/weights_bytes": float(len(body)), "resident/weights_transport": TRANSPORT_CODES["http"]}


def _in_background(fn: Callable[[], Any]) -> Future:
    done: Future = Future()

    def run() -> None:
        try:
            done.set_result(fn())
        except BaseException as err:  # noqa: BLE001 -- handed to the caller
            done.set_exception(err)

    threading.Thread(target=run, daemon=True, name="weights-op").start()
    return done


class WeightSender:
    """The actor trainer's end (its rank 0): the channel, formed at the first push, kept for the next."""

    def __init__(self, timeout_s: Optional[float] = None):
        self.sender: Optional[Sender] = None
        self.engine_url = ""
        self.pushes = 0
        self.timeout_s = timeout_s

    def _join(self, address: protocol.ServiceAddress) -> Sender:
        if self.sender is not None and self.engine_url == address.url:
            return self.sender
        self.close()
        host = urlsplit(address.url).hostname or "127.0.0.1"
        offer = protocol.call(address, "channel", {"host": host, "gpu": gpu_id(), **self._timeout()}, HTTP_TIMEOUT_S)
        self.sender = Sender(host, offer, **self._timeout())
        self.engine_url = address.url
        return self.sender

    def _timeout(self) -> Dict[str, float]:
        return {} if self.timeout_s is None else {"timeout_s": self.timeout_s}

    def push(self, address: protocol.ServiceAddress, args: Mapping[str, Any],
             state: Mapping[str, torch.Tensor]) -> Dict[str, float]:
        """``state`` to the engine service over the channel, with the ``weights`` op's ``args``; its reply."""
        reply: Optional[Future] = None
        backend = "not formed"
        try:
            sender = self._join(address)
            backend = sender.backend
            header, buckets = plan(state)
            self.pushes += 1
            op_args = {**args, "transport": "collective", "header": header, "push": self.pushes}
            reply = _in_background(lambda: protocol.call(address, "weights", op_args, HTTP_TIMEOUT_S))
            sender.wait_ready(self.pushes, reply.done, HTTP_TIMEOUT_S)
            sender.send(buckets)
            out = reply.result()
        except (ChannelError, protocol.ServiceError, torch.distributed.DistError, OSError) as err:
            # (DistError: the engine's store or group gone mid-push, e.g. the engine killed)
            self.close()  # the engine drops its end too: the next push forms a new channel
            kind = type(err) if isinstance(err, protocol.ServiceError) else protocol.ServiceError
            raise kind(f"the weights of iteration {args['version']} to {address.label} at {address.url} over the "
                       f"collective transport ({backend}) failed: {err}{_engine_error(reply, err)}. The engine does "
                       f"not serve them: rerun the launch to resume from the last checkpoint (or set "
                       f"run.resident_weight_transport=http)") from None
        size = sum(t.numel() * t.element_size() for bucket in buckets for t in bucket)
        return {**out, "resident/weights_bytes": float(size), "resident/weights_transport": TRANSPORT_CODES[backend]}

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        self.sender, self.engine_url = None, ""


def _engine_error(reply: Optional[Future], err: Exception) -> str:
    """The engine's own account of a failed push, when its reply comes within a few seconds."""
    if reply is None or isinstance(err, protocol.ServiceError):
        return ""
    try:
        reply.result(timeout=30)
    except protocol.ServiceError as engine:
        return f"; {engine}"
    except Exception:  # noqa: BLE001 -- no reply in time: the broadcast's error is the reason
        return ""
    return ""


class WeightReceiver:
    """The engine service's end: the ``channel`` op opens it, a ``weights`` op with the collective transport
    takes a push from it."""

    def __init__(self) -> None:
        self.receiver: Optional[Receiver] = None

    def open(self, args: Mapping[str, Any]) -> Dict[str, Any]:
        self.close()
        timeout = {"timeout_s": float(args["timeout_s"])} if "timeout_s" in args else {}
        self.receiver = Receiver(str(args["host"]), str(args.get("gpu", "")), **timeout)
        return self.receiver.offer()

    def receive(self, args: Mapping[str, Any]) -> Dict[str, torch.Tensor]:
        """The tensors of the push ``args`` announce (a ``weights`` op's arguments)."""
        if self.receiver is None:
            raise ChannelError("the weights came over the collective transport, but no weight channel is open "
                               "(the actor trainer opens one with the channel op at its first push)")
        backend = self.receiver.backend
        try:
            return self.receiver.receive(args["header"], int(args["push"]))
        except Exception as err:
            self.close()
            raise ChannelError(f"receiving the weights of iteration {args.get('version')} from the actor trainer "
                               f"over the collective transport ({backend}) failed: {err}") from err

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        self.receiver = None

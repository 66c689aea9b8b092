"""New actor weights from the actor trainer service to the engine service (``run.resident``): one interface,
:class:`Transport`, whose :meth:`~Transport.send` runs on the trainer's rank 0 and whose :meth:`~Transport.receive`
runs in the engine's ``weights`` op; both ends take the same one from :func:`transport_for`:

- ``collective`` (``run.resident_weight_transport``'s default): a process group of two, the trainer's rank 0 and
  the engine (:mod:`models.engines.weight_channel`; NCCL between two GPUs, else gloo), formed at the first push
  (the engine's ``connect`` op answers where its store listens) and kept; each push sends a header with the
  ``weights`` op and the tensors by broadcast while that op runs, a few flat buffers per dtype;
- ``http``: the tensors packed into the ``weights`` op's body (:func:`models.engines.weights.pack_weights`);
- with ``actor.lora``, the adapter alone, its file as the body (a few MB).

The engine then loads them in place and checks them with the probe; until that passed it serves no iteration. A
channel that does not form or breaks mid-push fails the update, naming the engine and the transport; the next
push forms a new one. Adding a transport: a subclass here, named in :data:`TRANSPORTS`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, Mapping, Optional
from urllib.parse import urlsplit

import torch

from models.engines.weight_channel import ChannelError, Receiver, Sender, gpu_id, plan
from models.engines.weights import pack_weights, unpack_weights
from models.service.client import ServiceClient, ServiceError
from models.training.files import ADAPTER_CONFIG

CODES = {"http": 0.0, "gloo": 1.0, "nccl": 2.0}
"""The metric ``resident/weights_transport``: how the update's weights reached the engine."""
ADAPTER_FILE = "adapter_model.safetensors"


class Transport:
    """One way for the weights to travel: the sender's and the receiver's end. ``weights``: the actor's
    (its language model's) state, gathered on rank 0 under FSDP2."""

    def send(self, engine: ServiceClient, args: Dict[str, Any], lm, weights: Mapping[str, torch.Tensor]) \
            -> Dict[str, float]:
        """Run the engine's ``weights`` op with ``args`` and the weights; its reply and what the push moved."""
        raise NotImplementedError

    def receive(self, meta: Mapping[str, Any], body: Optional[bytes]) -> Callable[[Any], None]:
        """The pushed weights, taken now; the function returned puts them into the engine it is given (the one
        serving when they are loaded: off-policy, later)."""
        raise NotImplementedError

    def connect(self, **offer: Any) -> Dict[str, Any]:
        raise ChannelError(f"the {type(self).__name__} needs no channel")

    def close(self) -> None:
        pass


def _in_body(engine: ServiceClient, args: Dict[str, Any], body: bytes) -> Dict[str, float]:
    out = engine.call("weights", args, body=body)
    return {**out, "resident/weights_bytes": float(len(body)), "resident/weights_transport": CODES["http"]}


class HTTPTransport(Transport):
    def send(self, engine, args, lm, weights):
        return _in_body(engine, args, pack_weights(weights))

    def receive(self, meta, body):
        tensors = unpack_weights(body)
        return lambda engine: engine.load_tensors(tensors)


class AdapterTransport(Transport):
    """LoRA: the adapter's file and config as the actor's checkpoint would hold them; the engine serves it as an
    adapter on its base, or merged into it (``rollout.lora_mode``), from a folder of its process."""

    def __init__(self, merged: bool = False, dtype: str = "float32", base_url: str = ""):
        self.merged, self.dtype, self.base_url, self.folder = merged, dtype, base_url, ""

    def send(self, engine, args, lm, weights):
        with tempfile.TemporaryDirectory(prefix="adapter-out-") as tmp:  # never the run's storage
            lm.save_pretrained(tmp, safe_serialization=True, save_embedding_layers=False, state_dict=weights)
            with open(os.path.join(tmp, ADAPTER_CONFIG), encoding="utf-8") as f:
                config = json.load(f)
            with open(os.path.join(tmp, ADAPTER_FILE), "rb") as f:
                body = f.read()
        return _in_body(engine, {**args, "meta": {"adapter_config": config}}, body)

    def receive(self, meta, body):
        from models.checkpoint.local import local_checkpoint
        from models.training.lora import canonical_url
        from models.training.merge import merged_copy

        folder = tempfile.mkdtemp(prefix="adapter-in-memory-")
        with open(os.path.join(folder, ADAPTER_FILE), "wb") as f:
            f.write(body)
        config = {**meta["adapter_config"], "base_model_name_or_path": canonical_url(self.base_url)}  # the run's base
        with open(os.path.join(folder, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
            json.dump(config, f)

        def put(engine) -> None:
            if self.merged:
                engine.load_weights(merged_copy(folder, local_checkpoint, getattr(torch, self.dtype)))
            else:
                engine.set_adapter(folder)
            if self.folder:
                shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = folder

        return put


class CollectiveTransport(Transport):
    """A process group of two, formed at the first push and kept for the next."""

    def __init__(self, timeout_s: Optional[float] = None):
        self.sender: Optional[Sender] = None
        self.receiver: Optional[Receiver] = None
        self.engine_url, self.pushes = "", 0
        self.timeout = {} if timeout_s is None else {"timeout_s": timeout_s}
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="weights-op")

    def _join(self, engine: ServiceClient) -> Sender:
        if self.sender is not None and self.engine_url == engine.url:
            return self.sender
        self.close()
        host = urlsplit(engine.url).hostname or "127.0.0.1"
        offer = engine.call("connect", {"host": host, "gpu": gpu_id(), **self.timeout})
        self.sender, self.engine_url = Sender(host, offer, **self.timeout), engine.url
        return self.sender

    def send(self, engine, args, lm, weights):
        reply: Optional[Future] = None
        backend = "not formed"
        try:
            sender = self._join(engine)
            backend = sender.backend
            header, buckets = plan(weights)
            self.pushes += 1
            op_args = {**args, "meta": {"header": header, "push": self.pushes}}
            reply = self.pool.submit(engine.call, "weights", op_args)  # the op takes the broadcasts while it runs
            # until the engine takes the op (after the op it runs: an off-policy rollout), as long as it shows
            # life: its heartbeat keeps the op's reply pending, its silence (or failure) ends it
            sender.wait_ready(self.pushes, reply.done, float("inf") if engine.heartbeat else engine.timeout_s)
            sender.send(buckets)
            out = reply.result()
        except (ChannelError, ServiceError, torch.distributed.DistError, OSError) as err:
            # (DistError: the engine's store or group gone mid-push, e.g. the engine killed)
            self.close()  # the engine drops its end too: the next push forms a new channel
            kind = type(err) if isinstance(err, ServiceError) else ServiceError
            raise kind(f"the weights of iteration {args['version']} to {engine.label} at {engine.url} over the "
                       f"collective transport ({backend}) failed: {err}{_engine_error(reply, err)}. The engine does "
                       f"not serve them: rerun the launch to resume from the last checkpoint (or set "
                       f"run.resident_weight_transport=http)") from None
        size = sum(t.numel() * t.element_size() for bucket in buckets for t in bucket)
        return {**out, "resident/weights_bytes": float(size), "resident/weights_transport": CODES[backend]}

    def connect(self, host: str, gpu: str = "", timeout_s: Optional[float] = None) -> Dict[str, Any]:
        self.close()
        self.receiver = Receiver(host, gpu, **({} if timeout_s is None else {"timeout_s": float(timeout_s)}))
        return self.receiver.offer()

    def receive(self, meta, body):
        if self.receiver is None:
            raise ChannelError("the weights came over the collective transport, but no weight channel is open "
                               "(the actor trainer opens one with the connect op at its first push)")
        backend = self.receiver.backend
        try:
            tensors = self.receiver.receive(meta["header"], int(meta["push"]))
        except Exception as err:
            self.close()
            raise ChannelError(f"receiving the weights from the actor trainer over the collective transport "
                               f"({backend}) failed: {err}") from err
        return lambda engine: engine.load_tensors(tensors)

    def close(self) -> None:
        for end in (self.sender, self.receiver):
            if end is not None:
                end.close()
        self.sender = self.receiver = None
        self.engine_url = ""


def _engine_error(reply: Optional[Future], err: Exception) -> str:
    """The engine's own account of a failed push, when its reply comes within a few seconds."""
    if reply is None or isinstance(err, ServiceError):
        return ""
    try:
        reply.result(timeout=30)
    except ServiceError as engine:
        return f"; {engine}"
    except Exception:  # noqa: BLE001 -- no reply in time: the broadcast's error is the reason
        return ""
    return ""


TRANSPORTS: Dict[str, Callable[..., Transport]] = {"collective": CollectiveTransport, "http": HTTPTransport}
"""``run.resident_weight_transport``'s values and their transports (LoRA: :class:`AdapterTransport`)."""


def transport_for(cfg, reference_url: str = "") -> Transport:
    """The transport both ends of a run use: the adapter alone with ``actor.lora``, else the configured one."""
    if cfg.actor.lora.enabled:
        return AdapterTransport(cfg.rollout.lora_mode == "merged", cfg.model.dtype, reference_url)
    return TRANSPORTS[cfg.run.resident_weight_transport]()

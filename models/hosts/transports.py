"""New actor weights from the actor trainer service to the engine service (``run.resident``): one interface,
:class:`Transport`, whose :meth:`~Transport.send` runs on the trainer's rank 0 and whose :meth:`~Transport.receive`
runs in the engine's ``weights`` op; both ends take the same one from :func:`transport_for`:

- ``collective`` (``run.resident_weight_transport``'s default): a process group of two, the trainer's rank 0 and
  the engine (:mod:`models.engines.weight_channel`; NCCL between two GPUs, else gloo), formed at the first push
  (the engine's ``connect`` op answers where its store listens) and kept (a tensor-parallel vLLM engine's workers
  join it instead of the engine's process, each receiving its share of every bucket:
  :mod:`models.engines.worker_channel`); each push sends a header with the
  ``weights`` op and the buckets by broadcast while that op runs;
- ``http``: the same buckets, one after the other, as the ``weights`` op's body;
- with ``actor.lora``, the adapter alone, its file as the body (a few MB).

Full weights go at the engine's dtype (``TrainConfig.engine_dtype``: ``rollout.vllm_dtype`` for vLLM,
``model.dtype`` for the HF engine; the trainer casts each tensor as it gathers it, round to nearest even, as a checkpoint load
casts), in buckets (:mod:`models.engines.weight_stream`): the trainer's rank 0 gathers a bucket's tensors (one
FSDP2 gather each, every rank taking part) and sends it before it gathers the next, and the engine loads each
bucket before it receives the next (with ``run.off_policy_steps=1`` or ``run.max_staleness`` ≥ 2 it keeps them until
the push is served: in host memory, each copied there as it arrives, so an NCCL push holds at most two buckets on the
engine's GPU while vLLM generates).
Each bucket carries its checksum, checked before it is loaded; after the load the engine reads sampled elements
of every tensor back from its own weights and compares them bit for bit with what the trainer sent, then checks
the probe; until both passed it serves no iteration. ``resident/weights_bytes`` is the tensors' bytes at the
engine's dtype. A channel that does not form or breaks mid-push fails the update, naming the engine and the
transport; the next push forms a new one. Adding a transport: a subclass here, named in :data:`TRANSPORTS`.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, Mapping, Optional, Tuple
from urllib.parse import urlsplit

import torch

from models.engines.weight_channel import ChannelError, Receiver, Sender, gpu_id
from models.engines.weight_stream import bucket_nbytes, check_header
from models.hosts.pushes import Held, Push, received, received_by_workers, sealed
from models.service.client import ServiceClient, ServiceError
from models.training.files import ADAPTER_CONFIG
from models.training.weight_shadow import Shadow
from models.training.weight_source import WeightSource

CODES = {"http": 0.0, "gloo": 1.0, "nccl": 2.0}
"""The metric ``resident/weights_transport``: how the update's weights reached the engine."""
ADAPTER_FILE = "adapter_model.safetensors"


class Transport:
    """One way for the weights to travel: the sender's and the receiver's end. ``dtype``: what floating-point
    tensors travel as (the engine's); ``bucket_bytes``: the most tensor bytes a bucket holds."""

    def __init__(self, dtype: str = "float32", bucket_bytes: Optional[int] = None):
        self.push = Push(getattr(torch, dtype), bucket_bytes)

    def ready(self, engine: ServiceClient, args: Dict[str, Any], source: WeightSource, wait_s: Optional[float] = None,
              plan: Optional[Mapping[str, Any]] = None) -> None:
        """Rank 0 of the trainer, before the push's first collective (its other ranks wait outside any meanwhile,
        :func:`models.hosts.trainers.push_weights`): what must hold before the gathers begin, at most ``wait_s``
        (None: as long as the engine shows life). Nothing here; the collective transport: the engine took the push."""

    def send(self, engine: ServiceClient, args: Dict[str, Any], lm, source: WeightSource,
             plan: Optional[Mapping[str, Any]] = None, shadow: Optional[Shadow] = None) -> Dict[str, float]:
        """Run the engine's ``weights`` op with ``args`` and the weights of ``source`` (rank 0 of the trainer); its
        reply and what the push moved. ``plan`` and ``shadow`` (``run.weight_push=delta``): the push's ids
        (:meth:`models.hosts.pushes.Push.header`) and the engine's copy the trainer keeps."""
        raise NotImplementedError

    def follow(self, source: WeightSource, plan: Optional[Mapping[str, Any]] = None,
               shadow: Optional[Shadow] = None) -> None:
        """A trainer rank other than 0, while rank 0 sends: its part in the gathers (a delta's: in the counts and
        gathers of the changed elements)."""
        if plan and plan.get("base"):
            for _ in shadow.deltas(source, self.push.dtype, int(plan["seed"])):
                pass
        else:
            (source.keeping(shadow.keep) if shadow is not None else source).follow(self.push.dtype)

    def buckets(self, header: Mapping[str, Any], source: WeightSource, device, version: int,
                plan: Optional[Mapping[str, Any]], shadow: Optional[Shadow]):
        """The push's buckets as rank 0 seals them (a delta's against ``shadow``; a full push's kept in it)."""
        seed = int(plan["seed"]) if plan else int(version)
        return sealed(header, source, torch.device(device), seed, self.push.dtype, shadow=shadow)

    def receive(self, meta: Mapping[str, Any], body: Optional[bytes], engine=None) -> Callable[[Any], Dict[str, float]]:
        """The pushed weights, taken now: loaded into ``engine`` as they arrive, or (None: off-policy, the push
        is served later) kept. The function returned puts them into the engine it is given (the one serving when
        they are loaded), checks that it holds what was sent, and says what the receiver held."""
        raise NotImplementedError

    def connect(self, **offer: Any) -> Dict[str, Any]:
        raise ChannelError(f"the {type(self).__name__} needs no channel")

    def close(self) -> None:
        pass


def _in_body(engine: ServiceClient, args: Dict[str, Any], body: bytes) -> Dict[str, float]:
    out = engine.call("weights", args, body=body)
    return {**out, "resident/weights_bytes": float(len(body)), "resident/weights_transport": CODES["http"]}


class HTTPTransport(Transport):
    """The buckets one after the other as the op's body (the receiver holds the whole body)."""

    def send(self, engine, args, lm, source, plan=None, shadow=None):
        header = self.push.header(source, "cpu", plan)
        buckets = self.buckets(header, source, "cpu", int(args["version"]), plan, shadow)
        sized = "delta" in header  # each bucket after its length (known once it is made)
        try:
            body = b"".join((struct.pack("<q", bucket.numel()) if sized else b"") + bytes(bucket.numpy())
                            for bucket in buckets)
        except BaseException:
            buckets.drain()  # the other ranks gather the rest: take part
            raise
        out = engine.call("weights", {**args, "meta": {"header": header}}, body=body)
        return {**out, **self.push.stats(header, getattr(buckets, "sent", None)),
                "resident/weights_transport": CODES["http"]}

    def receive(self, meta, body, engine=None):
        header = meta["header"]
        return received(header, _body_buckets(header, body or b""), engine)


def _body_buckets(header: Mapping[str, Any], body: bytes):
    """The buckets of an HTTP push: views of the body (read, never written)."""
    check_header(header)
    if "delta" in header:
        yield from _framed_buckets(header, body)
        return
    sizes = [bucket_nbytes(header, i) for i in range(len(header["buckets"]))]
    if sum(sizes) != len(body):
        raise ChannelError(f"the weights' body holds {len(body)} bytes where its header lays out {sum(sizes)}")
    offset = 0
    for index, size in enumerate(sizes):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # bytes are read-only: the tensors are only read
            buffer = torch.frombuffer(body, dtype=torch.uint8, count=size, offset=offset) if size else \
                torch.empty(0, dtype=torch.uint8)
        yield index, buffer
        offset += size


def _framed_buckets(header: Mapping[str, Any], body: bytes):
    """A delta push's buckets in an HTTP body, each after its length (8 bytes, little-endian)."""
    offset = 0
    for index in range(len(header["buckets"])):
        if offset + 8 > len(body):
            raise ChannelError(f"the delta weights' body ends ({len(body)} bytes) before bucket {index}")
        (size,) = struct.unpack_from("<q", body, offset)
        offset += 8
        if size < 0 or offset + size > len(body):
            raise ChannelError(f"the delta weights' body holds {len(body) - offset} bytes after bucket {index}'s "
                               f"length, which says {size}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # bytes are read-only: the tensors are only read
            yield index, torch.frombuffer(body, dtype=torch.uint8, count=size, offset=offset) if size else \
                torch.empty(0, dtype=torch.uint8)
        offset += size
    if offset != len(body):
        raise ChannelError(f"the delta weights' body holds {len(body) - offset} bytes after its last bucket")


def adapter_file(lm, state: Mapping[str, torch.Tensor]) -> Tuple[Dict[str, Any], bytes]:
    """The adapter's config and file as the actor's checkpoint would hold them (``state``: its tensors whole)."""
    with tempfile.TemporaryDirectory(prefix="adapter-out-") as tmp:  # never the run's storage
        lm.save_pretrained(tmp, safe_serialization=True, save_embedding_layers=False, state_dict=dict(state))
        with open(os.path.join(tmp, ADAPTER_CONFIG), encoding="utf-8") as f:
            config = json.load(f)
        with open(os.path.join(tmp, ADAPTER_FILE), "rb") as f:
            return config, f.read()


class AdapterTransport(Transport):
    """LoRA: the adapter's file and config as the actor's checkpoint would hold them; the engine serves it as an
    adapter on its base, or merged into it (``rollout.lora_mode``), from a folder of its process."""

    def __init__(self, merged: bool = False, dtype: str = "float32", base_url: str = ""):
        super().__init__()
        self.merged, self.dtype, self.base_url, self.folder = merged, dtype, base_url, ""

    def follow(self, source, plan=None, shadow=None):
        source.full()

    def send(self, engine, args, lm, source, plan=None, shadow=None):
        config, body = adapter_file(lm, source.full())
        return _in_body(engine, {**args, "meta": {"adapter_config": config}}, body)

    def receive(self, meta, body, engine=None):
        from models.checkpoint.local import local_checkpoint
        from models.training.lora import canonical_url
        from models.training.merge import merged_copy

        folder = tempfile.mkdtemp(prefix="adapter-in-memory-")
        with open(os.path.join(folder, ADAPTER_FILE), "wb") as f:
            f.write(body)
        config = {**meta["adapter_config"], "base_model_name_or_path": canonical_url(self.base_url)}  # the run's base
        with open(os.path.join(folder, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
            json.dump(config, f)

        def put(engine) -> Dict[str, float]:
            if self.merged:
                engine.load_weights(merged_copy(folder, local_checkpoint, getattr(torch, self.dtype)))
            else:
                engine.set_adapter(folder)
            if self.folder:
                shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = folder
            return {}

        return put


class CollectiveTransport(Transport):
    """A process group of two, formed at the first push and kept for the next."""

    def __init__(self, dtype: str = "float32", bucket_bytes: Optional[int] = None, timeout_s: Optional[float] = None):
        super().__init__(dtype, bucket_bytes)
        self.sender: Optional[Sender] = None
        self.receiver: Optional[Receiver] = None
        self.engine_url, self.pushes = "", 0
        self.timeout = {} if timeout_s is None else {"timeout_s": timeout_s}
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="weights-op")
        self.begun: Optional[Tuple[Sender, Dict[str, Any], Future]] = None  # ready(): the push under way

    def _join(self, engine: ServiceClient) -> Sender:
        if self.sender is not None and self.engine_url == engine.url:
            return self.sender
        self.close()
        host = urlsplit(engine.url).hostname or "127.0.0.1"
        offer = engine.call("connect", {"host": host, "gpu": gpu_id(), **self.timeout})
        self.sender, self.engine_url = Sender(host, offer, **self.timeout), engine.url
        return self.sender

    def ready(self, engine, args, source, wait_s=None, plan=None):
        """The channel formed, the ``weights`` op under way and the engine listening on it (after the op it runs: an
        off-policy rollout, an asynchronous unit): no broadcast and no gather waits on the engine meanwhile."""
        self.begun, reply, backend = None, None, "not formed"
        try:
            sender = self._join(engine)
            backend = sender.backend
            header = self.push.header(source, sender.device, plan)
            self.pushes += 1
            op_args = {**args, "meta": {"header": header, "push": self.pushes}}
            reply = self.pool.submit(engine.call, "weights", op_args)  # the op takes the broadcasts while it runs
            if wait_s is None:  # as long as it shows life: its heartbeat keeps the reply pending, silence ends it
                wait_s = float("inf") if engine.heartbeat else engine.timeout_s
            sender.wait_ready(self.pushes, reply.done, wait_s, "run.resident_push_wait_s")
        except BaseException as err:
            self.close()  # the engine drops its end too: the next push forms a new channel
            raise self._failed(err, args, engine, backend, reply) from None
        self.begun = (sender, header, reply)

    def send(self, engine, args, lm, source, plan=None, shadow=None):
        begun, self.begun = self.begun, None
        if begun is None:
            try:
                self.ready(engine, args, source, plan=plan)
            except BaseException:
                self.follow(source, plan, shadow)  # the other ranks' gathers
                raise
            begun, self.begun = self.begun, None
        sender, header, reply = begun
        buckets = None
        try:
            buckets = self.buckets(header, source, sender.device, self.pushes, plan, shadow)
            for index, bucket in enumerate(buckets):
                if sender.size > 2:  # the engine's workers, each its share
                    sender.send_shares(header, index, bucket)
                    continue
                if "delta" in header:
                    sender.send_size(bucket.numel())
                sender.send_bucket(bucket)
            out = reply.result()
        except BaseException as err:
            self.follow(source, plan, shadow) if buckets is None else buckets.drain()  # the other ranks' gathers
            self.close()  # the engine drops its end too: the next push forms a new channel
            raise self._failed(err, args, engine, sender.backend, reply) from None
        return {**out, **self.push.stats(header, getattr(buckets, "sent", None)),
                "resident/weights_transport": CODES[sender.backend]}

    @staticmethod
    def _failed(err: BaseException, args, engine, backend: str, reply: Optional[Future]) -> BaseException:
        if not isinstance(err, (ChannelError, ServiceError, torch.distributed.DistError, OSError)):
            return err  # (DistError: the engine's store or group gone mid-push, e.g. the engine killed)
        kind = type(err) if isinstance(err, ServiceError) else ServiceError
        return kind(f"the weights of iteration {args['version']} to {engine.label} at {engine.url} over the "
                    f"collective transport ({backend}) failed: {err}{_engine_error(reply, err)}. The engine does "
                    f"not serve them: the trainer keeps them for the same request to send again (or set "
                    f"run.resident_weight_transport=http)")

    def connect(self, host: str, gpu: str = "", timeout_s: Optional[float] = None, engine=None) -> Dict[str, Any]:
        """The channel's offer; an engine whose tensor-parallel workers are other processes has them join it, each
        to receive its share of every push (:mod:`models.engines.worker_channel`)."""
        self.close()
        workers = engine.channel_workers() if hasattr(engine, "channel_workers") else None
        self.receiver = Receiver(host, gpu, workers=workers,
                                 **({} if timeout_s is None else {"timeout_s": float(timeout_s)}))
        offer = self.receiver.offer()
        if workers:
            offer["shares"] = engine.join_channel(host, offer, self.receiver.timeout_s)
        return offer

    def receive(self, meta, body, engine=None):
        if self.receiver is None:
            raise ChannelError("the weights came over the collective transport, but no weight channel is open "
                               "(the actor trainer opens one with the connect op at its first push)")
        receiver, backend = self.receiver, self.receiver.backend
        if receiver.workers:
            try:
                return received_by_workers(receiver, meta["header"], int(meta["push"]), engine)
            except Exception as err:
                self.close()
                raise ChannelError(f"the engine's workers receiving the weights from the actor trainer over the "
                                   f"collective transport ({backend}) failed: {err}") from err
        held = Held()  # kept (engine None): each bucket copied to host memory as it arrives, two at most on the device
        alloc = held.alloc(engine.push_buffer if engine is not None else _in_memory)
        try:
            return received(meta["header"], receiver.buckets(meta["header"], int(meta["push"]), alloc), engine, held,
                            to_host=engine is None)
        except Exception as err:
            self.close()
            raise ChannelError(f"receiving the weights from the actor trainer over the collective transport "
                               f"({backend}) failed: {err}") from err

    def close(self) -> None:
        for end in (self.sender, self.receiver):
            if end is not None:
                end.close()
        self.sender = self.receiver = None
        self.engine_url = ""


def _in_memory(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


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
    """The transport both ends of a run use: the adapter alone with ``actor.lora``, else the configured one, at
    the engine's dtype."""
    if cfg.actor.lora.enabled:
        return AdapterTransport(cfg.rollout.lora_mode == "merged", cfg.model.dtype, reference_url)
    return TRANSPORTS[cfg.run.resident_weight_transport](cfg.engine_dtype)

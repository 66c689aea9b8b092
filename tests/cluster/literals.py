"""What Flyte's control plane does with literals: builds an execution's inputs (``TypeEngine``), resolves
a node's input bindings from the outputs of the nodes before it, and moves ``inputs.pb``/
``outputs.pb``/``futures.pb``/``error.pb`` through the object store, refusing documents over the
store's download limit (``storage.limits.maxDownloadMBs``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

from flyteidl.core import dynamic_job_pb2, errors_pb2, interface_pb2, literals_pb2

MAX_DOWNLOAD_BYTES = 2 << 20
"""flytestdlib's default ``storage.limits.maxDownloadMBs`` (2): propeller refuses a larger
``outputs.pb`` or ``futures.pb`` (helm charts often raise it to 10)."""


class LiteralTooLarge(RuntimeError):
    """A document the control plane reads is over :data:`MAX_DOWNLOAD_BYTES`."""


@dataclass(frozen=True)
class ObjectStore:
    """The cluster's metadata bucket as the control plane reaches it (s3fs with explicit settings,
    never the test process's environment)."""

    endpoint: str
    key: str
    secret: str
    max_download_bytes: int = MAX_DOWNLOAD_BYTES

    def fs(self):
        import s3fs

        return s3fs.S3FileSystem(key=self.key, secret=self.secret, client_kwargs={"endpoint_url": self.endpoint,
                                                                                  "region_name": "us-east-1"})

    def write(self, url: str, msg) -> int:
        data = msg.SerializeToString()
        with self.fs().open(url, "wb") as f:
            f.write(data)
        return len(data)

    def exists(self, url: str) -> bool:
        return self.fs().exists(url)

    def read(self, url: str, cls):
        """The protobuf ``cls`` at ``url``; :class:`LiteralTooLarge` past the download limit."""
        fs = self.fs()
        size = fs.size(url)
        if size > self.max_download_bytes:
            raise LiteralTooLarge(f"{url} is {size} bytes, over the control plane's download limit of "
                                  f"{self.max_download_bytes} bytes (storage.limits.maxDownloadMBs)")
        msg = cls()
        with fs.open(url, "rb") as f:
            msg.ParseFromString(f.read())
        return msg

    def listdir(self, prefix: str):
        fs = self.fs()
        return [p.rsplit("/", 1)[-1] for p in fs.ls(prefix, refresh=True)] if fs.exists(prefix) else []

    def read_literals(self, url: str) -> literals_pb2.LiteralMap:
        return self.read(url, literals_pb2.LiteralMap)

    def read_futures(self, url: str) -> dynamic_job_pb2.DynamicJobSpec:
        return self.read(url, dynamic_job_pb2.DynamicJobSpec)

    def read_error(self, url: str) -> errors_pb2.ErrorDocument:
        return self.read(url, errors_pb2.ErrorDocument)


def execution_inputs(interface: interface_pb2.TypedInterface, values: Mapping[str, Any]) -> literals_pb2.LiteralMap:
    """The LiteralMap a launch would send: each python value converted by ``TypeEngine`` to the type the
    workflow's interface declares (the python type guessed back from that literal type)."""
    from flytekit import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine
    from flytekit.models.types import LiteralType

    ctx = FlyteContextManager.current_context()
    out = {}
    for name, value in values.items():
        lt = LiteralType.from_flyte_idl(interface.inputs.variables[name].type)
        out[name] = TypeEngine.to_literal(ctx, value, TypeEngine.guess_python_type(lt), lt).to_flyte_idl()
    return literals_pb2.LiteralMap(literals=out)


START = ("", "start-node")
"""Node ids a promise uses for the workflow's own inputs."""


def resolve(binding: literals_pb2.BindingData, scope: Mapping[str, literals_pb2.LiteralMap]) -> literals_pb2.Literal:
    """The literal a binding stands for, ``scope`` holding each finished node's outputs (and the
    workflow's inputs under ``""``)."""
    kind = binding.WhichOneof("value")
    if kind == "scalar":
        return literals_pb2.Literal(scalar=binding.scalar)
    if kind == "collection":
        return literals_pb2.Literal(collection=literals_pb2.LiteralCollection(
            literals=[resolve(b, scope) for b in binding.collection.bindings]))
    if kind == "map":
        return literals_pb2.Literal(map=literals_pb2.LiteralMap(
            literals={k: resolve(v, scope) for k, v in binding.map.bindings.items()}))
    if kind == "promise":
        ref = binding.promise
        if ref.attr_path:
            raise NotImplementedError(f"promise attribute paths ({ref.node_id}.{ref.var}[...]) are not run")
        node = "" if ref.node_id in START else ref.node_id
        return scope[node].literals[ref.var]
    raise NotImplementedError(f"binding kind {kind!r}")


def node_inputs(node, scope: Mapping[str, literals_pb2.LiteralMap]) -> literals_pb2.LiteralMap:
    return literals_pb2.LiteralMap(literals={b.var: resolve(b.binding, scope) for b in node.inputs})


def upstream(node) -> set:
    """Nodes whose outputs ``node`` reads or that it waits for."""
    deps = set(node.upstream_node_ids)
    stack = [b.binding for b in node.inputs]
    while stack:
        b = stack.pop()
        kind = b.WhichOneof("value")
        if kind == "promise" and b.promise.node_id not in START:
            deps.add(b.promise.node_id)
        elif kind == "collection":
            stack.extend(b.collection.bindings)
        elif kind == "map":
            stack.extend(b.map.bindings.values())
    return deps


def python_value(literal: literals_pb2.Literal, python_type) -> Any:
    """A literal back in python (for the test's assertions)."""
    from flytekit import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine
    from flytekit.models.literals import Literal

    return TypeEngine.to_python_value(FlyteContextManager.current_context(), Literal.from_flyte_idl(literal),
                                      python_type)


def error_summary(doc: Optional[errors_pb2.ErrorDocument]) -> str:
    if doc is None:
        return ""
    e = doc.error
    kind = errors_pb2.ContainerError.Kind.Name(e.kind)
    return f"[{kind}] {e.code}: {e.message.strip().splitlines()[-1] if e.message.strip() else ''}"


def literal_map_bytes(lm: literals_pb2.LiteralMap) -> Dict[str, int]:
    return {k: v.ByteSize() for k, v in lm.literals.items()}

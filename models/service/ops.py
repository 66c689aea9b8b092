"""Ops: the methods of a host class a client may call (marked :func:`op`; the server runs nothing else), and the
checks a request passes before any rank runs it. It is refused (:class:`Refused`) when the host has no such op
(404); when it carries an argument the op does not take, or lacks one it needs (422: a service has the run's
config and layout from its start, so a request carries only what changes, never a config); when it names a
location outside the service's root (403: every argument named ``url``, ``batch`` or ``*_url``, nested ones
included, lies strictly inside the run's folder, or a server's ``--storage-root``, so a token holder cannot make
a service read or write elsewhere with its credentials); when it was sent for another config (409: digests).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import posixpath
from typing import Any, Callable, Dict, Iterator, Mapping, Tuple

BODY = "body"
"""The argument through which an op takes a request's binary body (the weights)."""


class Refused(ValueError):
    """A request the layer does not run; ``status`` is its HTTP status."""

    def __init__(self, message: str, status: int = 422):
        super().__init__(message)
        self.status = status


def op(fn: Callable) -> Callable:
    """Mark a method of a :class:`Host` as an op: ``client.call(name, args)`` runs it with ``args`` as its
    keyword arguments; its JSON-able return value is the reply."""
    fn.is_op = True
    return fn


class Host:
    """Base of what a service holds: its ops (methods marked :func:`op`), how its errors map to HTTP statuses,
    and how errors name it."""

    label = "the service"
    statuses: Mapping[type, int] = {}
    """The host's own errors and the status each answers with (any other error: 500)."""

    @op
    def health(self) -> Dict[str, Any]:
        return {"ok": True}

    @classmethod
    def ops(cls) -> Dict[str, Callable]:
        return {name: getattr(cls, name) for name in dir(cls) if getattr(getattr(cls, name), "is_op", False)}

    def close(self) -> None:
        """Free what the host holds (its engine) once the service stopped."""

    def status(self, err: BaseException) -> int:
        return next((code for kind, code in self.statuses.items() if isinstance(err, kind)), 500)


def digest(value: Any) -> str:
    """A short digest of JSON-able ``value`` (a run's config as a dict): equal values, equal digests."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def is_location(key: str) -> bool:
    return key in ("url", "batch") or key.endswith("_url")


def locations(args: Any, where: str = "") -> Iterator[Tuple[str, str]]:
    """``(argument path, value)`` of every non-empty location argument in ``args`` (nested dicts and lists)."""
    items = args.items() if isinstance(args, Mapping) else enumerate(args) if isinstance(args, list) else ()
    for key, value in items:
        path = f"{where}.{key}" if where else str(key)
        if isinstance(value, str) and value and is_location(str(key)):
            yield path, value
        elif isinstance(value, (Mapping, list)):
            yield from locations(value, path)


def _split(url: str) -> Tuple[str, str]:
    """``(scheme, path)``: a plain path and ``file://`` are both ``file``; a local path made absolute."""
    scheme, path = url.split("://", 1) if "://" in url else ("file", url)
    scheme = scheme.lower()
    return scheme, os.path.realpath(os.path.abspath(path)) if scheme == "file" else \
        posixpath.normpath("/" + path.strip("/"))


def inside(url: str, root: str) -> bool:
    """Whether ``url`` lies strictly inside ``root`` (same scheme and bucket; no ``..`` segment)."""
    if ".." in url.replace("\\", "/").split("/"):
        return False
    (scheme, path), (root_scheme, base) = _split(url), _split(root)
    return scheme == root_scheme and path != base and path.startswith(base.rstrip("/") + "/")


def check_request(host: Host, name: str, args: Mapping[str, Any], body: bool, request_digest: str,
                  root: str, config_digest: str) -> Callable:
    """The bound op ``name`` of ``host`` if the request may run (see the module docstring), else :class:`Refused`."""
    ops = host.ops()
    if name not in ops:
        raise Refused(f"{host.label} has no op {name!r} (its ops: {', '.join(sorted(ops))})", 404)
    if config_digest and request_digest != config_digest:
        raise Refused(f"{host.label} serves the config it started with (digest {config_digest}); the request was "
                      f"sent for another ({request_digest or 'none'}): rerun the launch to restart the services "
                      f"with the run's config", 409)
    params = dict(list(inspect.signature(ops[name]).parameters.items())[1:])
    takes = [p for p in params if p != BODY]
    extra = sorted(set(args) - set(takes)) + ([BODY] if body and BODY not in params else [])
    if extra:
        raise Refused(f"{host.label}'s op {name} takes no argument {extra[0]!r} (it takes "
                      f"{', '.join(takes) or 'none'}): a request carries only what changes, the service has the run's "
                      f"config from its start")
    missing = [p for p, spec in params.items() if spec.default is inspect.Parameter.empty and p not in args
               and (p != BODY or not body)]
    if missing:
        raise Refused(f"{host.label}'s op {name} needs the argument {missing[0]!r}")
    for where, url in locations(args):
        if not root:
            raise Refused(f"{host.label} reads and writes no storage (it has no root), but {where} names {url}", 403)
        if not inside(url, root):
            raise Refused(f"{where} {url!r} is outside {root}: {host.label} reads and writes only inside it", 403)
    return getattr(host, name)

"""One HTTP server for every service, standard library only: ``POST /call`` with the bearer token runs an op of the
host (:mod:`models.service.ops`) and answers ``{"result": ...}``, or ``{"error", "kind"}`` with the status of the
refusal or the host's error (500 for any other). A body is JSON ``{"op", "args", "digest"}``, or
(``application/octet-stream``) that JSON after its length in 8 bytes, then a blob the op takes as its ``body``
(weights). The guard answers before anything is parsed: 401 without the token (constant-time compare), 411
without a ``Content-Length``, 400 an unreadable one, 413 a body over ``max_body_bytes``.

Serial (a run's services): one request at a time, run by the loop of :meth:`Server.serve` on every rank of the
service (``share``: rank 0 hands it to the others, and the ranks agree on its outcome before rank 0 replies:
:mod:`models.service.ranks`). Concurrent (the servers someone starts): each request in its own thread, the host
keeping its own order. A service stops on the ``stop`` op, when the process that launched the run is gone
(``parent_pid``), or after ``idle_timeout_s`` without a request.

Heartbeats: a caller that sends :data:`HEARTBEAT_HEADER` (seconds) gets, once its request passed the checks, a
200 head at once and a space every that many seconds while the op waits and runs, then the JSON answer with its
``status`` (``{"result"}`` or ``{"error", "kind", "status"}``): a caller's read timeout then bounds how long a
service may show no sign of life, never how long an op may take (:class:`~models.service.client.ServiceClient`).
"""

from __future__ import annotations

import hmac
import json
import os
import queue
import socket
import threading
import time
import traceback
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Optional, Tuple

from models.service.ops import BODY, Host, Refused, check_request

STOP = "stop"
HEAD_BYTES = 8
HEARTBEAT_HEADER = "X-Heartbeat-S"
Request = Tuple[str, dict, Optional[bytes]]


@dataclass(frozen=True)
class Settings:
    """Who may call a service, what it accepts and when it stops by itself."""

    token: Optional[str] = field(default=None, repr=False)
    """Bearer token every request must carry; None: no authentication (a server on loopback)."""
    root: str = ""
    """Where its requests' locations must lie (:func:`models.service.ops.inside`); empty: no location."""
    digest: str = ""
    """The digest of the config it started with, which a request must carry; empty: no config."""
    max_body_bytes: int = 0
    serial: bool = True
    idle_timeout_s: float = 0.0
    parent_pid: int = 0
    """The largest body (0: any), serial or concurrent ops, the stops: after ``idle_timeout_s`` without a request,
    when process ``parent_pid`` is gone (0: neither)."""


def to_json(value: Any) -> bytes:
    """JSON with NaN and infinities kept (a broken model's values reach the caller, which names them)."""
    return json.dumps(value, default=lambda v: v.tolist() if hasattr(v, "tolist") else str(v)).encode()


def pack(head: dict, blob: bytes) -> bytes:
    data = json.dumps(head).encode()
    return len(data).to_bytes(HEAD_BYTES, "big") + data + blob


def unpack(body: bytes) -> Tuple[dict, bytes]:
    n = int.from_bytes(body[:HEAD_BYTES], "big")
    return json.loads(body[HEAD_BYTES:HEAD_BYTES + n]), body[HEAD_BYTES + n:]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Server:
    """Rank 0's HTTP face of ``host``: listens on ``listen`` (``0.0.0.0`` in a cluster pod, ``::`` for IPv6),
    reachable at :attr:`url` (``advertise``: the address the callers reach it at; default ``listen``)."""

    def __init__(self, host: Host, settings: Settings = Settings(), listen: str = "127.0.0.1", port: int = 0,
                 advertise: str = "", log: Callable[[str], None] = lambda line: None):
        self.host, self.settings, self.log = host, settings, log
        self.requests, self.stopping, self.last_request = 0, "", time.monotonic()
        self._queue: "queue.Queue[Tuple[Request, Optional[Future]]]" = queue.Queue()
        self._reply: Optional[Future] = None
        self._lock = threading.Lock()
        self._pending = self._writing = 0  # serial requests queued or running; answers being written
        family = socket.AF_INET6 if ":" in listen else socket.AF_INET
        # socketserver listens with a backlog of 5: past 5 connections waiting for accept() Linux drops the
        # handshake (a 1 s SYN retransmit, or a reset once the request is sent), which many clients hit at once
        self.httpd = type("HTTPServer", (ThreadingHTTPServer,), {"address_family": family,
                                                                 "request_queue_size": socket.SOMAXCONN})(
            (listen, port), self._handler())
        self.httpd.daemon_threads = True
        name = advertise or listen
        self.url = f"http://{f'[{name}]' if ':' in name else name}:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.1,), daemon=True, name="http").start()
        threading.Thread(target=self._watch, daemon=True, name="watch").start()

    def _watch(self) -> None:
        s = self.settings
        while not self.stopping:
            time.sleep(0.5)
            if s.parent_pid and not _alive(s.parent_pid):
                self.stop(f"the run's process {s.parent_pid} is gone")
            elif s.idle_timeout_s and time.monotonic() - self.last_request > s.idle_timeout_s \
                    and not self._pending:
                self.stop(f"no request for {s.idle_timeout_s:g} s (run.resident_idle_timeout_s)")

    def stop(self, reason: str) -> None:
        """Stop the loop once the request under way is done; later ones get 503."""
        if not self.stopping:
            self.stopping = reason
            self._queue.put(((STOP, {"reason": reason}, None), None))

    def handle(self, name: str, args: dict, body: Optional[bytes], request_digest: str) \
            -> "Tuple[int, dict] | Future":
        """Check the request, then run it here (concurrent), or queue it for the loop (serial): the future of
        its ``(status, reply)``."""
        self.last_request = time.monotonic()
        self.requests += 1
        if name == STOP:
            self.stop(str(args.get("reason", "stopped")))
            return 200, {"result": {"stopped": self.stopping}}
        try:
            check_request(self.host, name, args, body is not None, request_digest, self.settings.root,
                          self.settings.digest)
        except Refused as err:
            return err.status, {"error": str(err), "kind": "Refused"}
        if not self.settings.serial:
            return run(self.host, (name, args, body), self.log)
        if self.stopping:
            return 503, {"error": f"{self.host.label} is stopping: {self.stopping}", "kind": "Stopping"}
        reply: Future = Future()
        with self._lock:
            self._pending += 1
        reply.add_done_callback(self._answered)
        self._queue.put(((name, args, body), reply))  # the loop takes them in order, one at a time
        return reply

    def _answered(self, _: Future) -> None:
        with self._lock:
            self._pending -= 1
        self.last_request = time.monotonic()

    def writing(self, delta: int) -> None:
        with self._lock:
            self._writing += delta

    def flush(self, timeout_s: float = 5.0) -> None:
        """Wait until the answers given are written (before a stuck service's process ends)."""
        deadline = time.monotonic() + timeout_s
        while self._writing and time.monotonic() < deadline:
            time.sleep(0.05)

    def next_request(self) -> Request:
        request, self._reply = self._queue.get()
        return request

    def reply(self, status: int, body: dict) -> None:
        reply, self._reply = self._reply, None
        if reply is not None and not reply.done():
            reply.set_result((status, body))

    def serve(self, share: Callable[[Optional[Request]], Request] = lambda request: request) -> str:
        """The loop (rank 0); returns why it stopped. See :func:`serve_ranks`."""
        return serve_ranks(self.host, self, share, self.log)

    def close(self) -> None:
        """Stop listening; a request that came in as the loop stopped gets 503."""
        while not self._queue.empty():
            _, reply = self._queue.get_nowait()
            if reply is not None:
                reply.set_result((503, {"error": f"{self.host.label} stopped: {self.stopping}", "kind": "Stopping"}))
        self.httpd.shutdown()
        self.httpd.server_close()

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet: the run's console is the user's
                pass

            def _send(self, status: int, body: dict, headers=()) -> None:
                data = to_json(body)
                self.send_response(status)
                for key, value in (("Content-Type", "application/json"), ("Content-Length", str(len(data))),
                                   *headers):
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(data)

            def _refuse(self, status: int, error: str, kind: str, headers=()) -> None:
                self.close_connection = True
                self._send(status, {"error": error, "kind": kind}, headers)

            def _answer(self, reply: Future) -> None:
                """The loop's answer: whole when it comes, or (a caller that asked for heartbeats) a 200 head now,
                a space every few seconds, then the answer with its status."""
                server.writing(1)
                try:
                    beat = _seconds(self.headers.get(HEARTBEAT_HEADER))
                    if beat is None:
                        return self._send(*reply.result())
                    self.close_connection = True
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.end_headers()  # no length: the answer ends when the connection closes
                    while True:
                        try:
                            status, body = reply.result(timeout=beat)
                            break
                        except FutureTimeout:
                            self.wfile.write(b" ")
                            self.wfile.flush()
                    self.wfile.write(to_json({**body, "status": status}))
                except OSError:  # the caller went away; the op runs on
                    pass
                finally:
                    server.writing(-1)

            def do_POST(self) -> None:  # noqa: N802
                token = server.settings.token
                given = self.headers.get("Authorization", "")
                if token is not None and not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                    return self._refuse(401, f"bearer token missing or wrong ({server.host.label} accepts only its "
                                             f"callers' token)", "Unauthorized", [("WWW-Authenticate", "Bearer")])
                declared, limit = self.headers.get("Content-Length"), server.settings.max_body_bytes
                if declared is None:
                    return self._refuse(411, "a request body needs a Content-Length", "LengthRequired")
                if not declared.isdigit():
                    return self._refuse(400, f"invalid Content-Length header {declared[:40]!r}", "BadRequest")
                if limit and int(declared) > limit:
                    if int(declared) <= 4 * limit:  # read, so that the caller gets the answer
                        self.rfile.read(int(declared))
                    return self._refuse(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes "
                                             f"(--max-body-bytes); send fewer samples per request", "TooLarge")
                raw = self.rfile.read(int(declared))
                try:
                    message, blob = unpack(raw) if self.headers.get("Content-Type") == "application/octet-stream" \
                        else (json.loads(raw), None)
                    name, args = str(message["op"]), dict(message.get("args") or {})
                except (ValueError, KeyError, TypeError) as err:
                    return self._refuse(400, f"unreadable request ({err}): send {{'op', 'args'}}", "BadRequest")
                out = server.handle(name, args, blob, str(message.get("digest", "")))
                if isinstance(out, Future):
                    return self._answer(out)
                self._send(*out)

        return Handler


def _seconds(value: Optional[str]) -> Optional[float]:
    try:
        return min(max(float(value), 0.05), 60.0) if value else None
    except ValueError:
        return None


def run(host: Host, request: Request, log: Callable[[str], None]) -> Tuple[int, dict]:
    """Run one checked request on ``host``: ``(status, reply)``; a failed op answers its error."""
    name, args, body = request
    try:
        return 200, {"result": getattr(host, name)(**args, **({BODY: body} if body is not None else {}))}
    except Exception as err:  # noqa: BLE001 -- the caller gets the error; the service stays up
        status = host.status(err)
        if status >= 500:
            log(f"{name} failed:\n{traceback.format_exc()}")
        return status, {"error": str(err) or type(err).__name__, "kind": type(err).__name__}


def serve_ranks(host: Host, server: Optional[Server], share: Callable[[Optional[Request]], Request],
                log: Callable[[str], None]) -> str:
    """The loop every rank runs: the next request (rank 0's ``server`` takes it, ``share`` hands it to the other
    ranks: a :class:`~models.service.ranks.RankFanout`), run here, its outcome settled across the ranks
    (``share.settle``, when it has one); rank 0 replies. Returns why it stopped."""
    settle = getattr(share, "settle", None)
    while True:
        request = share(server.next_request() if server is not None else None)
        if request[0] == STOP:
            return request[1].get("reason", "stopped")
        execute = lambda: run(host, request, log)  # noqa: E731
        reply = execute() if settle is None else settle(execute, server)
        if server is not None:
            server.reply(*reply)

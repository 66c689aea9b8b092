"""The HTTP face of a resident service, standard library only: ``POST /call`` (JSON op), ``POST /weights``
(binary body), ``GET /health``. Rank 0 of a service listens; every request is handed to all of the
service's ranks (:class:`RankFanout`), one at a time, and rank 0 replies.

A service stops on the ``stop`` op, when the process that launched the run is gone (``parent_pid``),
or after ``idle_timeout_s`` without a request, so no service outlives its run.
"""

from __future__ import annotations

import hmac
import json
import os
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Optional, Tuple

from models.resident.protocol import split_weights_body

STOP = "stop"

Request = Tuple[str, dict, Optional[bytes]]
"""``(op, args, body)``: ``op`` ``weights`` carries the binary body."""


class RankFanout:
    """Hands rank 0's requests to the other ranks of the service's process group (a gloo group: the
    requests are small Python objects), so every rank runs the same op in the same order."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.group = dist.new_group(backend="gloo") if self.world > 1 else None

    def share(self, request: Optional[Request]) -> Request:
        if self.world == 1:
            return request
        box = [request]
        self.dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ServiceServer:
    """Rank 0's server: requests are queued to the rank loop (:meth:`serve`), which runs them one at a
    time on every rank and posts the reply back."""

    def __init__(self, token: str, host: str = "127.0.0.1", port: int = 0, idle_timeout_s: float = 1800.0,
                 parent_pid: int = 0, advertise: str = ""):
        """Listen on ``host`` (``0.0.0.0`` in a cluster pod); ``advertise``: the address the run's tasks reach
        it at (the pod's IP; default ``host``)."""
        self.token, self.idle_timeout_s, self.parent_pid = token, idle_timeout_s, parent_pid
        self.requests = 0
        self.started = time.monotonic()
        self._cond = threading.Condition()
        self._pending: Optional[Request] = None
        self._reply: Optional[Tuple[int, dict]] = None
        self._busy = threading.Lock()
        self.last_request = time.monotonic()
        self.stopping = ""
        self.httpd = ThreadingHTTPServer((host, port), self._handler())
        self.httpd.daemon_threads = True
        self.url = f"http://{advertise or host}:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while not self.stopping:
            time.sleep(0.5)
            if self.parent_pid and not _alive(self.parent_pid):
                self.submit_stop(f"the run's process {self.parent_pid} is gone")
            elif time.monotonic() - self.last_request > self.idle_timeout_s and not self._busy.locked():
                self.submit_stop(f"no request for {self.idle_timeout_s:g} s (run.resident_idle_timeout_s)")

    def submit_stop(self, reason: str) -> None:
        with self._cond:
            if self._pending is None and not self.stopping:
                self.stopping = reason
                self._pending = (STOP, {"reason": reason}, None)
                self._cond.notify_all()

    def run(self, request: Request) -> Tuple[int, dict]:
        """Queue ``request`` for the rank loop and wait for its reply (requests are served one at a time)."""
        with self._busy:
            self.last_request = time.monotonic()
            self.requests += 1
            with self._cond:
                if self.stopping:
                    return 503, {"error": f"the service is stopping: {self.stopping}", "kind": "ServiceStopping"}
                self._pending, self._reply = request, None
                self._cond.notify_all()
                while self._reply is None:
                    self._cond.wait()
                reply, self._reply = self._reply, None
            self.last_request = time.monotonic()
            return reply

    def next_request(self) -> Request:
        """The rank loop's next request (blocks)."""
        with self._cond:
            while self._pending is None:
                self._cond.wait()
            return self._pending

    def reply(self, status: int, body: dict) -> None:
        with self._cond:
            self._pending, self._reply = None, (status, body)
            self._cond.notify_all()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet: the run's console is the user's
                pass

            def _send(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorised(self) -> bool:
                given = self.headers.get("Authorization", "")
                if hmac.compare_digest(given.encode(), f"Bearer {server.token}".encode()):
                    return True
                self._send(401, {"error": "missing or wrong token (the run's services accept only its own tasks)",
                                 "kind": "Unauthorized"})
                return False

            def do_GET(self) -> None:  # noqa: N802
                if self._authorised():
                    self._send(200, {"result": {"ok": True, "stopping": server.stopping}})

            def do_POST(self) -> None:  # noqa: N802
                if not self._authorised():
                    return
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path == "/weights":
                    args, blob = split_weights_body(body)
                    request = ("weights", args, blob)
                else:
                    message = json.loads(body)
                    request = (message["op"], message.get("args") or {}, None)
                self._send(*server.run(request))

        return Handler


def serve(server: Optional[ServiceServer], fanout: RankFanout, handle: Callable[[str, dict, Optional[bytes]], Any],
          log: Callable[[str], None]) -> str:
    """The rank loop: every rank runs each request's ``handle``; rank 0 (``server``) replies. Returns why it
    stopped. A failed op answers 500 with its error on rank 0 and stops the service when it may have left the
    ranks apart (any error on a rank other than 0 cannot be told to rank 0: its collectives fail instead)."""
    while True:
        request = fanout.share(server.next_request() if server is not None else None)
        op, args, body = request
        if op == STOP:
            if server is not None:
                server.reply(200, {"result": {"stopped": args.get("reason", "")}})
            return args.get("reason", "stopped")
        try:
            result = handle(op, args, body)
        except Exception as err:  # noqa: BLE001 -- the caller gets the error; the service stays up
            log(f"{op} failed:\n{traceback.format_exc()}")
            if server is not None:
                server.reply(500, {"error": str(err) or type(err).__name__, "kind": type(err).__name__})
            continue
        if server is not None:
            server.reply(200, {"result": result})

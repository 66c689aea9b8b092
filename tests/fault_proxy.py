"""An HTTP proxy on 127.0.0.1 in front of the moto S3 server that fails requests on purpose.

Each request is forwarded to ``upstream`` unchanged (keep-alive, ``Content-Length`` or chunked
bodies, HEAD), unless the fault plan picks it: then the proxy answers ``503 ServiceUnavailable``
(an S3 XML error) or ``403 AccessDenied``, resets the connection without answering, or
(``corrupt``) forwards it but flips one byte of the answer's body. The plan: the first ``fail_first`` requests that ``match``, then a seeded
``fraction`` of them, ``max_faults`` at most (so every test stays bounded). ``requests`` and
``faults`` count what happened::

    with FaultProxy(s3_server, mode="503") as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)   # and FSSPEC_S3_ENDPOINT_URL
        proxy.fail_next(2)
        storage.write_bytes("s3://bucket/key", b"...")     # two 503s, retried, then written
        assert proxy.faults == 2
"""

from __future__ import annotations

import http.client
import random
import socket
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional
from urllib.parse import urlsplit

_XML_ERROR = ('<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{msg}</Message>'
              '<RequestId>fault-proxy</RequestId></Error>')
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade"}


class FaultProxy:
    """Loopback HTTP proxy with injected 503s, 403s, connection resets or corrupted bodies."""

    def __init__(self, upstream: str, fail_first: int = 0, fraction: float = 0.0, mode: str = "503",
                 match: Optional[Callable[[str, str], bool]] = None, max_faults: int = 1000, seed: int = 0):
        if mode not in ("503", "403", "reset", "corrupt"):
            raise ValueError(f"mode must be 503, 403, reset or corrupt, got {mode!r}")
        parts = urlsplit(upstream)
        if parts.hostname not in ("127.0.0.1", "localhost"):
            raise ValueError("the fault proxy only forwards to a loopback upstream")
        self.upstream = (parts.hostname, parts.port)
        self.fail_first, self.fraction, self.mode, self.max_faults = fail_first, fraction, mode, max_faults
        self.match = match or (lambda method, path: True)
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.requests = 0
        self.faults = 0
        self.log: list = []
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def start(self) -> "FaultProxy":
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def fail_next(self, n: int) -> None:
        """Fail the next ``n`` matching requests (counted on top of the faults so far)."""
        with self.lock:
            self.fail_first, self.max_faults = self.faults + n, self.faults + n

    def _pick(self, method: str, path: str) -> bool:
        """Whether this request gets a fault (and count it)."""
        with self.lock:
            self.requests += 1
            hit = self.match(method, path) and self.faults < self.max_faults and (
                self.faults < self.fail_first or self.rng.random() < self.fraction)
            self.faults += hit
            self.log.append((method, path, hit))
            return hit

    def _handler(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    raw = b""
                    while True:
                        line = self.rfile.readline()
                        raw += line
                        size = int(line.split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while True:  # trailers, then the blank line
                                trailer = self.rfile.readline()
                                raw += trailer
                                if trailer in (b"\r\n", b"\n", b""):
                                    return raw
                        raw += self.rfile.read(size + 2)
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _fault(self) -> None:
                if proxy.mode == "reset":  # RST instead of an answer
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.close_connection = True
                    return
                status, code, msg = (503, "ServiceUnavailable", "injected fault") if proxy.mode == "503" else \
                    (403, "AccessDenied", "Access Denied (injected)")
                data = _XML_ERROR.format(code=code, msg=msg).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _forward(self) -> None:
                body = self._body()
                corrupt = proxy._pick(self.command, self.path)
                if corrupt and proxy.mode != "corrupt":
                    self._fault()
                    return
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                try:
                    conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                    for k, v in self.headers.items():
                        conn.putheader(k, v)
                    conn.endheaders(body or None)
                    resp = conn.getresponse()
                    data = resp.read()
                    if corrupt and data:
                        data = data[:len(data) // 2] + bytes([data[len(data) // 2] ^ 0xFF]) + data[len(data) // 2 + 1:]
                finally:
                    conn.close()
                self.send_response_only(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP_BY_HOP and not (k.lower() == "content-length" and self.command != "HEAD"):
                        self.send_header(k, v)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        return Handler

"""The client of every service, standard library only (a thin task imports it without torch): ``call`` runs an op
(``client.call("score", {...})``, or ``client.score(...)``) and returns its result. A refused connection and 5xx
answers are retried ``retries`` times with exponential backoff (``backoff_s · 2^k``, capped); a connection dropped
after the request went out only for an op that may run twice (``resend``); 4xx answers and timeouts never (retrying
cannot fix them; a busy service is not helped by more load). Errors name the service::

    ServiceError: reward server at http://127.0.0.1:8123: infer returned 401: Unauthorized: bearer token ...
    ServiceGone: the critic trainer service at http://10.0.0.7:41234 does not answer (update: connection
    refused, 1 attempt). It was killed or crashed; rerun the launch to resume from the last checkpoint ...
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import time
import urllib.error
import urllib.request
from typing import Any, Mapping, Optional, Tuple

from models.service.server import HEARTBEAT_HEADER, pack

log = logging.getLogger(__name__)

SERVER_TOKEN_ENV = "RLHF_SERVER_TOKEN"
"""Environment variable (a Flyte secret on a cluster) holding the bearer token of the servers someone else
started (``critic.remote_url``, ``reward.remote_url``, ``rollout.remote_url``)."""


def server_token() -> Optional[str]:
    """The servers' bearer token from :data:`SERVER_TOKEN_ENV`; None if unset or empty."""
    return os.environ.get(SERVER_TOKEN_ENV) or None


class ServiceError(RuntimeError):
    """A call failed: the service answered an error, timed out, or could not be reached. ``kind``: the error's
    class on the service (``WrongIteration``, ``PushFailed``, ...) when it answered one."""

    def __init__(self, message: str, status: Optional[int] = None, attempts: int = 1, kind: str = ""):
        super().__init__(message)
        self.status, self.attempts, self.kind = status, attempts, kind


class ServiceGone(ServiceError):
    """The service does not answer (killed, crashed, or never started)."""


class ServiceClient:
    """Calls the ops of the service at ``url``; thread-safe. ``digest``: the config the caller runs (a run's
    services refuse another); ``gone_hint``: what a caller should do when the service does not answer.
    ``heartbeat``: the service shows it is alive while an op runs (a space every ``timeout_s / 6``, a run's
    services: :mod:`models.service.server`), so ``timeout_s`` bounds a silence, not an op."""

    def __init__(self, url: str, token: Optional[str] = None, label: str = "the service", digest: str = "",
                 timeout_s: float = 3600.0, retries: int = 0, backoff_s: float = 0.5, max_backoff_s: float = 8.0,
                 gone_hint: str = "", heartbeat: bool = False):
        if timeout_s <= 0 or retries < 0 or backoff_s < 0 or max_backoff_s < 0:
            raise ValueError("need timeout_s > 0, retries >= 0, backoff_s >= 0 and max_backoff_s >= 0")
        self.url, self.token, self.label, self.digest = url.rstrip("/"), token, label, digest
        self.timeout_s, self.attempts, self.heartbeat = timeout_s, retries + 1, heartbeat
        self.backoff_s, self.max_backoff_s, self.gone_hint = backoff_s, max_backoff_s, gone_hint

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda **args: self.call(name, args)

    def delay_s(self, attempt: int) -> float:
        """Sleep after failed attempt ``attempt`` (1-based): ``backoff_s · 2^(attempt-1)``, capped."""
        return min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s)

    def call(self, op: str, args: Optional[Mapping[str, Any]] = None, *, body: Optional[bytes] = None,
             resend: bool = True, timeout_s: Optional[float] = None) -> Any:
        """Run ``op`` with JSON ``args`` (and the binary ``body``, which the op takes as its ``body``); its result.
        ``resend``: whether the op may run twice (a connection dropped after sending is then retried)."""
        head = {"op": op, "args": dict(args or {}), "digest": self.digest}
        data, content = (pack(head, body), "application/octet-stream") if body is not None else \
            (json.dumps(head).encode(), "application/json")
        headers = {"Content-Type": content, **({"Authorization": f"Bearer {self.token}"} if self.token else {})}
        timeout = timeout_s or self.timeout_s
        if self.heartbeat:
            headers[HEARTBEAT_HEADER] = f"{timeout / 6:g}"
        where = f"{self.label} at {self.url}"
        silent = f"{where}: {op} timed out after {timeout:g} s" + \
            (" without an answer or a sign of life (its heartbeat): it hangs, or its machine cannot be reached"
             if self.heartbeat else "")
        for attempt in range(1, self.attempts + 1):
            request = urllib.request.Request(self.url + "/call", data=data, method="POST", headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=timeout) as response:
                    answer = json.loads(response.read())
                if "error" not in answer:
                    return answer["result"]
                code, kind, said = int(answer.get("status", 500)), str(answer.get("kind", "Error")), answer["error"]
            except urllib.error.HTTPError as err:
                code, (kind, said) = err.code, _detail(err)
            except (socket.timeout, TimeoutError) as err:
                raise ServiceError(silent, attempts=attempt) from err
            except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as err:
                reason = "the connection closed before its answer" if isinstance(err, ValueError) else \
                    getattr(err, "reason", err)
                if isinstance(reason, (socket.timeout, TimeoutError)):
                    raise ServiceError(silent, attempts=attempt) from None
                refused = isinstance(reason, ConnectionRefusedError)
                if attempt == self.attempts or not (refused or resend):
                    said = "connection refused" if refused else str(reason) or type(reason).__name__
                    raise ServiceGone(f"{where} does not answer ({op}: {said}, {attempt} attempt"
                                      f"{'s' if attempt > 1 else ''}).{' ' + self.gone_hint if self.gone_hint else ''}",
                                      attempts=attempt) from None
                log.warning("%s: %s: %s (attempt %d of %d)", where, op, reason, attempt, self.attempts)
                time.sleep(self.delay_s(attempt))
                continue
            if code < 500 or attempt == self.attempts:
                after = f" after {attempt} attempts" if attempt > 1 else ""
                raise ServiceError(f"{where}: {op} returned {code}{after}: {kind}: {said}", code, attempt, kind)
            log.warning("%s: %s returned %d (attempt %d of %d): %s: %s", where, op, code, attempt, self.attempts,
                        kind, said)
            time.sleep(self.delay_s(attempt))
        raise AssertionError("unreachable")  # pragma: no cover


def _detail(err: urllib.error.HTTPError) -> Tuple[str, str]:
    """The error's kind and message from an error answer's body."""
    raw = err.read()
    try:
        body = json.loads(raw)
        return str(body.get("kind", "Error")), str(body.get("error", ""))
    except ValueError:
        return "Error", f"{raw[:300]!r}"

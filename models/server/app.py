"""The HTTP face of :class:`RewardCriticService`: ``POST /infer``, ``/train``, ``/save``, ``GET /health``.

Concurrent ``/infer`` requests are batched together (:class:`models.server.batching.Batcher`);
``/train`` and ``/save`` run in a thread and take the service's lock, so they never overlap
each other or an infer batch. A pure-ASGI guard runs before any route: it checks the bearer
token (constant-time compare) and the body size, so an unauthenticated or oversized
request is refused before it is parsed.

Status codes: 400 unreadable Content-Length, 401 token missing/wrong, 413 body/samples/tokens over a limit, 422 malformed
request or token ids outside the vocabulary, 403 save outside the storage root, 409 part
not loaded or checkpoint already committed, 500 anything else (message in ``detail``).
"""

from __future__ import annotations

import hmac
import json
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Optional

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from models.server.batching import Batcher
from models.server.paths import SaveRefused
from models.server.schemas import (HealthResponse, InferRequest, InferResponse, SaveRequest, SaveResponse,
                                   TrainRequest, TrainResponse)
from models.server.service import AlreadyCommitted, InvalidRequest, NotLoaded, RewardCriticService


@dataclass(frozen=True)
class ServerSettings:
    """Batching and request limits of the HTTP server."""

    max_batch_size: int = 64
    """Most samples in one model batch (requests are never split across batches)."""
    max_delay_ms: float = 10.0
    """Longest wait for more requests after the first one of a batch arrived."""
    max_body_bytes: int = 16 << 20
    """Largest request body; bigger ones get 413."""
    max_samples_per_request: int = 1024
    """Most samples in one request; more get 413."""
    max_tokens_per_sample: int = 8192
    """Most prompt + response tokens in one sample; more get 413."""
    token: Optional[str] = field(default=None, repr=False)
    """Bearer token every request must carry; None: no authentication."""

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_body_bytes", "max_samples_per_request", "max_tokens_per_sample"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_delay_ms < 0:
            raise ValueError(f"max_delay_ms must be >= 0, got {self.max_delay_ms}")
        if self.token is not None and not self.token:
            raise ValueError("token must be None (no auth) or a non-empty string")


class TooLarge(ValueError):
    """A request over one of the size limits (HTTP 413)."""


_STATUS = {InvalidRequest: 422, TooLarge: 413, SaveRefused: 403, NotLoaded: 409, AlreadyCommitted: 409}


def json_response(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")  # NaN kept (see schemas)


async def _send_error(send, status: int, detail: str, headers=()) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class RequestGuard:
    """ASGI middleware: bearer token, then body size (the body is buffered and replayed)."""

    def __init__(self, app, token: Optional[str], max_body_bytes: int):
        self.app, self.token, self.max_body_bytes = app, token, max_body_bytes

    def _authorised(self, header: Optional[bytes]) -> bool:
        if self.token is None:
            return True
        scheme, _, given = (header or b"").decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.token.encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if not self._authorised(headers.get(b"authorization")):
            return await _send_error(send, 401, "bearer token missing or wrong",
                                     [(b"www-authenticate", b"Bearer")])
        too_big = (f"request body exceeds the server limit of {self.max_body_bytes} bytes "
                   f"(--max-body-bytes); send fewer samples per request")
        declared = headers.get(b"content-length")
        if declared is not None and not declared.isdigit():
            return await _send_error(send, 400, f"invalid Content-Length header {declared[:40]!r}")
        if declared is not None and int(declared) > self.max_body_bytes:
            await self._drain(receive, cap=4 * self.max_body_bytes)  # lets the client read the answer
            return await _send_error(send, 413, too_big)
        chunks, total, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            total += len(chunks[-1])
            more = message.get("more_body", False)
            if total > self.max_body_bytes:
                if more:
                    await self._drain(receive, cap=4 * self.max_body_bytes)
                return await _send_error(send, 413, too_big)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    @staticmethod
    async def _drain(receive, cap: int) -> None:
        total, more = 0, True
        while more and total <= cap:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            total += len(message.get("body", b""))
            more = message.get("more_body", False)


def check_limits(n_samples: int, token_counts: Iterable[int], settings: ServerSettings,
                 label: str = "sample {i}") -> None:
    """:class:`TooLarge` if the request has more than ``max_samples_per_request`` samples or entry
    ``i`` of ``token_counts`` (named by ``label``) more than ``max_tokens_per_sample`` tokens."""
    if n_samples > settings.max_samples_per_request:
        raise TooLarge(f"request has {n_samples} samples; this server accepts at most "
                       f"{settings.max_samples_per_request} per request (--max-samples)")
    for i, n in enumerate(token_counts):
        if n > settings.max_tokens_per_sample:
            raise TooLarge(f"{label.format(i=i)} has {n} tokens; this server accepts at most "
                           f"{settings.max_tokens_per_sample} per sample (--max-tokens)")


def _check_limits(samples, settings: ServerSettings) -> None:
    check_limits(len(samples), (len(s.prompt_tokens) + len(s.response_tokens) for s in samples), settings)


def _handler(status: int):
    async def handle(_request: Request, err: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(err)}, status_code=status)

    return handle


def guarded_app(title: str, settings: ServerSettings, lifespan, statuses: Mapping[type, int]) -> FastAPI:
    """A FastAPI app behind :class:`RequestGuard` whose errors map to ``statuses`` (else 500 with the
    message); the reward/critic and the rollout server are both built on it."""
    app = FastAPI(title=title, lifespan=lifespan)
    app.add_middleware(RequestGuard, token=settings.token, max_body_bytes=settings.max_body_bytes)
    for exc_type, status in statuses.items():
        app.add_exception_handler(exc_type, _handler(status))

    @app.exception_handler(Exception)
    async def internal(_request: Request, err: Exception):
        return JSONResponse({"detail": f"internal error: {type(err).__name__}: {err}"}, status_code=500)

    return app


def create_app(service: RewardCriticService, settings: ServerSettings = ServerSettings(),
               on_ready: Optional[Callable[[], None]] = None) -> FastAPI:
    """The FastAPI app; ``on_ready`` is called once the batcher runs (the CLI prints its line)."""

    def run_batch(flat):
        return service.infer([p for p, _ in flat], [r for _, r in flat])

    batcher = Batcher(run_batch, settings.max_batch_size, settings.max_delay_ms / 1000.0)

    @asynccontextmanager
    async def lifespan(_app):
        await batcher.start()
        if on_ready is not None:
            on_ready()
        yield
        await batcher.stop()

    app = guarded_app("reward/critic server", settings, lifespan, _STATUS)
    app.state.service, app.state.batcher = service, batcher

    @app.post("/infer")
    async def infer(req: InferRequest) -> Response:
        _check_limits(req.samples, settings)
        prompts = [s.prompt_tokens for s in req.samples]
        responses = [s.response_tokens for s in req.samples]
        service.check_samples(prompts, responses)  # one bad request must not fail a whole batch
        results = await batcher.submit(list(zip(prompts, responses)))
        return json_response(InferResponse(results=results))

    @app.post("/train")
    async def train(req: TrainRequest) -> Response:
        _check_limits(req.samples, settings)
        s = req.samples
        stats = await run_in_threadpool(service.train, [x.prompt_tokens for x in s], [x.response_tokens for x in s],
                                        [x.returns for x in s], [x.old_values for x in s], req.settings)
        return json_response(TrainResponse(stats=stats, train_calls=service.train_calls,
                                   optimizer_steps=service.optimizer_steps))

    @app.post("/save")
    async def save(req: SaveRequest) -> Response:
        url, files = await run_in_threadpool(service.save, req.url, req.overwrite)
        return json_response(SaveResponse(url=url, files=files, train_calls=service.train_calls))

    @app.get("/health")
    async def health() -> Response:
        st = batcher.stats
        return json_response(HealthResponse(
            parts=service.parts, critic=service.config.critic_url or None,
            reward_model=service.config.reward_model_url or None, vocab_size=service.vocab_size,
            device=str(service.device), train_calls=service.train_calls, optimizer_steps=service.optimizer_steps,
            infer_requests=st.requests, infer_samples=st.samples, infer_batches=st.batches,
            largest_batch=st.largest_batch))

    return app

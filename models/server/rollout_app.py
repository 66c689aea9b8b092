"""The HTTP face of :class:`RolloutService`: ``POST /generate`` and ``GET /health``.

Built on the reward/critic server's :func:`models.server.app.guarded_app`: the same bearer
token and body-size guard before any route, the same limits (``--max-samples`` counts
prompts × n, ``--max-tokens`` a prompt plus ``max_new_tokens``) and status codes: 401 token
missing/wrong, 413 over a limit, 422 malformed request, token ids outside the vocabulary or a
checkpoint that is not committed, 409 an adapter for a server started without LoRA or an engine
whose log-probs still differ from the trainer's after a restart (``models/training/probe.py``), 500
anything else (message in ``detail``). ``/generate`` waits in a worker thread; the service's
engine thread serialises requests, while ``/health`` answers at once.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Callable, Optional

from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from models.engines import SamplingSpec
from models.training.probe import EngineMismatchError
from models.server.app import ServerSettings, TooLarge, check_limits, guarded_app, json_response
from models.server.rollout_schemas import GenerateRequest, GenerateResponse, GenerationOut, RolloutHealth
from models.server.rollout_service import RolloutService
from models.server.service import InvalidRequest, NotLoaded

_STATUS = {InvalidRequest: 422, TooLarge: 413, NotLoaded: 409, EngineMismatchError: 409}


def create_rollout_app(service: RolloutService, settings: ServerSettings = ServerSettings(),
                       on_ready: Optional[Callable[[], None]] = None) -> FastAPI:
    """The FastAPI app; ``on_ready`` is called once it accepts requests (the CLI prints its line)."""

    @asynccontextmanager
    async def lifespan(_app):
        if on_ready is not None:
            on_ready()
        yield

    app = guarded_app("rollout server", settings, lifespan, _STATUS)
    app.state.service = service

    @app.post("/generate")
    async def generate(req: GenerateRequest) -> Response:
        s = req.sampling
        check_limits(len(req.prompts) * s.n, (len(p) + s.max_new_tokens for p in req.prompts), settings,
                     label="prompt {i} plus max_new_tokens")
        spec = SamplingSpec(**s.model_dump())
        served = await run_in_threadpool(
            service.generate, req.prompts, spec, req.checkpoint_url, req.adapter_url, req.probe_tolerance,
            req.trainer_dtype)
        out = [[GenerationOut.model_validate(g, from_attributes=True) for g in per_prompt]
               for per_prompt in served.generations]
        return json_response(GenerateResponse(generations=out, load_s=served.load_s, generate_s=served.generate_s,
                                              probe_gap_max=served.probe_gap_max))

    @app.get("/health")
    async def health() -> Response:
        stats = service.engine.stats
        return json_response(RolloutHealth(
            engine=service.config.engine, checkpoint_url=service.checkpoint_url, adapter_url=service.adapter_url,
            lora=service.lora, vocab_size=service.vocab_size, engine_starts=1 + stats.restarts,
            reloads=stats.reloads, requests=service.requests, prompts=service.prompts,
            generated_tokens=stats.generated_tokens))

    return app

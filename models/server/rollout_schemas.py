"""Request and response bodies of the rollout server (pydantic), shared by its app and client.

``Sampling`` mirrors :class:`models.engines.SamplingSpec` field for field, so a spec crosses
the wire unchanged; prompts are token ids, as the in-process engines take them.
"""

from __future__ import annotations

from typing import List, Literal, Optional

from pydantic import BaseModel, Field, StrictInt, model_validator

from models.engines.base import MIN_ENGINE_TEMPERATURE
from models.server.schemas import _REQUEST, _RESPONSE


class Sampling(BaseModel):
    """How to sample (see :class:`models.engines.SamplingSpec`)."""

    model_config = _REQUEST
    n: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(16, ge=1)
    min_new_tokens: int = Field(0, ge=0)
    seed: int = 0
    stop_token_ids: List[StrictInt] = []
    stop_strings: List[str] = []
    top_k: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _min_within_max(self) -> "Sampling":
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens={self.min_new_tokens} exceeds max_new_tokens={self.max_new_tokens}")
        if 0 < self.temperature < MIN_ENGINE_TEMPERATURE:
            raise ValueError(f"temperature={self.temperature} is below {MIN_ENGINE_TEMPERATURE}, where vLLM samples "
                             f"another temperature than the one asked; use 0 for greedy")
        return self


class GenerateRequest(BaseModel):
    """``POST /generate``: sample ``sampling.n`` responses per prompt from the policy at ``checkpoint_url``."""

    model_config = _REQUEST
    prompts: List[List[StrictInt]] = Field(min_length=1)
    sampling: Sampling = Sampling()
    checkpoint_url: str = Field(min_length=1)
    """Committed checkpoint to sample from; loaded in place when it is not the one served."""
    adapter_url: Optional[str] = Field(None, min_length=1)
    """Committed LoRA adapter on top of ``checkpoint_url``; None: the base weights alone."""
    probe_tolerance: float = Field(1e-3, ge=0)
    """After loading new weights the server checks its engine against the trainer's forward
    (``models/training/probe.py``): above this many nats it restarts the engine, and answers 409 if the gap
    persists; 0: no check. A server whose engine is not float32 raises it to at least 0.5."""
    trainer_dtype: Literal["float32", "bfloat16"] = "float32"
    """The dtype the trainer loads weights in (``model.dtype``): the probe's forward uses it."""


class GenerationOut(BaseModel):
    """One sampled response: tokens, the engine's log-probs of them, and whether it hit a stop."""

    model_config = _RESPONSE
    tokens: List[int]
    logprobs: List[float]
    is_end: bool


class GenerateResponse(BaseModel):
    """Per prompt its ``n`` generations, and where the request's time went."""

    model_config = _RESPONSE
    generations: List[List[GenerationOut]]
    load_s: float
    """Seconds spent fetching and loading new weights (0 when the policy was already served)."""
    generate_s: float
    probe_gap_max: Optional[float] = None
    """Largest |engine − trainer| log-prob of the probe run for this request's weight change (None: the
    weights were served already, or no probe)."""


class RolloutHealth(BaseModel):
    """``GET /health``: the engine, what it serves, and how much work it has done."""

    model_config = _RESPONSE
    status: str = "ok"
    engine: str
    checkpoint_url: Optional[str]
    """None after a failed load (the next request loads its checkpoint again)."""
    adapter_url: Optional[str]
    lora: bool
    """Whether the engine can serve adapters (``adapter_url``)."""
    vocab_size: int
    engine_starts: int
    """Engine builds since the server started: 1, plus restarts where an in-place reload could not work."""
    reloads: int
    """New weights pushed in place."""
    requests: int
    prompts: int
    generated_tokens: int

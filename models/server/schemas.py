"""Request and response bodies of the reward/critic server (pydantic), shared by app and client.

A sample is a prompt and a response as token ids; the server builds ``prompt ++ response``
right-padded rows itself (``models.data.batch_tensors.model_inputs``). Response-aligned lists
(``values``, ``returns``, ``old_values``) have one entry per response token: entry t is the
action that produced response token t (the index convention of docs/concepts/rollout_batch.md).

Responses may carry non-finite floats (a broken reward model); they are written as the
JSON constants ``NaN``/``Infinity`` (which Python's ``json`` and pydantic read back) so
the client can name the bad sample instead of the server failing to serialise.
"""

from __future__ import annotations

from typing import Dict, List, Optional

from pydantic import BaseModel, ConfigDict, Field, StrictInt

_REQUEST = ConfigDict(extra="forbid")
_RESPONSE = ConfigDict(ser_json_inf_nan="constants")


class Sample(BaseModel):
    """One (prompt, response) pair as token ids."""

    model_config = _REQUEST
    prompt_tokens: List[StrictInt]
    response_tokens: List[StrictInt]


class InferRequest(BaseModel):
    """``POST /infer``: samples to score (the server may batch them with other requests)."""

    model_config = _REQUEST
    samples: List[Sample]


class InferResult(BaseModel):
    """Per sample: ``values`` [R] when a critic is loaded, ``reward`` when a reward model is."""

    model_config = _RESPONSE
    values: Optional[List[float]] = None
    reward: Optional[float] = None


class InferResponse(BaseModel):
    """Results in the order of the request's samples."""

    model_config = _RESPONSE
    results: List[InferResult]


class TrainSample(Sample):
    """A sample with its PPO targets: ``returns`` and ``old_values`` [R] (values at rollout time)."""

    returns: List[float]
    old_values: List[float]


class TrainSettings(BaseModel):
    """Shape of one critic update (``models.training.update.LoopSettings`` plus the value clip)."""

    model_config = _REQUEST
    epochs: int = Field(1, ge=1, le=100)
    minibatch_size: int = Field(16, ge=1)
    micro_batch_size: int = Field(8, ge=1)
    grad_clip: float = Field(1.0, gt=0)
    value_clip: float = Field(0.2, ge=0)
    """Clip of the new value around ``old_values``; 0 disables clipping."""
    seed: Optional[int] = None
    """Shuffling seed; None uses the server's train-call count."""


class TrainRequest(BaseModel):
    """``POST /train``: one critic update on these samples."""

    model_config = _REQUEST
    samples: List[TrainSample]
    settings: TrainSettings = TrainSettings()


class TrainResponse(BaseModel):
    """Loss statistics averaged over the update's optimiser steps, and the server's counters."""

    model_config = _RESPONSE
    stats: Dict[str, float]
    train_calls: int
    optimizer_steps: int


class SaveRequest(BaseModel):
    """``POST /save``: commit the current critic at ``url`` (inside the server's storage root)."""

    model_config = _REQUEST
    url: str = Field(min_length=1)
    overwrite: bool = False


class SaveResponse(BaseModel):
    model_config = _RESPONSE
    url: str
    files: List[str]
    train_calls: int


class HealthResponse(BaseModel):
    """``GET /health``: what is loaded and how much work the server has done."""

    model_config = _RESPONSE
    status: str = "ok"
    parts: List[str]
    critic: Optional[str]
    reward_model: Optional[str]
    vocab_size: int
    device: str
    train_calls: int
    optimizer_steps: int
    infer_requests: int
    infer_samples: int
    infer_batches: int
    largest_batch: int

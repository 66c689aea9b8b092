"""Small helpers the task adapters share: checkpoints as local folders, prompt selection, timing."""

from __future__ import annotations

import contextlib
import functools
import json
import time
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from models import storage
from models.checkpoint import download_checkpoint

CACHE_VERSION = "2"
"""Bump when a task's outputs change meaning for the same inputs."""


@functools.lru_cache(maxsize=16)
def local_checkpoint(url: str) -> str:
    """A verified local folder of the committed checkpoint at ``url`` (downloaded once per process)."""
    return download_checkpoint(url)


def load_hf(url: str, auto_cls, dtype: str = "float32", trainable: bool = False):
    """The model of the committed checkpoint at ``url``: full weights, or a LoRA adapter on its base
    (``models.lora``); ``trainable``: the adapter's parameters require gradients."""
    import torch

    from models.lora import load_pretrained

    return load_pretrained(local_checkpoint(url), auto_cls, getattr(torch, dtype), local_checkpoint, trainable)


def base_checkpoint_url(url: str) -> str:
    """The full checkpoint behind ``url``: the base of a LoRA adapter, else ``url`` itself."""
    from models.lora import base_url, is_adapter

    local = local_checkpoint(url)
    return base_url(local) if is_adapter(local) else url


def load_tokenizer(url: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(local_checkpoint(url))


def read_prompts(url: str) -> Tuple[List[str], np.ndarray]:
    """The run's validated prompt file (JSONL with ``prompt`` and ``prompt_id``)."""
    rows = [json.loads(line) for line in storage.read_bytes(url).decode("utf-8").splitlines() if line.strip()]
    ids = np.array([r.get("prompt_id", i) for i, r in enumerate(rows)], dtype=np.int64)
    return [r["prompt"] for r in rows], ids


def iteration_indices(num_prompts: int, per_iteration: int, iteration: int, seed: int) -> np.ndarray:
    """Rows for ``iteration``: consecutive slices of per-epoch seeded permutations (no repeats within an epoch)."""
    start = iteration * per_iteration
    out = []
    while len(out) < per_iteration:
        epoch, offset = divmod(start + len(out), num_prompts)
        perm = np.random.default_rng([seed, epoch]).permutation(num_prompts)
        out.extend(perm[offset:offset + per_iteration - len(out)].tolist())
    return np.asarray(out, dtype=np.int64)


@contextlib.contextmanager
def timed(stats: Dict[str, float], key: str) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        stats[key] = stats.get(key, 0.0) + time.perf_counter() - t0


SERVER_TOKEN_ENV = "RLHF_SERVER_TOKEN"
"""Environment variable (a Flyte secret on a cluster) holding the bearer token of the reward/critic
and the rollout server."""


def server_token() -> Optional[str]:
    """The servers' bearer token from :data:`SERVER_TOKEN_ENV`; None if unset or empty."""
    import os

    return os.environ.get(SERVER_TOKEN_ENV) or None


def server_client(url: str, timeout_s: float = 60.0):
    """A client of the reward/critic server at ``url`` (token from :data:`SERVER_TOKEN_ENV`)."""
    from models.server.client import RewardCriticClient

    return RewardCriticClient(url, token=server_token(), timeout_s=timeout_s)

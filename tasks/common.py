"""Small helpers the task adapters share: checkpoints as local folders, prompt selection, timing."""

from __future__ import annotations

import contextlib
import functools
import json
import time
from typing import Dict, Iterator, List, Tuple

import numpy as np

from models import storage
from models.checkpoint import download_checkpoint

CACHE_VERSION = "1"
"""Bump when a task's outputs change meaning for the same inputs."""


@functools.lru_cache(maxsize=16)
def local_checkpoint(url: str) -> str:
    """A verified local folder of the committed checkpoint at ``url`` (downloaded once per process)."""
    return download_checkpoint(url)


def load_hf(url: str, auto_cls, dtype: str = "float32"):
    import torch

    return auto_cls.from_pretrained(local_checkpoint(url), dtype=getattr(torch, dtype), use_safetensors=True)


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
"""Environment variable (a Flyte secret on a cluster) holding the reward/critic server's bearer token."""


def server_client(url: str, timeout_s: float = 60.0):
    """A client of the reward/critic server at ``url`` (token from :data:`SERVER_TOKEN_ENV`)."""
    import os

    from models.server.client import RewardCriticClient

    return RewardCriticClient(url, token=os.environ.get(SERVER_TOKEN_ENV) or None, timeout_s=timeout_s)

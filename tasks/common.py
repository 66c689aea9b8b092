"""Small helpers the task adapters share: checkpoints as local folders, prompt selection, timing."""

from __future__ import annotations

import contextlib
import time
from typing import Dict, Iterator, Optional

import numpy as np

from models import storage
from models.checkpoint import download_checkpoint
from tasks import batch_type  # noqa: F401  (registers RolloutBatch as a Flyte type for the tasks)

CACHE_VERSION = "2"
"""Bump when a task's outputs change meaning for the same inputs."""


_IN_PLACE: Dict[str, str] = {}


def local_checkpoint(url: str) -> str:
    """A verified local folder of the committed checkpoint at ``url``: a local one in place (verified
    once per process), a remote one from the node's checkpoint cache (downloaded once per node and
    shared by its ranks, keyed by content, bounded: ``models/checkpoint/cache.py``)."""
    if not storage.is_local(url):
        return download_checkpoint(url)
    if url not in _IN_PLACE:
        _IN_PLACE[url] = download_checkpoint(url)
    return _IN_PLACE[url]


def load_hf(url: str, auto_cls, dtype: str = "float32", trainable: bool = False):
    """The model of the committed checkpoint at ``url``: full weights, or a LoRA adapter on its base
    (``models.training.lora``); ``trainable``: the adapter's parameters require gradients."""
    import torch

    from models.training.lora import load_pretrained

    return load_pretrained(local_checkpoint(url), auto_cls, getattr(torch, dtype), local_checkpoint, trainable)


def base_checkpoint_url(url: str) -> str:
    """The full checkpoint behind ``url``: the base of a LoRA adapter, else ``url`` itself."""
    from models.training.lora import base_url, is_adapter

    local = local_checkpoint(url)
    return base_url(local) if is_adapter(local) else url


def load_tokenizer(url: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(local_checkpoint(url))


def read_prompts(url: str):
    """The run's validated prompts (its copy under ``data/``), read by the reader that validated
    them: a :class:`models.data.prompts.PromptDataset` (texts as the model sees them, row ids, columns)."""
    from models.run.data import read_run_prompts

    return read_run_prompts(url)


def iteration_indices(num_prompts: int, per_iteration: int, iteration: int, seed: int) -> np.ndarray:
    """Rows for ``iteration``: consecutive slices of per-epoch seeded permutations (no repeats within an epoch).

    Draw k of the run (iteration ``k // per_iteration``) is row ``permutation(seed, epoch)[k mod N]`` with
    epoch ``k // N``: every row once per epoch, a fresh shuffle each epoch. When ``per_iteration > N`` an
    iteration spans several epochs and takes a row more than once (:func:`draw_ids` keeps them apart)."""
    start = iteration * per_iteration
    out = []
    while len(out) < per_iteration:
        epoch, offset = divmod(start + len(out), num_prompts)
        perm = np.random.default_rng([seed, epoch]).permutation(num_prompts)
        out.extend(perm[offset:offset + per_iteration - len(out)].tolist())
    return np.asarray(out, dtype=np.int64)


def draw_ids(per_iteration: int, iteration: int) -> np.ndarray:
    """``[per_iteration]`` int64: the run-wide index of each prompt drawn in ``iteration``, its
    ``prompt_id``. Every drawn instance is its own group (GRPO/RLOO baselines over exactly
    ``n_samples_per_prompt`` samples), even when one row is drawn twice in an iteration."""
    return np.arange(iteration * per_iteration, (iteration + 1) * per_iteration, dtype=np.int64)


@contextlib.contextmanager
def timed(stats: Dict[str, float], key: str) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        stats[key] = stats.get(key, 0.0) + time.perf_counter() - t0

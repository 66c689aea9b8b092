"""Committed checkpoints as local folders, and the models and tokenizers loaded from them."""

from __future__ import annotations

from typing import Dict

from models import storage
from models.checkpoint import download_checkpoint

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
    """The tokenizer committed with the checkpoint at ``url``."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(local_checkpoint(url))

"""Committed checkpoints as local folders, and the tokenizers committed with them (the models:
``models/training/load.py``)."""

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


def load_tokenizer(url: str):
    """The tokenizer committed with the checkpoint at ``url``."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(local_checkpoint(url))

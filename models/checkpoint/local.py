"""Committed checkpoints as local folders, and the tokenizers committed with them (the models:
``models/training/load.py``)."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Dict

from models import storage
from models.checkpoint import download_checkpoint

_IN_PLACE: Dict[str, str] = {}
_TOKENIZERS: Dict[str, object] = {}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja", "chat_template.json",
                    "tokenizer.model", "spiece.model", "sentencepiece.bpe.model")
"""What ``AutoTokenizer`` reads from a folder (and ``*.tiktoken`` files), besides ``config.json``'s ``model_type`` and
``tokenizer_class`` where the tokenizer's config names no class."""


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
    return cached_tokenizer(local_checkpoint(url))


def cached_tokenizer(folder: str):
    """``AutoTokenizer.from_pretrained(folder)``, loaded once per process for each content of the folder's tokenizer
    files: every iteration's checkpoint carries the same tokenizer, and a resident service scores, updates and samples
    with it each iteration (Qwen3's 151,936-token one: 1-3 s of CPU a load). Keyed by the files' bytes, so a folder
    written again with another tokenizer loads that one. Shared: callers pass per-call options (``padding_side``)
    rather than setting attributes on it."""
    from transformers import AutoTokenizer

    digest = hashlib.blake2b(digest_size=16)
    config = os.path.join(folder, "config.json")
    if os.path.isfile(config):  # its other fields (the dtype a checkpoint was saved in) are not the tokenizer's
        with open(config, encoding="utf-8") as f:
            model = json.load(f)
        digest.update(json.dumps([model.get("model_type"), model.get("tokenizer_class")]).encode())
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if (name in _TOKENIZER_FILES or name.endswith(".tiktoken")) and os.path.isfile(path):
            digest.update(name.encode() + b"\0")
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
    key = digest.hexdigest()
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = AutoTokenizer.from_pretrained(folder)
    return _TOKENIZERS[key]

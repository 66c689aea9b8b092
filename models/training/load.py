"""The models of committed checkpoints: full weights, or a LoRA adapter on its base."""

from __future__ import annotations

import torch

from models.checkpoint.local import local_checkpoint
from models.training.lora import base_url, is_adapter, load_pretrained


def load_hf(url: str, auto_cls, dtype: str = "float32", trainable: bool = False):
    """The model of the committed checkpoint at ``url``: full weights, or a LoRA adapter on its base
    (``models.training.lora``); ``trainable``: the adapter's parameters require gradients."""
    return load_pretrained(local_checkpoint(url), auto_cls, getattr(torch, dtype), local_checkpoint, trainable)


def base_checkpoint_url(url: str) -> str:
    """The full checkpoint behind ``url``: the base of a LoRA adapter, else ``url`` itself."""
    local = local_checkpoint(url)
    return base_url(local) if is_adapter(local) else url

"""LoRA adapters (Hu et al. 2021) with ``peft``: build, commit as adapter-only checkpoints, load any
checkpoint (full or adapter) as a model. Merging one into full weights: :mod:`models.training.merge`.

An adapter checkpoint is a peft directory (``adapter_config.json`` + ``adapter_model.safetensors``)
plus the tokenizer files, committed like every checkpoint (``COMMITTED.json``). Its
``base_model_name_or_path`` is the URL of the committed full checkpoint it adapts (absolute for
local storage, so ``peft.AutoPeftModelForCausalLM.from_pretrained(adapter_dir)`` loads it too).
With the adapter switched off the model *is* that base: for the actor, the frozen reference policy.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from typing import Any, Callable, Dict, Mapping, Optional, Protocol, Sequence

import torch
from torch import nn

from models import storage
from models.checkpoint import download_checkpoint, save_checkpoint
from models.training.files import ADAPTER_CONFIG, is_adapter  # also exported here; torch-free there

CAUSAL_LM = "CAUSAL_LM"
"""peft task type of the actor (``AutoModelForCausalLM``)."""
TOKEN_CLS = "TOKEN_CLS"
"""peft task type of the critic (``AutoModelForTokenClassification``); peft keeps its head
(``score`` / ``classifier``) fully trainable and saves it with the adapter (``modules_to_save``)."""

Fetch = Callable[[str], str]
"""Committed checkpoint URL → verified local folder (``models.checkpoint.download_checkpoint``)."""


class LoraSpec(Protocol):
    """What building an adapter needs (``models.config.LoraConfig`` provides it)."""

    rank: int
    alpha: float
    dropout: float
    target_modules: Sequence[str]


def auto_class(task_type: str):
    """The transformers auto class of an adapter's ``task_type`` (``CAUSAL_LM``, ``TOKEN_CLS``)."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    classes = {CAUSAL_LM: AutoModelForCausalLM, TOKEN_CLS: AutoModelForTokenClassification}
    if task_type not in classes:
        raise ValueError(f"adapter task type {task_type!r} is not one of {sorted(classes)}")
    return classes[task_type]


def adapter_config(local_dir: str) -> Dict[str, Any]:
    with open(os.path.join(local_dir, ADAPTER_CONFIG), encoding="utf-8") as f:
        return json.load(f)


def base_url(local_dir: str) -> str:
    """URL of the full checkpoint the adapter in ``local_dir`` adapts."""
    url = adapter_config(local_dir).get("base_model_name_or_path")
    if not url:
        raise ValueError(f"adapter {local_dir}: {ADAPTER_CONFIG} has no base_model_name_or_path")
    return url


def canonical_url(url: str) -> str:
    """``url`` with a local path made absolute (``file://`` dropped), so two spellings compare equal."""
    return os.path.abspath(storage.local_path(url)) if storage.is_local(url) else url.rstrip("/")


def add_adapter(model: nn.Module, spec: LoraSpec, task_type: str) -> nn.Module:
    """``model`` with fresh adapters on ``spec.target_modules`` (``B = 0``: the output is unchanged);
    only the adapters (and, for ``TOKEN_CLS``, the head) require gradients."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                        target_modules=list(spec.target_modules), task_type=task_type)
    return get_peft_model(model, config)


def is_peft(model: nn.Module) -> bool:
    """True for a peft model. Without peft imported nothing can be one: full fine-tuning never
    pays peft's import (a second or more in every actor-update worker)."""
    if "peft" not in sys.modules:
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)


def load_pretrained(local_dir: str, auto_cls: Any, dtype: torch.dtype, fetch: Fetch = download_checkpoint,
                    trainable: bool = False) -> nn.Module:
    """The model of a checkpoint folder: full weights, or its base (fetched) with the adapter on.

    ``trainable``: the adapter's parameters require gradients (the base's never do)."""
    if not is_adapter(local_dir):
        return auto_cls.from_pretrained(local_dir, dtype=dtype, use_safetensors=True)
    from peft import PeftModel

    base = auto_cls.from_pretrained(fetch(base_url(local_dir)), dtype=dtype, use_safetensors=True)
    return PeftModel.from_pretrained(base, local_dir, is_trainable=trainable)


def with_adapter(base: nn.Module, local_dir: str, spec: LoraSpec, task_type: str) -> nn.Module:
    """``base`` with a trainable adapter in float32 (:func:`trainable_in_float32`): the one of ``local_dir``
    if it is an adapter folder, else a fresh one of ``spec`` (seeded by the caller's RNG)."""
    if not is_adapter(local_dir):
        return trainable_in_float32(add_adapter(base, spec, task_type))
    from peft import PeftModel

    return trainable_in_float32(PeftModel.from_pretrained(base, local_dir, is_trainable=True), local_dir)


PEFT_LEVELS = re.compile(r"\.(base_layer|original_module|modules_to_save\.[^.]+)(?=\.)")
"""The module levels peft puts between a base model's module and its parameters: the wrapped layer
(``q_proj.base_layer.weight``) and a trained head's two copies (``score.original_module.weight``,
``score.modules_to_save.default.weight``)."""


def base_name(name: str) -> str:
    """The base checkpoint's name of parameter ``name`` of a model peft wrapped (named from that model,
    not from the ``PeftModel``): ``model.layers.0.self_attn.q_proj.base_layer.weight`` →
    ``model.layers.0.self_attn.q_proj.weight``. An adapter's own matrices (``lora_A``) keep their names,
    which no base checkpoint holds."""
    return PEFT_LEVELS.sub("", name)


def trainable_in_float32(model: nn.Module, local_dir: Optional[str] = None) -> nn.Module:
    """``model`` with every parameter that trains in float32 (master weights; the frozen rest keeps
    its dtype). Peft puts LoRA's matrices in float32 on a lower-precision base but copies a
    ``TOKEN_CLS`` head in the base's dtype: an adapter loaded from ``local_dir`` (saved in float32)
    is read again into the float32 parameters, so no update is lost to rounding."""
    low = [p for p in model.parameters() if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32]
    for p in low:
        p.data = p.data.float()
    if low and local_dir is not None and is_adapter(local_dir) and is_peft(model):
        from peft.utils import load_peft_weights, set_peft_model_state_dict

        set_peft_model_state_dict(model, load_peft_weights(local_dir, device="cpu"))
    return model


class AdapterDisabled(nn.Module):
    """A policy/critic wrapper whose peft model runs with its adapter switched off: the base model.
    Shares every weight with the wrapped module (no second copy)."""

    def __init__(self, wrapped: nn.Module, peft_model: nn.Module):
        super().__init__()
        self.wrapped = wrapped
        self.peft_model = peft_model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.peft_model.disable_adapter():
            return self.wrapped(*args, **kwargs)


def without_adapter(wrapped: nn.Module, model: nn.Module) -> nn.Module:
    """``wrapped`` (which runs ``model``) as its base model: adapter disabled, or itself if ``model``
    has no adapter (then it is the base)."""
    return AdapterDisabled(wrapped, model) if is_peft(model) else wrapped


def save_adapter_checkpoint(model: nn.Module, tokenizer: Any, url: str, base: str, overwrite: bool = False,
                            state_dict: Optional[Mapping[str, torch.Tensor]] = None) -> Mapping[str, Any]:
    """Commit the adapter of peft ``model`` (not the base weights) with ``tokenizer`` at ``url``,
    pointing at the committed base checkpoint ``base``. ``state_dict``: the peft model's full
    state when its own parameters are sharded (FSDP2)."""
    with tempfile.TemporaryDirectory(prefix="adapter-") as tmp:
        kwargs = {"state_dict": dict(state_dict)} if state_dict is not None else {}
        # save_embedding_layers=False: with lm_head among the targets peft would otherwise save the
        # (frozen, tied) base lm_head / embedding weights too; the base checkpoint already has them
        model.save_pretrained(tmp, safe_serialization=True, save_embedding_layers=False, **kwargs)
        path = os.path.join(tmp, ADAPTER_CONFIG)
        config = adapter_config(tmp)
        config["base_model_name_or_path"] = canonical_url(base)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        return save_checkpoint(tmp, url, overwrite=overwrite)

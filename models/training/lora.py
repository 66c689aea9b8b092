"""LoRA adapters (Hu et al. 2021) with ``peft``: build, commit as adapter-only checkpoints, load any
checkpoint (full or adapter) as a model, merge into full weights.

An adapter checkpoint is a peft directory (``adapter_config.json`` + ``adapter_model.safetensors``)
plus the tokenizer files, committed like every checkpoint (``COMMITTED.json``). Its
``base_model_name_or_path`` is the URL of the committed full checkpoint it adapts (absolute for
local storage, so ``peft.AutoPeftModelForCausalLM.from_pretrained(adapter_dir)`` loads it too).
With the adapter switched off the model *is* that base: for the actor, the frozen reference policy.

CLI::

    python -m models.training.lora merge --adapter URL --out URL [--overwrite]

writes the adapter merged into its base as a full committed HF checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from typing import Any, Callable, Dict, Mapping, Optional, Protocol, Sequence

import torch
from torch import nn

from models import storage
from models.checkpoint import download_checkpoint, save_checkpoint

ADAPTER_CONFIG = "adapter_config.json"
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


def _auto_class(task_type: str):
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    classes = {CAUSAL_LM: AutoModelForCausalLM, TOKEN_CLS: AutoModelForTokenClassification}
    if task_type not in classes:
        raise ValueError(f"adapter task type {task_type!r} is not one of {sorted(classes)}")
    return classes[task_type]


def is_adapter(local_dir: str) -> bool:
    """True if ``local_dir`` is a peft adapter directory (not full weights)."""
    return os.path.isfile(os.path.join(local_dir, ADAPTER_CONFIG))


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


MERGE_TOLERANCE = 1e-4
"""Largest |merged − base + adapter| log-prob (nats, float32) a merge may leave on the probe sequences."""


def untie_for_adapter(model: nn.Module, target_modules: Any) -> bool:
    """Give a tied output embedding its own copy of the weight when the adapter targets either side
    of the tie (``lm_head`` or the input embedding). Trained with peft, a LoRA on a tied ``lm_head``
    changes the logits only, not the input embedding; merged into the shared tensor it would change
    both. Returns whether the model was untied (``config.tie_word_embeddings`` is then false)."""
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    if out is None or inp is None or out.weight is not inp.weight:
        return False
    targets = [target_modules] if isinstance(target_modules, str) else list(target_modules or [])
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if module is out or module is inp}
    if not names & set(targets):
        return False
    out.weight = nn.Parameter(inp.weight.detach().clone(), requires_grad=inp.weight.requires_grad)
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config.tie_word_embeddings = False
    return True


def merge_adapter(adapter_dir: str, out_dir: str, fetch: Fetch = download_checkpoint,
                  dtype: torch.dtype = torch.float32, tolerance: float = MERGE_TOLERANCE) -> str:
    """Write ``W + (alpha/r)·B·A`` for every adapted layer (and the trained head) as a full HF
    directory ``out_dir`` with the adapter's tokenizer; returns ``out_dir``.

    A tied output embedding among the targets is untied first (:func:`untie_for_adapter`), so the
    merged model computes what base + adapter computes; that is checked on the probe sequences
    (:mod:`models.training.probe`, float32): a gap above ``tolerance`` nats raises ``ValueError``."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    config = adapter_config(adapter_dir)
    auto_cls = _auto_class(config.get("task_type") or CAUSAL_LM)
    base = auto_cls.from_pretrained(fetch(base_url(adapter_dir)), dtype=dtype, use_safetensors=True)
    untie_for_adapter(base, config.get("target_modules"))
    model = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    model.save_pretrained(out_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(adapter_dir).save_pretrained(out_dir)
    if auto_cls.__name__ == "AutoModelForCausalLM" and tolerance > 0:
        from models.training.probe import compare_policies

        gap = compare_policies(adapter_dir, out_dir, fetch)
        if gap.gap_max > tolerance:
            raise ValueError(f"merging adapter {adapter_dir} changed the model: merged vs base + adapter differ by "
                             f"{gap.gap_max:.3g} nats (tolerance {tolerance:g}) at {gap.where()}")
    return out_dir


_MERGED: Dict[str, str] = {}


def merged_copy(adapter_dir: str, fetch: Fetch, dtype: torch.dtype = torch.float32) -> str:
    """``adapter_dir`` merged into its base in a temporary folder, for engines that serve full
    weights; the folder of the previously merged adapter is removed (one at a time per process)."""
    if adapter_dir not in _MERGED:
        for old in _MERGED.values():
            shutil.rmtree(old, ignore_errors=True)
        _MERGED.clear()
        _MERGED[adapter_dir] = merge_adapter(adapter_dir, tempfile.mkdtemp(prefix="merged-"), fetch, dtype)
    return _MERGED[adapter_dir]


def merge_command(adapter_url: str, out_url: str, overwrite: bool = False) -> str:
    """Merge the committed adapter at ``adapter_url`` and commit the full checkpoint at ``out_url``."""
    with tempfile.TemporaryDirectory(prefix="merge-") as tmp:
        adapter_dir = download_checkpoint(adapter_url, os.path.join(tmp, "adapter"))
        if not is_adapter(adapter_dir):
            raise ValueError(f"{adapter_url} is not a LoRA adapter checkpoint (no {ADAPTER_CONFIG})")
        save_checkpoint(merge_adapter(adapter_dir, os.path.join(tmp, "merged")), out_url, overwrite=overwrite)
    return out_url


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m models.training.lora", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    merge = sub.add_parser("merge", help="write an adapter merged into its base as a full HF checkpoint")
    merge.add_argument("--adapter", required=True, help="committed adapter checkpoint (directory or fsspec URL)")
    merge.add_argument("--out", required=True, help="where to commit the full checkpoint")
    merge.add_argument("--overwrite", action="store_true", help="replace a committed checkpoint at --out")
    args = parser.parse_args(argv)
    print(merge_command(args.adapter, args.out, args.overwrite))


if __name__ == "__main__":
    main()

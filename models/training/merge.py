"""A LoRA adapter merged into its base as full weights (``W + (alpha/r)·B·A``), checked on the probe
sequences (:mod:`models.training.probe`): for engines that serve full weights, for the model registry,
and from the command line::

    python -m models.training.merge --adapter URL --out URL [--overwrite]

which commits the merged model as a full HF checkpoint. Above the adapter basics
(:mod:`models.training.lora`) and the probe, which both load checkpoints through ``lora``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from typing import Any, Dict, Optional, Sequence

import torch
from torch import nn

from models.checkpoint import download_checkpoint, save_checkpoint
from models.training.lora import ADAPTER_CONFIG, CAUSAL_LM, Fetch, adapter_config, auto_class, base_url, is_adapter
from models.training.probe import compare_policies

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
    auto_cls = auto_class(config.get("task_type") or CAUSAL_LM)
    base = auto_cls.from_pretrained(fetch(base_url(adapter_dir)), dtype=dtype, use_safetensors=True)
    untie_for_adapter(base, config.get("target_modules"))
    model = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    model.save_pretrained(out_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(adapter_dir).save_pretrained(out_dir)
    if auto_cls.__name__ == "AutoModelForCausalLM" and tolerance > 0:
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
    parser = argparse.ArgumentParser(prog="python -m models.training.merge", description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapter", required=True, help="committed adapter checkpoint (directory or fsspec URL)")
    parser.add_argument("--out", required=True, help="where to commit the full checkpoint")
    parser.add_argument("--overwrite", action="store_true", help="replace a committed checkpoint at --out")
    args = parser.parse_args(argv)
    print(merge_command(args.adapter, args.out, args.overwrite))


if __name__ == "__main__":
    main()

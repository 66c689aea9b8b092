"""Full weights committed by every rank (``actor.checkpoint_by_rank``, ``critic.checkpoint_by_rank``): under
FSDP2 each rank writes and uploads one file of the Hugging Face sharded layout, in parallel with the others,
instead of every rank gathering the whole float32 state and rank 0 writing and uploading it alone::

    iter-000007/actor/    model-00001-of-00002.safetensors   (written and uploaded by rank 0)
                          model-00002-of-00002.safetensors   (by rank 1)
                          model.safetensors.index.json, config.json, generation_config.json, tokenizer files,
                          COMMITTED.json                     (rank 0, the marker last)

Each tensor the folder stores (as ``save_pretrained`` stores them: tied copies and
``_keys_to_ignore_on_save`` left out) has one owner rank, the tensors dealt largest first to the rank with
the fewest bytes so far (:func:`assign`: deterministic, so every rank knows every owner). A tensor's DTensor
shards are gathered to its owner only (``dist.gather``, the rows each rank holds): a rank's host holds its
file's tensors, about 1/n of the model, never the whole. The folder is an ordinary Hugging Face checkpoint
(``AutoModelForCausalLM.from_pretrained``, vLLM, :mod:`models.training.sharded_load` read its index) under
the same commit marker as any other (``models/checkpoint``: every file's size and digest, rank 0 gathering
the other ranks'). A LoRA model commits its adapter from rank 0 as before (it is small).
"""

from __future__ import annotations

import json
import math
import os
import uuid
from typing import Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from models import storage
from models.checkpoint import (CheckpointError, check_file_allowed, checked_digest, commit_uploaded, file_digest,
                               put_checkpoint_file, staging_dir)
from models.training.distributed import DistInfo, is_sharded
from models.training.lora import is_peft
from models.training.sharded_load import INDEX


def weight_file(rank: int, world: int) -> str:
    """Rank ``rank``'s file, as ``save_pretrained`` names the shards of a model cut in ``world`` files."""
    return f"model-{rank + 1:05d}-of-{world:05d}.safetensors"


def applies(module: nn.Module, model: nn.Module, info: DistInfo) -> bool:
    """Whether the trained ``model`` (the HF model inside the training wrapper ``module``) is committed by
    rank: full weights FSDP2-sharded over two ranks or more (a peft model's adapter is committed whole),
    stored under the names it holds them (:func:`converted` models are written whole by rank 0, said once)."""
    if not (info.world_size > 1 and is_sharded(module) and not is_peft(model)):
        return False
    if converted(model):
        if info.is_main:
            print(f"checkpoint_by_rank: transformers converts {type(model).__name__}'s tensors on save "
                  f"(fused or renamed weights), so rank 0 writes its checkpoint whole", flush=True)
        return False
    return True


def converted(model: nn.Module) -> bool:
    """Whether ``save_pretrained`` stores ``model``'s tensors under other names or shapes than it holds
    them (a conversion mapping, e.g. Mixtral's fused experts): it reverts that over the whole state dict
    at once, which no rank holds here. The conversions transformers' ``revert_weight_conversion`` applies."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    loaded = getattr(model, "_weight_conversions", None)
    if loaded is not None:
        return len(loaded) > 0
    return any(not isinstance(c, PrefixChange) for c in get_model_conversion_mapping(model, add_legacy=False))


def assign(sizes: Mapping[str, int], world: int) -> Dict[str, int]:
    """Owner rank of each tensor of ``sizes`` (name → bytes): largest first (ties by name) to the rank with
    the fewest bytes so far (ties: the lower rank), which keeps the ranks' files within one tensor of even."""
    load = [0] * world
    owners = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[name] = rank
        load[rank] += sizes[name]
    return owners


def stored_tensors(model: nn.Module, info: DistInfo) -> Dict[str, torch.Tensor]:
    """``model``'s tensors as its Hugging Face folder stores them (sharded parameters as DTensors): its
    state dict less the keys ``save_pretrained`` leaves out (``_keys_to_ignore_on_save``, the aliases of a
    tied weight). Rank 0 picks the names, with transformers' own rule, and every rank keeps the same."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = model.state_dict(keep_vars=True)
    names = [None]
    if info.is_main:
        local = {k: v.to_local() if hasattr(v, "to_local") else v for k, v in state.items()
                 if k not in (model._keys_to_ignore_on_save or ())}
        names = [list(remove_tied_weights_from_state_dict(local, model))]
    dist.broadcast_object_list(names, src=0)
    return {name: state[name] for name in names[0]}


def gather_to(t: torch.Tensor, owner: int, info: DistInfo, device: Optional[torch.device] = None,
              dtype: Optional[torch.dtype] = None) -> Optional[torch.Tensor]:
    """The whole of ``t`` on rank ``owner``, on the CPU (or ``device``), in its dtype (or ``dtype``: each rank casts
    its rows before they travel); None on the other ranks. A DTensor sharded along dim 0 (FSDP2: ``ceil(rows /
    ranks)`` rows per rank, the last ranks fewer or none) is gathered to the owner only, each rank sending its rows
    padded to that count; a replicated or plain tensor (a buffer) is whole on every rank already."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    local = t.to_local() if isinstance(t, DTensor) else t
    local = local if dtype is None else local.detach().to(dtype)
    if not isinstance(t, DTensor) or isinstance(t.placements[0], Replicate):
        if info.rank != owner:
            return None
        return local.detach().cpu().clone() if device is None and dtype is None else \
            local.detach().to(device or "cpu")
    (placement,) = t.placements
    if not (isinstance(placement, Shard) and placement.dim == 0):
        raise ValueError(f"checkpoint by rank: placement {placement} is not FSDP2's Shard(0)")
    rows = math.ceil(t.shape[0] / info.world_size)
    padded = local.new_zeros((rows, *t.shape[1:]))  # [rows, ...]
    padded[:local.shape[0]] = local.detach()
    parts = [torch.empty_like(padded) for _ in range(info.world_size)] if info.rank == owner else None
    dist.gather(padded, parts, dst=owner)
    if parts is None:
        return None
    whole = torch.empty(t.shape, dtype=local.dtype, device=device)  # [rows_total, ...] on the host or device
    for rank, part in enumerate(parts):
        start = min(rank * rows, t.shape[0])
        whole[start:start + rows] = part[:whole.shape[0] - start]
    return whole


def my_tensors(tensors: Mapping[str, torch.Tensor], owners: Mapping[str, int],
               info: DistInfo) -> Dict[str, torch.Tensor]:
    """This rank's tensors, whole on the host; every rank takes part in every gather, in the same order."""
    mine = {}
    for name, t in tensors.items():
        whole = gather_to(t, owners[name], info)
        if whole is not None:
            mine[name] = whole.contiguous()
    return mine


def save(model: nn.Module, tokenizer, url: str, info: DistInfo) -> Mapping[str, dict]:
    """Every rank: commit ``model`` (FSDP2-sharded full weights: :func:`applies`) and ``tokenizer`` (may be
    None) at ``url``, each rank writing and uploading its file to a staging folder, rank 0 the index, the
    configs and the tokenizer, then the marker with every file's digest (``commit_uploaded``, replacing a
    checkpoint at ``url``). A rank that fails makes every rank raise (none waits forever); nothing is
    committed then. Returns the marker's files."""
    tensors = stored_tensors(model, info)
    owners = assign({n: t.numel() * t.element_size() for n, t in tensors.items()}, info.world_size)
    mine = my_tensors(tensors, owners, info)
    box = [f"{url.rstrip('/')}.tmp-{uuid.uuid4().hex[:12]}" if info.is_main else None]
    dist.broadcast_object_list(box, src=0)
    files, error = {}, None
    with staging_dir(url) as tmp:
        try:
            files = _write_weights(mine, tmp, box[0], url, info)
            if info.is_main:
                index = _index(model, tensors, owners, info.world_size)
                files.update(_write_rest(model, tokenizer, index, tmp, box[0]))
        except Exception as err:  # noqa: BLE001 - every rank learns of it below, then raises
            error = err
    reports: List[Tuple[Dict[str, dict], Optional[str]]] = [None] * info.world_size
    dist.all_gather_object(reports, (files, None if error is None else f"{type(error).__name__}: {error}"))
    failed = [(rank, msg) for rank, (_, msg) in enumerate(reports) if msg]
    if failed:
        if info.is_main:
            storage.remove(box[0], recursive=True)
        if error is not None:
            raise error
        raise CheckpointError(f"checkpoint {url}: rank {failed[0][0]} failed to write its weights "
                              f"({failed[0][1]}); nothing was committed")
    manifest = {rel: digest for files, _ in reports for rel, digest in files.items()}
    if info.is_main:
        commit_uploaded(box[0], url, manifest)
    dist.barrier()  # committed before any rank reports the update done
    return manifest


def _write_weights(mine: Dict[str, torch.Tensor], tmp: str, box: str, url: str, info: DistInfo) -> Dict[str, dict]:
    """This rank's file written in ``tmp``, refused if not finite, uploaded into ``box``; ``{file: digest}``."""
    from safetensors.torch import save_file

    rel = weight_file(info.rank, info.world_size)
    path = os.path.join(tmp, rel)
    save_file(mine, path, metadata={"format": "pt"})  # transformers refuses files without it
    digest = checked_digest(path, rel, url)  # refused if not finite
    put_checkpoint_file(path, storage.join(box, rel), consume=True)
    return {rel: digest}


def _index(model: nn.Module, tensors: Mapping[str, torch.Tensor], owners: Mapping[str, int], world: int) -> dict:
    """``model.safetensors.index.json``'s content, as ``save_pretrained`` writes it."""
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    return {"metadata": {"total_parameters": model.num_parameters(), "total_size": total},
            "weight_map": {name: weight_file(owners[name], world) for name in sorted(tensors)}}


def _write_rest(model: nn.Module, tokenizer, index: dict, tmp: str, box: str) -> Dict[str, dict]:
    """Rank 0: the index, ``config.json`` (dtype and architecture set as ``save_pretrained`` sets them), the
    generation config of a generating model and the tokenizer, uploaded into ``box``; ``{file: digest}``."""
    folder = os.path.join(tmp, "rest")
    os.makedirs(folder)
    with open(os.path.join(folder, INDEX), "w", encoding="utf-8") as f:
        f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
    model.config.dtype = str(model.dtype).split(".")[1]
    model.config.architectures = [type(model).__name__.removeprefix("FSDP")]
    model.config.save_pretrained(folder)
    if model.can_generate():
        model.generation_config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    digests = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        check_file_allowed(name, folder)
        digests[name] = file_digest(path)
        put_checkpoint_file(path, storage.join(box, name), consume=True)
    return digests

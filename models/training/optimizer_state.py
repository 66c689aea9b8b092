"""AdamW's moments carried from one iteration's update to the next, beside the checkpoint they trained.

Every update is a new process (an elastic job per iteration), so without this AdamW would start
from zero each iteration: at its first step the bias-corrected ``m̂/√v̂`` is ``g/|g|``, so every
weight moves by about ±lr whatever its gradient history, and the moment estimates never span more
than one batch. One long-running trainer keeps them (TRL, OpenRLHF, veRL, NeMo-Aligner); so does
this project, as a committed folder beside each checkpoint::

    iter-000007/actor/              the HF checkpoint (what engines, MLflow and users load)
    iter-000007/actor-optimizer/    optimizer.safetensors + COMMITTED.json

``optimizer.safetensors`` holds ``{param}.exp_avg``, ``{param}.exp_avg_sq`` and ``{param}.step``
for every trainable parameter, by its name in the unwrapped training module, as whole
(unsharded) tensors in the parameters' dtype, so the next update may run on another number of ranks. Only the state is
carried: learning rate, betas and weight decay come from the run's config each iteration. A state
that does not fit the model (other trainable parameters or shapes: the LoRA settings changed, say)
is reported and AdamW starts from zero.

A parameter the optimizer has not stepped yet (an update that took no step: every advantage zero)
is saved as AdamW would start it, zero moments at step 0, so the next update starts where a fresh
AdamW would, without a "does not fit" notice; a state loaded and not stepped is saved as loaded.
"""

from __future__ import annotations

import os
from typing import Dict, Optional

import torch
from torch import nn

from models.checkpoint import is_committed, read_marker, save_checkpoint, staging_dir, verified_copy
from models.training.distributed import DistInfo, is_sharded, unwrap

FILE = "optimizer.safetensors"
MOMENTS = ("exp_avg", "exp_avg_sq")
FORMAT = "adamw-moments-1"


def _trainable(model: nn.Module) -> Dict[str, nn.Parameter]:
    return {name: p for name, p in unwrap(model).named_parameters() if p.requires_grad}


def _full(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole on the CPU (all-gathers a DTensor shard: collective under FSDP2); a CPU tensor is
    not copied (it is written before the optimizer steps again)."""
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    return full.detach().cpu().contiguous()


def gather(model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, torch.Tensor]:
    """The optimizer's per-parameter state as whole CPU tensors keyed ``{param}.{exp_avg|exp_avg_sq|step}``.

    Every rank must call it (under FSDP2 each moment is all-gathered); parameters the optimizer
    has not stepped yet are left out."""
    out: Dict[str, torch.Tensor] = {}
    for name, p in _trainable(model).items():
        st = optimizer.state.get(p)
        if not st:
            continue
        for key in MOMENTS:
            out[f"{name}.{key}"] = _full(st[key])
        out[f"{name}.step"] = torch.as_tensor(st["step"], dtype=torch.float32).detach().cpu().reshape(())
    return out


def fill_unstepped(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Give every trainable parameter without optimizer state the state a fresh AdamW starts from: zero
    moments (sharded like the parameter) and step 0, where its first step would make it 1."""
    capturable = _capturable(optimizer)
    for p in _trainable(model).values():
        if not optimizer.state.get(p):
            step = torch.zeros((), dtype=torch.float32, device=p.device if capturable else "cpu")
            optimizer.state[p] = {"step": step, **{key: torch.zeros_like(p, memory_format=torch.preserve_format)
                                                   for key in MOMENTS}}


def save(model: nn.Module, optimizer: torch.optim.Optimizer, url: str, info: DistInfo, sharded: bool = False) -> None:
    """Commit the optimizer's state at ``url`` (rank 0 writes; every rank must call). ``sharded``: under
    FSDP2 with more than one rank, each rank writes its own shard instead (``models/training/optimizer_shards.py``);
    otherwise (DDP, one process: every rank holds the whole state) the whole state as usual."""
    from safetensors.torch import save_file

    fill_unstepped(model, optimizer)
    if sharded and info.world_size > 1 and is_sharded(model):
        from models.training import optimizer_shards

        optimizer_shards.save(_trainable(model), optimizer, url, info)
        return
    state = gather(model, optimizer)
    if not info.is_main:
        return
    with staging_dir(url) as tmp:
        save_file(state, os.path.join(tmp, FILE), metadata={"format": FORMAT, "optimizer": type(optimizer).__name__})
        save_checkpoint(tmp, url, overwrite=True, consume=True, require_model=False)


def load(model: nn.Module, optimizer: torch.optim.Optimizer, url: str,
         info: Optional[DistInfo] = None, role: str = "actor") -> Optional[int]:
    """Set ``optimizer``'s state from the committed state at ``url``; returns the steps it had taken,
    or None (the optimizer left fresh) when there is none or it does not fit ``model``.

    Every rank reads the file itself (a DTensor parameter gets its shard of each moment); a state saved
    per rank (``models/training/optimizer_shards.py``) is read by each rank of ``info`` from its own shard only."""
    from safetensors import safe_open

    if not is_committed(url):
        return None
    params = _trainable(model)
    if optimizer_shards_saved(url):
        from models.training import optimizer_shards

        return optimizer_shards.load(params, optimizer, url, info or DistInfo(0, 1, 0, torch.device("cpu")),
                                     _capturable(optimizer), role)
    with verified_copy(url) as local, safe_open(os.path.join(local, FILE), framework="pt") as f:
        meta = f.metadata() or {}
        keys = set(f.keys())
        want = {f"{n}.{k}" for n in params for k in (*MOMENTS, "step")}
        problem = _mismatch(meta, type(optimizer).__name__, keys, want)
        if problem is None:
            for name, p in params.items():
                shape = tuple(p.shape)  # a DTensor's shape is the whole parameter's
                got = tuple(f.get_slice(f"{name}.exp_avg").get_shape())
                if got != shape:
                    problem = f"parameter {name} has shape {shape}, the saved state {got}"
                    break
        if problem is not None:
            print(f"optimizer state {url} does not fit this model ({problem}): AdamW starts from zero", flush=True)
            return None
        steps = 0
        for name, p in params.items():
            st = {key: _like(f.get_tensor(f"{name}.{key}"), p) for key in MOMENTS}
            step = f.get_tensor(f"{name}.step").to(torch.float32)
            st["step"] = step.to(p.device) if _capturable(optimizer) else step
            optimizer.state[p] = st
            steps = max(steps, int(step.item()))
    return steps


def optimizer_shards_saved(url: str) -> bool:
    """Whether the committed state at ``url`` was saved per rank."""
    from models.training.optimizer_shards import is_sharded_state

    return is_sharded_state(read_marker(url)["files"])


def _mismatch(meta: Dict[str, str], optimizer: str, keys: set, want: set) -> Optional[str]:
    if meta.get("format") != FORMAT:
        return f"format {meta.get('format')!r}, expected {FORMAT!r}"
    if meta.get("optimizer") != optimizer:
        return f"saved by {meta.get('optimizer')}, this update uses {optimizer}"
    if keys != want:
        missing, extra = sorted(want - keys), sorted(keys - want)
        return f"{len(missing)} entries missing (e.g. {missing[:2]}), {len(extra)} unexpected (e.g. {extra[:2]})"
    return None


def _like(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``full`` as ``p`` holds its state: on its device, sharded like it when ``p`` is a DTensor."""
    full = full.to(device=p.device, dtype=p.dtype if p.is_floating_point() else full.dtype)
    if hasattr(p, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(full, p.device_mesh, p.placements)
    return full


def _capturable(optimizer: torch.optim.Optimizer) -> bool:
    g = optimizer.param_groups[0]
    return bool(g.get("capturable") or g.get("fused"))

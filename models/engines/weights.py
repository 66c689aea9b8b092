"""Weights as bytes: a trainer's new weights on their way to a running engine in memory, never
through storage (:meth:`models.engines.base.SwappableEngine.load_tensors` serves them).

The bytes are a safetensors file built in memory (``safetensors.torch.save``/``load``): every
tensor on the CPU, contiguous, in its own dtype, so the round trip is bit-exact (float32,
bfloat16, ...). A Hugging Face state dict of a tied model holds ``lm_head.weight`` and
``model.embed_tokens.weight`` as one storage, which safetensors refuses to write twice: such a
tensor is written once, the other names are recorded as its aliases in the header's metadata, and
:func:`unpack_weights` gives them back as one tensor again.
"""

from __future__ import annotations

import json
import struct
from typing import Dict, Mapping, Tuple

import torch

_ALIASES = "aliases"
"""Metadata key: ``{name: name it is the same tensor as}`` (JSON)."""


def _view_key(t: torch.Tensor) -> Tuple:
    """Two tensors with this key are the same values in the same memory (one tensor under two names)."""
    return (t.device, t.dtype, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())


def distinct_tensors(state: Mapping[str, torch.Tensor]) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """``(tensors, aliases)``: ``state``'s tensors (detached), each tensor once under the first name it has,
    and ``{other name: that name}`` for names that share it (a tied head)."""
    tensors: Dict[str, torch.Tensor] = {}
    aliases: Dict[str, str] = {}
    first: Dict[Tuple, str] = {}
    for name, t in state.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"weight {name!r} is a {type(t).__name__}, not a tensor")
        t = t.detach()
        key = _view_key(t)
        if t.numel() and key in first:
            aliases[name] = first[key]
            continue
        first[key] = name
        tensors[name] = t
    return tensors, aliases


def pack_weights(state: Mapping[str, torch.Tensor]) -> bytes:
    """``state`` (name → tensor, any device) as safetensors bytes; names that share one tensor (a tied
    head) are written once, the others recorded as aliases."""
    distinct, aliases = distinct_tensors(state)
    tensors: Dict[str, torch.Tensor] = {}
    storages = set()
    for name, t in distinct.items():
        cpu = t.to("cpu").contiguous()
        if cpu.numel() and cpu.untyped_storage().data_ptr() in storages:  # another view of a written storage
            cpu = cpu.clone()
        storages.add(cpu.untyped_storage().data_ptr())
        tensors[name] = cpu
    from safetensors.torch import save

    return save(tensors, metadata={"format": "pt", _ALIASES: json.dumps(aliases)})


def _metadata(data: bytes) -> Dict[str, str]:
    """The ``__metadata__`` of safetensors bytes (an 8-byte little-endian header length, then a JSON header)."""
    if len(data) < 8:
        raise ValueError(f"not packed weights: {len(data)} bytes, shorter than a safetensors header")
    (size,) = struct.unpack("<Q", data[:8])
    try:
        header = json.loads(data[8:8 + size]) if 8 + size <= len(data) else None
    except (UnicodeDecodeError, ValueError):
        header = None
    if not isinstance(header, dict):
        raise ValueError(f"not packed weights: no safetensors header of {size} bytes in the first {len(data)}")
    return header.get("__metadata__") or {}


def unpack_weights(data: bytes) -> Dict[str, torch.Tensor]:
    """The state dict :func:`pack_weights` packed: CPU tensors, aliases as the same tensor as their target."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    aliases = json.loads(_metadata(data).get(_ALIASES, "{}"))
    try:
        state = load(bytes(data))
    except SafetensorError as err:
        raise ValueError(f"not packed weights: {err}") from err
    for name, target in aliases.items():
        if target not in state:
            raise ValueError(f"packed weights name {name!r} an alias of {target!r}, which they do not hold")
        state[name] = state[target]
    return state

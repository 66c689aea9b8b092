"""Rank-local loading: a checkpoint read into an FSDP2-sharded model, each rank reading only its rows.

The model is built on the meta device (no memory), wrapped and sharded by
:func:`models.training.distributed.wrap_for_training`, materialised as empty local shards
(``to_empty``), and each rank then reads its shard of every weight out of the checkpoint's
safetensors files: FSDP2 shards a parameter along dim 0 (``Shard(0)``, ``torch.chunk``'s split:
``ceil(rows / ranks)`` rows per rank, the last ranks fewer or none), and a row-major tensor's rows
are one byte range of the file (its header gives where), read straight into the shard. Host memory per
rank is its share of the weights, not the whole float32 model.

Not ``safe_open(file).get_slice(name)[start:stop]``: it reads the same rows through a memory map of
the file, whose pages then count in the rank's resident set beside the shard they were copied to
(twice the shard; ``benchmarks/bench_sharded_load.py`` measured it at the whole load's peak).

A LoRA model (:func:`load_sharded_lora`) reads its frozen base the same way from the full checkpoint
the adapter names, each parameter under its base name (:func:`models.training.lora.base_name`); its
adapter, small, is made whole on every rank (read from the adapter folder, or fresh from the caller's
RNG as the whole load makes it) and each rank keeps its rows. The commit stays the adapter folder.

Buffers are not sharded: those the checkpoint holds are read whole, the others (rotary ``inv_freq``)
are computed by the model's own ``_init_weights``, as transformers' ``from_pretrained`` computes
them. Tied weights (``lm_head = embed_tokens``) are one parameter, sharded and read once.

``torch.distributed.checkpoint``'s ``HuggingFaceStorageReader`` reads the same slices with ``get_slice``
(the memory map again), wants the state dict under the checkpoint's names without the tied
duplicates, and plans the read with collectives; reading the rows here needs no communication.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
from typing import Callable, Dict, Iterator, Optional, Tuple

import torch
from torch import nn

from models.checkpoint.tensor_file import SAFETENSORS_DTYPES, read_exactly, read_header
from models.training.distributed import DistInfo, wrap_for_training
from models.training.policy import known_packing, with_packing
from models.training.update import disable_dropout

INDEX = "model.safetensors.index.json"


def tensor_files(local_dir: str) -> Dict[str, str]:
    """Tensor name → the safetensors file of ``local_dir`` that holds it (from the index when sharded)."""
    index = os.path.join(local_dir, INDEX)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(local_dir, file) for name, file in weight_map.items()}
    files = sorted(f for f in os.listdir(local_dir) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{local_dir}: no .safetensors file (a sharded load reads safetensors only)")
    return {name: os.path.join(local_dir, file) for file in files
            for name in read_header(os.path.join(local_dir, file))[0]}


def read_rows(f, entry: dict, data_start: int, start: int, out: torch.Tensor) -> None:
    """Rows ``start .. start + len(out)`` of the stored tensor of header ``entry`` into ``out``, cast to its
    dtype: one read of their bytes (a row-major tensor's rows are contiguous), straight into ``out``
    when it is a host tensor of the stored dtype. A plain read, not a memory map: the file's pages stay
    out of this process's memory."""
    dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
    if dtype is None:
        raise ValueError(f"sharded load: safetensors dtype {entry['dtype']} is not supported")
    row_bytes = math.prod(entry["shape"][1:]) * dtype.itemsize
    direct = out.device.type == "cpu" and out.dtype == dtype and out.is_contiguous()
    buf = out if direct else torch.empty(out.shape, dtype=dtype)  # on the host, then copied (a GPU's shard)
    view = memoryview(buf.reshape(-1).view(torch.uint8).numpy())
    f.seek(data_start + entry["data_offsets"][0] + start * row_bytes)
    read_exactly(f, view)
    if buf is not out:
        out.copy_(buf)


def shard_rows(param: torch.Tensor, info: DistInfo) -> Tuple[torch.Tensor, int]:
    """``param``'s local tensor on this rank and the first global row it holds (0 for a whole one)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(param, DTensor):
        return param.data, 0
    local = param.to_local()
    (placement,) = param.placements
    if isinstance(placement, Replicate):
        return local, 0
    if not (isinstance(placement, Shard) and placement.dim == 0):
        raise ValueError(f"sharded load: placement {placement} is not FSDP2's Shard(0)")
    rows = math.ceil(param.shape[0] / info.world_size)
    return local, min(info.rank * rows, param.shape[0])


def _by_file(names: Iterator[Tuple[str, torch.Tensor]], files: Dict[str, str], local_dir: str):
    """``{file: [(name, tensor)]}``, naming every tensor the checkpoint lacks."""
    grouped: Dict[str, list] = {}
    missing = []
    for name, tensor in names:
        if name in files:
            grouped.setdefault(files[name], []).append((name, tensor))
        else:
            missing.append(name)
    if missing:
        raise ValueError(f"{local_dir}: the checkpoint has no tensor {', '.join(missing[:5])}"
                         f"{' ...' if len(missing) > 5 else ''} (a sharded load reads every weight from it)")
    return grouped


def fill_from_checkpoint(model: nn.Module, local_dir: str, files: Dict[str, str], info: DistInfo,
                         given: Optional[Dict[str, torch.Tensor]] = None,
                         rename: Callable[[str], str] = lambda name: name) -> None:
    """Copy this rank's rows of every parameter of ``model`` (an HF model, sharded or not) and every
    persistent buffer the checkpoint holds out of ``local_dir``'s safetensors ``files``
    (:func:`tensor_files`), the checkpoint's tensor of a parameter named ``rename(name)``. ``given``:
    parameters (by their name in ``model``) copied from these whole tensors instead (a LoRA adapter's)."""
    given = given or {}
    persistent = set(model.state_dict(keep_vars=True))
    params = [(rename(n), p) for n, p in model.named_parameters() if n not in given]
    buffers = [(rename(n), b) for n, b in model.named_buffers() if n in persistent and rename(n) in files]
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in given:
                _copy_rows(name, given[name], param, info)
    for path, tensors in _by_file(iter([*params, *buffers]), files, local_dir).items():
        header, data_start = read_header(path)
        with open(path, "rb", buffering=0) as f, torch.no_grad():
            for name, param in tensors:
                shape = tuple(header[name]["shape"])
                if shape != tuple(param.shape):
                    raise ValueError(f"{local_dir}: {name} has shape {shape} in the checkpoint, "
                                     f"{tuple(param.shape)} in the model")
                local, start = shard_rows(param, info)
                if local.numel():
                    read_rows(f, header[name], data_start, start, local)


def _copy_rows(name: str, whole: torch.Tensor, param: torch.Tensor, info: DistInfo) -> None:
    """This rank's rows of ``whole`` into ``param``'s shard."""
    if tuple(whole.shape) != tuple(param.shape):
        raise ValueError(f"sharded load: {name} has shape {tuple(whole.shape)}, {tuple(param.shape)} in the model")
    local, start = shard_rows(param, info)
    local.copy_(whole[start:start + local.shape[0]])


def materialise(module: nn.Module, model: nn.Module, device: torch.device) -> None:
    """Give meta-device ``module`` (``model`` or a wrapper of it, sharded or not) empty storage on
    ``device``, its ties restored (``to_empty`` gives a tied head a storage of its own) and its buffers
    computed (:func:`init_buffers`); the parameters are then read by :func:`fill_from_checkpoint`."""
    module.to_empty(device=device)
    model.tie_weights()
    init_buffers(model)


def init_buffers(model: nn.Module) -> None:
    """The buffers ``model``'s own ``_init_weights`` computes (rotary ``inv_freq``), as transformers'
    ``from_pretrained`` computes those a checkpoint lacks; the parameters are flagged as loaded, so
    the init leaves them alone. A floating buffer the init leaves unset (NaN) is an error."""
    for p in model.parameters():
        p._is_hf_initialized = True  # transformers' init skips flagged tensors
    owners = [m for m in model.modules() if next(m.buffers(recurse=False), None) is not None]
    for module in owners:
        for b in module.buffers(recurse=False):
            if b.is_floating_point():
                b.fill_(float("nan"))
        model._init_weights(module)


def _unset_buffers(model: nn.Module, files: Dict[str, str], rename: Callable[[str], str]):
    return [n for n, b in model.named_buffers()
            if b.is_floating_point() and rename(n) not in files and b.isnan().any()]


def meta_model(local_dir: str, auto_cls, dtype: torch.dtype) -> nn.Module:
    """``auto_cls``'s model of ``local_dir``'s config on the meta device, its weights in ``dtype``."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(local_dir)
    with torch.device("meta"):
        return auto_cls.from_config(config, dtype=dtype)


def load_sharded(local_dir: str, auto_cls, info: DistInfo, sharding: str, compute_dtype: torch.dtype,
                 wrapper: Callable[[nn.Module], nn.Module], pack: bool = False,
                 activation_checkpointing: bool = False, frozen: bool = False) -> nn.Module:
    """The full-weight checkpoint in ``local_dir`` as ``wrapper(model)`` (e.g. ``PolicyLogprobs``),
    FSDP2-sharded over ``info``'s ranks (``sharding`` must mean FSDP2 there), each rank reading only its
    rows, float32 master weights computing in ``compute_dtype``. ``pack``: ``model.pack_sequences``
    (checked on the loaded model, :func:`models.training.policy.with_packing`); ``activation_checkpointing``:
    as :func:`wrap_for_training`'s. ``frozen`` (π_ref, a reward model: never trained): the weights held at the
    checkpoint's own dtype where every weight is stored at one below float32 (:func:`stored_dtype`), cast to
    ``compute_dtype`` as each unit is gathered: the same forward as of float32 weights read from it (the cast
    of a bfloat16 value to float32 is exact), in half their memory, the root unit resharded after each forward
    (:func:`~models.training.distributed.wrap_for_training`'s ``frozen``).

    A collective: every rank calls it. Returns the module :func:`wrap_for_training` returns."""
    held = (stored_dtype(local_dir) if frozen else None) or torch.float32
    model = meta_model(local_dir, auto_cls, held)
    module = disable_dropout(model.eval())
    return _shard_and_read(wrapper(module), model, local_dir, info, sharding, compute_dtype, pack,
                           activation_checkpointing=activation_checkpointing, held_dtype=held, frozen=frozen)


def stored_dtype(local_dir: str) -> Optional[torch.dtype]:
    """The one floating dtype below float32 (bfloat16, float16) every floating tensor of ``local_dir``'s
    safetensors files is stored at; None when they are float32 or of several dtypes."""
    found = {SAFETENSORS_DTYPES.get(entry["dtype"]) for path in set(tensor_files(local_dir).values())
             for entry in read_header(path)[0].values()}
    floating = {d for d in found if d is not None and d.is_floating_point}
    return floating.pop() if len(floating) == 1 and next(iter(floating)).itemsize < 4 else None


def load_sharded_lora(local_dir: str, base_dir: str, auto_cls, info: DistInfo, sharding: str,
                      compute_dtype: torch.dtype, adapt: Callable[[nn.Module], nn.Module],
                      wrapper: Callable[[nn.Module], nn.Module], pack: bool = False,
                      activation_checkpointing: bool = False) -> nn.Module:
    """:func:`load_sharded` of a LoRA model: the frozen base of the full checkpoint in ``base_dir`` (in
    ``compute_dtype``, as the whole load has it) read by shard, each rank its rows, with ``adapt(base)``'s
    adapter (``local_dir``'s if that is an adapter folder, else fresh:
    :func:`models.training.lora.with_adapter`), made whole on every rank (it is small) and each rank
    keeping its rows.

    The base is built on the meta device; peft gives a new adapter its base layer's device, so it is
    made over :func:`stand_ins` (real tensors of one element of storage), and its weights kept aside:
    the trained ones of an adapter folder, or a fresh adapter's own matrices. A trained head's copy in
    a fresh adapter (a critic's ``score``) is read from the base checkpoint into its float32 parameter:
    under a bfloat16 ``compute_dtype`` the whole load copies it from the bfloat16 base, rounded. A
    collective: every rank calls it."""
    from models.training.lora import base_name, is_adapter

    model = meta_model(base_dir, auto_cls, compute_dtype)
    files = tensor_files(base_dir)
    with stand_ins(model):
        lora = disable_dropout(adapt(model).eval())
        given = {n: p.detach().clone() for n, p in model.named_parameters()
                 if p.requires_grad and (is_adapter(local_dir) or base_name(n) not in files)}
    return _shard_and_read(wrapper(lora), model, base_dir, info, sharding, compute_dtype, pack, given, base_name,
                           activation_checkpointing)


def _shard_and_read(top: nn.Module, model: nn.Module, local_dir: str, info: DistInfo, sharding: str,
                    compute_dtype: torch.dtype, pack: bool, given: Optional[Dict[str, torch.Tensor]] = None,
                    rename: Callable[[str], str] = lambda name: name,
                    activation_checkpointing: bool = False, held_dtype: torch.dtype = torch.float32,
                    frozen: bool = False) -> nn.Module:
    """``top`` (a wrapper of meta-device ``model``) FSDP2-sharded, its storage made and every rank's rows
    read (:func:`fill_from_checkpoint` of ``local_dir``, ``given`` and ``rename`` passed on)."""
    module = wrap_for_training(top, info, sharding, compute_dtype, activation_checkpointing, held_dtype, frozen)
    if not hasattr(module, "reshard"):
        raise ValueError(f"sharded load: sharding {sharding!r} over {info.world_size} rank(s) is not FSDP2")
    materialise(module, model, info.device)
    files = tensor_files(local_dir)
    fill_from_checkpoint(model, local_dir, files, info, given, rename)
    unset = _unset_buffers(model, files, rename)
    if unset:
        raise ValueError(f"{local_dir}: buffers {unset} are neither in the checkpoint nor computed by "
                         f"{type(model).__name__}._init_weights")
    return _checked_packing(module, pack)


@contextlib.contextmanager
def stand_ins(model: nn.Module) -> Iterator[nn.Module]:
    """Meta-device ``model``'s parameters as real tensors of their shapes and dtypes over one element of
    storage (a zero expanded: no memory) while the block runs; afterwards the meta parameters back (ties
    kept: one stand-in per parameter; frozen as their stand-ins were) and every real parameter made
    since (an adapter's) on meta too."""
    made: Dict[int, nn.Parameter] = {}
    swapped = []
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and p.is_meta:
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(torch.zeros((), dtype=p.dtype).expand(p.shape), p.requires_grad)
                swapped.append((module, name, p))
                module._parameters[name] = made[id(p)]
    try:
        yield model
    finally:
        for module, name, p in swapped:
            module._parameters[name] = p.requires_grad_(made[id(p)].requires_grad)  # peft froze the base
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is not None and not p.is_meta:
                    module._parameters[name] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)


def _checked_packing(module: nn.Module, pack: bool) -> nn.Module:
    """``module`` run packed if ``pack`` and its model keeps packed rows apart: the check's forwards run
    as an FSDP forward of the root (its weights gathered, every rank taking part), then resharded so
    the optimizer sees the shards."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    if not pack:
        return module
    if known_packing(module) is not None:  # checked on a model like this one already: no forward, nothing gathered
        return with_packing(module, True)
    module.check_packing = functools.partial(with_packing, module, True)
    register_fsdp_forward_method(module, "check_packing")
    module.check_packing()
    del module.check_packing
    module.reshard()
    return module

"""A weight push into vLLM's workers, run in each worker through ``collective_rpc`` (vLLM 0.32's in-place reload,
split over calls): :func:`begin` starts vLLM's layerwise reload (``initialize_layerwise_reload``: the weights on
the meta device, every loader deferred until its layer has all its weights), each :func:`chunk` runs the model's
own ``load_weights`` on a chunk (the loaders take the worker's tensor-parallel slice of each tensor and process a
layer, e.g. repack it for the CPU's GEMM, as soon as it is complete), and :func:`finish` ends the reload
(``finalize_layerwise_reload``) and returns what vLLM's loader reported it could not load, as
``reload_weights`` would (vLLM only logs those: each is a failure here).

With ``tensor_parallel_size`` > 1 a trainer's push reaches each worker straight over the weight channel
(:mod:`models.engines.worker_channel`, which loads through :func:`begin`, :func:`chunk` and :func:`finish` in the
worker); a chunk loaded from this process (``load_tensors``, the HTTP transport) reaches them as a file in shared
memory they map (:func:`chunk`'s ``shared``): each worker's loaders read only the slices it keeps, where
``collective_rpc``'s arguments would pickle the whole chunk to every worker.

:func:`read_back` reads sampled elements of the pushed tensors back from the worker's weights. A tensor's
elements sit in vLLM's weights under other names (q, k and v in one ``qkv_proj``), sliced per worker: where, is
what the model's loaders do with it, so :func:`_where` runs them once on placeholders that record each copy
(vLLM's own dry run for its sharded transfer: ``FakeRDTTensor``, ``BakeSink``) and keeps, per tensor, the
region of the tensor each copy read and of the weight it wrote. A weight the CPU's GEMM repacked (vLLM frees
``weight`` there) is read through its layer's own kernel, one unit vector per column: ``x @ W.T`` with
``x = e_k`` is column ``k`` exactly, as the engine computes with it.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from models.engines.weight_stream import bits
from models.faults import drop_pushed

_RELOAD_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise",
                   "vllm.model_executor.model_loader.reload.inplace")
_NOT_LOADED = ": Failed to load weights"
_STATE: Dict[int, Dict[str, Any]] = {}
"""Per worker (``id``), the push under way: its log capture and the weights loaded so far."""
_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
"""Per model, the last :func:`_where` and the tensors it was made for."""


class Capture(logging.Handler):
    """vLLM's reload reports (warnings), whatever the user's log level."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: List[str] = []
        self.saved: List[Tuple[logging.Logger, int, bool]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def install(self) -> "Capture":
        for name in _RELOAD_LOGGERS:
            lg = logging.getLogger(name)
            self.saved.append((lg, lg.level, lg.disabled))
            lg.setLevel(logging.WARNING)
            lg.disabled = False
            lg.addHandler(self)
        return self

    def remove(self) -> None:
        for lg, level, disabled in self.saved:
            lg.removeHandler(self)
            lg.setLevel(level)
            lg.disabled = disabled
        self.saved = []


def own_params(module: torch.nn.Module) -> List[torch.nn.Parameter]:
    return list(module.parameters(recurse=False))


def tied_modules(model: torch.nn.Module) -> List[torch.nn.Module]:
    """Modules every one of whose parameters is also another module's (a tied ``lm_head``)."""
    owners: Dict[int, int] = {}
    for module in model.modules():
        for p in own_params(module):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return [m for m in model.modules() if own_params(m) and all(owners[id(p)] > 1 for p in own_params(m))]


def failures(model: torch.nn.Module, capture: Capture) -> List[str]:
    """What the loader reported it could not load, less what is repaired here: the packed copy of a tied module
    (its shared weight is new, its derived copy not) is derived again; a module holding buffers only (rotary
    caches) has nothing to load."""
    repaired = set()
    for module in tied_modules(model):
        method = getattr(module, "quant_method", None)
        if method is not None and type(method).__name__.startswith("Unquantized"):
            method.process_weights_after_loading(module)
            repaired.add(type(module).__name__)
    owning = {type(m).__name__ for m in model.modules() if own_params(m)}
    benign = repaired | ({type(m).__name__ for m in model.modules()} - owning)
    reports = [msg for msg in capture.messages if "Failed to load" in msg or "not loaded" in msg]
    return [msg for msg in reports if not (msg.endswith(_NOT_LOADED) and msg[:-len(_NOT_LOADED)] in benign)]


def _config(worker: Any):
    from vllm.config import set_current_vllm_config

    return set_current_vllm_config(worker.vllm_config)


def begin(worker: Any) -> None:
    from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

    capture = Capture().install()
    _STATE[id(worker)] = {"capture": capture, "loaded": set()}
    with _config(worker):
        initialize_layerwise_reload(worker.model_runner.get_model())


def _mapped(shared: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """The tensors of a chunk in shared memory: views of the mapped file (nothing read until a loader reads it)."""
    data = torch.from_file(shared["path"], shared=True, size=int(shared["nbytes"]), dtype=torch.uint8)
    out = {}
    for name, dtype, shape, offset in shared["tensors"]:
        dt = getattr(torch, dtype)
        n = 1
        for s in shape:
            n *= int(s)
        out[name] = data[offset:offset + n * dt.itemsize].view(dt).view(shape)
    return out


def chunk(worker: Any, tensors: Optional[Dict[str, torch.Tensor]] = None,
          shared: Optional[Dict[str, Any]] = None) -> None:
    """Load ``tensors`` (in this process: the engine's own worker), or the chunk in shared memory ``shared``."""
    weights = drop_pushed(tensors if tensors is not None else _mapped(shared or {}))
    with _config(worker):
        loaded = worker.model_runner.get_model().load_weights(iter(weights.items()))
    _STATE[id(worker)]["loaded"] |= set(loaded or ())


def finish(worker: Any) -> List[str]:
    """End the reload; what the loader could not load (empty: every weight is the push's)."""
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    state = _STATE.pop(id(worker), None)
    if state is None:
        return ["no push was begun on this worker"]
    model = worker.model_runner.get_model()
    try:
        with _config(worker):
            finalize_layerwise_reload(model, worker.model_runner.model_config)
    finally:
        state["capture"].remove()
    runner = worker.model_runner
    for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):  # as reload_weights does
        getattr(runner, reset, lambda: None)()
    problems = failures(model, state["capture"])
    lora = worker.vllm_config.lora_config is not None
    held = {n.replace(".base_layer.", ".") if lora else n for n, _ in model.named_parameters()}
    missing = sorted(held - state["loaded"])
    if missing:
        problems.append(f"Following weights were not loaded: {missing[:5]}")
    return problems


def patch(worker: Any, patches: Dict[str, Tuple[Sequence[int], Any]]) -> None:
    """A delta push's chunk, in place (no layerwise reload): ``{name: (shape, Patch)}``
    (:class:`models.engines.weight_delta.Patch`; steps added to the elements this worker holds, :func:`held_at`)
    through vLLM's own sparse loader (``load_checkpoint_weight_patches``: the model's loaders map each checkpoint
    tensor onto its fused and tensor-parallel parameters, writing only the positions given). Needs the weights as
    loaded (a GPU's; the CPU's GEMM repacks and frees them, so a CPU engine takes full pushes only)."""
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (CheckpointWeightPatch,
                                                                          load_checkpoint_weight_patches)

    from models.engines.weight_delta import stepped

    model = worker.model_runner.get_model()
    device = next(model.parameters()).device
    chunk = []
    for name, (shape, got) in drop_pushed(patches).items():
        n = 1
        for s in shape:
            n *= int(s)
        at = torch.arange(n, device=device) if got.indices is None else got.indices.to(device)  # whole: every place
        values = got.values if got.step is None else stepped(held_at(worker, name, at, got.step), got)
        chunk.append(CheckpointWeightPatch(name, tuple(int(s) for s in shape), values.dtype,
                                           values.reshape(-1).to(device), at))
    with _config(worker):
        load_checkpoint_weight_patches(model, chunk)


def patched(worker: Any) -> List[str]:
    """After a delta push's last chunk: the runner's caches that hold results of the old weights reset."""
    for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
        getattr(worker.model_runner, reset, lambda: None)()
    return []


def drop() -> None:
    """Forget the pushes under way in this process (their engine is closing): their log captures removed."""
    for state in _STATE.values():
        state["capture"].remove()
    _STATE.clear()


# -- reading back ------------------------------------------------------------------------------------------------

Region = Tuple[int, Tuple[int, ...], Tuple[int, ...]]
"""``(storage offset, shape, stride)`` of a view."""


def _replay(t: torch.Tensor, chain) -> torch.Tensor:
    for op, args, kwargs in chain:
        t = getattr(t, op)(*args, **dict(kwargs))
    return t


def _region(t: torch.Tensor) -> Region:
    return t.storage_offset(), tuple(t.shape), tuple(t.stride())


def _where(worker: Any, metas: Dict[str, Tuple[Sequence[int], str]]) -> Dict[str, list]:
    """Per pushed tensor, where its elements went in this worker: ``[(layer, weight name, weight shape, region
    of the weight written, region of the tensor read)]``, from one dry run of the model's loaders."""
    from vllm.distributed.weight_transfer.sharded_rdt_engine import ShardedRDTWeightTransferEngine as Rdt
    from vllm.distributed.weight_transfer.sharded_rdt_fake import BakeSink, FakeRDTTensor
    from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

    model = worker.model_runner.get_model()
    key = tuple(sorted((n, tuple(s), d) for n, (s, d) in metas.items()))
    cached = _PLANS.get(model)
    if cached is not None and cached[0] == key:
        return cached[1]
    device = next(model.parameters()).device
    sink = BakeSink()
    with _config(worker), torch.device(device):
        initialize_layerwise_reload(model)  # the weights on meta, as the loaders see them in a push
        Rdt._install_recording_stamps(None, model, sink)  # (neither uses its engine)
        try:
            model.load_weights([(n, FakeRDTTensor(n, torch.Size(s), getattr(torch, d), device, sink=sink))
                                for n, (s, d) in metas.items()])
            shapes = {(id(layer), c.param_name): tuple(getattr(layer, c.param_name).shape)
                      for layer, copies in sink.copies_by_layer.items() for c in copies if c is not None}
        finally:
            Rdt._restore_after_dry_run(None, model)
    plan: Dict[str, list] = {}
    for layer, copies in sink.copies_by_layer.items():
        for c in copies:
            if c is None:
                continue
            name, chain = c.src
            base = torch.empty(metas[name][0], device="meta")
            view = _replay(base, chain)
            if view is not base and view._base is not base:
                raise RuntimeError(f"vLLM's loader reads {name!r} through a copy ({chain}): its elements cannot "
                                   f"be told apart to read them back")
            read = _region(view)
            plan.setdefault(name, []).append((layer, c.param_name, shapes[(id(layer), c.param_name)],
                                              (c.offset, c.shape, c.stride), read))
    _PLANS[model] = (key, plan)
    return plan


def boxed(flats: torch.Tensor, region: Region) -> Tuple[torch.Tensor, torch.Tensor]:
    """For flat positions ``flats`` (int64) of a contiguous tensor, their indices in the view ``region`` (a box of
    it) and whether the view holds each (largest stride first: the box's index is unique): ``[n, dims]``, ``[n]``."""
    offset, shape, stride = region
    rest = flats.to(torch.int64) - offset
    held = rest >= 0
    index = torch.zeros(flats.numel(), len(shape), dtype=torch.int64, device=flats.device)
    for d in sorted(range(len(shape)), key=lambda d: -stride[d]):
        if stride[d]:
            index[:, d] = torch.div(rest, stride[d], rounding_mode="floor")
            rest = rest - index[:, d] * stride[d]
            held &= index[:, d] < shape[d]
    return index, held & (rest == 0)


def _at(region: Region, index: torch.Tensor) -> torch.Tensor:
    offset, _, stride = region
    return offset + (index * torch.tensor(stride, dtype=torch.int64, device=index.device)).sum(-1)


def read_back(worker: Any, positions: Dict[str, List[int]], metas: Dict[str, Tuple[Sequence[int], str]]
              ) -> Dict[str, List[Optional[int]]]:
    """The bits this worker holds at ``positions`` of each pushed tensor (``metas``: every pushed tensor's shape
    and dtype), cast to the dtype it was pushed at; None where it holds no such element."""
    plan = _where(worker, metas)
    out: Dict[str, List[Optional[int]]] = {}
    with torch.no_grad():
        for name, where in positions.items():
            dtype = getattr(torch, metas[name][1])
            got = _gathered(plan.get(name, []), torch.tensor([int(p) for p in where], dtype=torch.int64), dtype)
            out[name] = [int(b) if h else None for b, h in zip(bits(got[0]).tolist(), got[1].tolist())]
    return out


def held_at(worker: Any, name: str, flats: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The elements (at ``dtype``) this worker holds at flat positions ``flats`` of pushed tensor ``name``, where the
    last push's read-back found them (a delta follows a push read back); zeros where it holds none (another
    tensor-parallel worker's elements, which this worker's loaders do not write)."""
    cached = _PLANS.get(worker.model_runner.get_model())
    if cached is None:
        raise RuntimeError("a delta's steps need the elements the engine holds, and no push was read back from it")
    with torch.no_grad():
        return _gathered(cached[1].get(name, []), flats, dtype)[0]


def _gathered(where: list, flats: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """The elements at ``flats`` of a pushed tensor whose copies ``where`` lists (:func:`_where`'s), at ``dtype``, and
    whether this worker holds each (on ``flats``' device: a GPU's patch gathers there)."""
    out = torch.zeros(flats.numel(), dtype=dtype, device=flats.device)
    held = torch.zeros(flats.numel(), dtype=torch.bool, device=flats.device)
    for layer, weight, shape, written, read in where:
        index, inside = boxed(flats, read)
        if not bool(inside.any()):
            continue
        values = _values(layer, weight, shape, _at(written, index[inside]))
        out[inside], held[inside] = values.to(flats.device, dtype), True
    return out, held


def _values(layer: torch.nn.Module, weight: str, shape: Tuple[int, ...], flats: torch.Tensor) -> torch.Tensor:
    """Elements ``flats`` (flat positions in the weight as loaded, of ``shape``) of ``layer``'s ``weight``: from the
    weight itself, or through the layer's kernel where it was repacked and freed (a linear layer on the CPU)."""
    held = getattr(layer, weight)
    n = 1
    for s in shape:
        n *= s
    if held.numel() == n:
        flat = held.detach().reshape(-1)
        return flat[flats.to(flat.device)]
    flats = flats.tolist()
    method = getattr(layer, "quant_method", None)
    if weight != "weight" or len(shape) != 2 or method is None or not hasattr(method, "apply"):
        raise RuntimeError(f"{type(layer).__name__}.{weight} holds {held.numel()} elements where {n} were loaded, "
                           f"and it has no kernel to read them through")
    rows, cols = zip(*(divmod(q, shape[1]) for q in flats))
    unique = sorted(set(cols))
    x = torch.zeros(len(unique), shape[1], dtype=held.dtype, device=held.device)  # [k, in]
    x[torch.arange(len(unique)), torch.tensor(unique)] = 1
    y = method.apply(layer, x, None)  # [k, out]: column c of W for row e_c
    at = {c: i for i, c in enumerate(unique)}
    return torch.stack([y[at[c], r] for r, c in zip(rows, cols)]) if rows else y.new_zeros(0)


def shared_dir() -> str:
    """Where a chunk's shared-memory file goes: ``/dev/shm`` (RAM) where there is one."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else os.environ.get("TMPDIR", "/tmp")

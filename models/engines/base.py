"""What every generation engine shares: the sampling spec, per-sample seeds, stop tokens, the weights layout an
in-place reload needs, and the reload-or-restart logic.

One rule for every engine (:mod:`kernels.sampling`): a rollout samples from the processed distribution the spec
names — temperature, then top-k/top-p if asked, nothing else (no repetition penalty or other defaults from the
checkpoint's ``generation_config.json``) — and reports the log-probs of that distribution; it stops on every eos id
of the checkpoint (:func:`eos_token_ids`) and on the spec's stop tokens and strings; sample ``j`` of prompt ``i``
draws its noise from its own stream, seeded by :func:`sample_seed`, so it depends on the request's seed and its
position only, not on the batch or on how long the engine has run."""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple

from models.engines.patching import EngineLoadError, Patching  # noqa: F401 -- EngineLoadError: imported from here

log = logging.getLogger(__name__)

MIN_ENGINE_TEMPERATURE = 0.01
"""Lowest sampling temperature both engines honour: vLLM samples any temperature in (0, 0.01) at
0.01 (``vllm.sampling_params._MAX_TEMP``) and below 1e-5 greedily, so the trainer would score
another distribution than the one sampled. 0 (greedy) is allowed."""


@dataclass(frozen=True)
class SamplingSpec:
    """How to sample. ``temperature == 0`` is greedy. Stop tokens are masked until
    ``min_new_tokens`` tokens are out (``== max_new_tokens``: every response has that length).
    ``top_k = 0`` and ``top_p = 1`` leave the temperature-scaled distribution whole."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    min_new_tokens: int = 0
    seed: int = 0
    stop_token_ids: Sequence[int] = ()
    stop_strings: Sequence[str] = ()
    top_k: int = 0

    def __post_init__(self) -> None:
        if 0 < self.temperature < MIN_ENGINE_TEMPERATURE:
            raise ValueError(f"temperature {self.temperature} is below {MIN_ENGINE_TEMPERATURE}, where vLLM samples "
                             f"another temperature than the one asked; use 0 for greedy")
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"need temperature >= 0, top_k >= 0 and 0 < top_p <= 1 (got {self.temperature}, "
                             f"{self.top_k}, {self.top_p})")
        if self.n < 1 or self.max_new_tokens < 1 or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"need n >= 1, max_new_tokens >= 1 and 0 <= min_new_tokens <= max_new_tokens (got "
                             f"{self.n}, {self.max_new_tokens}, {self.min_new_tokens})")


@dataclass
class Generation:
    """One sampled response."""

    tokens: List[int]
    logprobs: List[float]
    is_end: bool


@dataclass
class EngineStats:
    """Seconds spent in the engine, for ``time/*`` metrics and benchmarks."""

    start_s: float = 0.0
    reload_s: float = 0.0
    generate_s: float = 0.0
    restarts: int = 0
    reloads: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0  # of the requests it finished, where it reports its prefix cache (vLLM in this process)
    cached_prompt_tokens: int = 0  # of those, served from its prefix cache (vLLM's num_cached_tokens)
    extra: Dict[str, float] = field(default_factory=dict)


def stream_seed(*parts: int) -> int:
    """A 63-bit seed from integers (BLAKE2b of their decimal text): distinct tuples give unrelated
    seeds, where sums like ``seed + i`` collide (prompt i's sample j+1 and prompt i+1's sample j)."""
    text = ",".join(str(int(p)) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & (2**63 - 1)


def sample_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """The seed of the random stream of sample ``sample_index`` of prompt ``prompt_index`` in a request
    seeded ``seed``."""
    return stream_seed(seed, prompt_index, sample_index)


def request_indices(prompts: Sequence[Any], first_index: int = 0, indices: Optional[Sequence[int]] = None
                    ) -> List[int]:
    """Each prompt's index in the whole request, what its samples are seeded by (:func:`sample_seed`): ``indices``
    when given (one per prompt), else ``first_index + i``."""
    if indices is None:
        return list(range(first_index, first_index + len(prompts)))
    if len(indices) != len(prompts):
        raise ValueError(f"{len(indices)} prompt indices for {len(prompts)} prompts")
    return [int(i) for i in indices]


def contiguous_shares(count: int, parts: int) -> List[Tuple[int, int]]:
    """``(start, end)`` of ``parts`` contiguous shares of ``range(count)``, in order, sizes differing by
    at most one (the first ``count % parts`` one longer)."""
    size, extra = divmod(count, parts)
    shares, start = [], 0
    for part in range(parts):
        end = start + size + (part < extra)
        shares.append((start, end))
        start = end
    return shares


def _eos_list(value: Any) -> List[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def eos_token_ids(checkpoint_dir: str) -> Tuple[int, ...]:
    """Every end-of-sequence id of a checkpoint: the tokenizer's ``eos_token`` and the
    ``eos_token_id`` (an id or a list) of ``generation_config.json``, or of ``config.json`` when there
    is no generation config (as transformers and vLLM derive one)."""
    ids: List[int] = []
    gen = os.path.join(checkpoint_dir, "generation_config.json")
    source = gen if os.path.isfile(gen) else os.path.join(checkpoint_dir, "config.json")
    if os.path.isfile(source):
        with open(source, encoding="utf-8") as f:
            ids += _eos_list(json.load(f).get("eos_token_id"))
    if os.path.isfile(os.path.join(checkpoint_dir, "tokenizer_config.json")):
        from models.checkpoint.local import cached_tokenizer

        ids += _eos_list(cached_tokenizer(checkpoint_dir).eos_token_id)
    return tuple(sorted(set(ids)))


def engine_thread(target: Callable[[], None], name: str) -> threading.Thread:
    """A started daemon thread that runs ``target`` at the torch intra-op thread count of the thread that made it.

    vLLM's CPU attention plans a step's work for ``omp_get_max_threads()`` threads when it builds the step's
    metadata and checks the count again in the kernel (``cpu_attn_impl.hpp``: "Check failed: ...thread_num ==
    thread_num"). A new thread starts at OpenMP's process default (``OMP_NUM_THREADS``, else every core) and moves
    to torch's count at its first parallel torch op, which can fall between the two: the thread's first step then
    fails whenever the process set another count (a host's ``--threads``). Setting the count first (through
    ``torch._C``: vLLM's CPU worker makes ``torch.set_num_threads`` a no-op) keeps every step on one count."""
    import torch

    threads = torch.get_num_threads()

    def run() -> None:
        torch._C.set_num_threads(threads)
        target()

    thread = threading.Thread(target=run, daemon=True, name=name)
    thread.start()
    return thread


class GenerationEngine(Protocol):
    stats: EngineStats

    def generate(self, prompts: List[List[int]], spec: SamplingSpec) -> List[List[Generation]]:
        """``prompts[i]`` → ``spec.n`` generations. (The in-process engines also take ``first_index``:
        ``prompts`` are the request's prompts from that index on, for the seeds of :func:`sample_seed`.)"""

    def prompt_logprobs(self, sequences: List[List[int]]) -> List[List[float]]:
        """log p(token t | tokens < t) at temperature 1 for t ≥ 1 of each sequence (the probe's side)."""

    def load_weights(self, checkpoint_dir: str) -> None:
        """Serve the weights of ``checkpoint_dir`` (same architecture) from now on."""

    def load_tensors(self, state: Mapping[str, Any]) -> None:
        """Serve the weights ``state`` (named as in a Hugging Face state dict) from now on, in place."""

    def begin_push(self, shapes: Mapping[str, Sequence[int]]) -> None:
        """The same in chunks (``push_chunk``, then ``end_push``; ``abort_push`` gives up; ``push_buffer`` a chunk's
        buffer; ``read_back`` what the engine holds): a resident run's push (the in-process engines)."""

    def restart(self, checkpoint_dir: str) -> None:
        """Build the engine anew from ``checkpoint_dir`` (no adapter)."""

    def set_adapter(self, adapter_dir: Optional[str]) -> None:
        """Serve the base weights plus the LoRA adapter (peft directory) ``adapter_dir`` from now
        on; None: the base weights alone."""

    def close(self) -> None:
        """Free the engine."""


_RUN_ONLY_CONFIG_KEYS = ("_name_or_path", "transformers_version", "dtype", "torch_dtype")
"""config.json entries that do not change the served model (the engine's dtype is its own)."""


@dataclass(frozen=True)
class WeightsLayout:
    """What an in-place reload needs unchanged: the model config and every tensor's name and shape."""

    config: Dict[str, Any]
    shapes: Dict[str, Tuple[int, ...]]

    @classmethod
    def read(cls, checkpoint_dir: str) -> "WeightsLayout":
        """From ``config.json`` and the safetensors headers (no tensor data is read)."""
        from safetensors import safe_open

        files = sorted(glob.glob(os.path.join(checkpoint_dir, "*.safetensors")))
        try:
            with open(os.path.join(checkpoint_dir, "config.json")) as f:
                config = {k: v for k, v in json.load(f).items() if k not in _RUN_ONLY_CONFIG_KEYS}
            if not files:
                raise FileNotFoundError("no *.safetensors files")
            shapes = {}
            for path in files:
                with safe_open(path, "pt") as st:
                    shapes.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
        except Exception as err:
            raise EngineLoadError(f"checkpoint {checkpoint_dir} is unusable: {type(err).__name__}: {err}") from err
        return cls(config, shapes)

    def mismatch(self, new: "WeightsLayout") -> Optional[str]:
        """Why ``new`` weights cannot replace these in place, or None if they can."""
        keys = sorted(k for k in self.config.keys() | new.config.keys() if self.config.get(k) != new.config.get(k))
        if keys:
            return f"config differs in {keys}"
        return self.shapes_mismatch(new.shapes)

    def shapes_mismatch(self, shapes: Mapping[str, Tuple[int, ...]]) -> Optional[str]:
        """Why tensors of these names and ``shapes`` cannot replace these in place, or None if they can."""
        missing, extra = sorted(self.shapes.keys() - shapes.keys()), sorted(shapes.keys() - self.shapes.keys())
        if missing or extra:
            return f"tensors differ: missing {missing[:3]}, unexpected {extra[:3]}"
        reshaped = [f"{k} {self.shapes[k]} -> {tuple(shapes[k])}" for k in sorted(self.shapes)
                    if self.shapes[k] != tuple(shapes[k])]
        return f"tensor shapes differ: {reshaped[:3]}" if reshaped else None

    def fit(self, state: Mapping[str, Any]) -> Dict[str, Any]:
        """``state`` (tensors named as in a Hugging Face state dict) without the tied copies this
        layout does not hold (``lm_head.weight`` of a model with ``tie_word_embeddings``: the same
        tensor as, or equal to, one it holds); :class:`EngineLoadError` naming the first names or
        shapes that do not fit."""
        import torch

        odd = [k for k, t in state.items() if not isinstance(t, torch.Tensor)]
        if odd:
            raise EngineLoadError(f"these weights are not all tensors: {odd[:3]} ({type(state[odd[0]]).__name__})")
        fitted = dict(state)
        if self.config.get("tie_word_embeddings"):
            held = [t for k, t in state.items() if k in self.shapes]
            for name in [k for k in state if k not in self.shapes]:
                t = state[name]
                if any(h is t or (h.shape == t.shape and h.dtype == t.dtype and torch.equal(h, t)) for h in held):
                    del fitted[name]
        reason = self.shapes_mismatch({k: tuple(t.shape) for k, t in fitted.items()})
        if reason:
            raise EngineLoadError(f"these weights do not fit the served model: {reason}")
        return fitted


class SwappableEngine(Patching):
    """New weights in place when the layout matches, else (or when that fails) a restart."""

    stats: EngineStats
    _layout: WeightsLayout
    eos_ids: Tuple[int, ...] = ()
    """The served checkpoint's eos ids (:func:`eos_token_ids`), stops on top of the spec's."""

    def _start(self, checkpoint_dir: str) -> None:
        """Build the engine from ``checkpoint_dir``."""
        raise NotImplementedError

    def _reload_in_place(self, checkpoint_dir: str) -> None:
        """Copy the weights of ``checkpoint_dir`` (same layout) into the running engine; raise if
        any weight could not be copied."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def _begin(self, checkpoint_dir: str) -> None:
        self.pushed = ""
        t0 = time.perf_counter()
        self.stats = EngineStats()
        self._layout = WeightsLayout.read(checkpoint_dir)
        self.eos_ids = eos_token_ids(checkpoint_dir)
        self._start(checkpoint_dir)
        self.stats.start_s = time.perf_counter() - t0

    def stop_ids(self, spec: SamplingSpec) -> List[int]:
        """The spec's stop tokens and the checkpoint's eos ids."""
        return sorted(set(spec.stop_token_ids) | set(self.eos_ids))

    def load_weights(self, checkpoint_dir: str) -> None:
        """Serve the weights of ``checkpoint_dir`` from now on.

        An unreadable checkpoint raises :class:`EngineLoadError` and leaves the engine as it
        was. A half-done reload must not keep serving, so after a failed reload, and whenever
        the layout differs, the engine restarts from ``checkpoint_dir``; if that fails too it
        stays closed and :class:`EngineLoadError` says why.
        """
        layout = WeightsLayout.read(checkpoint_dir)
        reason = self._layout.mismatch(layout)
        self.pushed = ""
        t0 = time.perf_counter()
        if reason is None:
            try:
                self._reload_in_place(checkpoint_dir)
                self._layout, self.eos_ids = layout, eos_token_ids(checkpoint_dir)
                self.stats.reload_s += time.perf_counter() - t0
                self.stats.reloads += 1
                return
            except Exception as err:  # the weights may be half-replaced: restart
                reason = f"in-place reload failed ({type(err).__name__}: {err})"
        log.warning("%s: %s; restarting the engine from it", checkpoint_dir, reason)
        self._restart(checkpoint_dir, layout, reason)

    def load_tensors(self, state: Mapping[str, Any]) -> None:
        """Serve the weights ``state`` (tensors named as in a Hugging Face state dict, tied copies
        included or not; e.g. a trainer's ``state_dict()`` through :mod:`models.engines.weights`) from
        now on, copied into the running engine in place: the in-memory path, no checkpoint between.
        A push of one chunk (:meth:`begin_push`), with its checks and failures."""
        fitted = self._layout.fit(state)
        self.begin_push({k: tuple(t.shape) for k, t in fitted.items()})
        self.push_chunk(fitted)
        self.end_push()

    def begin_push(self, shapes: Mapping[str, Sequence[int]]) -> None:
        """New weights arrive in chunks (:meth:`push_chunk`), then :meth:`end_push`; ``shapes``: every tensor the
        push holds (tied copies left out), named as in a Hugging Face state dict.

        Names or shapes that do not fit the served model raise :class:`EngineLoadError` naming them, before
        anything is copied. Until :meth:`end_push` returns, the engine holds part of the old weights and part of
        the new. A copy that fails half-way (or :meth:`abort_push`) leaves no checkpoint to restart from: the
        engine is closed (it must not serve half-replaced weights) and :class:`EngineLoadError` says why;
        :meth:`restart` from a checkpoint brings it back."""
        self._start_push(shapes, lambda: self._begin_push_in_place(list(shapes)))

    def push_chunk(self, tensors: Mapping[str, Any]) -> None:
        """Copy ``tensors`` (some of the push's; cast to the engine's dtype if they are not) into the engine."""
        self._pushed("copy", lambda: self._push_chunk_in_place(dict(tensors)))

    def end_push(self) -> None:
        """The push is complete: every weight it named copied, or :class:`EngineLoadError` (the engine closed)."""
        self._finish_push(self._end_push_in_place)

    def abort_push(self) -> None:
        """Give the push up (the sender failed, a chunk arrived corrupted): the engine is closed."""
        if getattr(self, "_pushing", False):
            self._pushing = False
            self.close()

    def push_buffer(self, nbytes: int, device: Any) -> Any:
        """A byte buffer to receive a chunk of a push into (an engine whose workers are other processes gives
        one they can map)."""
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def read_back(self, positions: Mapping[str, Sequence[int]], dtypes: Mapping[str, str]
                  ) -> Dict[str, List[List[int]]]:
        """The bits the engine holds at flat ``positions`` of each named tensor (named and shaped as in a Hugging
        Face state dict; ``dtypes``: the dtype it was pushed at, what a held value is cast to first): per position
        one value per copy held (tensor-parallel workers that share it), none where no weight holds it."""
        raise NotImplementedError

    def _begin_push_in_place(self, names: List[str]) -> None:
        raise NotImplementedError

    def _push_chunk_in_place(self, tensors: Dict[str, Any]) -> None:
        raise NotImplementedError

    def _end_push_in_place(self) -> None:
        """Raise if any weight the push named was not copied."""
        raise NotImplementedError

    def restart(self, checkpoint_dir: str) -> None:
        """Build the engine anew from ``checkpoint_dir`` (what the probe does when the served
        weights differ from the trainer's)."""
        self._restart(checkpoint_dir, WeightsLayout.read(checkpoint_dir), "restart asked for")

    def _restart(self, checkpoint_dir: str, layout: WeightsLayout, reason: str) -> None:
        self.pushed = ""
        t0 = time.perf_counter()
        self.close()
        try:
            self.eos_ids = eos_token_ids(checkpoint_dir)
            self._start(checkpoint_dir)
        except Exception as err:
            self.close()
            raise EngineLoadError(f"cannot serve {checkpoint_dir}: {reason}, and starting the engine from it "
                                  f"failed: {type(err).__name__}: {err}") from err
        self._layout = layout
        self.stats.start_s += time.perf_counter() - t0
        self.stats.restarts += 1

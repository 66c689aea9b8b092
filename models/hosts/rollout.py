"""The rollout server (``python -m models.hosts serve-rollout``), a host of the service layer: one generation
engine, started once; its op ``generate`` samples from the committed checkpoint a request names (and a LoRA
adapter on it), inside the storage root. New weights go into the running engine in place
(:meth:`models.engines.GenerationEngine.load_weights`: vLLM ``reload_weights``, or a restart where that cannot
work), so on a cluster the engine starts once per run instead of once per rollout pod; after every weight change
the engine is probed against the trainer's forward (:func:`models.training.probe.ensure_serves`, as the rollout
task probes its own): above ``probe_tolerance`` it restarts, and a gap that persists fails the request (409).

Every engine call runs on one dedicated thread: that serialises requests (one engine, each sampled from the
weights it named) and keeps the thread-local state the engine depends on fixed (vLLM's CPU attention checks the
OpenMP thread count it was planned with). Statuses: 413 over a size limit (``max_samples`` counts prompts × n,
``max_tokens`` a prompt plus ``max_new_tokens``), 422 a malformed request, token ids outside the vocabulary or a
checkpoint that is not committed, 409 an adapter for a server without LoRA or a probe that keeps failing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch

from models.checkpoint import CheckpointError, download_checkpoint
from models.engines import SamplingSpec, make_engine
from models.training.lora import canonical_url
from models.training.probe import EngineMismatchError, ProbeResult, effective_tolerance, ensure_serves
from models.hosts.reward_critic import STATUSES, InvalidRequest, NotLoaded, check_limits, check_token_ids
from models.service.ops import Host, op


@dataclass(frozen=True)
class RolloutServiceConfig:
    """The engine the server starts (the fields of :class:`models.engines.VLLMEngine`; each is the option of the same
    name of ``python -m models.hosts serve-rollout``, whose help says what it does)."""

    checkpoint_url: str
    engine: str = "vllm"
    dtype: str = "float32"
    kv_cache_gib: float = 1.0
    gpu_memory_utilization: float = 0.5
    max_model_len: int = 0
    """vLLM's context; 0: ``max_tokens`` (the longest prompt + response a request may ask for), either capped at
    the checkpoint's ``max_position_embeddings``."""
    max_num_seqs: int = 0
    """vLLM: most sequences run at once (0: vLLM's default)."""
    max_lora_rank: int = 0
    """vLLM: largest LoRA rank served (0: no adapters). The HF engine serves any adapter (peft)."""
    seed: int = 0
    threads: int = 0
    """Torch intra-op threads of the engine thread; 0: torch's choice."""
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enforce_eager: bool = False
    """vLLM on a GPU: no CUDA graphs (``rollout.enforce_eager``)."""
    max_samples: int = 1024
    max_tokens: int = 8192
    """Most prompts × n per request, most prompt + ``max_new_tokens`` tokens per prompt (413 above)."""

    def __post_init__(self) -> None:
        if not self.checkpoint_url:
            raise ValueError("RolloutServiceConfig needs checkpoint_url")
        if self.engine not in ("vllm", "hf"):
            raise ValueError(f"unknown engine {self.engine!r}: use 'vllm' or 'hf'")
        if self.kv_cache_gib <= 0 or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("need kv_cache_gib > 0 and 0 < gpu_memory_utilization <= 1")
        if self.max_model_len < 0 or self.max_lora_rank < 0 or self.max_num_seqs < 0:
            raise ValueError("need max_model_len >= 0, max_num_seqs >= 0 and max_lora_rank >= 0")
        if self.tensor_parallel_size < 1 or (self.tensor_parallel_size > 1 and self.engine != "vllm"):
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size}: need >= 1, and 1 with the HF engine")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size={self.data_parallel_size}: need >= 1")


def _fetch(url: str) -> str:
    """The local folder of the committed checkpoint at ``url`` (a remote one from the node's bounded checkpoint
    cache); a checkpoint that is missing, uncommitted or fails its checksums is the caller's error (422)."""
    try:
        return download_checkpoint(url)
    except CheckpointError as err:
        raise InvalidRequest(str(err)) from err
    except FileNotFoundError as err:
        raise InvalidRequest(f"checkpoint {url} not found: {err}") from err


def _vocab_size(checkpoint_dir: str) -> int:
    with open(os.path.join(checkpoint_dir, "config.json"), encoding="utf-8") as f:
        return int(json.load(f)["vocab_size"])


class RolloutHost(Host):
    """One engine; ``generate`` loads the named weights when they change, then samples."""

    label = "rollout server"
    statuses = {**STATUSES, EngineMismatchError: 409}

    def __init__(self, config: RolloutServiceConfig):
        self.config = config
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="engine")
        try:
            self._thread.submit(self._start).result()
        except BaseException:
            self._thread.shutdown()
            raise
        self.lora = config.engine == "hf" or config.max_lora_rank > 0
        self.checkpoint_url: Optional[str] = config.checkpoint_url
        self.adapter_url: Optional[str] = None
        self.adapter: Optional[str] = None  # the local folders served
        self.requests = self.prompts = 0
        self._probed: Optional[ProbeResult] = None

    def _start(self) -> None:
        config = self.config
        if config.threads > 0:
            torch.set_num_threads(config.threads)
        self.weights = _fetch(config.checkpoint_url)
        kwargs = dict(dtype=config.dtype) if config.engine == "hf" else dict(
            dtype=config.dtype, kv_cache_gib=config.kv_cache_gib, seed=config.seed,
            gpu_memory_utilization=config.gpu_memory_utilization,
            max_model_len=config.max_model_len or config.max_tokens, max_num_seqs=config.max_num_seqs,
            max_lora_rank=config.max_lora_rank, tensor_parallel_size=config.tensor_parallel_size,
            enforce_eager=config.enforce_eager)
        self.engine = make_engine(config.engine, self.weights, data_parallel_size=config.data_parallel_size, **kwargs)
        self.vocab_size = _vocab_size(self.weights)

    def _serve(self, checkpoint_url: str, adapter_url: Optional[str], probe_tolerance: float,
               trainer_dtype: str) -> Optional[float]:
        """Serve the named weights; the probe's gap when they changed (else None)."""
        if adapter_url is not None and not self.lora:
            raise NotLoaded("this rollout server serves no LoRA adapters: start it with --max-lora-rank R")
        if checkpoint_url != self.checkpoint_url:
            weights = _fetch(checkpoint_url)  # a bad URL leaves the weights served alone
            self.checkpoint_url = self.adapter_url = None  # unknown until the load succeeded; it drops the adapter
            self.engine.load_weights(weights)
            self.weights, self.checkpoint_url, self.vocab_size = weights, checkpoint_url, _vocab_size(weights)
        if adapter_url != self.adapter_url:
            adapter, self.adapter_url = _fetch(adapter_url) if adapter_url else None, None
            self.engine.set_adapter(adapter)
            self.adapter, self.adapter_url = adapter, adapter_url
        weights, adapter = self.weights, self.adapter

        def restart() -> None:
            self.engine.restart(weights)
            if adapter is not None:
                self.engine.set_adapter(adapter)

        def fetch(url: str) -> str:  # an adapter's base is usually the checkpoint served already
            return weights if canonical_url(url) == canonical_url(checkpoint_url) else _fetch(url)

        done = ensure_serves(self.engine, (checkpoint_url, adapter_url), adapter or weights, probe_tolerance,
                             restart, fetch, what=adapter_url or checkpoint_url, dtype=trainer_dtype)
        if done is None or done is self._probed:
            return None
        self._probed = done
        return done.gap_max

    @op
    def generate(self, prompts: List[List[int]], sampling: Dict[str, Any], checkpoint_url: str,
                 adapter_url: Optional[str] = None, probe_tolerance: float = 1e-3,
                 trainer_dtype: str = "float32") -> Dict[str, Any]:
        """``sampling["n"]`` generations per prompt from the policy at ``checkpoint_url`` (+ ``adapter_url``), the
        seconds spent loading and generating and the probe's gap if the weights changed (against the trainer's
        forward in ``trainer_dtype``; None: no change). Blocks until the engine thread has served the requests
        before this one and this one."""
        try:
            spec = SamplingSpec(**sampling)
        except (TypeError, ValueError) as err:
            raise InvalidRequest(f"sampling: {err}") from err
        if not isinstance(prompts, list) or not prompts or trainer_dtype not in ("float32", "bfloat16") \
                or probe_tolerance < 0:
            raise InvalidRequest("need >= 1 prompt, trainer_dtype float32 or bfloat16 and probe_tolerance >= 0")
        check_token_ids(prompts, 2 ** 62, "prompts", row="prompt")  # lists of integers; the vocabulary below
        check_limits(len(prompts) * spec.n, (len(p) + spec.max_new_tokens for p in prompts), self.config.max_samples,
                     self.config.max_tokens, label="prompt {i} plus max_new_tokens")
        tolerance = effective_tolerance(probe_tolerance, self.config.dtype, trainer_dtype)
        return self._thread.submit(self._generate, prompts, spec, checkpoint_url, adapter_url, tolerance,
                                   trainer_dtype).result()

    @op
    def health(self) -> Dict[str, Any]:
        stats = self.engine.stats
        return {"status": "ok", "engine": self.config.engine, "checkpoint_url": self.checkpoint_url,
                "adapter_url": self.adapter_url, "lora": self.lora, "vocab_size": self.vocab_size,
                "engine_starts": 1 + stats.restarts, "reloads": stats.reloads, "requests": self.requests,
                "prompts": self.prompts, "generated_tokens": stats.generated_tokens}

    def _generate(self, prompts: List[List[int]], spec: SamplingSpec, checkpoint_url: str,
                  adapter_url: Optional[str], probe_tolerance: float, trainer_dtype: str) -> Dict[str, Any]:
        t0 = time.perf_counter()
        gap = self._serve(checkpoint_url, adapter_url, probe_tolerance, trainer_dtype)
        t1 = time.perf_counter()
        self._check(prompts, spec.stop_token_ids)
        generations = self.engine.generate(prompts, spec)
        self.requests += 1
        self.prompts += len(prompts)
        return {"generations": [[dataclasses.asdict(g) for g in per_prompt] for per_prompt in generations],
                "load_s": t1 - t0, "generate_s": time.perf_counter() - t1, "probe_gap_max": gap}

    def _check(self, prompts: Sequence[Sequence[int]], stop_token_ids: Sequence[int]) -> None:
        empty = next((i for i, p in enumerate(prompts) if not p), None)
        if empty is not None:
            raise InvalidRequest(f"prompt {empty} is empty (the first response token is predicted from the "
                                 f"last prompt token)")
        check_token_ids(prompts, self.vocab_size, "prompts", row="prompt")
        bad = [t for t in stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"sampling.stop_token_ids: token id {bad[0]} is outside the vocabulary "
                                 f"[0, {self.vocab_size})")

    def close(self) -> None:
        """Free the engine (after the requests under way)."""
        self._thread.submit(self.engine.close).result()
        self._thread.shutdown()

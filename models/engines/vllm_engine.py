"""vLLM's offline ``LLM`` as a generation engine: every sampling setting passed explicitly, one request
per sample with its own seed, and in-place reloads that fail loudly.

- ``generation_config="vllm"``: vLLM's neutral defaults, not the checkpoint's sampling settings
  (we pass every setting anyway; eos ids still come from the checkpoint, and we pass them too).
- vLLM gives the j-th of ``n`` samples of a request seeded s the stream ``s + j``, so requests seeded
  ``base + i`` share streams across prompts; here each sample is its own request (``n=1``) seeded
  :func:`models.engines.base.sample_seed` (prompts share their KV blocks through the prefix cache).
- ``reload_weights`` only *logs* what it could not load ("ParallelLMHead: Failed to load weights" for
  a tied ``lm_head`` on CPU, whose packed copy keeps the old values; "Following weights were not
  loaded from checkpoint"). :func:`_reload_reporting` runs in the worker, captures those reports
  whatever the user's log level, re-derives the packed copies of tied modules, and returns any other
  report, which :class:`VLLMEngine` treats as a failed reload (a restart follows).
- Tensors from memory (``load_tensors``, a trainer's push in chunks) take the same reload, split over
  calls (:mod:`models.engines.vllm_push`): the same reports, the same repair of tied modules; with tensor
  parallelism each worker maps a chunk from shared memory and reads only its slices. ``read_back`` reads
  pushed elements back from the workers' weights.
- CUDA graphs on a GPU unless ``enforce_eager`` (``rollout.enforce_eager``); always eager on the CPU,
  which has no graphs to capture.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from models.engines import vllm_push, worker_channel
from models.engines.context import check_kv_cache
from models.engines.vllm_setup import (cpu_workers_bound, cuda_graphs, llm_kwargs, read_json, read_settings_afresh,
                                       unsupported_lora_targets)
from models.engines.vllm_steps import Sample, StepLoop, count_prompt, reset_prefix_cache
from models.engines.weight_stream import merge_held
from models.engines.base import (EngineLoadError, Generation, SamplingSpec, SwappableEngine, request_indices,
                                sample_seed)


def _reload_reporting(worker: Any, weights_path: str) -> List[str]:
    """In the worker: ``reload_weights`` from ``weights_path``; returns what the loader reported it
    could not load and that is not repaired here (empty: every weight is the checkpoint's)."""
    capture = vllm_push.Capture().install()
    try:
        worker.reload_weights(weights_path=weights_path)
    finally:
        capture.remove()
    return vllm_push.failures(worker.model_runner.get_model(), capture)


class VLLMEngine(SwappableEngine):
    """vLLM's offline ``LLM`` in this process (no engine subprocess; with ``tensor_parallel_size`` > 1
    its workers run in their own processes, one per GPU or per group of CPU cores), prompts as token ids."""

    def __init__(self, checkpoint_dir: str, dtype: str = "float32", kv_cache_gib: float = 1.0,
                 gpu_memory_utilization: float = 0.5, max_model_len: Optional[int] = None, seed: int = 0,
                 max_lora_rank: int = 0, tensor_parallel_size: int = 1, enforce_eager: bool = False,
                 colocated: bool = False, max_num_seqs: int = 0):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        kwargs = llm_kwargs(checkpoint_dir, dtype, gpu_memory_utilization, max_model_len, seed, max_lora_rank,
                            tensor_parallel_size, enforce_eager, torch.cuda.is_available(), kv_cache_gib, max_num_seqs)
        if not torch.cuda.is_available() and "max_model_len" in kwargs:  # refused before any weight loads
            check_kv_cache(read_json(checkpoint_dir, "config.json"), dtype, kwargs["max_model_len"], kv_cache_gib,
                           tensor_parallel_size)
        if colocated:  # in a trainer's rank (run.resident_layout=colocated): sleeps on a GPU; beside other ranks,
            kwargs["enable_sleep_mode"] = torch.cuda.is_available()  # it joins their process group (made first),
            # a tensor-parallel engine over tensor_parallel_size consecutive ranks (vLLM's own groups of the world)
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                kwargs["distributed_executor_backend"] = "external_launcher"
        self._lora = None  # vllm.lora.request.LoRARequest of the adapter being served
        self._lora_ids = 0
        self._shared: Dict[int, str] = {}  # a push's shared-memory buffers given out: storage -> file
        self._llm_kwargs = kwargs
        self._checkpoint = checkpoint_dir
        self._steps: Optional[StepLoop] = None  # generate_versions under way
        self.llm = None
        self._begin(checkpoint_dir)

    def _start(self, checkpoint_dir: str) -> None:
        from vllm import LLM, SamplingParams, TokensPrompt

        read_settings_afresh()
        self._lora = None
        self._checkpoint = checkpoint_dir
        with cpu_workers_bound(self._workers()):  # a restart binds them again
            self.llm = LLM(model=checkpoint_dir, **self._llm_kwargs)
        self.stats.extra["cuda_graphs"] = float(cuda_graphs(self.llm))
        eos = self.llm.get_tokenizer().eos_token_id
        self.llm.generate([TokensPrompt(prompt_token_ids=[eos])], SamplingParams(max_tokens=1),
                          use_tqdm=False)  # warm-up

    def _reload_in_place(self, checkpoint_dir: str) -> None:
        self._copy_in(_reload_reporting, {"weights_path": checkpoint_dir})
        self._checkpoint = checkpoint_dir

    def _begin_push_in_place(self, names: List[str]) -> None:
        self._llm().collective_rpc(vllm_push.begin)
        self._shared: Dict[int, str] = {}

    def push_buffer(self, nbytes: int, device: Any) -> torch.Tensor:
        """With tensor-parallel workers (other processes), a file in shared memory they map; else (or on a GPU, where
        the chunk goes to shared memory when it is pushed) an ordinary buffer."""
        if self._workers() == 1 or torch.device(device).type != "cpu":
            return super().push_buffer(nbytes, device)
        path = os.path.join(vllm_push.shared_dir(), f"rlhf-push-{os.getpid()}-{time.monotonic_ns()}")
        buffer = torch.from_file(path, shared=True, size=int(nbytes), dtype=torch.uint8)
        self._shared[buffer.untyped_storage().data_ptr()] = path
        return buffer

    def _push_chunk_in_place(self, tensors: Dict[str, Any]) -> None:
        """One worker (this process): the tensors themselves. Several: the chunk's shared-memory file (tensors not in
        one are copied into one first), each worker reading only its slices from it."""
        if self._workers() == 1:
            self._llm().collective_rpc(vllm_push.chunk, kwargs={"tensors": tensors})
            return
        ptrs = {t.untyped_storage().data_ptr() for t in tensors.values()}
        if len(ptrs) != 1 or next(iter(ptrs)) not in self._shared:
            tensors = self._in_shared_memory(tensors)
        ptr = next(iter(tensors.values())).untyped_storage().data_ptr()
        path = self._shared.pop(ptr)
        layout = [(name, str(t.dtype).removeprefix("torch."), list(t.shape), t.storage_offset() * t.element_size())
                  for name, t in tensors.items()]
        nbytes = next(iter(tensors.values())).untyped_storage().nbytes()
        try:
            self._llm().collective_rpc(vllm_push.chunk, kwargs={"shared": {"path": path, "nbytes": nbytes,
                                                                           "tensors": layout}})
        finally:
            os.unlink(path)  # the workers' mappings (and ours) stay valid until they are dropped

    def _in_shared_memory(self, tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        offsets, end = {}, 0
        for name, t in tensors.items():
            offsets[name] = -(-end // 16) * 16
            end = offsets[name] + t.numel() * t.element_size()
        buffer = self.push_buffer(max(end, 1), "cpu")
        out = {}
        for name, t in tensors.items():
            n = t.numel() * t.element_size()
            out[name] = buffer[offsets[name]:offsets[name] + n].view(t.dtype).view(t.shape)
            out[name].copy_(t)
        return out

    def _end_push_in_place(self) -> None:
        for path in self._shared.values():  # buffers given out but never pushed
            os.unlink(path)
        self._shared = {}
        self._copy_in(vllm_push.finish, {})

    @property
    def patchable(self) -> bool:
        """A delta patches the weights in place on a GPU; the CPU's GEMM repacks them (full pushes only)."""
        return torch.cuda.is_available()

    def _patch_chunk_in_place(self, patches: Dict[str, Any]) -> None:
        shapes = self._layout.shapes
        self._llm().collective_rpc(vllm_push.patch, kwargs={"patches": {
            name: (list(shapes[name]), got) for name, got in patches.items()}})

    def _end_patch_in_place(self) -> None:
        self._copy_in(vllm_push.patched, {})

    @property
    def worker_processes(self) -> int:
        """vLLM's workers of this engine in processes of their own (0: the model runs in this process)."""
        return self._workers() if self._workers() > 1 else 0

    def channel_workers(self) -> Optional[List[str]]:
        """The GPUs ("" for none) of this engine's tensor-parallel workers when they are other processes, each to
        take its share of a push straight from the trainer (:mod:`models.engines.worker_channel`); None: the
        pushes arrive in this process."""
        if not self.worker_processes:
            return None
        return list(self._llm().collective_rpc(worker_channel.worker_gpu))

    def join_channel(self, host: str, offer: Dict[str, Any], timeout_s: float) -> List[Dict[str, list]]:
        """The workers members of the weight channel ``offer`` (each forms it in a thread); each worker's share of
        every tensor it loads (:mod:`models.engines.weight_shares`), the sender to cut each bucket by."""
        dtype = self._llm_kwargs["dtype"]
        metas = {name: (list(shape), dtype) for name, shape in self._layout.shapes.items()}
        llm = self._llm()
        shares = list(llm.collective_rpc(worker_channel.shares, args=(metas,)))
        llm.collective_rpc(worker_channel.join, args=(host, {**offer, "shares": shares}, float(timeout_s)))
        self.channel = llm
        return shares

    def check_channel(self, header: Optional[Dict[str, Any]] = None) -> None:
        """:class:`EngineLoadError` unless this engine's workers are the ones that joined the weight channel and
        ``header``'s push fits it (the checks :meth:`begin_push` makes, before the workers take any of it)."""
        if self.llm is None or getattr(self, "channel", None) is not self.llm:
            raise EngineLoadError("the engine was restarted since its workers joined the weight channel: the next "
                                  "push forms a new one")
        if header is not None:
            self.check_fits({name: shape for name, _, shape, *_ in header["tensors"]}, "delta" in header)

    def push_from_channel(self, header: Dict[str, Any], n: int) -> List[Dict[str, Any]]:
        """Push ``n`` of the channel into every worker (:func:`worker_channel.load`), as a push's steps go
        (:meth:`begin_push`'s checks, the engine closed if a worker fails mid-push); per worker, its samples and
        the bytes it received."""
        self.check_channel()
        shapes = {name: shape for name, _, shape, *_ in header["tensors"]}
        self._start_push(shapes, lambda: None, patch="delta" in header)
        parts: List[Dict[str, Any]] = []
        self._pushed("copy", lambda: parts.extend(self._llm().collective_rpc(worker_channel.load, args=(n,))))
        self._finish_push(lambda: self._copied([p for part in parts for p in part["problems"]]))
        return parts

    def read_back(self, positions, dtypes):
        metas = {name: (list(shape), dtypes.get(name, self._llm_kwargs["dtype"]))
                 for name, shape in self._layout.shapes.items()}
        return merge_held(self._llm().collective_rpc(vllm_push.read_back,
                                                     args=({k: list(v) for k, v in positions.items()}, metas)))

    def _workers(self) -> int:
        """vLLM's workers in this process's executor: one in a trainer's rank (``external_launcher``: the other
        ranks of a tensor-parallel engine hold the other workers, each its own shard), else
        ``tensor_parallel_size``."""
        external = self._llm_kwargs.get("distributed_executor_backend") == "external_launcher"
        return 1 if external else int(self._llm_kwargs.get("tensor_parallel_size", 1))

    def _copy_in(self, reporting, kwargs: Dict[str, Any]) -> None:
        self._copied([p for reports in self._llm().collective_rpc(reporting, kwargs=kwargs) for p in reports])

    def _copied(self, problems: List[str]) -> None:
        """After new weights went into the workers: the caches of the old ones dropped, and what vLLM's loader
        reported it could not load (``problems``) raised."""
        reset_prefix_cache(self.llm)  # stale prefixes would give old-weight results
        self._lora = None
        if problems:
            raise RuntimeError(f"vLLM's loader reported: {'; '.join(problems)[:500]}")

    def set_adapter(self, adapter_dir: Optional[str]) -> None:
        from vllm.lora.request import LoRARequest

        llm = self._llm()
        if adapter_dir is not None and not llm.llm_engine.vllm_config.lora_config:
            raise RuntimeError("this vLLM engine was started without LoRA (max_lora_rank=0)")
        if adapter_dir is not None:
            bad = unsupported_lora_targets(read_json(self._checkpoint, "config.json"),
                                           read_json(adapter_dir, "adapter_config.json").get("target_modules") or [])
            if bad:
                raise EngineLoadError(f"vLLM cannot serve LoRA on {bad} for this architecture; serve the adapter "
                                      f"merged (rollout.lora_mode=merged) or with the HF engine")
        if self._lora is not None:
            llm.llm_engine.remove_lora(self._lora.lora_int_id)
        self._lora = None
        if adapter_dir is not None:  # a new id each time: vLLM caches adapters (and prefixes) by id
            self._lora_ids += 1
            self._lora = LoRARequest(f"adapter-{self._lora_ids}", self._lora_ids, adapter_dir)

    def _llm(self):
        if self._steps is not None:  # a push or another op between two steps of generate_versions: its requests
            self._steps.suspend()  # leave the engine first (submitted again afterwards)
        if self.llm is None:
            raise EngineLoadError("VLLMEngine is closed (closed by its owner, or its last restart failed)")
        return self.llm

    def prompt_logprobs(self, sequences: List[List[int]]) -> List[List[float]]:
        """log p(token t | tokens < t) at temperature 1: a request a sequence (``prompt_logprobs``, raw log-softmax);
        in an engine started for LoRA (that path fails there) a greedy request a prefix ``seq[:t]`` for ``seq[t]``: the
        same bits, but 480 tokens through the model for the probe's 4 x 16 (7.9 s, not 2.4, at Qwen3-0.6B's shape)."""
        from vllm import SamplingParams, TokensPrompt

        if self._llm_kwargs.get("enable_lora"):  # even without an adapter served: vLLM's LoRA kernels fail on it
            return self._logprobs_by_prefix(sequences)
        outs = self._llm().generate([TokensPrompt(prompt_token_ids=list(s)) for s in sequences],
                                    SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0), use_tqdm=False)
        return [[float(at[int(tok)].logprob) for at, tok in zip((out.prompt_logprobs or [None])[1:], s[1:])]
                for out, s in zip(outs, sequences)]

    def _logprobs_by_prefix(self, sequences: List[List[int]]) -> List[List[float]]:
        from vllm import SamplingParams, TokensPrompt

        prefixes = [(list(s[:t]), s[t]) for s in sequences for t in range(1, len(s))]
        params = [SamplingParams(max_tokens=1, temperature=0.0, logprob_token_ids=[int(tok)]) for _, tok in prefixes]
        outs = self._llm().generate([TokensPrompt(prompt_token_ids=p) for p, _ in prefixes], params,
                                    use_tqdm=False, lora_request=self._lora)
        flat = iter([float(out.outputs[0].logprobs[0][tok].logprob) for out, (_, tok) in zip(outs, prefixes)])
        return [[next(flat) for _ in s[1:]] for s in sequences]

    def _params(self, spec: SamplingSpec, seed: int, drawn: int = 0):
        """vLLM's ``SamplingParams`` for one sample seeded ``seed`` that has ``drawn`` of its tokens already."""
        from vllm import SamplingParams

        greedy = spec.temperature == 0
        return SamplingParams(
            n=1, temperature=spec.temperature, top_p=1.0 if greedy else spec.top_p,
            top_k=0 if greedy else spec.top_k, max_tokens=spec.max_new_tokens - drawn,
            min_tokens=max(spec.min_new_tokens - drawn, 0), seed=seed, logprobs=0,
            stop_token_ids=self.stop_ids(spec), stop=list(spec.stop_strings) or None)

    def generate(self, prompts: List[List[int]], spec: SamplingSpec, first_index: int = 0,
                 indices: Optional[Sequence[int]] = None) -> List[List[Generation]]:
        """``first_index``: the index of ``prompts[0]`` in the whole request (an engine replica's share),
        so sample ``j`` of ``prompts[i]`` is seeded ``sample_seed(spec.seed, first_index + i, j)``; or ``indices``,
        each prompt's index (a share dealt by length over ranks, :mod:`models.engines.rank_engines`)."""
        from vllm import TokensPrompt

        at = request_indices(prompts, first_index, indices)
        llm = self._llm()
        t0 = time.perf_counter()
        params = [self._params(spec, sample_seed(spec.seed, at[i], j)) for i in range(len(prompts))
                  for j in range(spec.n)]
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts for _ in range(spec.n)]
        outs = llm.generate(requests, params, use_tqdm=False, lora_request=self._lora)
        results: List[List[Generation]] = [[] for _ in prompts]
        for k, out in enumerate(outs):
            c = out.outputs[0]
            toks = list(c.token_ids)
            lps = [float(step[t].logprob) for step, t in zip(c.logprobs or [], toks)]
            results[k // spec.n].append(Generation(toks, lps, c.finish_reason == "stop"))
            self.stats.generated_tokens += len(toks)
            count_prompt(self.stats, len(requests[k]["prompt_token_ids"]), out.num_cached_tokens)
        self.stats.generate_s += time.perf_counter() - t0
        return results

    def generate_versions(self, prompts: List[List[int]], spec: SamplingSpec, first_index: int = 0, version: int = 0,
                          between_steps: Optional[Callable[[], int]] = None,
                          indices: Optional[Sequence[int]] = None) -> Tuple[List[List[Generation]], List[List[int]]]:
        """:meth:`generate` step by step (:class:`models.engines.vllm_steps.StepLoop`), and each sample's per-token
        policy versions (prompt-major): the weights served at the start are ``version``; ``between_steps()``, called
        after every step, may let the service's ops use the engine (a push: the samples under way go on under the
        new weights, their earlier tokens' KV recomputed by them) and returns the version served from then on."""
        at = request_indices(prompts, first_index, indices)
        llm = self._llm()
        samples = [Sample(list(p), sample_seed(spec.seed, at[i], j)) for i, p in enumerate(prompts)
                   for j in range(spec.n)]
        loop = StepLoop(llm, samples, lambda s: self._params(spec, s.seed, len(s.tokens)), self._lora, self.stats)

        def guarded() -> int:
            served = between_steps()
            if self.llm is not llm:  # a restart: this generation's requests went with the old engine
                raise EngineLoadError("the engine was restarted during a generation")
            return served

        t0 = time.perf_counter()
        self._steps = loop
        try:
            loop.run(version, guarded if between_steps is not None else None)
        finally:
            self._steps = None
        gens = loop.generations(llm.get_tokenizer(), spec)
        results: List[List[Generation]] = [gens[i * spec.n:(i + 1) * spec.n] for i in range(len(prompts))]
        self.stats.generated_tokens += sum(len(g.tokens) for g in gens)
        self.stats.generate_s += time.perf_counter() - t0
        return results, [s.versions for s in samples]

    def max_num_seqs(self) -> int:
        """The most sequences vLLM's scheduler runs in one step (``rollout.vllm_max_num_seqs``, or vLLM's default)."""
        return int(self._llm().llm_engine.vllm_config.scheduler_config.max_num_seqs)

    def stream(self) -> StepLoop:
        """A step loop open to samples added while it runs (:meth:`StepLoop.add`: continuous batching, the
        asynchronous producer's, :mod:`models.hosts.stream`); any other use of the engine suspends it, as it
        suspends :meth:`generate_versions`' loop."""
        loop = StepLoop(self._llm(), [], lambda s: s.params(s), self._lora, self.stats)
        self._steps = loop
        return loop

    def stream_samples(self, prompts: List[List[int]], spec: SamplingSpec, first_index: int) -> List[Sample]:
        """The samples of ``prompts`` for a :meth:`stream` (prompt-major, ``spec.n`` each), seeded as
        :meth:`generate` seeds them."""
        def params(s: Sample):
            return self._params(spec, s.seed, len(s.tokens))

        return [Sample(list(p), sample_seed(spec.seed, first_index + i, j), params=params)
                for i, p in enumerate(prompts) for j in range(spec.n)]

    def stream_open(self, loop: StepLoop) -> bool:
        """Whether ``loop``'s requests are still this engine's (not after a restart, a new adapter, another loop)."""
        return self._steps is loop and self.llm is loop.llm and self._lora is loop.lora

    def stream_step(self, loop: StepLoop, version: int) -> List[Sample]:
        """One step of ``loop`` (:meth:`StepLoop.step`), its tokens counted in the engine's stats."""
        t0 = time.perf_counter()
        done = loop.step(version)
        self.stats.generated_tokens += sum(len(s.tokens) for s in done)
        self.stats.generate_s += time.perf_counter() - t0
        return done

    def close_stream(self, loop: StepLoop) -> None:
        """``loop``'s requests out of the engine; the engine no longer suspends it."""
        if self.llm is loop.llm:
            loop.suspend()
        if self._steps is loop:
            self._steps = None

    def close(self) -> None:
        vllm_push.drop()  # a push given up in this process's worker
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            try:
                if self._llm_kwargs.get("distributed_executor_backend") == "external_launcher":
                    from models.engines.in_rank import close_vllm

                    close_vllm(llm)  # in a trainer's rank: its process group stays
                else:
                    llm.llm_engine.engine_core.shutdown()
            except Exception as e:  # shutting down must not hide the real outcome
                logging.getLogger(__name__).warning("vLLM shutdown: %s", e)

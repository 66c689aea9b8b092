"""The ``actor`` section: the policy update, with its ``lora`` adapters and its step ``guard``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from kernels.choices import LossAgg
from models.config.checks import check, check_choice
from models.config.topology import ElasticTopology

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
        check(self.rank >= 0, f"{section}.lora.rank must be >= 0 (0 = off), got {self.rank}")
        check(self.alpha > 0, f"{section}.lora.alpha must be > 0, got {self.alpha}")
        check(0 <= self.dropout < 1, f"{section}.lora.dropout must be in [0, 1), got {self.dropout}")
        check(len(self.target_modules) > 0 and all(self.target_modules),
              f"{section}.lora.target_modules must be a non-empty list of module names")


@dataclass(frozen=True)
class StepGuardConfig:
    """Which optimiser steps are skipped, and when too many skipped fail the run (``models/training/step_guard.py``).

    A step whose loss or gradient norm is NaN or infinite, or above a bound here, takes no step: the
    weights and AdamW's moments stay as they were (as a dynamic loss scaler skips an overflowing step),
    a console line names the step and the bound, and ``<role>/skipped_steps`` counts it. An update
    that skipped more than ``max_skipped_fraction`` of its steps fails the run before that iteration
    commits anything, so a diverged policy is never committed nor registered. docs/algorithms.md"""

    max_loss: float = 1e3
    """Skip a step whose |loss| exceeds this; 0 = no bound. The actor's losses are O(1) when healthy
    (advantages normalised or whitened, the ratio clipped, k3 bounded, ``kernels/kl.py``): past 1e3 its
    update has diverged (GRPO at ``actor.lr=10`` gave 2.6e6). The critic has none by default."""
    max_grad_norm: float = 1e5
    """Skip a step whose gradient norm before clipping (``grad_clip``) exceeds this; 0 = no bound. This
    is a skip, not the clip: a step below it is clipped to ``grad_clip`` as usual. The actor's was 4 at
    temperature 1 and 7e3 at 0.1 on the tiny task, 2e5 at ``actor.lr=10``. The critic has none by default."""
    max_skipped_fraction: float = 0.5
    """An update that skipped more than this fraction of its optimiser steps fails the run, naming the
    counts and the bound; so does a run that did over all its iterations (no policy is registered).
    An update that skipped steps and took none always fails."""

    def check(self, section: str) -> None:
        """Raise :class:`ConfigError` naming ``{section}.guard.<field>`` (called by the owning config)."""
        check(self.max_loss >= 0, f"{section}.guard.max_loss must be >= 0 (0 = no bound), got {self.max_loss}")
        check(self.max_grad_norm >= 0,
              f"{section}.guard.max_grad_norm must be >= 0 (0 = no bound), got {self.max_grad_norm}")
        check(0 <= self.max_skipped_fraction <= 1,
              f"{section}.guard.max_skipped_fraction must be in [0, 1], got {self.max_skipped_fraction}")


@dataclass(frozen=True)
class ActorConfig(ElasticTopology):
    """The policy update (an elastic torchrun job; its topology, ``nnodes`` to ``max_restarts``, as the
    critic's: ``models/config/topology.py``)."""

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
    """token_mean, seq_mean_token_mean, seq_mean_token_sum or seq_mean_token_sum_norm (÷ the constant
    ``rollout.max_new_tokens``); kernels/aggregation.py. Fixed by dr_grpo (refused there)."""
    tis_cap: float = 0.0
    """Truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
    Off-Policy RL Training"): each token's loss is weighted by ``min(π_old/π_sampler, C)``, C this cap,
    correcting for a sampler that computes differently from the trainer (bf16 vLLM); 0 = off. Refused
    with ``actor.old_logprobs=sampler`` (the weight is then 1). docs/rlvr/truncated_is.md"""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    guard: StepGuardConfig = field(default_factory=StepGuardConfig)
    """Steps skipped for a non-finite or out-of-bound loss or gradient norm, and the share of skipped
    steps that fails the run."""
    keep_optimizer_state: bool = True
    """Carry AdamW's moments from one iteration's update to the next (committed beside each
    checkpoint as ``<checkpoint>-optimizer/``, ``models/training/optimizer_state.py``), as one long-running
    trainer would; false restarts AdamW every iteration."""
    optimizer_state_sharded: bool = False
    """Commit AdamW's moments per rank: under FSDP2 each rank writes and reads only its own shard
    (``models/training/optimizer_shards.py``), so with n ranks each node reads 1/n of the state instead of all of
    it, the largest state term of a stateless iteration at scale (docs/cluster.md). The state then
    loads only on the same number of ranks (another count is an error naming both); under DDP or one
    process (every rank holds the whole state) the whole state is committed as with false."""
    checkpoint_by_rank: bool = False
    """Commit the trained weights by rank: under FSDP2 over two ranks or more each rank writes and uploads
    one file of the Hugging Face sharded layout (``model-0000{r+1}-of-0000{n}.safetensors``, whole tensors
    dealt by bytes, each gathered to its owner rank only), in parallel, and rank 0 the index, configs,
    tokenizer and the commit marker (``models/training/weight_shards.py``), instead of every rank gathering
    the whole float32 model and rank 0 writing and uploading it alone. The folder loads as any Hugging Face
    checkpoint. Under DDP or one process, for a LoRA adapter (small) and for a model transformers converts
    on save (fused experts, e.g. Mixtral), rank 0 commits as with false."""
    activation_checkpointing: bool = False
    """Checkpoint each decoder layer's activations in the update (``models/training/distributed.py``,
    ``checkpoint_activations``): a layer keeps only its input through the forward and recomputes the rest in the
    backward, about a third more compute for activations of ``2 × tokens × hidden`` bytes a layer instead of the
    whole set (``benchmarks/projection_memory.py`` counts both per micro-batch). The gradients are the same. On in
    the GPU presets of 8B and above: without it a 70B micro-batch of 2 × 2,048 tokens needs ~110 GB of
    activations on an 80-GB GPU. Scoring forwards keep nothing either way (no gradients)."""
    old_logprobs: str = "recompute"
    """π_old: ``recompute`` (a forward of the training-side actor in ``score``), ``sampler`` (the
    engine's own log-probs, one forward less; only where the engine computes in the trainer's dtype,
    float32, as TRL's PPOTrainer does with its generation logits) or ``update`` (the update's own forward,
    detached, one forward less with any engine: exact where the batch gets one optimizer step, ``ppo_epochs`` 1
    and ``minibatch_size`` at least the batch, which it requires, as TRL's GRPOTrainer does with
    ``num_iterations=1``; the sampler's gap to π_old is then measured in the update)."""
    nproc_per_node: int = 2
    """Processes per node (gloo on CPU, NCCL on GPU; one GPU each: ``resources.actor_gpu`` is this or 0)."""
    score_on_ranks: bool = False
    """Run the stateless ``score`` task as an elastic job on this topology (``actor.nnodes ×
    actor.nproc_per_node``, ``actor.sharding``): π_old, π_ref and the critic's values sharded over the
    ranks (each rank reading only its shard of a full-weight checkpoint under FSDP2), each rank scoring its
    share of the rows, rank 0 computing the rewards (``models/stages/score_ranks.py``); ``resources.score_*``
    are then per node, ``resources.score_gpu`` 0 or ``actor.nproc_per_node``. False: one process scores the
    whole batch. ``run.resident`` always scores on the actor trainer's ranks."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (``actor.lora.rank > 0``): checkpoints hold the adapter only, and the
    reference log-probs come from the same model with the adapter disabled."""

    def __post_init__(self) -> None:
        self.lora.check("actor")
        self.guard.check("actor")
        check(self.lr > 0, "actor.lr must be > 0")
        check(self.ppo_epochs >= 1, "actor.ppo_epochs must be >= 1")
        check(self.minibatch_size >= 1 and self.micro_batch_size >= 1,
              "actor.minibatch_size and actor.micro_batch_size must be >= 1")
        check(0 < self.clip_eps < 1, "actor.clip_eps must be in (0, 1)")
        check(self.clip_eps_high >= 0, "actor.clip_eps_high must be >= 0")
        check(self.dual_clip == 0 or self.dual_clip > 1, "actor.dual_clip must be 0 (off) or > 1")
        check_choice("actor.loss_agg", self.loss_agg, list(LossAgg))
        check(self.tis_cap >= 0, "actor.tis_cap must be >= 0 (0 = off)")
        check(self.grad_clip > 0, "actor.grad_clip must be > 0")
        check_choice("actor.old_logprobs", self.old_logprobs, ["recompute", "sampler", "update"])
        self.check_topology("actor")

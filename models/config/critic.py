"""The ``critic`` section: the value-function update (PPO only)."""

from __future__ import annotations

from dataclasses import dataclass, field

from models.config.actor import LoraConfig, StepGuardConfig
from models.config.checks import check
from models.config.topology import ElasticTopology


@dataclass(frozen=True)
class CriticConfig(ElasticTopology):
    """The value-function update (PPO only): an elastic torchrun job as the actor's, one process by
    default (``nnodes`` to ``max_restarts``: ``models/config/topology.py``)."""

    lr: float = 5e-5
    """AdamW learning rate."""
    epochs: int = 1
    """Passes over each rollout batch."""
    minibatch_size: int = 16
    """Samples per optimiser step, summed over all ranks."""
    micro_batch_size: int = 8
    """Samples per forward/backward on one rank (gradient accumulation up to the minibatch)."""
    value_clip: float = 0.2
    """Clip of the new value around the old one; 0 disables clipping."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    guard: StepGuardConfig = field(default_factory=lambda: StepGuardConfig(max_loss=0.0, max_grad_norm=0.0))
    """As ``actor.guard``, with no loss or gradient-norm bound by default: the value loss grows with the
    square of the returns, which nothing normalises, so no one bound fits every reward scale (non-finite
    steps are skipped all the same). Not applied by the critic server (``critic.remote_url``), which
    skips non-finite steps only."""
    keep_optimizer_state: bool = True
    """Carry AdamW's moments from one iteration's update to the next (as ``actor.keep_optimizer_state``;
    the critic server keeps its optimiser in memory instead)."""
    optimizer_state_sharded: bool = False
    """Commit AdamW's moments per rank, as ``actor.optimizer_state_sharded`` (the same code,
    ``models/training/optimizer_shards.py``): under FSDP2 on ``critic.nnodes × critic.nproc_per_node``
    ranks each rank writes and reads only its own shard, as a full critic at 70B needs (docs/cluster.md);
    one process or DDP (every rank holds the whole state) commits the whole state as with false."""
    checkpoint_by_rank: bool = False
    """Commit the trained critic's weights by rank, as ``actor.checkpoint_by_rank`` (the same code,
    ``models/training/weight_shards.py``): under FSDP2 on two ranks or more each rank writes and uploads its
    own file of the Hugging Face folder; one process, DDP or a LoRA critic commit from rank 0 as with false."""
    activation_checkpointing: bool = False
    """Checkpoint each decoder layer's activations in the critic's update, as ``actor.activation_checkpointing``
    (the same code); on in the GPU presets of 8B and above. Not applied by the critic server
    (``critic.remote_url``), which refuses it."""
    remote_url: str = ""
    """Critic server base URL; empty runs the critic inside the tasks."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters for the critic's trunk; the value head stays fully trainable."""

    def __post_init__(self) -> None:
        self.lora.check("critic")
        self.guard.check("critic")
        self.check_topology("critic")
        check(not (self.world_size > 1 and self.remote_url),
              f"critic.nnodes × critic.nproc_per_node = {self.nnodes} × {self.nproc_per_node} needs the critic "
              f"inside the tasks: the critic server (critic.remote_url) trains its own critic in one process")
        check(not (self.lora.enabled and self.remote_url),
              "critic.lora needs the critic inside the tasks: the critic server (critic.remote_url) "
              "trains its own critic")
        check(not (self.optimizer_state_sharded and self.remote_url),
              "critic.optimizer_state_sharded needs the critic inside the tasks: the critic server "
              "(critic.remote_url) keeps its optimizer in memory and commits none")
        check(not (self.checkpoint_by_rank and self.remote_url),
              "critic.checkpoint_by_rank needs the critic inside the tasks: the critic server "
              "(critic.remote_url) commits its own checkpoints")
        check(not (self.activation_checkpointing and self.remote_url),
              "critic.activation_checkpointing needs the critic inside the tasks: the critic server "
              "(critic.remote_url) trains its own critic")
        check(self.lr > 0, "critic.lr must be > 0")
        check(self.epochs >= 1, "critic.epochs must be >= 1")
        check(self.minibatch_size >= 1 and self.micro_batch_size >= 1,
              "critic.minibatch_size and critic.micro_batch_size must be >= 1")
        check(self.value_clip >= 0, "critic.value_clip must be >= 0")
        check(self.grad_clip > 0, "critic.grad_clip must be > 0")

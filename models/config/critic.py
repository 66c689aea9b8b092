"""The ``critic`` section: the value-function update (PPO only)."""

from __future__ import annotations

from dataclasses import dataclass, field

from models.config.actor import LoraConfig, StepGuardConfig
from models.config.checks import check


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
    ``models/checkpoint/optimizer_shards.py``). The critic update runs as one process today, and one process holds
    the whole state, so it commits the whole state as with false; the option takes effect (each rank
    reads 1/n) once the critic trains on n ranks under FSDP2, as a full critic at 70B must
    (docs/cluster.md)."""
    remote_url: str = ""
    """Critic server base URL; empty runs the critic inside the tasks."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters for the critic's trunk; the value head stays fully trainable."""

    def __post_init__(self) -> None:
        self.lora.check("critic")
        self.guard.check("critic")
        check(not (self.lora.enabled and self.remote_url),
              "critic.lora needs the critic inside the tasks: the critic server (critic.remote_url) "
              "trains its own critic")
        check(not (self.optimizer_state_sharded and self.remote_url),
              "critic.optimizer_state_sharded needs the critic inside the tasks: the critic server "
              "(critic.remote_url) keeps its optimizer in memory and commits none")
        check(self.lr > 0, "critic.lr must be > 0")
        check(self.epochs >= 1, "critic.epochs must be >= 1")
        check(self.minibatch_size >= 1 and self.micro_batch_size >= 1,
              "critic.minibatch_size and critic.micro_batch_size must be >= 1")
        check(self.value_clip >= 0, "critic.value_clip must be >= 0")
        check(self.grad_clip > 0, "critic.grad_clip must be > 0")

"""How an update's elastic job is laid out: the fields ``actor`` and ``critic`` share (each section
inherits them, so the keys are ``actor.nnodes``, ``critic.nnodes``, ...)."""

from __future__ import annotations

from dataclasses import dataclass

from models.config.checks import check, check_choice


@dataclass(frozen=True)
class ElasticTopology:
    """An update run as ``nnodes × nproc_per_node`` processes of one torch-elastic launch."""

    nnodes: int = 1
    """Nodes for the elastic job."""
    nproc_per_node: int = 1
    """Processes per node (gloo on CPU, NCCL on GPU; one GPU each: the section's ``resources.actor_gpu``
    or ``resources.critic_gpu`` is this or 0)."""
    sharding: str = "auto"
    """How the ranks hold the model: ``fsdp2`` (weights, gradients and AdamW's state sharded over the
    ranks, ``fully_shard`` per decoder layer), ``ddp`` (a whole copy on every rank) or ``auto``: FSDP2 on
    GPUs, DDP on CPU. One process holds the whole model whatever this says."""
    max_restarts: int = 1
    """Torch-elastic restarts of the worker group on failure."""

    def check_topology(self, section: str) -> None:
        """Raise :class:`ConfigError` naming ``{section}.<field>`` (called by the owning config)."""
        check_choice(f"{section}.sharding", self.sharding, ["auto", "fsdp2", "ddp"])
        check(self.nnodes >= 1 and self.nproc_per_node >= 1,
              f"{section}.nnodes and {section}.nproc_per_node must be >= 1")
        check(self.max_restarts >= 0, f"{section}.max_restarts must be >= 0")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

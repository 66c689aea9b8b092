"""The ``resources`` section: what each heavy task asks of a Flyte cluster (``tasks/deploy.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from models.config.checks import check

TASKS_WITH_RESOURCES = ("rollout", "score", "actor", "critic")
"""Tasks whose requests come from :class:`ResourcesConfig` (``actor`` is ``actor_update``)."""


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
    rollout_disk: str = "10Gi"
    """Ephemeral storage (requested and limit) of ``rollout``: the actor checkpoint it samples from and the reference
    (the tokenizer's home) in the node's checkpoint cache (``models/checkpoint/cache.py``); size it from the
    checkpoint bytes, float32 = 4 bytes per parameter."""
    score_cpu: str = "2"
    """CPU cores of ``score``."""
    score_mem: str = "8Gi"
    """Memory of ``score``."""
    score_gpu: int = 0
    """GPUs of ``score``."""
    score_disk: str = "10Gi"
    """Ephemeral storage (requested and limit) of ``score``: up to four checkpoints in the node's checkpoint cache
    (actor, reference, critic, reward model) (``models/checkpoint/cache.py``); size it from the checkpoint bytes,
    float32 = 4 bytes per parameter."""
    actor_cpu: str = "2"
    """CPU cores of each node of ``actor_update``."""
    actor_mem: str = "8Gi"
    """Memory of each node of ``actor_update``."""
    actor_gpu: int = 0
    """GPUs of each node of ``actor_update``: 0, or ``actor.nproc_per_node`` (one per process)."""
    actor_disk: str = "10Gi"
    """Ephemeral storage (requested and limit) of ``actor``'s nodes: per node: the actor checkpoint and the reference
    in the node's cache, the new checkpoint staged before upload and the optimizer state (two float32 moments per
    parameter) (``models/checkpoint/cache.py``); size it from the checkpoint bytes, float32 = 4 bytes per
    parameter."""
    critic_cpu: str = "2"
    """CPU cores of ``critic_update``."""
    critic_mem: str = "8Gi"
    """Memory of ``critic_update``."""
    critic_gpu: int = 0
    """GPUs of ``critic_update``."""
    critic_disk: str = "10Gi"
    """Ephemeral storage (requested and limit) of ``critic``: the critic checkpoint and the reference in the node's
    cache, the new critic staged before upload and its optimizer state (``models/checkpoint/cache.py``); size it
    from the checkpoint bytes, float32 = 4 bytes per parameter."""
    accelerator: str = ""
    """GPU type for tasks that ask for GPUs, as the cluster labels it (``nvidia-tesla-a100``,
    ``nvidia-h100``, ``nvidia-l4``, ...); empty: any GPU."""

    def __post_init__(self) -> None:
        for task in TASKS_WITH_RESOURCES:
            check(getattr(self, f"{task}_gpu") >= 0, f"resources.{task}_gpu must be >= 0")
            for kind in ("cpu", "mem", "disk"):
                check(bool(str(getattr(self, f"{task}_{kind}")).strip()), f"resources.{task}_{kind} must not be empty")

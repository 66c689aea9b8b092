"""What training writes, by name and without torch: where the optimizer state of a checkpoint lies and
whether a checkpoint is a LoRA adapter. The commit stage and the model registry read them, in a thin
task's pod too (issue 29); :mod:`models.training.optimizer_state` and :mod:`models.training.lora`,
which write those files, export the same names."""

from __future__ import annotations

import os

ADAPTER_CONFIG = "adapter_config.json"
"""The file that makes a checkpoint folder a peft adapter (with ``adapter_model.safetensors``)."""


def optimizer_url(checkpoint_url: str) -> str:
    """Where the optimizer state that trained ``checkpoint_url`` lives: ``{checkpoint_url}-optimizer``."""
    return checkpoint_url.rstrip("/") + "-optimizer"


def is_adapter(local_dir: str) -> bool:
    """True if ``local_dir`` is a peft adapter directory (not full weights)."""
    return os.path.isfile(os.path.join(local_dir, ADAPTER_CONFIG))

"""The ``model`` section: where the policy, reference and critic come from."""

from __future__ import annotations

from dataclasses import dataclass

from models.config.checks import ConfigError, check_choice
from models.rewards import RewardError, parse_spec


@dataclass(frozen=True)
class ModelConfig:
    """Where the policy, reference, critic and reward model come from."""

    actor_path: str = ""
    """HF checkpoint (directory or fsspec URL) the actor starts from; also the frozen reference.
    Empty: the checkpoint ``builder`` writes."""
    builder: str = ""
    """Used when ``actor_path`` is empty: ``module:function(key=value, ...)`` that writes the run's starting
    model and data, called at set-up as ``fn(out_dir, **kwargs)`` (Python literal arguments); it returns the
    paths it wrote: ``actor`` (an HF checkpoint with its tokenizer) and optionally ``critic``,
    ``train_prompts`` and ``eval_prompts`` (used when ``data.train_prompts`` is empty). The demo presets
    name theirs (``models.demos.builders:reverse_demo(...)``, docs/presets.md); the keys
    ``model.demo_task``, ``model.tiny_hidden_size``, ``model.tiny_num_layers``, ``model.tiny_num_heads``,
    ``model.warm_start_steps``, ``data.num_demo_train_prompts`` and ``data.num_demo_eval_prompts`` are
    accepted as aliases of its arguments."""
    critic_path: str = ""
    """HF checkpoint of the critic (token-classification head, 1 label). Empty: the builder's critic if it
    wrote one, else the actor's trunk with a fresh value head."""
    dtype: str = "float32"
    """Compute dtype of the training-side forwards (scoring and updates): float32 or bfloat16.
    Updates keep the weights they train, their gradients and AdamW's state in float32 and commit
    float32 checkpoints (master weights: an AdamW step of lr 1e-6 is below bfloat16's resolution
    for most weights); with LoRA the frozen base stays in this dtype."""
    pack_sequences: bool = True
    """Training and scoring forwards run each micro-batch's rows packed end to end into a few shared
    rows instead of padded to the longest (models/training/packing.py): position ids restart at every row, so
    attention stays within it. Checked once per loaded model against padding; a model whose
    attention would mix packed rows pads instead, with a message."""

    def __post_init__(self) -> None:
        check_choice("model.dtype", self.dtype, ["float32", "bfloat16"])
        if self.builder:
            try:
                parse_spec(self.builder)
            except RewardError as err:
                raise ConfigError(f"model.builder={self.builder!r}: {err}") from None

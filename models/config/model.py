"""The ``model`` section: where the policy, reference and critic come from."""

from __future__ import annotations

from dataclasses import dataclass

from models.config.checks import check, check_choice


@dataclass(frozen=True)
class ModelConfig:
    """Where the policy, reference, critic and reward model come from."""

    actor_path: str = ""
    """HF checkpoint (directory or fsspec URL) the actor starts from; also the frozen reference.
    Empty: build the demo models of ``demo_task`` (tokenizer, warm-started actor, critic) under the run."""
    demo_task: str = "reverse"
    """Demo models only: ``reverse``: the character-level Llama on string reversal (``make demo``);
    ``math``: a Qwen2-shaped chat model (byte-level BPE, ChatML) on arithmetic word problems with an
    ``answer`` column (``make demo TASK=math``, docs/math_demo.md)."""
    critic_path: str = ""
    """HF checkpoint of the critic (token-classification head, 1 label). Empty: initialise
    the critic from the actor's trunk with a fresh value head."""
    tiny_hidden_size: int = 64
    """Demo models only: width of the tiny Llama (``reverse``; ``math`` has its own shape)."""
    tiny_num_layers: int = 2
    """Demo models only: number of decoder layers."""
    tiny_num_heads: int = 2
    """Demo models only: attention heads (head size = hidden / heads)."""
    warm_start_steps: int = 300
    """Demo models only: supervised warm-start steps before RL (cached by content; the ``math``
    demo is tuned for 400)."""
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
        check_choice("model.demo_task", self.demo_task, ["reverse", "math"])
        check(self.tiny_hidden_size % max(self.tiny_num_heads, 1) == 0,
              f"model.tiny_hidden_size={self.tiny_hidden_size} is not divisible by "
              f"model.tiny_num_heads={self.tiny_num_heads}")
        check(self.warm_start_steps >= 0, "model.warm_start_steps must be >= 0")

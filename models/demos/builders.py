"""What a demo preset's ``model.builder`` names: one function per demo that writes its starting model and
its prompts into the run's set-up folder (docs/presets.md).

Set-up calls the builder a config names when ``model.actor_path`` is empty, as ``fn(out_dir, **kwargs)``
with the keyword arguments of the spec (``models.demos.builders:reverse_demo(hidden_size=64, ...)``), and
knows nothing else of the demos. A builder returns the paths it wrote: ``actor`` (an HF checkpoint with
its tokenizer), and optionally ``critic`` (PPO's starting critic) and ``train_prompts`` /
``eval_prompts`` (JSONL files, used when ``data.train_prompts`` is empty). The warm starts are cached by
content under :func:`cache_dir`, so every run after the first copies them.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Dict

from models.environ import CACHE_ENV, cache_dir  # noqa: F401 -- the demos' models are cached there, by content


STARTS = ("actor", "critic", "train_prompts", "eval_prompts")
"""What a builder returns (set-up's ``BUILT_PARTS``)."""


def _paths(built: Dict[str, object]) -> Dict[str, str]:
    """The paths set-up takes (the reversal demo also writes a reward model it does not use)."""
    return {k: str(v) for k, v in built.items() if k in STARTS}


def reverse_demo(out_dir: str, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 2,
                 warm_start_steps: int = 300, num_train_prompts: int = 2000,
                 num_eval_prompts: int = 64) -> Dict[str, str]:
    """String reversal (``make demo``): the character-level Llama of ``num_layers`` x ``hidden_size``
    (``num_heads`` heads, head size = hidden / heads), warm-started for ``warm_start_steps`` supervised
    steps (:mod:`models.demos.warm_start`), its critic (the actor's trunk, a fresh value head) and
    ``num_train_prompts`` / ``num_eval_prompts`` generated prompts."""
    from models.demos.tiny import TinyModelConfig
    from models.demos.warm_start import WarmStartConfig, build_demo_models

    if hidden_size % max(num_heads, 1):
        raise ValueError(f"hidden_size={hidden_size} is not divisible by num_heads={num_heads}")
    if warm_start_steps < 0:
        raise ValueError(f"warm_start_steps={warm_start_steps} must be >= 0")
    model = TinyModelConfig(hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                            num_kv_heads=num_heads, intermediate_size=4 * hidden_size)
    return _paths(build_demo_models(out_dir, os.path.join(cache_dir(), "warm_start"), model,
                                    cfg=WarmStartConfig(steps=warm_start_steps), num_train_prompts=num_train_prompts,
                                    num_eval_prompts=num_eval_prompts))


def math_demo(out_dir: str, warm_start_steps: int = 400, num_train_prompts: int = 1024,
              num_eval_prompts: int = 64) -> Dict[str, str]:
    """Arithmetic word problems (``make demo TASK=math``, docs/math_demo.md): the Qwen2-shaped chat model
    (byte-level BPE, ChatML) warm-started for ``warm_start_steps`` steps, and conversational prompts with
    an ``answer`` column."""
    from models.demos.math_demo import DEMO_WARM_START, build_math_demo

    if warm_start_steps < 0:
        raise ValueError(f"warm_start_steps={warm_start_steps} must be >= 0")
    return _paths(build_math_demo(out_dir, os.path.join(cache_dir(), "warm_start"),
                                  cfg=dataclasses.replace(DEMO_WARM_START, steps=warm_start_steps),
                                  num_train_prompts=num_train_prompts, num_eval_prompts=num_eval_prompts))


def real_shape_chat(out_dir: str, shape: str = "qwen3-0.6b", num_layers: int = 0, max_position_embeddings: int = 0,
                    num_train_prompts: int = 64, num_eval_prompts: int = 8) -> Dict[str, str]:
    """A released model's shape with random weights and its real tokenizer and chat template
    (:mod:`models.demos.real_shapes`, cached by content; ``num_layers`` 0: the real depth,
    ``max_position_embeddings`` 0: the released value), and conversational prompts in TRL's format
    (:mod:`models.demos.chat_prompts`) written under ``out_dir``."""
    from models.demos.chat_prompts import write_chat_prompts
    from models.demos.real_shapes import SHAPES, BuildOptions, real_checkpoint

    if shape not in SHAPES:
        raise ValueError(f"shape={shape!r}: choose from {sorted(SHAPES)}")
    opts = BuildOptions(num_layers=num_layers or None, max_position_embeddings=max_position_embeddings or None)
    return {"actor": str(real_checkpoint(SHAPES[shape], opts)),
            **write_chat_prompts(out_dir, num_train_prompts, num_eval_prompts)}

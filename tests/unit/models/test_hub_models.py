"""The Hub-shaped test checkpoints are what they claim to be, loaded the way users load them."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from models.demos.hub_models import (ENDOFTEXT, IM_END, HubModelConfig, build_llama_bpe, build_qwen2_chat,
                               padded_vocab, qwen2_tokenizer)

TEXTS = ["Grüße aus München: 12345 + 678 = ?", "中文 😀 🚀", "  leading spaces\n\ttabs\r\n", "x² ≈ π", ""]


def test_qwen2_snapshot_files_and_generation_config(qwen2_chat_dir):
    names = {p.name for p in qwen2_chat_dir.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", "vocab.json", "merges.txt", "LICENSE", "README.md", ".gitattributes"} <= names
    gen = json.loads((qwen2_chat_dir / "generation_config.json").read_text())
    tok = AutoTokenizer.from_pretrained(qwen2_chat_dir)
    im_end, eot = tok.convert_tokens_to_ids([IM_END, ENDOFTEXT])
    assert gen["eos_token_id"] == [im_end, eot] and im_end != eot
    assert gen["repetition_penalty"] == 1.05 and gen["top_k"] == 20 and gen["temperature"] == 0.7
    assert json.loads((qwen2_chat_dir / "tokenizer_config.json").read_text())["tokenizer_class"] == "Qwen2Tokenizer"


def test_qwen2_has_tied_embeddings_and_a_padded_vocabulary(qwen2_chat_dir):
    model = AutoModelForCausalLM.from_pretrained(qwen2_chat_dir)
    tok = AutoTokenizer.from_pretrained(qwen2_chat_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert model.config.vocab_size > len(tok)  # rows no token uses, as released checkpoints have
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped-query attention
    assert model.model.layers[0].self_attn.q_proj.bias is not None  # Qwen2's q/k/v biases


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_tokenizers_round_trip_any_text(qwen2_chat_dir, llama_bpe_dir, text):
    for path in (qwen2_chat_dir, llama_bpe_dir):
        tok = AutoTokenizer.from_pretrained(path)
        assert tok.unk_token_id is None or tok.unk_token_id not in tok(text)["input_ids"]
        assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text


def test_digits_are_single_tokens(qwen2_chat_dir):
    tok = AutoTokenizer.from_pretrained(qwen2_chat_dir)
    assert tok.convert_ids_to_tokens(tok("12345")["input_ids"]) == ["1", "2", "3", "4", "5"]


def test_chatml_template_renders_roles_tools_and_the_generation_prompt(qwen2_chat_dir):
    tok = AutoTokenizer.from_pretrained(qwen2_chat_dir)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    calls = [{"role": "user", "content": "12*13?"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12*13"}}}]},
             {"role": "tool", "content": "156"}]
    text = tok.apply_chat_template(calls, tools=tools, tokenize=False, add_generation_prompt=True)
    assert '"name": "calculator"' in text.split("<|im_end|>")[0]  # the schema in the system turn
    assert '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*13"}}\n</tool_call>' in text
    assert text.endswith("<|im_start|>user\n<tool_response>\n156\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n")
    ids = tok("<tool_call>x</tool_call>")["input_ids"]
    assert tok.convert_ids_to_tokens([ids[0], ids[-1]]) == ["<tool_call>", "</tool_call>"]
    assert "<tool_call>" in tok.decode(ids, skip_special_tokens=True)  # not special: kept in the response text


def test_llama_bpe_has_bos_no_pad_and_untied_head(llama_bpe_dir):
    tok = AutoTokenizer.from_pretrained(llama_bpe_dir)
    model = AutoModelForCausalLM.from_pretrained(llama_bpe_dir)
    assert tok.pad_token is None
    assert tok("hi")["input_ids"][0] == tok.bos_token_id
    assert model.get_output_embeddings().weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
    gen = json.loads((llama_bpe_dir / "generation_config.json").read_text())
    assert len(gen["eos_token_id"]) == 2
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_builds_are_reproducible_byte_for_byte(tmp_path):
    cfg = HubModelConfig(seed=3)
    digests = []
    for name in ("a", "b"):
        out = build_qwen2_chat(tmp_path / name, cfg)
        digests.append({p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir())})
    assert digests[0] == digests[1]
    other = build_qwen2_chat(tmp_path / "c", HubModelConfig(seed=4))
    assert hashlib.sha256((other / "model.safetensors").read_bytes()).hexdigest() != \
        digests[0]["model.safetensors"]


def test_logit_scale_sharpens_the_distribution(tmp_path):
    tok = qwen2_tokenizer()
    flat = AutoModelForCausalLM.from_pretrained(build_qwen2_chat(tmp_path / "flat", tokenizer=tok))
    sharp = AutoModelForCausalLM.from_pretrained(
        build_qwen2_chat(tmp_path / "sharp", HubModelConfig(logit_scale=40.0), tokenizer=tok))
    ids = torch.tensor([tok("What is 2+2?")["input_ids"]])

    def entropy(model):
        with torch.no_grad():
            logp = model(ids).logits[0, -1].log_softmax(-1)
        return float(-(logp.exp() * logp).sum())

    assert entropy(sharp) < 0.5 * entropy(flat)


def test_padded_vocab_adds_rows():
    tok = qwen2_tokenizer()
    assert padded_vocab(tok, 64) % 64 == 0 and padded_vocab(tok, 64) > len(tok)


def test_tie_word_embeddings_overrides_the_builders_default(tmp_path):
    from models.demos.hub_models import llama_tokenizer

    def shares(path):
        model = AutoModelForCausalLM.from_pretrained(path)
        return model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()

    tok = llama_tokenizer(HubModelConfig(num_kv_heads=2))
    tied = build_llama_bpe(tmp_path / "llama", HubModelConfig(num_kv_heads=2, tie_word_embeddings=True), tok)
    assert shares(tied) and json.loads((tied / "config.json").read_text())["tie_word_embeddings"] is True
    untied = build_qwen2_chat(tmp_path / "qwen2", HubModelConfig(tie_word_embeddings=False), qwen2_tokenizer())
    assert not shares(untied)

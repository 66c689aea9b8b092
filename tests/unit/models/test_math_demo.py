"""The math demo's warm start: chat-templated demonstrations, the content-keyed cache, the files a run
reads (a Qwen2-shaped chat checkpoint and conversational prompt rows with their answers)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

import models.demos.math_demo as md
from models.demos.hub_models import HubModelConfig
from models.demos.math_task import MathTaskConfig, ProblemGenerator
from models.demos.warm_start import WarmStartConfig

SMALL = HubModelConfig(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
TASK = MathTaskConfig(max_number=9)
STEPS = WarmStartConfig(steps=3, batch_size=4, lr=1e-3)


def test_demonstrations_are_chat_templated_and_the_cache_is_keyed_by_content(tmp_path, monkeypatch):
    seen = []
    real = md.train_on_demonstrations

    def recording(model, tokenizer, next_pairs, cfg, threads=1):
        def spy(n):
            pairs = next_pairs(n)
            seen.extend(pairs)
            return pairs
        return real(model, tokenizer, spy, cfg, threads)

    monkeypatch.setattr(md, "train_on_demonstrations", recording)
    actor = md.math_warm_start(tmp_path, SMALL, TASK, STEPS)
    info = json.loads((actor / "warm_start.json").read_text())
    assert len(info["losses"]) == 3 and len(seen) == 12
    want = ProblemGenerator(TASK, "train", seed=0).demonstrations(12)
    assert seen == [(f"<|im_start|>user\n{m[0]['content']}<|im_end|>\n<|im_start|>assistant\n", w) for m, w in want]
    tok = AutoTokenizer.from_pretrained(actor)
    assert tok.eos_token == "<|im_end|>" and tok.chat_template and tok.bos_token is None
    assert json.loads((actor / "config.json").read_text())["model_type"] == "qwen2"

    def no_training(*a, **k):
        raise AssertionError("trained although the result is cached")

    monkeypatch.setattr(md, "train_on_demonstrations", no_training)
    assert md.math_warm_start(tmp_path, SMALL, TASK, STEPS) == actor
    with pytest.raises(AssertionError, match="cached"):
        md.math_warm_start(tmp_path, SMALL, MathTaskConfig(max_number=8), STEPS)


def test_build_math_demo_writes_the_actor_and_conversational_rows(tmp_path):
    paths = md.build_math_demo(tmp_path / "out", tmp_path / "cache", SMALL, TASK, STEPS,
                               num_train_prompts=20, num_eval_prompts=5)
    rows = [json.loads(line) for line in paths["eval_prompts"].read_text().splitlines()]
    assert rows == ProblemGenerator(TASK, "eval", 0).rows(5)
    assert {"prompt_id", "question", "messages", "answer"} == set(rows[0])
    assert len(paths["train_prompts"].read_text().splitlines()) == 20
    assert (paths["actor"] / "model.safetensors").is_file() and (paths["actor"] / "warm_start.json").is_file()
    assert 0.0 <= md.accuracy(paths["actor"], rows, max_new_tokens=4) <= 1.0

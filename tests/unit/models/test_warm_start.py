"""Warm start: batch layout, response-only loss, loss drops, caching, CLI, tuned reward."""

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from models.demos import warm_start as ws
from models.demos.reverse_task import ReverseTaskConfig
from models.demos.tiny import TinyModelConfig, build_actor
from models.demos.tokenizer import build_char_tokenizer

TOK = build_char_tokenizer()


def _id(ch):
    return TOK(ch, add_special_tokens=False).input_ids[0]


def test_demo_batch_layout_hand_worked():
    batch = ws.demo_batch(TOK, [("ab=", "ba"), ("abc=", "cba")])
    a, b, c, eq = _id("a"), _id("b"), _id("c"), _id("=")
    assert batch["input_ids"].tolist() == [
        [1, a, b, eq, b, a, 2, 0, 0],
        [1, a, b, c, eq, c, b, a, 2],
    ]
    assert batch["labels"].tolist() == [
        [-100, -100, -100, -100, b, a, 2, -100, -100],
        [-100, -100, -100, -100, -100, c, b, a, 2],
    ]
    assert batch["attention_mask"].tolist() == [[1] * 7 + [0, 0], [1] * 9]


def test_loss_covers_response_tokens_only():
    model = build_actor(TinyModelConfig(), TOK)
    batch = ws.demo_batch(TOK, [("ab=", "ba"), ("abcd=", "dcba")])
    with torch.no_grad():
        loss = model(**batch).loss
        logp = F.log_softmax(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits, -1)
    # manual: token t+1 is predicted at position t; response tokens start after "=".
    terms = []
    for row, (ids, n_prompt) in enumerate([(batch["input_ids"][0][:7], 4), (batch["input_ids"][1], 6)]):
        for t in range(n_prompt, len(ids)):
            terms.append(-logp[row, t - 1, ids[t]])
    assert len(terms) == 3 + 5
    torch.testing.assert_close(loss, torch.stack(terms).mean(), rtol=0, atol=1e-6)


def test_short_training_reduces_loss():
    model = build_actor(TinyModelConfig(), TOK)
    losses = ws.train_sft(model, TOK, ReverseTaskConfig(), ws.WarmStartConfig(steps=20, batch_size=8, lr=3e-3))
    assert len(losses) == 20
    assert losses[0] == pytest.approx(4.6, abs=0.3)  # ~ln(99): a random model is near uniform
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0
    assert not model.training


def test_cache_hit_returns_same_dir_without_training(tmp_path, monkeypatch):
    cfg = ws.WarmStartConfig(steps=5)
    first = ws.warm_start(tmp_path, cfg=cfg)
    info = json.loads((first / ws.DONE_FILE).read_text())
    assert len(info["losses"]) == 5 and info["warm_start"]["steps"] == 5
    AutoModelForCausalLM.from_pretrained(str(first))  # a loadable HF directory

    def no_training(*args, **kwargs):
        raise AssertionError("cache miss: trained again")

    monkeypatch.setattr(ws, "train_sft", no_training)
    assert ws.warm_start(tmp_path, cfg=cfg) == first
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary leftovers
    with pytest.raises(AssertionError, match="cache miss"):
        ws.warm_start(tmp_path, cfg=ws.WarmStartConfig(steps=6))
    with pytest.raises(AssertionError, match="cache miss"):
        ws.warm_start(tmp_path, task_cfg=ReverseTaskConfig(max_len=7), cfg=cfg)


def test_cache_key_depends_on_every_config():
    base = ws.cache_key(TinyModelConfig(), ReverseTaskConfig(), ws.WarmStartConfig(), "ab")
    assert base == ws.cache_key(TinyModelConfig(), ReverseTaskConfig(), ws.WarmStartConfig(), "ab")
    others = {
        ws.cache_key(TinyModelConfig(seed=1), ReverseTaskConfig(), ws.WarmStartConfig(), "ab"),
        ws.cache_key(TinyModelConfig(), ReverseTaskConfig(min_len=2), ws.WarmStartConfig(), "ab"),
        ws.cache_key(TinyModelConfig(), ReverseTaskConfig(), ws.WarmStartConfig(lr=1e-3), "ab"),
        ws.cache_key(TinyModelConfig(), ReverseTaskConfig(), ws.WarmStartConfig(), "abc"),
    }
    assert base not in others and len(others) == 4


def test_greedy_generation_matches_a_manual_argmax_loop():
    model = build_actor(TinyModelConfig(seed=3), TOK)
    prompts = ["abc=", "hello="]
    got = ws.generate_responses(model, TOK, prompts, max_new_tokens=5, temperature=0.0)
    for prompt, response in zip(prompts, got):
        ids = TOK(prompt, return_tensors="pt").input_ids
        out = []
        with torch.no_grad():
            for _ in range(5):
                nxt = model(input_ids=ids).logits[0, -1].argmax().item()
                if nxt == TOK.eos_token_id:
                    break
                out.append(nxt)
                ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
        assert response == TOK.decode(out, skip_special_tokens=True)


def test_sampling_is_seeded():
    model = build_actor(TinyModelConfig(), TOK)
    prompts = ["abc="] * 8
    a = ws.generate_responses(model, TOK, prompts, max_new_tokens=6, temperature=1.0, seed=1)
    b = ws.generate_responses(model, TOK, prompts, max_new_tokens=6, temperature=1.0, seed=1)
    c = ws.generate_responses(model, TOK, prompts, max_new_tokens=6, temperature=1.0, seed=2)
    assert a == b and a != c
    assert len(set(a)) > 1  # a random model at T=1 gives varied samples


def test_cli_builds_all_demo_dirs(tmp_path, capsys):
    ws.main(["--out", str(tmp_path / "demo"), "--cache-dir", str(tmp_path / "cache"),
             "--steps", "3", "--eval-prompts", "0"])
    demo = tmp_path / "demo"
    for name in ("actor", "critic", "reward_model"):
        assert (demo / name / "model.safetensors").is_file()
        assert (demo / name / "tokenizer.json").is_file()
    assert len((demo / "prompts" / "train.jsonl").read_text().splitlines()) == 1024
    assert len((demo / "prompts" / "eval.jsonl").read_text().splitlines()) == 256
    assert "actor" in capsys.readouterr().out


@pytest.mark.slow  # the full default warm start (240 steps) and 512 generations: about a minute of CPU
def test_default_warm_start_leaves_room_for_rl(tmp_path):
    """The tuned defaults: partly right when sampling at T=1, better but imperfect greedy."""
    actor = ws.warm_start(tmp_path)
    sampled = ws.evaluate_actor(actor, num_prompts=256, temperature=1.0)
    greedy = ws.evaluate_actor(actor, num_prompts=256, temperature=0.0)
    assert 0.3 <= sampled <= 0.6
    assert sampled + 0.15 < greedy < 0.95

"""Tiny actor/critic/reward model: shapes, seeding, save/load, pooling, critic init."""

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
)

from models.demos.tiny import (
    TinyModelConfig,
    build_actor,
    build_tiny_models,
    critic_from_actor,
)
from models.demos.tokenizer import build_char_tokenizer

CFG = TinyModelConfig()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return build_tiny_models(tmp_path_factory.mktemp("tiny"), CFG)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _right_padded(tok, texts):
    enc = tok(texts, return_tensors="pt", padding=True)
    return enc.input_ids, enc.attention_mask  # [B, T] each


def test_config_defaults_fit_vllm_cpu_and_checks_run():
    assert CFG.head_dim == 32 and CFG.vllm_compatible
    assert not TinyModelConfig(hidden_size=48, num_heads=3, num_kv_heads=3).vllm_compatible  # 16
    with pytest.raises(ValueError, match="divisible by num_heads"):
        TinyModelConfig(hidden_size=64, num_heads=3)
    with pytest.raises(ValueError, match="divisible by num_kv_heads"):
        TinyModelConfig(num_heads=2, num_kv_heads=3)
    with pytest.raises(ValueError, match="num_layers"):
        TinyModelConfig(num_layers=0)


def test_build_is_seeded_and_leaves_global_rng_alone(tok):
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_actor(CFG, tok)
    assert torch.equal(torch.rand(1), before)  # building did not consume the caller's RNG
    b = build_actor(CFG, tok)
    c = build_actor(TinyModelConfig(seed=1), tok)
    w = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(a.state_dict()[w], b.state_dict()[w])
    assert not torch.equal(a.state_dict()[w], c.state_dict()[w])


def test_saved_dirs_are_hf_safetensors_with_tokenizer(saved):
    assert set(saved) == {"actor", "critic", "reward_model"}
    for path in saved.values():
        names = {p.name for p in path.iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
        assert not any(n.endswith((".bin", ".pt", ".pkl")) for n in names)
    assert AutoTokenizer.from_pretrained(str(saved["actor"])).eos_token_id == 2


@pytest.mark.parametrize(
    "role, auto_cls, out_shape",
    [
        ("actor", AutoModelForCausalLM, lambda B, T: (B, T, 99)),
        ("critic", AutoModelForTokenClassification, lambda B, T: (B, T, 1)),
        ("reward_model", AutoModelForSequenceClassification, lambda B, T: (B, 1)),
    ],
)
def test_reload_with_auto_class_gives_identical_outputs(saved, tok, role, auto_cls, out_shape):
    from models.demos import tiny

    builder = {"actor": tiny.build_actor, "critic": tiny.build_critic, "reward_model": tiny.build_reward_model}
    original = builder[role](CFG, tok)  # same seed as the saved one
    loaded = auto_cls.from_pretrained(str(saved[role])).eval()
    ids, mask = _right_padded(tok, ["abc=", "hello world="])
    with torch.no_grad():
        expected = original(input_ids=ids, attention_mask=mask).logits
        got = loaded(input_ids=ids, attention_mask=mask).logits
    saved_weights, built_weights = loaded.state_dict(), original.state_dict()
    assert saved_weights.keys() == built_weights.keys()
    for name, tensor in built_weights.items():
        assert torch.equal(saved_weights[name], tensor), name
    assert got.shape == out_shape(*ids.shape)
    # equal weights; the outputs may differ in the last bit (memory layout picks the kernel)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_critic_values_are_per_token(saved, tok):
    critic = AutoModelForTokenClassification.from_pretrained(str(saved["critic"])).eval()
    ids, mask = _right_padded(tok, ["ab=", "abcdef="])
    with torch.no_grad():
        values = critic(input_ids=ids, attention_mask=mask).logits.squeeze(-1)  # [B, T]
    assert values.shape == ids.shape
    assert values.dtype == torch.float32


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_reward_model_scores_the_last_non_pad_token(saved, tok, padding_side):
    rm = AutoModelForSequenceClassification.from_pretrained(str(saved["reward_model"])).eval()
    texts = ["ab=", "abcdef=ba", "q"]
    enc = tok(texts, return_tensors="pt", padding=True, padding_side=padding_side)
    with torch.no_grad():
        scores = rm(**enc).logits.squeeze(-1)  # [B]
        # manual: run the trunk, apply the head at each row's last real token
        hidden = rm.model(**enc).last_hidden_state  # [B, T, H]
        last = torch.tensor([max(i for i, m in enumerate(row) if m) for row in enc.attention_mask.tolist()])
        manual = rm.score(hidden[torch.arange(len(texts)), last]).squeeze(-1)  # [B]
        # independent reference: each text alone, unpadded, scored at its final position
        alone = torch.stack([rm(**tok(t, return_tensors="pt")).logits[0, 0] for t in texts])
    assert scores.shape == (3,)
    torch.testing.assert_close(scores, manual, rtol=0, atol=1e-6)
    torch.testing.assert_close(scores, alone, rtol=0, atol=1e-5)
    assert len(set(scores.tolist())) == 3  # not all pooled from one position


def test_critic_from_actor_copies_the_trunk(saved, tmp_path, tok):
    out = critic_from_actor(saved["actor"], tmp_path / "critic")
    actor = AutoModelForCausalLM.from_pretrained(str(saved["actor"])).eval()
    critic = AutoModelForTokenClassification.from_pretrained(str(out)).eval()
    assert critic.config.num_labels == 1
    assert critic.score.weight.shape == (1, CFG.hidden_size)
    actor_trunk = actor.model.state_dict()
    for name, tensor in critic.model.state_dict().items():
        assert torch.equal(tensor, actor_trunk[name]), name
    ids, mask = _right_padded(tok, ["abc="])
    with torch.no_grad():
        h_actor = actor.model(input_ids=ids, attention_mask=mask).last_hidden_state
        values = critic(input_ids=ids, attention_mask=mask).logits  # [1, T, 1]
    torch.testing.assert_close(values, critic.score(h_actor), rtol=0, atol=1e-6)

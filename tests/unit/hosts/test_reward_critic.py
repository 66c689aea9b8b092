"""RewardCriticHost (models/hosts/reward_critic.py) against direct forwards of the same checkpoints (no HTTP)."""

import os
import threading
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

from models.checkpoint import is_committed, load_model
from models.training.policy import CriticValues, reward_model_scores, with_packing
from models.hosts.reward_critic import (AlreadyCommitted, InvalidRequest, NotLoaded, RewardCriticHost, ServiceConfig,
                                        TooLarge, token_table)
from models.data.batch_tensors import model_inputs
from tests.unit.hosts.tiny_checkpoints import commit_tiny_models, samples


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    return commit_tiny_models(tmp_path_factory.mktemp("server-models"))


def _service(urls, **kw) -> RewardCriticHost:
    return RewardCriticHost.load(ServiceConfig(urls["critic"], urls["reward_model"], **kw))


def test_values_and_rewards_equal_direct_forwards(urls):
    svc = _service(urls, infer_micro_batch_size=3)  # 7 samples → slices of 3, 3, 1
    assert svc.critic.packed and not _service(urls, pack_sequences=False).critic.packed  # packed rows, checked here
    prompts, responses = samples(7, seed=1)
    got = svc.values_and_rewards(prompts, responses)
    critic = load_model(urls["critic"], AutoModelForTokenClassification).eval()
    rm = load_model(urls["reward_model"], AutoModelForSequenceClassification).eval()
    with torch.no_grad():
        inputs = model_inputs(token_table(prompts, responses), pad_token_id=0)
        ref_values = CriticValues(critic)(inputs)  # [B, T]
        ref_rewards = reward_model_scores(rm, inputs)  # [B]
        for b, (p, r) in enumerate(zip(prompts, responses)):
            assert len(got[b]["values"]) == len(r)
            torch.testing.assert_close(torch.tensor(got[b]["values"]), ref_values[b, :len(r)], atol=1e-5, rtol=1e-5)
            # independent of padding and of CriticValues: one unpadded row, value of action t at P+t-1
            row = torch.tensor([p + r])
            direct = critic(input_ids=row).logits[0, len(p) - 1:len(p) + len(r) - 1, 0]
            torch.testing.assert_close(torch.tensor(got[b]["values"]), direct, atol=1e-5, rtol=1e-5)
            assert got[b]["reward"] == pytest.approx(float(rm(input_ids=row).logits[0, 0]), abs=1e-5)
    np.testing.assert_allclose([g["reward"] for g in got], ref_rewards.numpy(), atol=1e-5)


def _value_loss(svc, prompts, responses, returns) -> float:
    """½·mean over tokens of (V − G)², from the service's own values."""
    got = svc.values_and_rewards(prompts, responses)
    err = np.concatenate([np.subtract(g["values"], ret) for g, ret in zip(got, returns)])
    return 0.5 * float(np.mean(err ** 2))


def test_train_lowers_value_loss_and_keeps_optimizer_state(urls):
    svc = _service(urls, lr=3e-3)
    prompts, responses = samples(4, seed=2)
    returns = [np.linspace(1.0, -1.0, len(r)).tolist() for r in responses]
    before = _value_loss(svc, prompts, responses, returns)
    settings = dict(minibatch_size=2, micro_batch_size=1, value_clip=0.0)
    for _ in range(5):
        old = [g["values"] for g in svc.values_and_rewards(prompts, responses)]
        stats = svc.train_on(prompts, responses, returns, old, **settings)
        assert stats["steps"] == 2.0  # 4 samples / minibatch 2
    after = _value_loss(svc, prompts, responses, returns)
    assert after < 0.5 * before, (before, after)
    assert (svc.train_calls, svc.optimizer_steps) == (5, 10)
    adam_steps = {float(s["step"]) for s in svc.optimizer.state.values()}
    assert adam_steps == {10.0}  # one AdamW state across the calls, not a fresh one per call


def test_train_validates_its_targets(urls):
    svc = _service(urls)
    prompts, responses = samples(2, seed=3)
    ok = [[0.0] * len(r) for r in responses]
    with pytest.raises(InvalidRequest, match="sample 1: returns has"):
        svc.train_on(prompts, responses, [ok[0], ok[1] + [1.0]], ok)
    with pytest.raises(InvalidRequest, match="old_values holds a non-finite"):
        svc.train_on(prompts, responses, ok, [ok[0], [float("nan")] * len(ok[1])])
    with pytest.raises(InvalidRequest, match="every response is empty"):
        svc.train_on(prompts, [[], []], [[], []], [[], []])
    reward_only = RewardCriticHost.load(ServiceConfig(reward_model_url=urls["reward_model"]))
    with pytest.raises(NotLoaded, match="no critic"):
        reward_only.train_on(prompts, responses, ok, ok)
    assert reward_only.values_and_rewards(prompts, responses)[0]["values"] is None


def test_check_samples_names_the_bad_sample(urls):
    svc = _service(urls)
    with pytest.raises(InvalidRequest, match=r"sample 2: token id 99 in response_tokens .* \[0, 99\)"):
        svc.check_samples([[5], [6], [7]], [[5], [6], [8, 99]])
    with pytest.raises(InvalidRequest, match="sample 0: token id -1 in prompt_tokens"):
        svc.check_samples([[-1]], [[5]])
    with pytest.raises(InvalidRequest, match="sample 1 has an empty prompt_tokens"):
        svc.check_samples([[5], []], [[5], [6]])
    with pytest.raises(InvalidRequest, match="does not fit in int64"):
        svc.check_samples([[2 ** 70]], [[5]])
    with pytest.raises(InvalidRequest, match="sample 1: response_tokens must be a list of token ids"):
        svc.check_samples([[5], [6]], [[5], [6.0]])
    with pytest.raises(TooLarge, match="sample 0 has 8193 tokens; this server accepts at most 8192"):
        svc.check_samples([[5] * 8000], [[6] * 193])


def test_save_commits_a_checkpoint_that_loads_back_identical(urls, tmp_path):
    svc = _service(urls, lr=1e-2)
    prompts, responses = samples(3, seed=4)
    old = [g["values"] for g in svc.values_and_rewards(prompts, responses)]
    svc.train_on(prompts, responses, [[1.0] * len(r) for r in responses], old)
    url = str(tmp_path / "root" / "run" / "iter-1" / "critic")
    files = svc.save(url)["files"]
    assert is_committed(url) and "model.safetensors" in files and "tokenizer.json" in files
    trained = svc.values_and_rewards(prompts, responses)
    assert not np.allclose(trained[0]["values"], old[0])  # the saved critic is the trained one
    back = load_model(url, AutoModelForTokenClassification).eval()
    with torch.no_grad():
        ref = with_packing(CriticValues(back), True)(model_inputs(token_table(prompts, responses)))  # as served
    for b, r in enumerate(responses):
        assert torch.equal(torch.tensor(trained[b]["values"]), ref[b, :len(r)])
    with pytest.raises(AlreadyCommitted, match="overwrite=true"):
        svc.save(url)
    svc.save(url, overwrite=True)  # (a save outside the storage root: the layer refuses it, test_reward_server.py)


def test_bfloat16_compute_trains_and_saves_float32_master_weights(urls, tmp_path):
    """``dtype=bfloat16``: the reward model is held in bfloat16; the critic keeps float32 weights and
    AdamW state, computes its values in bfloat16 (close to float32's, not equal), and an update of
    lr 1e-5, below bfloat16's resolution for most weights, still moves them and is saved in float32."""
    exact = _service(urls)
    svc = _service(urls, dtype="bfloat16", lr=1e-5)
    assert {p.dtype for p in svc.reward_model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in svc.critic.parameters()} == {torch.float32}
    prompts, responses = samples(4, seed=6)
    got, want = svc.values_and_rewards(prompts, responses), exact.values_and_rewards(prompts, responses)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g["values"], w["values"], atol=0.05)
        assert g["reward"] == pytest.approx(w["reward"], abs=0.05)
    assert not all(np.array_equal(g["values"], w["values"]) for g, w in zip(got, want))
    before = {n: p.detach().clone() for n, p in svc.critic.named_parameters()}
    svc.train_on(prompts, responses, [[1.0] * len(r) for r in responses], [g["values"] for g in got],
              minibatch_size=4, micro_batch_size=2, value_clip=0.0)
    moved = [n for n, p in svc.critic.named_parameters() if not torch.equal(p, before[n])]
    changed = sum(int((p != before[n]).sum()) for n, p in svc.critic.named_parameters())
    assert len(moved) == len(before) and changed > 0.9 * sum(p.numel() for p in before.values())
    assert {s["exp_avg"].dtype for s in svc.optimizer.state.values()} == {torch.float32}
    url = svc.save(str(tmp_path / "critic"))["url"]
    saved = load_file(os.path.join(url, "model.safetensors"))
    trained = dict(svc.critic.critic.named_parameters())
    assert {t.dtype for t in saved.values()} == {torch.float32}
    for n, t in saved.items():
        assert torch.equal(t, trained[n]), n


def test_train_save_and_infer_wait_for_the_model_lock(urls, tmp_path):
    svc = _service(urls)
    prompts, responses = samples(2, seed=8)
    zeros = [[0.0] * len(r) for r in responses]
    calls = {"infer": lambda: svc.values_and_rewards(prompts, responses), "train": lambda: svc.train_on(prompts, responses, zeros, zeros),
             "save": lambda: svc.save(str(tmp_path / "locked" / "critic"))}
    done = {}
    threads = [threading.Thread(target=lambda k=k, f=f: done.setdefault(k, f())) for k, f in calls.items()]
    with svc.lock:  # as if an infer batch were running
        for t in threads:
            t.start()
        time.sleep(0.3)
        assert done == {}  # all three are blocked on the lock
    for t in threads:
        t.join(30)
    assert set(done) == {"infer", "train", "save"} and svc.train_calls == 1

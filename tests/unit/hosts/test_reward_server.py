"""The reward/critic server in-process (the service layer's Server in a thread on 127.0.0.1, no child process),
driven through the one client: token, size limits, validation, batches read from inside the storage root only,
train and save, the reward source backed by it."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForSequenceClassification

from models.checkpoint import is_committed, load_model
from models.data.batch_tensors import model_inputs
from models.hosts.reward_critic import RewardCriticHost, ServiceConfig, token_table
from models.rewards import RewardError
from models.service.client import ServiceClient, ServiceError
from models.service.server import Server, Settings
from models.stages.rewards import RemoteReward, tokens_from_inputs
from models.training.policy import reward_model_scores
from tests.unit.hosts.tiny_checkpoints import commit_tiny_models, plant_nan_embedding, samples, write_batch

TOKEN = "s3cret-token"
NAN_TOKEN = 42


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    return commit_tiny_models(tmp_path_factory.mktemp("app-models"))


@pytest.fixture(scope="module")
def server(urls, tmp_path_factory):
    root = tmp_path_factory.mktemp("storage")
    host = RewardCriticHost.load(ServiceConfig(urls["critic"], urls["reward_model"], lr=1e-3, max_batch_size=8,
                                               max_delay_ms=1, max_samples=6, max_tokens=400))
    plant_nan_embedding(host.reward_model, NAN_TOKEN)
    srv = Server(host, Settings(TOKEN, str(root), max_body_bytes=4000, serial=False))
    srv.root = root
    yield srv
    srv.close()


def _client(server, token=TOKEN, **kw) -> ServiceClient:
    return ServiceClient(server.url, token, "reward server", **kw)


def _infer(client, prompts, responses):
    return client.infer(samples=[{"prompt_tokens": p, "response_tokens": r} for p, r in zip(prompts, responses)])


@pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x"])
def test_requests_without_the_right_token_get_401(server, token):
    with pytest.raises(ServiceError, match="health returned 401: Unauthorized: bearer token missing or wrong") as err:
        _client(server, token).health()
    assert err.value.status == 401 and err.value.attempts == 1


def test_infer_health_and_counters(server):
    client = _client(server)
    before = client.health()
    assert before["parts"] == ["critic", "reward_model"] and before["vocab_size"] == 99
    prompts, responses = samples(3, seed=5, max_prompt=8, max_response=8)
    out = _infer(client, prompts, responses)
    assert [len(r["values"]) for r in out] == [len(r) for r in responses]
    after = client.health()
    assert (after["infer_requests"] - before["infer_requests"], after["infer_samples"] - before["infer_samples"]) \
        == (1, 3)


def test_size_limits_give_413(server):
    client = _client(server)
    with pytest.raises(ServiceError, match=r"returned 413: TooLarge: request body of \d+ bytes exceeds the limit of "
                                           r"4000 bytes"):
        _infer(client, [[50] * 150] * 6, [[60] * 150] * 6)  # ~900 bytes per sample
    with pytest.raises(ServiceError, match=r"returned 413: TooLarge: request has 7 samples; .* at most 6"):
        _infer(client, [[5]] * 7, [[6]] * 7)
    with pytest.raises(ServiceError, match=r"returned 413: TooLarge: sample 1 has 401 tokens; .* at most 400"):
        _infer(client, [[5], [5] * 200], [[6], [6] * 201])


def test_invalid_requests_give_422_naming_the_problem(server):
    client = _client(server)
    with pytest.raises(ServiceError, match=r"returned 422: InvalidRequest: sample 1: token id 120 in prompt_tokens"):
        _infer(client, [[5], [120]], [[6], [7]])
    with pytest.raises(ServiceError, match=r"returned 422: InvalidRequest: sample 0 has an empty prompt_tokens"):
        _infer(client, [[]], [[7]])
    with pytest.raises(ServiceError, match=r"422: InvalidRequest: sample 0: response_tokens must be a list of token"):
        client.infer(samples=[{"prompt_tokens": [1]}])
    batch = write_batch(server.root / "bad.arrow", [[5]], [[6, 7]], returns=[[1.0, 1.0]], values=[[0.0, 0.0]])
    with pytest.raises(ServiceError, match=r"422: InvalidRequest: settings: need 1 <= epochs <= 100"):
        client.call("train", {"batch": batch, "settings": {"epochs": 0}})
    with pytest.raises(ServiceError, match=r"422: InvalidRequest: settings: .*unexpected keyword argument 'lr'"):
        client.call("train", {"batch": batch, "settings": {"lr": 1.0}})


def test_values_train_and_save_round_trip_inside_the_storage_root_only(server, tmp_path):
    client = _client(server)
    prompts, responses = samples(4, seed=6, max_prompt=8, max_response=8)
    old = [r["values"] for r in _infer(client, prompts, responses)]
    batch = write_batch(server.root / "iter-0" / "advantages.arrow", prompts, responses,
                        returns=[[1.0] * len(r) for r in responses], values=old)
    np.testing.assert_allclose(client.values(batch=batch, iteration=0), np.concatenate(old), atol=1e-6)
    res = client.call("train", {"batch": batch}, resend=False)
    assert res["train_calls"] >= 1 and res["stats"]["steps"] == 1.0 and np.isfinite(res["stats"]["loss"])
    saved = client.save(url=str(server.root / "iter-1" / "critic"))
    assert is_committed(saved["url"])
    with pytest.raises(ServiceError, match="returned 409: AlreadyCommitted: .*already committed"):
        client.save(url=saved["url"])
    for outside in ("/etc/critic", str(server.root / ".." / "critic"), "s3://bucket/critic"):
        with pytest.raises(ServiceError, match=r"returned 403: Refused: url .* is outside .*storage"):
            client.save(url=outside)
    elsewhere = write_batch(tmp_path / "advantages.arrow", prompts, responses)
    with pytest.raises(ServiceError, match=r"returned 403: Refused: batch .* is outside"):
        client.values(batch=elsewhere, iteration=0)


def test_remote_reward_matches_the_reward_model_and_names_non_finite_samples(server, urls):
    reward = RemoteReward(_client(server), max_samples_per_request=3)  # 5 samples → requests of 3 and 2
    prompts, responses = samples(5, seed=7, max_prompt=8, max_response=8)
    responses = [[t for t in r if t != NAN_TOKEN] or [5] for r in responses]
    prompts = [[t for t in p if t != NAN_TOKEN] or [5] for p in prompts]
    table = token_table(prompts, responses)
    micro = [model_inputs(table.slice(0, 2)), model_inputs(table.slice(2, 3))]
    got = reward(["p"] * 5, ["r"] * 5, micro)
    rm = load_model(urls["reward_model"], AutoModelForSequenceClassification).eval()
    ref = torch.cat([reward_model_scores(rm, m) for m in micro])
    np.testing.assert_allclose(got, ref.numpy(), atol=1e-5)
    responses[3] = responses[3] + [NAN_TOKEN]
    with pytest.raises(RewardError, match="sample 3 got nan"):
        reward.score_tokens(prompts, responses)
    with pytest.raises(RewardError, match="micro-batches hold 2 rows for 5 samples"):
        reward(["p"] * 5, ["r"] * 5, micro[:1])


def test_tokens_from_inputs_inverts_model_inputs():
    prompts, responses = [[5, 6, 7], [8], [9, 10]], [[11], [12, 13, 14], []]
    assert tokens_from_inputs(model_inputs(token_table(prompts, responses))) == (prompts, responses)

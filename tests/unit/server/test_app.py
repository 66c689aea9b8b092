"""The FastAPI app in-process (Starlette's TestClient, no socket), driven through RewardCriticClient."""

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoModelForSequenceClassification

from models.checkpoint import is_committed, load_model
from models.training.policy import reward_model_scores
from models.rewards import RewardError
from models.server.app import ServerSettings, create_app
from models.server.client import RemoteReward, RewardCriticClient, ServerError, tokens_from_inputs
from models.server.service import RewardCriticService, ServiceConfig, token_table
from models.data.batch_tensors import model_inputs
from tests.unit.server.tiny_checkpoints import commit_tiny_models, plant_nan_embedding, samples

TOKEN = "s3cret-token"
NAN_TOKEN = 42


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    return commit_tiny_models(tmp_path_factory.mktemp("app-models"))


@pytest.fixture(scope="module")
def http(urls, tmp_path_factory):
    root = tmp_path_factory.mktemp("storage")
    service = RewardCriticService.load(ServiceConfig(urls["critic"], urls["reward_model"], str(root), lr=1e-3))
    plant_nan_embedding(service.reward_model, NAN_TOKEN)
    settings = ServerSettings(max_batch_size=8, max_delay_ms=1, max_body_bytes=4000, max_samples_per_request=6,
                              max_tokens_per_sample=400, token=TOKEN)
    with TestClient(create_app(service, settings)) as tc:
        tc.storage_root = root
        yield tc


def _client(http, token=TOKEN, **kw) -> RewardCriticClient:
    return RewardCriticClient("http://testserver", token=token, http=http, retries=0, **kw)


@pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x"])
def test_requests_without_the_right_token_get_401(http, token):
    with pytest.raises(ServerError, match="returned 401: bearer token missing or wrong") as err:
        _client(http, token).health()
    assert err.value.status == 401 and err.value.attempts == 1
    raw = http.get("/health", headers={"Authorization": f"Basic {TOKEN}"})  # right secret, wrong scheme
    assert raw.status_code == 401 and raw.headers["www-authenticate"] == "Bearer"


def test_infer_health_and_counters(http):
    client = _client(http)
    before = client.health()
    assert before.parts == ["critic", "reward_model"] and before.vocab_size == 99
    prompts, responses = samples(3, seed=5, max_prompt=8, max_response=8)
    out = client.infer(prompts, responses)
    assert [len(r.values) for r in out] == [len(r) for r in responses]
    after = client.health()
    assert (after.infer_requests - before.infer_requests, after.infer_samples - before.infer_samples) == (1, 3)


def test_size_limits_give_413(http):
    client = _client(http)
    with pytest.raises(ServerError, match=r"returned 413: request body exceeds .* 4000 bytes"):
        client.infer([[50] * 150] * 6, [[60] * 150] * 6)  # ~900 bytes per sample
    with pytest.raises(ServerError, match=r"returned 413: request has 7 samples; .* at most 6"):
        client.infer([[5]] * 7, [[6]] * 7)
    with pytest.raises(ServerError, match=r"returned 413: sample 1 has 401 tokens; .* at most 400"):
        client.infer([[5], [5] * 200], [[6], [6] * 201])
    lying = http.post("/infer", content=b"{}", headers={"Authorization": f"Bearer {TOKEN}",
                                                        "Content-Length": "abc"})
    assert lying.status_code == 400 and "invalid Content-Length" in lying.json()["detail"]
    chunked = http.post("/infer", content=iter([b" " * 3000, b" " * 3000]),  # no Content-Length: counted
                        headers={"Authorization": f"Bearer {TOKEN}"})
    assert chunked.status_code == 413 and "exceeds the server limit" in chunked.json()["detail"]


def test_invalid_requests_give_422_naming_the_problem(http):
    client = _client(http)
    with pytest.raises(ServerError, match=r"returned 422: sample 1: token id 120 in prompt_tokens"):
        client.infer([[5], [120]], [[6], [7]])
    with pytest.raises(ServerError, match=r"returned 422: sample 0 has an empty prompt_tokens"):
        client.infer([[]], [[7]])
    raw = http.post("/infer", json={"samples": [{"prompt_tokens": [1]}]},
                    headers={"Authorization": f"Bearer {TOKEN}"})
    assert raw.status_code == 422 and raw.json()["detail"][0]["loc"][-1] == "response_tokens"
    with pytest.raises(ServerError, match=r"422: sample 0: returns has 1 entries for 2 response tokens"):
        client.train([[5]], [[6, 7]], [[1.0]], [[0.0, 0.0]])


def test_train_and_save_round_trip(http, urls):
    client = _client(http)
    prompts, responses = samples(4, seed=6, max_prompt=8, max_response=8)
    old = [r.values for r in client.infer(prompts, responses)]
    res = client.train(prompts, responses, [[1.0] * len(r) for r in responses], old)
    assert res.train_calls >= 1 and res.stats["steps"] == 1.0 and np.isfinite(res.stats["loss"])
    saved = client.save("iter-1/critic")
    assert is_committed(saved.url) and saved.url.startswith(str(http.storage_root))
    with pytest.raises(ServerError, match="returned 409: .*already committed"):
        client.save("iter-1/critic")
    with pytest.raises(ServerError, match="returned 403: save URL '/etc/critic' is outside the storage root"):
        client.save("/etc/critic")


def test_remote_reward_matches_the_reward_model_and_names_non_finite_samples(http, urls):
    reward = RemoteReward(_client(http), max_samples_per_request=3)  # 5 samples → requests of 3 and 2
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

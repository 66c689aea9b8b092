"""The reward/critic server for real: ``python -m models.hosts serve`` on 127.0.0.1, driven over HTTP.

Also the client against tiny stdlib HTTP servers that misbehave on purpose (5xx, slow,
4xx), to check retries, backoff and messages.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

from models.checkpoint import is_committed, load_model
from models.training.policy import CriticValues, reward_model_scores
from models.data.batch_tensors import model_inputs
from models.hosts.reward_critic import token_table
from models.service.client import ServiceClient, ServiceError
from tests.processes import server_process
from tests.unit.hosts.tiny_checkpoints import commit_tiny_models, samples, write_batch

pytestmark = pytest.mark.integration

TOKEN = "integration-token"


def start_server(args: list[str], log: Path):
    """The CLI server on 127.0.0.1 (free port, one torch thread), ready to serve."""
    return server_process(["--threads", "1", *args], env={"RS_TEST_TOKEN": TOKEN}, log_path=log).start()


def Client(url, token=None, **kw) -> ServiceClient:  # noqa: N802
    return ServiceClient(url, token, "reward server", **kw)


def infer(client, prompts, responses):
    return client.infer(samples=[{"prompt_tokens": p, "response_tokens": r} for p, r in zip(prompts, responses)])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return commit_tiny_models(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    server = start_server(["--critic", models["critic"], "--reward-model", models["reward_model"],
                              "--token-env", "RS_TEST_TOKEN", "--storage-root", str(tmp / "root"),
                              "--max-batch-size", "64", "--max-delay-ms", "100", "--max-body-bytes", "100000",
                              "--max-samples", "64", "--lr", "3e-3"], tmp / "server.log")
    try:
        yield server.url, tmp / "root"
    finally:
        server.stop()


def reference_values(critic_url, prompts, responses):
    critic = CriticValues(load_model(critic_url, AutoModelForTokenClassification).eval())
    with torch.no_grad():
        values = critic(model_inputs(token_table(prompts, responses)))  # [B, T]
    return [values[b, :len(r)].numpy() for b, r in enumerate(responses)]


def test_infer_train_save_round_trip(server, models):
    url, root = server
    client = Client(url, token=TOKEN, timeout_s=30)
    assert client.health()["parts"] == ["critic", "reward_model"]
    prompts, responses = samples(6, seed=11)
    first = [r["values"] for r in infer(client, prompts, responses)]
    for got, ref in zip(first, reference_values(models["critic"], prompts, responses)):
        np.testing.assert_allclose(got, ref, atol=1e-5)
    returns = [np.linspace(-1, 1, len(r)).tolist() for r in responses]

    def loss(values):
        return np.mean(np.concatenate([(np.array(v) - g) ** 2 for v, g in zip(values, returns)]))

    values = first
    settings = {"minibatch_size": 3, "micro_batch_size": 3, "value_clip": 0.0}
    for k in range(4):
        batch = write_batch(root / f"iter-{k}" / "advantages.arrow", prompts, responses, returns=returns, values=values)
        client.call("train", {"batch": batch, "settings": settings}, resend=False)
        values = [r["values"] for r in infer(client, prompts, responses)]
    assert loss(values) < 0.7 * loss(first)  # 0.4-0.6x in runs here; depends on the thread count
    assert client.health()["optimizer_steps"] == 8
    saved = client.save(url=str(root / "iter-4" / "critic"))
    assert is_committed(saved["url"]) and Path(saved["url"]).is_relative_to(root)
    for got, ref in zip(values, reference_values(saved["url"], prompts, responses)):
        np.testing.assert_allclose(got, ref, atol=1e-5)  # the checkpoint is the trained critic
    with pytest.raises(ServiceError, match="403: Refused: url .* is outside") as err:
        client.save(url=str(root / ".." / "outside"))
    assert err.value.status == 403 and not (root.parent / "outside").exists()


def test_concurrent_clients_are_batched_and_get_their_own_answers(server, models):
    url, _ = server
    n = 12
    requests = [samples(1 + i % 3, seed=100 + i) for i in range(n)]  # distinct contents, 1-3 samples
    client = Client(url, token=TOKEN, timeout_s=30)
    alone = [infer(client, *req) for req in requests]  # one at a time: each its own model batch
    rm = load_model(models["reward_model"], AutoModelForSequenceClassification).eval()
    before = client.health()
    answers: list = [None] * n
    barrier = threading.Barrier(n)

    def one(i):
        barrier.wait()
        answers[i] = infer(client, *requests[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    after = client.health()
    assert after["infer_requests"] - before["infer_requests"] == n
    assert after["infer_batches"] - before["infer_batches"] < n  # several requests shared a model batch
    for (prompts, responses), got, ref in zip(requests, answers, alone):
        with torch.no_grad():  # rewards: the untrained reward model, computed here
            rewards = reward_model_scores(rm, model_inputs(token_table(prompts, responses)))
        np.testing.assert_allclose([g["reward"] for g in got], rewards.numpy(), atol=1e-5)
        assert [len(g["values"]) for g in got] == [len(r) for r in responses]
        for g, r in zip(got, ref):  # values: the (possibly trained) critic, as served alone
            np.testing.assert_allclose(g["values"], r["values"], atol=1e-5)


def test_auth_and_size_limits(server):
    url, _ = server
    with pytest.raises(ServiceError, match=r"infer returned 401: Unauthorized: bearer token missing or wrong"):
        infer(Client(url, timeout_s=30), [[5]], [[6]])
    client = Client(url, token=TOKEN, timeout_s=30)
    with pytest.raises(ServiceError, match=r"returned 413: TooLarge: request body of \d+ bytes exceeds the limit of "
                                           r"100000") as e:
        infer(client, [[50] * 300] * 60, [[60] * 300] * 60)  # ~108 KB of token ids
    assert e.value.status == 413 and e.value.attempts == 1
    with pytest.raises(ServiceError, match=r"returned 413: TooLarge: request has 65 samples"):
        infer(client, [[5]] * 65, [[6]] * 65)


def test_killed_server_gives_a_clear_error_after_the_retries(models, tmp_path):
    server = start_server(["--reward-model", models["reward_model"]], tmp_path / "log")
    url = server.url
    try:
        client = Client(url, timeout_s=30, retries=3, backoff_s=0.05)
        assert infer(client, [[5, 6]], [[7]])[0]["values"] is None  # reward model only
    finally:
        server.stop()  # SIGTERM: the process exits, the port is closed
    t0 = time.monotonic()
    with pytest.raises(ServiceError) as err:
        infer(client, [[5, 6]], [[7]])
    assert str(err.value) == f"reward server at {url} does not answer (infer: connection refused, 4 attempts)."
    assert err.value.attempts == 4 and time.monotonic() - t0 >= 0.05 + 0.1 + 0.2


class FaultyServer:
    """A stdlib HTTP server on 127.0.0.1 answering from a script of ``(status, body, delay_s)``;
    the last entry repeats. Records the time of every request."""

    def __init__(self, script):
        self.script, self.hits = list(script), []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.hits.append(time.monotonic())
                status, body, delay = outer.script[min(len(outer.hits), len(outer.script)) - 1]
                time.sleep(delay)
                data = json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout test)
                    pass

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


OK = (200, {"result": [{"values": None, "reward": 0.25}]}, 0.0)


def test_5xx_is_retried_with_exponential_backoff():
    server = FaultyServer([(503, {"error": "warming up"}, 0.0), (500, {"error": "boom"}, 0.0), OK])
    try:
        got = infer(Client(server.url, retries=3, backoff_s=0.1), [[5]], [[6]])
    finally:
        server.close()
    assert got[0]["reward"] == 0.25 and len(server.hits) == 3
    gaps = np.diff(server.hits)
    assert gaps[0] >= 0.1 and gaps[1] >= 0.2  # 0.1 then doubled


def test_5xx_exhausted_4xx_and_timeouts_are_not_retried_further():
    server = FaultyServer([(500, {"error": "model exploded", "kind": "RuntimeError"}, 0.0)])
    try:
        with pytest.raises(ServiceError, match=r": infer returned 500 after 3 attempts: RuntimeError: model exploded"):
            infer(Client(server.url, retries=2, backoff_s=0.01), [[5]], [[6]])
        assert len(server.hits) == 3
    finally:
        server.close()
    server = FaultyServer([(400, {"error": "bad sample", "kind": "BadRequest"}, 0.0)])
    try:
        with pytest.raises(ServiceError, match=r"returned 400: BadRequest: bad sample"):
            infer(Client(server.url, retries=5, backoff_s=0.01), [[5]], [[6]])
        assert len(server.hits) == 1
    finally:
        server.close()
    server = FaultyServer([(200, OK[1], 1.0)])
    try:
        with pytest.raises(ServiceError, match=r": infer timed out after 0.2 s"):
            infer(Client(server.url, retries=5, backoff_s=0.01, timeout_s=0.2), [[5]], [[6]])
        assert len(server.hits) == 1
    finally:
        server.close()

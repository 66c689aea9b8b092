"""The rollout server for real: ``python -m models.hosts serve-rollout`` on 127.0.0.1 (HF engine),
checked against the same engine run in this process on the same checkpoint and seed.

Both sides run torch with one thread, so the same checkpoint, prompts and seed give the same
tokens bit for bit; the log-probs cross the wire as JSON floats (within 1e-5). The two actor
checkpoints have peaked next-token distributions (``actor_checkpoints``), so sampling from the
wrong one gives visibly different tokens.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from models.checkpoint import save_checkpoint
from models.engines import HFEngine, SamplingSpec
from models.service.client import ServiceClient, ServiceError
from models.stages.engine import RemoteEngine
from tests.processes import server_process
from tests.unit.models.actor_checkpoints import PROMPTS, actor_dir

pytestmark = pytest.mark.integration

TOKEN = "rollout-token"
SPEC = SamplingSpec(n=3, temperature=1.0, top_p=0.9, max_new_tokens=6, seed=7, stop_token_ids=(2,))


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """As the server (``--threads 1``): the same reductions, so the same samples."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Two committed actors with the same layout and different weights."""
    root = tmp_path_factory.mktemp("actors")
    out = {}
    for name, seed in (("a", 0), ("b", 1)):
        out[name] = str(root / "committed" / name)
        save_checkpoint(actor_dir(root / "hf" / name, seed=seed), out[name])
    return out


def start(checkpoint: str, log: Path, *args: str, timeout_s: float = 120.0, root: str = ""):
    """The server; the checkpoints its requests name lie under ``root`` (default: where ``checkpoint`` is)."""
    return server_process(["--checkpoint", checkpoint, "--engine", "hf", "--threads", "1", "--storage-root",
                           root or str(Path(checkpoint).parents[1]), *args], "serve-rollout", {"RO_TEST_TOKEN": TOKEN},
                          log, timeout_s).start()


@pytest.fixture(scope="module")
def server(ckpts, tmp_path_factory):
    srv = start(ckpts["a"], tmp_path_factory.mktemp("server") / "server.log", "--token-env", "RO_TEST_TOKEN",
                "--max-samples", "16", "--max-tokens", "64", "--max-body-bytes", "20000",
                root=str(tmp_path_factory.getbasetemp()))  # the tests' runs and checkpoints
    try:
        yield srv.url
    finally:
        srv.stop()


@pytest.fixture
def client(server):
    return ServiceClient(server, TOKEN, "rollout server", timeout_s=120)


def generate(client, prompts, spec, checkpoint_url, adapter_url=None):
    """The server's generations through the engine face the rollout stage uses (:class:`RemoteEngine`)."""
    engine = RemoteEngine(client, checkpoint_url, adapter_url)
    return engine.generate(prompts, spec)


def in_process(checkpoint: str, spec: SamplingSpec = SPEC):
    engine = HFEngine(checkpoint)
    try:
        return engine.generate(PROMPTS, spec)
    finally:
        engine.close()


def assert_same(got, want) -> None:
    assert [[g.tokens for g in p] for p in got] == [[g.tokens for g in p] for p in want]
    assert [[g.is_end for g in p] for p in got] == [[g.is_end for g in p] for p in want]
    for p_got, p_want in zip(got, want):
        for g, w in zip(p_got, p_want):
            np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5, rtol=0)


def test_remote_generate_equals_the_engine_in_process(client, ckpts):
    out = generate(client, PROMPTS, SPEC, ckpts["a"])
    assert [len(p) for p in out] == [SPEC.n] * len(PROMPTS)
    assert_same(out, in_process(ckpts["a"]))
    greedy = dataclasses.replace(SPEC, n=1, temperature=0.0, min_new_tokens=6)
    assert_same(generate(client, PROMPTS, greedy, ckpts["a"]), in_process(ckpts["a"], greedy))


def test_a_new_checkpoint_goes_in_place_and_is_served(client, ckpts):
    before = client.health()
    out = generate(client, PROMPTS, SPEC, ckpts["b"])
    after = client.health()
    assert after["checkpoint_url"] == ckpts["b"]
    assert after["engine_starts"] == 1 and after["reloads"] == before["reloads"] + 1
    reference_b = in_process(ckpts["b"])
    assert_same(out, reference_b)
    assert [[g.tokens for g in p] for p in reference_b] != [[g.tokens for g in p] for p in in_process(ckpts["a"])]
    engine = RemoteEngine(client)  # the GenerationEngine face: load_weights records the URL
    engine.load_weights(ckpts["a"])
    assert_same(engine.generate(PROMPTS, SPEC), in_process(ckpts["a"]))
    assert client.health()["checkpoint_url"] == ckpts["a"] and engine.stats.generated_tokens > 0


def test_token_bad_input_and_limits_are_refused_with_a_clear_status(server, client, ckpts, tmp_path):
    with pytest.raises(ServiceError, match=r"generate returned 401: Unauthorized: bearer token missing or wrong"):
        generate(ServiceClient(server, timeout_s=30), PROMPTS, SPEC, ckpts["a"])
    sampling = {"n": 3, "max_new_tokens": 6, "seed": 7}
    cases = [
        (([[1, 5], [1, 500]], sampling, ckpts["a"]), 422,
         r"prompt 1: token id 500 in prompts is outside the vocabulary \[0, 99\)"),
        (([[1, 5], []], sampling, ckpts["a"]), 422, r"prompt 1 is empty"),
        (([[1, 5]], sampling, "/nothing"), 403, r"checkpoint_url '/nothing' is outside"),
        (([[1, 5]], sampling, str(tmp_path / "nothing")), 422, r"checkpoint .*nothing is not committed"),
        (([[1, 5]], {**sampling, "min_new_tokens": 9}, ckpts["a"]), 422,
         r"0 <= min_new_tokens <= max_new_tokens \(got 3, 6, 9\)"),
        (([[1, 5]] * 6, sampling, ckpts["a"]), 413, r"request has 18 samples; this server accepts at most 16"),
        (([[1, 5], [1] * 60], sampling, ckpts["a"]), 413,
         r"prompt 1 plus max_new_tokens has 66 tokens; this server accepts at most 64"),
        (([[1] * 2000] * 5, {**sampling, "n": 1}, ckpts["a"]), 413, r"exceeds the limit of 20000 bytes"),
    ]
    for (prompts, spec, url), status, message in cases:
        with pytest.raises(ServiceError, match=message) as err:
            client.call("generate", {"prompts": prompts, "sampling": spec, "checkpoint_url": url})
        assert (err.value.status, err.value.attempts) == (status, 1)
    assert client.health()["checkpoint_url"] is not None  # a bad URL leaves the served weights alone


def test_killed_server_gives_a_clear_error_after_the_retries(ckpts, tmp_path):
    srv = start(ckpts["a"], tmp_path / "log")
    client = ServiceClient(srv.url, label="rollout server", timeout_s=60, retries=3, backoff_s=0.05)
    try:
        assert len(generate(client, [[1, 5]], SPEC, ckpts["a"])[0]) == SPEC.n
    finally:
        srv.stop()
    with pytest.raises(ServiceError) as err:
        RemoteEngine(client, ckpts["a"]).generate([[1, 5]], SPEC)
    assert str(err.value) == f"rollout server at {srv.url} does not answer (generate: connection refused, 4 attempts)."
    assert err.value.attempts == 4


def test_rollout_and_eval_tasks_through_the_server_match_the_engine_in_the_task(server, tmp_path, monkeypatch):
    """``rollout.remote_url``: the rollout task writes the batch the in-task engine writes, and the
    evaluation gets the same reward (both get their engine from ``engine_for``)."""
    from models.config.io import config_from_json_dict, to_dict
    from models.stages.evaluate import eval_reward
    from models.stages.rollout import run_rollout
    from models.run.setup import setup_run

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.setenv("RLHF_SERVER_TOKEN", TOKEN)
    small = ["rollout.engine=hf", "model.warm_start_steps=0", "rollout.prompts_per_iteration=6",
             "rollout.n_samples_per_prompt=2", "actor.minibatch_size=12", "actor.micro_batch_size=6",
             "data.num_demo_train_prompts=12", "data.num_demo_eval_prompts=4"]
    setup = setup_run("tiny_grpo", [f"run.storage_root={tmp_path}", *small], "remote-rollout")
    data = to_dict(setup.cfg)
    data["rollout"]["remote_url"] = server
    remote_cfg = config_from_json_dict(data)
    columns = ("prompt_id", "prompt_tokens", "response_tokens", "is_end")
    local = run_rollout(setup.cfg, setup.run, setup.state).batch
    want = {c: local.column(c).to_pylist() for c in columns + ("sampler_logprobs",)}
    remote = run_rollout(remote_cfg, setup.run, setup.state).batch
    assert {c: remote.column(c).to_pylist() for c in columns} == {c: want[c] for c in columns}
    np.testing.assert_allclose(np.concatenate(remote.column("sampler_logprobs").to_pylist()),
                               np.concatenate(want["sampler_logprobs"]), atol=1e-5, rtol=0)
    assert ServiceClient(server, TOKEN).health()["checkpoint_url"] == setup.state.actor_url
    remote_eval = eval_reward(remote_cfg, setup.run, setup.state.actor_url)
    assert remote_eval == pytest.approx(eval_reward(setup.cfg, setup.run, setup.state.actor_url), abs=1e-6)


def test_vllm_server_equals_vllm_in_process(ckpts, tmp_path):
    """The vLLM engine behind the server samples what ``VLLMEngine`` samples in this process."""
    pytest.importorskip("vllm")
    from models.engines import VLLMEngine

    srv = start(ckpts["a"], tmp_path / "log", "--engine", "vllm", "--max-model-len", "64",
                timeout_s=300)  # vLLM's start took 67 s on a loaded 2-core box (docs/multi_turn.md)
    try:
        client = ServiceClient(srv.url, label="rollout server", timeout_s=120)
        remote = generate(client, PROMPTS, SPEC, ckpts["a"])
        assert client.health()["engine"] == "vllm"
        with pytest.raises(ServiceError, match="returned 409: NotLoaded: this rollout server serves no LoRA adapters"):
            generate(client, PROMPTS, SPEC, ckpts["a"], adapter_url=ckpts["b"])
    finally:
        srv.stop()
    engine = VLLMEngine(ckpts["a"], max_model_len=64)
    try:
        assert_same(remote, engine.generate(PROMPTS, SPEC))
    finally:
        engine.close()

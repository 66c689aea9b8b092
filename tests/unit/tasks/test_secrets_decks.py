"""Flyte secrets reach the libraries through their environment variables; rollout/score decks
show the batch (reward and length histograms, escaped samples)."""

from __future__ import annotations

import re

import flytekit
import pytest

from tasks import decks, secrets
from models.data.batch import BatchMetadata, RolloutBatch


def _mount(monkeypatch, key: str, value: str) -> None:
    """What Flyte does for a requested secret: an env var the secrets manager reads."""
    monkeypatch.setenv(flytekit.current_context().secrets.get_secrets_env_var(secrets.GROUP, key), value)


def test_secrets_exported_only_when_mounted_and_not_empty(monkeypatch):
    for spec in secrets.S3 + secrets.MLFLOW + secrets.SERVER:
        monkeypatch.setenv(spec.env, "")  # recorded, so what load() exports is undone after the test
        monkeypatch.delenv(spec.env)
    _mount(monkeypatch, "aws-access-key-id", "AKIAFROMSECRET")
    _mount(monkeypatch, "aws-secret-access-key", "  ")  # empty: e.g. S3 access from an IAM role
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "from-env")  # a local run's own variable wins
    _mount(monkeypatch, "mlflow-tracking-token", "from-secret")
    import os

    assert secrets.load(secrets.S3, secrets.MLFLOW) == ["AWS_ACCESS_KEY_ID"]
    assert os.environ["AWS_ACCESS_KEY_ID"] == "AKIAFROMSECRET"
    assert "AWS_SECRET_ACCESS_KEY" not in os.environ
    assert os.environ["MLFLOW_TRACKING_TOKEN"] == "from-env"
    # the servers' token requested as a Flyte secret is the one the reward/critic/rollout clients send
    from models.service.client import server_token

    for request in secrets.requests(secrets.SERVER):
        _mount(monkeypatch, request.key, "tok-from-secret")
    secrets.load(secrets.SERVER)
    assert server_token() == "tok-from-secret"


def _scored_batch() -> RolloutBatch:
    responses = [[5, 6, 2], [7, 2], [8, 9, 10, 11], [12]]
    return RolloutBatch.from_rollout(
        BatchMetadata(iteration=3, policy_version=3, algorithm="ppo"), prompt_id=[0, 0, 1, 1],
        prompt_tokens=[[1, 2]] * 4, response_tokens=responses, sampler_logprobs=[[-1.0] * len(r) for r in responses],
        is_end=[True, True, False, False], prompt=["ab=", "ab=", "<b>x=", "<b>x="],
        response=["ba", "b", "x<y", "q"]).with_columns(reward=[1.0, 0.5, 0.25, 0.0])


def test_deck_shows_histograms_summary_and_escaped_samples():
    page = decks.batch_html(_scored_batch(), "Score: iteration 3")  # rewards 1, .5, .25, 0: std sqrt(.1367)
    assert len(re.findall(r'<img alt="[^"]+" src="data:image/png;base64,', page)) == 2  # reward + length
    assert "mean reward 0.438 (std 0.370)" in page
    assert "4 samples" in page and "mean response length 2.50 tokens" in page and "ended with a stop token 50%" in page
    assert "&#x27;&lt;b&gt;x=&#x27;" in page and "<b>x=" not in page  # prompts are text, not markup
    rows = re.findall(r"<tr>(.*?)</tr>", page)
    assert len(rows) == 1 + 4 and "<td>0.250</td>" in rows[3]


def test_rollout_deck_has_no_reward_yet():
    b = _scored_batch().select(["prompt_id", "prompt_tokens", "response_tokens", "sampler_logprobs", "is_end",
                                "prompt", "response"])
    page = decks.batch_html(b, "Rollout")
    assert page.count("<img") == 1 and "reward" not in page


@pytest.mark.parametrize("name", ["Rollout", "Score"])
def test_publish_adds_a_deck(name):
    ctx = flytekit.current_context()
    before = len(ctx.decks)
    decks.publish(name, _scored_batch())
    assert [d.name for d in ctx.decks[before:]] == [name]


def test_a_local_execution_renders_each_tasks_own_decks_only():
    """flytekit shares one deck list (and one timeline) between the tasks of a local execution, and each task
    with decks renders the whole list when it writes its own: the n-th task paid for the n before it (issue #36).
    ``decks.only_this_task`` (called by ``publish``) keeps the list to the running task's."""
    seen = []

    @flytekit.task(enable_deck=True)
    def noted(i: int) -> int:
        decks.only_this_task()
        ctx = flytekit.current_context()
        seen.append((len(ctx.decks), len(ctx.timeline_deck.time_info)))
        flytekit.Deck("mine", "<p>one</p>")
        return i + 1

    @flytekit.workflow
    def four() -> int:
        return noted(i=noted(i=noted(i=noted(i=0))))

    assert four() == 4
    assert seen == [(1, 0)] * 4  # the running task's timeline alone, never the decks of the tasks before


def test_a_resident_run_s_tasks_and_services_derive_the_token_from_a_flyte_secret(monkeypatch):
    """Every task that calls or stops a resident run's service, and every service, requests the Flyte secret the
    token is derived from; loaded, the token derives from it (none is published: test_resident.py tries the doors).
    The trainer services are never restarted by torch elastic; the engine's node is retried by Flyte."""
    from models.service.token import SECRET_ENV, service_token
    from tasks import iteration, resident, services

    wanted = secrets.requests(secrets.SERVICE)[0]
    thin = [resident.rollout_resident, resident.score_resident, resident.actor_update_resident,
            resident.critic_update_resident, resident.evaluate_resident, iteration.finish_run]
    for task in thin + [services.engine_service, services.actor_service, services.critic_service]:
        assert any(s.group == wanted.group and s.key == wanted.key for s in task.security_context.secrets), task.name
    monkeypatch.setenv(SECRET_ENV, "")
    monkeypatch.delenv(SECRET_ENV)
    _mount(monkeypatch, wanted.key, "the-cluster-secret")
    assert secrets.load(secrets.SERVICE) == [SECRET_ENV]
    assert service_token("s3://b/r", "exec-1", "engine") == \
        service_token("s3://b/r", "exec-1", "engine", {SECRET_ENV: "the-cluster-secret"}) != \
        service_token("s3://b/r", "exec-2", "engine", {SECRET_ENV: "the-cluster-secret"})
    assert services.actor_service.task_config.max_restarts == services.critic_service.task_config.max_restarts == 0
    assert services.engine_service.metadata.retries == services.ENGINE_RETRIES > 0
    assert services.actor_service.metadata.retries == services.critic_service.metadata.retries == 0

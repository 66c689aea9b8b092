"""Client behaviour that needs no server: backoff schedule, argument checks, a refused port."""

import socket
import time

import pytest

from models.server.client import RewardCriticClient, ServerError


def test_backoff_doubles_and_is_capped():
    client = RewardCriticClient("http://127.0.0.1:1/", backoff_s=0.5, max_backoff_s=3.0)
    assert [client.delay_s(k) for k in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 3.0]
    assert client.base_url == "http://127.0.0.1:1"
    with pytest.raises(ValueError, match="retries >= 0"):
        RewardCriticClient("http://x", retries=-1)


def test_refused_port_fails_after_every_attempt_with_a_clear_message():
    with socket.socket() as s:  # a port nobody listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        client = RewardCriticClient(f"http://127.0.0.1:{port}", retries=2, backoff_s=0.05)
        t0 = time.monotonic()
        with pytest.raises(ServerError) as err:
            client.health()
        elapsed = time.monotonic() - t0
    assert str(err.value) == (f"reward server http://127.0.0.1:{port}/health unreachable after 3 attempts "
                              f"(connection refused)")
    assert err.value.attempts == 3 and err.value.status is None
    assert elapsed >= 0.05 + 0.1  # slept between the attempts

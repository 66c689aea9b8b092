"""Client of the reward/critic server, and :class:`RemoteReward`, a reward source backed by it;
:class:`JSONClient` is the retrying base it shares with the rollout client (``rollout_client``).

Retries: connection failures and 5xx answers are retried with exponential backoff
(``backoff_s · 2^k``, capped at ``max_backoff_s``); 4xx answers are not (retrying cannot
fix them); a timeout is not either (the server is busy: more load will not help). ``train``
changes the critic, so it is retried only when the request provably never reached the
server (connection refused) or the server answered 5xx. Errors read, for example::

    ServerError: reward server http://127.0.0.1:8123/infer unreachable after 4 attempts (connection refused)
    ServerError: reward server http://127.0.0.1:8123/infer returned 401: bearer token missing or wrong
    ServerError: reward server http://127.0.0.1:8123/infer timed out after 10 s
"""

from __future__ import annotations

import logging
import os
import time
from typing import Iterable, List, Optional, Sequence

import httpx
import numpy as np

from models.rewards.sources import check_rewards
from models.rewards import RewardError
from models.server.schemas import (HealthResponse, InferResponse, InferResult, SaveResponse, TrainResponse,
                                   TrainSettings)

log = logging.getLogger(__name__)


class ServerError(RuntimeError):
    """The server could not be reached, timed out, or answered with an error status."""

    def __init__(self, message: str, url: str, status: Optional[int] = None, attempts: int = 1):
        super().__init__(message)
        self.url, self.status, self.attempts = url, status, attempts


def _detail(response: httpx.Response) -> str:
    """The server's ``detail`` (FastAPI's error body), else the start of the body."""
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        return response.text[:500] or response.reason_phrase
    if isinstance(detail, list):  # request validation: [{"loc": [...], "msg": ...}, ...]
        return "; ".join(f"{'.'.join(map(str, d.get('loc', ())))}: {d.get('msg')}" for d in detail[:5])
    return str(detail)


def _reason(err: Exception) -> str:
    text = str(err) or type(err).__name__
    return "connection refused" if "refused" in text.lower() else text


class JSONClient:
    """JSON over HTTP with the retries above; subclasses add the endpoints. Thread-safe (one ``httpx.Client``)."""

    name = "server"
    """How errors name the server (``reward server http://... returned 401: ...``)."""

    def __init__(self, base_url: str, token: Optional[str] = None, timeout_s: float = 60.0, retries: int = 3,
                 backoff_s: float = 0.5, max_backoff_s: float = 8.0, http: Optional[httpx.Client] = None):
        """``retries``: extra attempts after the first; ``http``: an ``httpx.Client`` to use
        (e.g. Starlette's ``TestClient``; its own timeout applies), else one with ``timeout_s``."""
        if timeout_s <= 0 or retries < 0 or backoff_s < 0 or max_backoff_s < 0:
            raise ValueError("need timeout_s > 0, retries >= 0, backoff_s >= 0 and max_backoff_s >= 0")
        self.base_url = base_url.rstrip("/")
        self.timeout_s, self.attempts = timeout_s, retries + 1
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = http if http is not None else httpx.Client(timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "JSONClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def delay_s(self, attempt: int) -> float:
        """Sleep after failed attempt ``attempt`` (1-based): ``backoff_s · 2^(attempt-1)``, capped."""
        return min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s)

    def _request(self, method: str, path: str, body: Optional[dict] = None, resend_after_drop: bool = True):
        url = self.base_url + path
        retryable = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) \
            if resend_after_drop else (httpx.ConnectError,)
        for attempt in range(1, self.attempts + 1):
            try:
                response = self._http.request(method, url, json=body, headers=self._headers)
            except httpx.TimeoutException as err:
                raise ServerError(f"{self.name} {url} timed out after {self.timeout_s:g} s", url,
                                  attempts=attempt) from err
            except retryable as err:
                if attempt == self.attempts:
                    raise ServerError(f"{self.name} {url} unreachable after {attempt} attempts ({_reason(err)})",
                                      url, attempts=attempt) from err
                log.warning("%s %s: %s (attempt %d of %d)", self.name, url, _reason(err), attempt, self.attempts)
            except httpx.HTTPError as err:
                raise ServerError(f"{self.name} {url} failed: {_reason(err)}", url, attempts=attempt) from err
            else:
                if response.status_code < 400:
                    return response
                detail = _detail(response)
                if response.status_code < 500:
                    raise ServerError(f"{self.name} {url} returned {response.status_code}: {detail}", url,
                                      response.status_code, attempt)
                if attempt == self.attempts:
                    raise ServerError(f"{self.name} {url} returned {response.status_code} after {attempt} "
                                      f"attempts: {detail}", url, response.status_code, attempt)
                log.warning("%s %s returned %d (attempt %d of %d): %s", self.name, url, response.status_code,
                            attempt, self.attempts, detail)
            time.sleep(self.delay_s(attempt))
        raise AssertionError("unreachable")  # pragma: no cover


class RewardCriticClient(JSONClient):
    """``infer`` / ``train`` / ``save`` / ``health`` of the reward/critic server."""

    name = "reward server"

    def infer(self, prompt_tokens: Sequence[Sequence[int]],
              response_tokens: Sequence[Sequence[int]]) -> List[InferResult]:
        """Per sample ``values`` [R] (critic) and ``reward`` (reward model), in order."""
        body = {"samples": [{"prompt_tokens": list(map(int, p)), "response_tokens": list(map(int, r))}
                            for p, r in zip(prompt_tokens, response_tokens, strict=True)]}
        return InferResponse.model_validate_json(self._request("POST", "/infer", body).content).results

    def train(self, prompt_tokens: Sequence[Sequence[int]], response_tokens: Sequence[Sequence[int]],
              returns: Sequence[Sequence[float]], old_values: Sequence[Sequence[float]],
              settings: TrainSettings = TrainSettings()) -> TrainResponse:
        """One critic update; ``returns``/``old_values`` have one entry per response token."""
        samples = [{"prompt_tokens": list(map(int, p)), "response_tokens": list(map(int, r)),
                    "returns": list(map(float, g)), "old_values": list(map(float, v))}
                   for p, r, g, v in zip(prompt_tokens, response_tokens, returns, old_values, strict=True)]
        body = {"samples": samples, "settings": settings.model_dump()}
        response = self._request("POST", "/train", body, resend_after_drop=False)
        return TrainResponse.model_validate_json(response.content)

    def save(self, url: str, overwrite: bool = False) -> SaveResponse:
        """Commit the critic at ``url`` (must be inside the server's storage root)."""
        body = {"url": url, "overwrite": overwrite}
        return SaveResponse.model_validate_json(self._request("POST", "/save", body).content)

    def health(self) -> HealthResponse:
        return HealthResponse.model_validate_json(self._request("GET", "/health").content)


def tokens_from_inputs(inputs) -> tuple[List[List[int]], List[List[int]]]:
    """Prompt and response token lists of each row of right-padded ``ModelInputs``.

    Row b holds ``P_b`` prompt then ``R_b`` response tokens; ``R_b = response_mask[b].sum()``
    and ``P_b = attention_mask[b].sum() - R_b``.
    """
    ids = inputs.input_ids.cpu().numpy()  # [B, L]
    total = inputs.attention_mask.cpu().numpy().sum(1).astype(np.int64)  # [B]
    r_len = inputs.response_mask.cpu().numpy().sum(1).astype(np.int64)  # [B]
    p_len = total - r_len
    rows = np.split(ids[np.arange(ids.shape[1])[None, :] < total[:, None]], np.cumsum(total)[:-1])  # B × [P+R]
    return ([row[:p].tolist() for row, p in zip(rows, p_len)], [row[p:].tolist() for row, p in zip(rows, p_len)])


class RemoteReward:
    """A reward source scored by the server's reward model, called like the other sources."""

    def __init__(self, client: RewardCriticClient, max_samples_per_request: int = 256, name: str = ""):
        self.client, self.chunk = client, max_samples_per_request
        self.name = name or client.base_url

    def __call__(self, prompts: Sequence[str], responses: Sequence[str], micro_batches: Iterable = ()) -> List[float]:
        """Rewards of the rows of ``micro_batches`` (the texts only fix the sample count)."""
        prompt_tokens, response_tokens = [], []
        for inputs in micro_batches:
            p, r = tokens_from_inputs(inputs)
            prompt_tokens += p
            response_tokens += r
        if len(prompt_tokens) != len(prompts):
            raise RewardError(f"reward server {self.name}: micro-batches hold {len(prompt_tokens)} rows "
                              f"for {len(prompts)} samples")
        return self.score_tokens(prompt_tokens, response_tokens)

    def score_tokens(self, prompt_tokens: Sequence[Sequence[int]],
                     response_tokens: Sequence[Sequence[int]]) -> List[float]:
        """One finite reward per sample, else :class:`RewardError` naming the first bad sample."""
        rewards: List[float] = []
        for start in range(0, len(prompt_tokens), self.chunk):
            results = self.client.infer(prompt_tokens[start:start + self.chunk],
                                        response_tokens[start:start + self.chunk])
            if any(r.reward is None for r in results):
                raise RewardError(f"reward server {self.name} has no reward model loaded")
            rewards += [r.reward for r in results]
        return check_rewards(rewards, f"server {self.name}").astype(float).tolist()


SERVER_TOKEN_ENV = "RLHF_SERVER_TOKEN"
"""Environment variable (a Flyte secret on a cluster) holding the bearer token of the reward/critic
and the rollout server."""


def server_token() -> Optional[str]:
    """The servers' bearer token from :data:`SERVER_TOKEN_ENV`; None if unset or empty."""
    return os.environ.get(SERVER_TOKEN_ENV) or None


def server_client(url: str, timeout_s: float = 60.0):
    """A client of the reward/critic server at ``url`` (token from :data:`SERVER_TOKEN_ENV`)."""
    return RewardCriticClient(url, token=server_token(), timeout_s=timeout_s)

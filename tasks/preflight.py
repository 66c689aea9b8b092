"""Checks a run makes before it spends any accelerator time, each failing with an error that
names what is wrong (the URL, the field, the numbers).

``setup_run`` calls them in this order: storage reachable and writable, then (new runs) the
prompts, the tokenizer against the model's vocabulary, the reward source and the servers;
(resumed runs) the checkpoints ``state.json`` points at. Bad prompts and config values are
checked by :mod:`tasks.prompts` and :mod:`tasks.config`.
"""

from __future__ import annotations

import uuid

from models import storage
from models.checkpoint import CheckpointError, is_committed
from models.rewards import RewardError
from tasks.config import ConfigError, TrainConfig


def check_storage(run_url: str) -> None:
    """Write and remove a small file under the run's folder: an unreachable store or a missing
    permission fails here (``StorageError`` / ``PermissionError`` naming the URL), not after
    models were built."""
    probe = storage.join(run_url, f".write-check-{uuid.uuid4().hex[:8]}")
    storage.write_bytes(probe, b"ok")
    storage.remove(probe)


def model_vocab_size(model_url: str) -> int | None:
    """``vocab_size`` of the checkpoint's ``config.json`` (or of its ``text_config``); None if absent."""
    cfg = storage.read_json(storage.join(model_url, "config.json"))
    return cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")


def model_context(model_url: str) -> int | None:
    """``max_position_embeddings`` of the checkpoint's ``config.json`` (or of its ``text_config``): the
    longest prompt + response it takes; None if absent."""
    cfg = storage.read_json(storage.join(model_url, "config.json"))
    return cfg.get("max_position_embeddings") or (cfg.get("text_config") or {}).get("max_position_embeddings")


def check_vocab(tokenizer, model_url: str, what: str) -> None:
    """The tokenizer's ids must index the model's embedding: ``len(tokenizer) <= vocab_size``
    (a larger embedding, padded for speed, is fine)."""
    vocab = model_vocab_size(model_url)
    if vocab is not None and len(tokenizer) > vocab:
        raise ConfigError(f"{what} {model_url}: the tokenizer has {len(tokenizer)} tokens but the model's "
                          f"embedding has {vocab} rows (config.json vocab_size); token ids >= {vocab} would "
                          f"index past it — use the tokenizer the model was trained with")


def check_reward_functions(cfg: TrainConfig, probe) -> None:
    """Import every reward function in its worker and call it once on the ``probe`` rows (a few
    training prompts, with their data columns) with empty responses (a policy may stop at once, so
    every reward function must take them): a missing function, one that hangs past
    ``reward.timeout_s``, raises, takes a column the data lacks, returns the wrong number of values,
    a string, NaN or inf fails now with a ``RewardError`` naming it."""
    from models.reward_sources import FunctionRewards

    try:
        FunctionRewards.from_config(cfg.reward)(probe.prompts, [""] * len(probe), columns=probe.columns)
    except RewardError as err:
        raise type(err)(f"{err} (set-up check: the reward called on {len(probe)} training prompts with empty "
                        f"responses)") from err


def check_server(url: str, what: str, timeout_s: float, num_tokens: int) -> None:
    """``/health`` of the reward/critic server answers in time with the configured token
    (``ServerError`` naming the URL: unreachable, timed out, 401, 5xx after retries), serves
    the needed model, and that model's vocabulary holds the tokenizer's ``num_tokens`` ids."""
    from tasks.common import server_client

    with server_client(url, timeout_s) as client:
        health = client.health()
    need = {"reward": "reward_model", "critic": "critic"}[what]
    if need not in health.parts:
        raise ConfigError(f"{what} server {url} serves {health.parts}, not a {need}")
    if health.vocab_size < num_tokens:
        raise ConfigError(f"{what} server {url}: its model's vocabulary has {health.vocab_size} tokens, the "
                          f"run's tokenizer {num_tokens}; token ids >= {health.vocab_size} would index past it")


def check_sources(cfg: TrainConfig, probe, num_tokens: int) -> None:
    """The reward source and the remote servers the config names (``probe``: a few training rows,
    a :class:`tasks.prompts.PromptDataset`; ``num_tokens``: the size of the run's tokenizer)."""
    r = cfg.reward
    if r.source == "function":
        check_reward_functions(cfg, probe)
    elif r.source == "remote":
        check_server(r.remote_url, "reward", r.remote_timeout_s, num_tokens)
    if cfg.uses_critic and cfg.critic.remote_url:
        check_server(cfg.critic.remote_url, "critic", r.remote_timeout_s, num_tokens)


def check_resume_point(run_url: str, actor_url: str, critic_url: str) -> None:
    """The checkpoints ``state.json`` names must be committed."""
    for url in (actor_url, critic_url):
        if url and not is_committed(url):
            raise CheckpointError(f"run {run_url}: state.json points at {url}, which is not committed "
                                  f"(no COMMITTED.json); the run's storage was changed by hand or is damaged")

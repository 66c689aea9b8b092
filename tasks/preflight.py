"""Checks a run makes before it spends any accelerator time, each failing with an error that
names what is wrong (the URL, the field, the numbers).

``setup_run`` calls them in this order: storage reachable and writable, then (new runs) the
model folders the config names, the prompts, the tokenizer against the model's vocabulary, the
reward source and the servers; (resumed runs) the checkpoints ``state.json`` points at. Bad prompts and config values are
checked by :mod:`tasks.prompts` and :mod:`tasks.config`.
"""

from __future__ import annotations

import uuid
from typing import Sequence

from models import storage
from models.checkpoint import PICKLE_SUFFIXES, CheckpointError, is_committed
from models.rewards import RewardError, compute_rewards, resolve_reward_fn
from tasks.config import ConfigError, TrainConfig


def check_storage(run_url: str) -> None:
    """Write and remove a small file under the run's folder: an unreachable store or a missing
    permission fails here (``StorageError`` / ``PermissionError`` naming the URL), not after
    models were built."""
    probe = storage.join(run_url, f".write-check-{uuid.uuid4().hex[:8]}")
    storage.write_bytes(probe, b"ok")
    storage.remove(probe)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")
"""Files of which a checkpoint's tokenizer needs at least one."""
_MODEL_CLASS = {"model.actor_path": "AutoModelForCausalLM", "model.critic_path": "AutoModelForTokenClassification",
                "reward.model_path": "AutoModelForSequenceClassification"}


def check_model_dir(url: str, field: str, needs_tokenizer: bool = False) -> None:
    """The Hugging Face checkpoint folder ``url`` that config ``field`` names: it exists, has a
    ``config.json``, safetensors weights (pickled ones are refused, with the conversion), and with
    ``needs_tokenizer`` a tokenizer. Checked before anything reads it, so the error names the cause
    instead of the Hub's repo-id rules or a tokenizer converter's hint."""
    if not storage.exists(url):
        raise ConfigError(f"{field}={url}: no such folder. Give a local folder or an fsspec URL (s3://...) holding a "
                          f"Hugging Face checkpoint; Hub repo ids are not downloaded, so fetch one first, e.g. "
                          f"`huggingface-cli download <repo> --local-dir <folder>`")
    names = {rel for rel in storage.list_files(url) if "/" not in rel}
    weights = sorted(n for n in names if n.endswith(".safetensors"))
    pickled = sorted(n for n in names if n.lower().endswith(PICKLE_SUFFIXES))
    if pickled and not weights:
        cls = _MODEL_CLASS.get(field, "AutoModel")
        raise ConfigError(f"{field}={url} holds pickled weights ({', '.join(pickled)}) and no .safetensors: pickle "
                          f"files can run code when loaded, so they are refused. Convert them once, on a machine "
                          f"where you trust the file: python -c \"from transformers import {cls}; {cls}."
                          f"from_pretrained('{url}').save_pretrained('<out>', safe_serialization=True)\", copy the "
                          f"tokenizer files into <out> and set {field}=<out>")
    if "config.json" not in names:
        raise ConfigError(f"{field}={url} is not a Hugging Face checkpoint: no config.json (it holds "
                          f"{sorted(names) or 'no files'})")
    if not weights:
        raise ConfigError(f"{field}={url} holds no weights (*.safetensors)")
    if needs_tokenizer and not names & set(TOKENIZER_FILES):
        raise ConfigError(f"{field}={url} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): save the "
                          f"tokenizer the model was trained with into it (tokenizer.save_pretrained)")


def check_model_dirs(cfg: TrainConfig) -> None:
    """Every user checkpoint folder the config names (the actor's with its tokenizer)."""
    m = cfg.model
    if m.actor_path:
        check_model_dir(m.actor_path, "model.actor_path", needs_tokenizer=True)
    if m.critic_path and cfg.uses_critic:
        check_model_dir(m.critic_path, "model.critic_path")
    if cfg.reward.source == "model":
        check_model_dir(cfg.reward.model_path, "reward.model_path")


def model_vocab_size(model_url: str) -> int | None:
    """``vocab_size`` of the checkpoint's ``config.json`` (or of its ``text_config``); None if absent."""
    cfg = storage.read_json(storage.join(model_url, "config.json"))
    return cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")


def check_vocab(tokenizer, model_url: str, what: str) -> None:
    """The tokenizer's ids must index the model's embedding: ``len(tokenizer) <= vocab_size``
    (a larger embedding, padded for speed, is fine)."""
    vocab = model_vocab_size(model_url)
    if vocab is not None and len(tokenizer) > vocab:
        raise ConfigError(f"{what} {model_url}: the tokenizer has {len(tokenizer)} tokens but the model's "
                          f"embedding has {vocab} rows (config.json vocab_size); token ids >= {vocab} would "
                          f"index past it — use the tokenizer the model was trained with")


def check_reward_function(spec: str, prompts: Sequence[str]) -> None:
    """Import ``module:function`` and call it once on ``prompts`` with empty responses (a policy
    may stop at once, so every reward function must take them): a missing function, one that
    raises, returns the wrong number of values, NaN or inf fails now with a ``RewardError``."""
    fn = resolve_reward_fn(spec)
    try:
        compute_rewards(fn, list(prompts), [""] * len(prompts), spec=spec)
    except RewardError as err:
        raise RewardError(f"{err} (set-up check: the function called on {len(prompts)} training prompts "
                          f"with empty responses)") from err


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


def check_sources(cfg: TrainConfig, prompts: Sequence[str], num_tokens: int) -> None:
    """The reward source and the remote servers the config names (``num_tokens``: the size of
    the run's tokenizer)."""
    r = cfg.reward
    if r.source == "function":
        check_reward_function(r.function, prompts)
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

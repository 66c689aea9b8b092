"""The reward/critic server (``python -m models.hosts serve``; NeMo-Aligner's critic server with the reward model
co-located), a host of the service layer. Its ops: ``infer(samples)``, per sample (token ids) the critic's values
``[R]`` (read at ``P+t-1``, as :class:`models.training.policy.CriticValues`) and the reward model's score,
concurrent calls batched together (:class:`Batcher`); ``values(batch)``, the critic's values of a RolloutBatch
inside the storage root (``critic.remote_url``'s path, :func:`models.stages.score.service_values`);
``train(batch, settings)``, one clipped value-regression update on its ``returns``, AdamW's state kept across
calls, non-finite steps skipped and counted, an update without a finite step refused (422) with nothing changed;
``save(url)``, the critic committed inside the storage root; ``health()``.

One lock serialises every use of the models; rows are built by :func:`models.data.batch_tensors.model_inputs`, as
the stages build them. Statuses: 413 over a size limit, 422 a malformed request or a token id outside the
vocabulary, 409 a part not loaded or a checkpoint already committed (and the layer's own: 401, 403, 404, 411).
"""

from __future__ import annotations

import inspect
import itertools
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa
import torch
from torch import nn

from models.checkpoint import download_checkpoint, save_model_checkpoint
from models.data.batch import RolloutBatch
from models.data.batch_tensors import model_inputs, padded_tensors
from models.service.ops import Host, op
from models.training.distributed import DistInfo, wrap_for_training
from models.training.policy import CriticValues, inputs_to, reward_model_scores, with_packing
from models.training.update import (LoopSettings, NonFiniteUpdate, UpdateData, critic_loss_fn, disable_dropout,
                                    make_optimizer, run_update)

_DTYPES = ("float32", "bfloat16", "float16")


class InvalidRequest(ValueError):
    """The request cannot be served as given (HTTP 422): bad token ids, lengths, values."""


class TooLarge(ValueError):
    """A request over one of the size limits (HTTP 413)."""


class NotLoaded(LookupError):
    """The request needs a part this server did not load (HTTP 409)."""


class AlreadyCommitted(FileExistsError):
    """A committed checkpoint exists at the save URL and ``overwrite`` is false (HTTP 409)."""


STATUSES = {InvalidRequest: 422, TooLarge: 413, NotLoaded: 409, AlreadyCommitted: 409}


def check_token_ids(lists: Sequence[Sequence[int]], vocab_size: int, name: str, row: str = "sample") -> None:
    """:class:`InvalidRequest` naming the first ``{row} i`` of ``lists`` that is not a list of token ids in
    ``[0, vocab_size)`` (an embedding lookup would fail or read another row's memory)."""
    for i, ids in enumerate(lists):
        if not isinstance(ids, list) or not all(type(t) is int for t in ids):
            raise InvalidRequest(f"{row} {i}: {name} must be a list of token ids (integers)")
    lengths = np.fromiter(map(len, lists), np.int64, len(lists))  # [B]
    try:
        flat = np.fromiter(itertools.chain.from_iterable(lists), np.int64, int(lengths.sum()))  # [N]
    except OverflowError as err:
        raise InvalidRequest(f"{name}: a token id does not fit in int64: {err}") from err
    bad = np.flatnonzero((flat < 0) | (flat >= vocab_size))
    if bad.size:
        i = int(np.searchsorted(np.cumsum(lengths), bad[0], side="right"))
        raise InvalidRequest(f"{row} {i}: token id {int(flat[bad[0]])} in {name} is outside the "
                             f"vocabulary [0, {vocab_size})")


def check_limits(n_samples: int, token_counts, max_samples: int, max_tokens: int, label: str = "sample {i}") -> None:
    """:class:`TooLarge` for more than ``max_samples`` samples, or an entry of ``token_counts`` over ``max_tokens``."""
    if n_samples > max_samples:
        raise TooLarge(f"request has {n_samples} samples; this server accepts at most {max_samples} per request "
                       f"(--max-samples)")
    for i, n in enumerate(token_counts):
        if n > max_tokens:
            raise TooLarge(f"{label.format(i=i)} has {n} tokens; this server accepts at most {max_tokens} per "
                           f"sample (--max-tokens)")


@dataclass(frozen=True)
class ServiceConfig:
    """What the server loads, how it trains, and what one request may hold."""

    critic_url: str = ""
    """Committed critic checkpoint (token classification, 1 label); empty: no critic."""
    reward_model_url: str = ""
    """Committed reward model (sequence classification, 1 label); empty: no reward model."""
    lr: float = 5e-5
    """AdamW's learning rate (and ``weight_decay``) for the critic; the optimiser lives as long as the server."""
    weight_decay: float = 0.0
    device: str = "cpu"
    dtype: str = "float32"
    """Compute dtype: the reward model is held in it; the critic trains float32 master weights (and saves them)
    and computes in it under ``torch.autocast``."""
    infer_micro_batch_size: int = 64
    """Rows per forward (a larger batch runs in slices)."""
    pack_sequences: bool = True
    """The critic's forwards run rows packed end to end (``model.pack_sequences`` of training)."""
    max_batch_size: int = 64
    max_delay_ms: float = 10.0
    """Most samples in one model batch of concurrent ``infer`` calls, longest wait for more after the first."""
    max_samples: int = 1024
    max_tokens: int = 8192
    """Most samples per request, most prompt + response tokens per sample (413 above)."""

    def __post_init__(self) -> None:
        if not (self.critic_url or self.reward_model_url):
            raise ValueError("ServiceConfig needs critic_url, reward_model_url or both")
        if self.lr <= 0 or self.weight_decay < 0:
            raise ValueError(f"need lr > 0 and weight_decay >= 0, got {self.lr}, {self.weight_decay}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if min(self.infer_micro_batch_size, self.max_batch_size, self.max_samples, self.max_tokens) < 1 \
                or self.max_delay_ms < 0:
            raise ValueError("need infer_micro_batch_size, max_batch_size, max_samples, max_tokens >= 1 and "
                             "max_delay_ms >= 0")


def load_part(url: str, auto_cls, dtype: str) -> Tuple[nn.Module, Optional[object]]:
    """``(model, tokenizer or None)`` from the committed checkpoint at ``url`` (verified; a remote one through the
    node's checkpoint cache); one label required."""
    from transformers import AutoTokenizer

    path = download_checkpoint(url)
    model = auto_cls.from_pretrained(path, dtype=getattr(torch, dtype), use_safetensors=True)
    has_tok = any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
    if model.config.num_labels != 1:
        raise ValueError(f"{url}: expected a head with 1 label, got {model.config.num_labels}")
    return model.eval(), AutoTokenizer.from_pretrained(path) if has_tok else None


def token_table(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], **floats) -> pa.Table:
    """A RolloutBatch-shaped table: token lists as list<int32>, extra float lists as list<float32>."""
    cols = {"prompt_tokens": pa.array(prompts, pa.list_(pa.int32())),
            "response_tokens": pa.array(responses, pa.list_(pa.int32()))}
    cols.update({k: pa.array(v, pa.list_(pa.float32())) for k, v in floats.items()})
    return pa.table(cols)


class Batcher:
    """``submit(items)`` from concurrent threads → ``run_batch``'s results for exactly those items. A worker takes
    the first waiting call, then more until the batch holds ``max_batch_size`` items or ``max_delay_s`` passed
    since that first call; a call is never split (one that would overflow waits for the next batch, one larger
    than ``max_batch_size`` runs alone). A failing batch fails its calls only."""

    def __init__(self, run_batch: Callable[[List[Any]], List[Any]], max_batch_size: int, max_delay_s: float):
        if max_batch_size < 1 or max_delay_s < 0:
            raise ValueError(f"need max_batch_size >= 1 and max_delay_s >= 0, got {max_batch_size}, {max_delay_s}")
        self.run_batch, self.max_batch_size, self.max_delay_s = run_batch, max_batch_size, max_delay_s
        self.stats = {"requests": 0, "samples": 0, "batches": 0, "largest_batch": 0}
        self._queue: "queue.Queue[Tuple[List[Any], Future]]" = queue.Queue()
        threading.Thread(target=self._run, daemon=True, name="batcher").start()

    def submit(self, items: Sequence[Any]) -> List[Any]:
        future: Future = Future()
        self._queue.put((list(items), future))
        return future.result()

    def _collect(self, first):
        deadline = time.monotonic() + self.max_delay_s
        batch, size = [first], len(first[0])
        while size < self.max_batch_size:
            try:
                remaining = deadline - time.monotonic()
                nxt = self._queue.get(timeout=remaining) if remaining > 0 else self._queue.get_nowait()
            except queue.Empty:
                return batch, None
            if size + len(nxt[0]) > self.max_batch_size:
                return batch, nxt
            batch.append(nxt)
            size += len(nxt[0])
        return batch, None

    def _run(self) -> None:
        carry = None
        while True:
            batch, carry = self._collect(carry or self._queue.get())
            flat = [item for items, _ in batch for item in items]
            s = self.stats
            s.update(requests=s["requests"] + len(batch), samples=s["samples"] + len(flat), batches=s["batches"] + 1,
                     largest_batch=max(s["largest_batch"], len(flat)))
            try:
                results = self.run_batch(flat)
                if len(results) != len(flat):
                    raise RuntimeError(f"batch function returned {len(results)} results for {len(flat)} items")
            except Exception as err:  # noqa: BLE001 - handed to every waiting call
                for _, future in batch:
                    future.set_exception(err)
                continue
            start = 0
            for items, future in batch:
                future.set_result(results[start:start + len(items)])
                start += len(items)


class RewardCriticHost(Host):
    """A critic and/or a reward model behind the ops of the module docstring (thread-safe)."""

    label = "reward server"
    statuses = STATUSES

    def __init__(self, config: ServiceConfig, critic: Optional[nn.Module] = None,
                 reward_model: Optional[nn.Module] = None, tokenizer=None):
        if critic is None and reward_model is None:
            raise ValueError("RewardCriticHost needs a critic, a reward model or both")
        self.config, self.device = config, torch.device(config.device)
        self._info = DistInfo(0, 1, 0, self.device)
        self.critic = None if critic is None else wrap_for_training(  # on the device, computing in config.dtype
            with_packing(CriticValues(disable_dropout(critic)), config.pack_sequences), self._info,
            compute_dtype=getattr(torch, config.dtype)).eval()
        self.reward_model = reward_model.to(self.device).eval() if reward_model is not None else None
        self.tokenizer = tokenizer
        models = [m for m in (critic, reward_model) if m is not None]
        self.vocab_size = min(int(m.config.vocab_size) for m in models)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = int(pad if pad is not None else (models[0].config.pad_token_id or 0))
        self.optimizer = make_optimizer(self.critic, config.lr, config.weight_decay) if self.critic else None
        self.train_calls = self.optimizer_steps = 0
        self.lock = threading.Lock()
        """Held by every use of the models: infer batches, train and save never overlap."""
        self.batcher = Batcher(lambda pairs: self.values_and_rewards(*zip(*pairs)) if pairs else [],
                               config.max_batch_size, config.max_delay_ms / 1000.0)

    @classmethod
    def load(cls, config: ServiceConfig) -> "RewardCriticHost":
        """Load the configured checkpoints (any fsspec URL, verified against their markers)."""
        from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

        critic = reward_model = tokenizer = None
        if config.reward_model_url:
            reward_model, tokenizer = load_part(config.reward_model_url, AutoModelForSequenceClassification,
                                                config.dtype)
        if config.critic_url:  # the critic's tokenizer is the one saved with it
            critic, tokenizer = load_part(config.critic_url, AutoModelForTokenClassification, "float32")
        return cls(config, critic, reward_model, tokenizer)

    @property
    def parts(self) -> List[str]:
        return [name for name, m in (("critic", self.critic), ("reward_model", self.reward_model)) if m is not None]

    def check_samples(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> None:
        """:class:`TooLarge` over the limits; :class:`InvalidRequest` naming the first sample with an empty prompt
        or a token id outside ``[0, vocab_size)``."""
        if len(prompts) == 0 or len(prompts) != len(responses):
            raise InvalidRequest(f"need >= 1 sample and as many prompts as responses, got "
                                 f"{len(prompts)} and {len(responses)}")
        for name, lists in (("prompt_tokens", prompts), ("response_tokens", responses)):
            check_token_ids(lists, self.vocab_size, name)
        check_limits(len(prompts), (len(p) + len(r) for p, r in zip(prompts, responses)), self.config.max_samples,
                     self.config.max_tokens)
        empty = next((i for i, p in enumerate(prompts) if not p), None)
        if empty is not None:
            raise InvalidRequest(f"sample {empty} has an empty prompt_tokens (the first response token is "
                                 f"predicted from the last prompt token)")

    @torch.no_grad()
    def values_and_rewards(self, prompts, responses) -> List[Dict[str, Any]]:
        """Per sample ``values`` [R_b] (critic) and ``reward`` (reward model); None for a part not loaded."""
        out: List[Dict[str, Any]] = []
        step = self.config.infer_micro_batch_size
        with self.lock:
            for start in range(0, len(prompts), step):
                mb_p, mb_r = prompts[start:start + step], responses[start:start + step]
                inputs = inputs_to(model_inputs(token_table(mb_p, mb_r), self.pad_id), self.device)
                values = self.critic(inputs).cpu().numpy() if self.critic else None  # [b, T]
                rewards = reward_model_scores(self.reward_model, inputs).cpu().numpy() \
                    if self.reward_model is not None else None  # [b]
                out += [{"values": None if values is None else values[i, :len(resp)].tolist(),
                         "reward": None if rewards is None else float(rewards[i])} for i, resp in enumerate(mb_r)]
        return out

    @op
    def infer(self, samples: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        if not isinstance(samples, list) or not all(isinstance(s, dict) for s in samples):
            raise InvalidRequest("samples must be a list of {prompt_tokens, response_tokens}")
        prompts = [s.get("prompt_tokens") for s in samples]
        responses = [s.get("response_tokens") for s in samples]
        self.check_samples(prompts, responses)  # one bad request must not fail a whole batch
        return self.batcher.submit(list(zip(prompts, responses)))

    @op
    def values(self, batch: str, iteration: int = -1) -> List[float]:
        """The critic's values of ``batch``, flat in response order (``iteration``: a run's service checks it;
        a server someone else started holds no iteration)."""
        if self.critic is None:
            raise NotLoaded("this server has no critic loaded (start it with --critic)")
        table = RolloutBatch.open(batch).table
        prompts, responses = (table.column(c).to_pylist() for c in ("prompt_tokens", "response_tokens"))
        self.check_samples(prompts, responses)
        return [v for result in self.values_and_rewards(prompts, responses) for v in result["values"]]

    @op
    def train(self, batch: str, settings: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """One critic update on the batch's ``returns`` (``values``: the critic's at rollout time); ``settings``:
        :meth:`train_on`'s."""
        table = RolloutBatch.open(batch).table
        columns = [table.column(c).to_pylist() for c in ("prompt_tokens", "response_tokens", "returns", "values")]
        try:
            inspect.signature(self.train_on).bind(*columns, **(settings or {}))
        except TypeError as err:
            raise InvalidRequest(f"settings: {err}") from err
        stats = self.train_on(*columns, **(settings or {}))
        return {"stats": stats, "train_calls": self.train_calls, "optimizer_steps": self.optimizer_steps}

    def train_on(self, prompts, responses, returns, old_values, epochs: int = 1, minibatch_size: int = 16,
                 micro_batch_size: int = 8, grad_clip: float = 1.0, value_clip: float = 0.2,
                 seed: Optional[int] = None) -> Dict[str, float]:
        """One critic update on these samples (the value clipped around ``old_values``, 0: no clip; ``seed`` of the
        shuffling, None: the train-call count); statistics averaged over its optimiser steps."""
        if not (1 <= epochs <= 100 and minibatch_size >= 1 and micro_batch_size >= 1 and grad_clip > 0
                and value_clip >= 0):
            raise InvalidRequest("settings: need 1 <= epochs <= 100, minibatch_size and micro_batch_size >= 1, "
                                 "grad_clip > 0 and value_clip >= 0")
        if self.critic is None:
            raise NotLoaded("this server has no critic loaded (start it with --critic) and cannot train")
        self.check_samples(prompts, responses)
        for name, lists in (("returns", returns), ("old_values", old_values)):
            if len(lists) != len(responses):
                raise InvalidRequest(f"{name} has {len(lists)} rows for {len(responses)} samples")
            for i, (vals, resp) in enumerate(zip(lists, responses)):
                if len(vals) != len(resp):
                    raise InvalidRequest(f"sample {i}: {name} has {len(vals)} entries for {len(resp)} response tokens")
            if not np.isfinite(np.fromiter(itertools.chain.from_iterable(lists), np.float64)).all():
                raise InvalidRequest(f"{name} holds a non-finite value")
        if not any(map(len, responses)):
            raise InvalidRequest("every response is empty: nothing to train on")
        table = token_table(prompts, responses, values=old_values, returns=returns)
        inputs = model_inputs(table, self.pad_id)
        padded = padded_tensors(table, ["values", "returns"])  # [B, T] each, right-padded
        data = UpdateData(inputs.input_ids, inputs.attention_mask, inputs.response_positions, inputs.response_mask,
                          old_values=padded["values"].float(), returns=padded["returns"].float())
        loop = LoopSettings(epochs, minibatch_size, micro_batch_size, grad_clip,
                            seed if seed is not None else self.train_calls)
        with self.lock:
            try:
                stats = run_update(self.critic, self.optimizer, data, critic_loss_fn(value_clip or None), loop,
                                   self._info)
            except NonFiniteUpdate as err:  # the critic and its optimiser are as before the call
                raise InvalidRequest(f"train: {err}") from err
            finally:
                self.critic.eval()
            self.train_calls += 1
            self.optimizer_steps += int(stats["steps"])
        return stats

    @op
    def save(self, url: str, overwrite: bool = False) -> Dict[str, Any]:
        """Commit the critic and tokenizer at ``url`` (inside the storage root: the layer refuses another)."""
        if self.critic is None:
            raise NotLoaded("this server has no critic loaded; there is nothing to save")
        with self.lock:
            try:
                marker = save_model_checkpoint(self.critic.critic, self.tokenizer, url, overwrite=overwrite)
            except FileExistsError as err:
                raise AlreadyCommitted(f"{err}; send overwrite=true to replace it") from err
        return {"url": url, "files": sorted(marker["files"]), "train_calls": self.train_calls}

    @op
    def health(self) -> Dict[str, Any]:
        c = self.config
        return {"status": "ok", "parts": self.parts, "critic": c.critic_url or None,
                "reward_model": c.reward_model_url or None, "vocab_size": self.vocab_size, "device": str(self.device),
                "train_calls": self.train_calls, "optimizer_steps": self.optimizer_steps,
                **{f"infer_{k}" if k != "largest_batch" else k: v for k, v in self.batcher.stats.items()}}

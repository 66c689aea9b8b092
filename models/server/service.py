"""The model side of the reward/critic server, usable without HTTP (NeMo-Aligner's critic
server: infer / train / save, with the reward model co-located).

- ``infer``: per sample the critic's values ``[R]`` (read at position ``P+t-1``, as
  :class:`models.training.policy.CriticValues`) and the reward model's sequence score
  (:func:`models.training.policy.reward_model_scores`);
- ``train``: one clipped value-regression update (:func:`models.training.update.run_update` with
  :func:`models.training.update.critic_loss_fn`), AdamW state kept across calls; non-finite steps are
  skipped and counted (``nonfinite_steps``), and an update with no finite step is refused (422)
  with the critic and its optimiser unchanged;
- ``save``: commit the critic (+ tokenizer) as a checkpoint inside the storage root.

One lock serialises every use of the models, so a train or save never overlaps an infer
batch. Rows are built by :func:`models.data.batch_tensors.model_inputs` (right-padded
``prompt ++ response``), the same function the ``score`` and update tasks use.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import tempfile
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa
import torch
from torch import nn

from models import storage
from models.checkpoint import download_checkpoint, save_model_checkpoint
from models.training.distributed import DistInfo, wrap_for_training
from models.training.policy import CriticValues, inputs_to, reward_model_scores, with_packing
from models.server.paths import check_save_url
from models.server.schemas import InferResult, TrainSettings
from models.training.update import (LoopSettings, NonFiniteUpdate, UpdateData, critic_loss_fn, disable_dropout, make_optimizer,
                           run_update)
from models.data.batch_tensors import ModelInputs, model_inputs, padded_tensors

_DTYPES = ("float32", "bfloat16", "float16")


class InvalidRequest(ValueError):
    """The request cannot be served as given (HTTP 422): bad token ids, lengths, values."""


class NotLoaded(LookupError):
    """The request needs a part (critic) this server did not load (HTTP 409)."""


class AlreadyCommitted(FileExistsError):
    """A committed checkpoint exists at the save URL and ``overwrite`` is false (HTTP 409)."""


def check_token_ids(lists: Sequence[Sequence[int]], vocab_size: int, name: str, row: str = "sample") -> None:
    """:class:`InvalidRequest` naming the first ``{row} i`` of ``lists`` with a token id outside
    ``[0, vocab_size)`` (an embedding lookup would fail or read another row's memory)."""
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


@dataclass(frozen=True)
class ServiceConfig:
    """What the service loads and how it trains."""

    critic_url: str = ""
    """Committed critic checkpoint (token classification, 1 label); empty: no critic."""
    reward_model_url: str = ""
    """Committed reward model (sequence classification, 1 label); empty: no reward model."""
    storage_root: str = ""
    """fsspec URL under which ``save`` may write; empty: saving refused."""
    lr: float = 5e-5
    """AdamW learning rate of the critic (the optimiser lives as long as the server)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    device: str = "cpu"
    """Torch device of both models."""
    dtype: str = "float32"
    """Compute dtype: float32, bfloat16 or float16. The reward model is held in it; the critic trains
    float32 master weights (and saves them) and computes in it under ``torch.autocast``."""
    infer_micro_batch_size: int = 64
    """Rows per forward during ``infer`` (a larger batch runs in slices)."""
    pack_sequences: bool = True
    """The critic's forwards run rows packed end to end instead of padded (``model.pack_sequences``
    of training, :mod:`models.training.packing`), when its model keeps packed rows apart."""

    def __post_init__(self) -> None:
        if not (self.critic_url or self.reward_model_url):
            raise ValueError("ServiceConfig needs critic_url, reward_model_url or both")
        if self.lr <= 0 or self.weight_decay < 0:
            raise ValueError(f"need lr > 0 and weight_decay >= 0, got {self.lr}, {self.weight_decay}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.infer_micro_batch_size < 1:
            raise ValueError(f"infer_micro_batch_size must be >= 1, got {self.infer_micro_batch_size}")


def load_part(url: str, auto_cls, dtype: str) -> Tuple[nn.Module, Optional[object]]:
    """``(model, tokenizer or None)`` from the committed checkpoint at ``url``; one label required."""
    from transformers import AutoTokenizer

    with contextlib.ExitStack() as stack:
        tmp = None if storage.is_local(url) else stack.enter_context(tempfile.TemporaryDirectory(prefix="ckpt-"))
        path = download_checkpoint(url, tmp)
        model = auto_cls.from_pretrained(path, dtype=getattr(torch, dtype), use_safetensors=True)
        has_tok = any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
        tokenizer = AutoTokenizer.from_pretrained(path) if has_tok else None
    if model.config.num_labels != 1:
        raise ValueError(f"{url}: expected a head with 1 label, got {model.config.num_labels}")
    return model.eval(), tokenizer


def token_table(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], **floats) -> pa.Table:
    """A RolloutBatch-shaped table: token lists as list<int32>, extra float lists as list<float32>."""
    cols = {"prompt_tokens": pa.array(prompts, pa.list_(pa.int32())),
            "response_tokens": pa.array(responses, pa.list_(pa.int32()))}
    cols.update({k: pa.array(v, pa.list_(pa.float32())) for k, v in floats.items()})
    return pa.table(cols)


class RewardCriticService:
    """A critic and/or a reward model behind ``infer`` / ``train`` / ``save`` (thread-safe)."""

    def __init__(self, config: ServiceConfig, critic: Optional[nn.Module] = None,
                 reward_model: Optional[nn.Module] = None, tokenizer=None):
        if critic is None and reward_model is None:
            raise ValueError("RewardCriticService needs a critic, a reward model or both")
        self.config = config
        self.device = torch.device(config.device)
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
        self.train_calls = 0
        self.optimizer_steps = 0
        self.lock = threading.Lock()
        """Held by every use of the models: infer batches, train and save never overlap."""

    @classmethod
    def load(cls, config: ServiceConfig) -> "RewardCriticService":
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
        """:class:`InvalidRequest` naming the first sample with an empty prompt or a token id
        outside ``[0, vocab_size)``."""
        if len(prompts) == 0 or len(prompts) != len(responses):
            raise InvalidRequest(f"need >= 1 sample and as many prompts as responses, got "
                                 f"{len(prompts)} and {len(responses)}")
        empty = np.flatnonzero(np.fromiter(map(len, prompts), np.int64, len(prompts)) == 0)
        if empty.size:
            raise InvalidRequest(f"sample {int(empty[0])} has an empty prompt_tokens (the first response "
                                 f"token is predicted from the last prompt token)")
        for name, lists in (("prompt_tokens", prompts), ("response_tokens", responses)):
            check_token_ids(lists, self.vocab_size, name)

    def _inputs(self, prompts, responses) -> ModelInputs:
        return inputs_to(model_inputs(token_table(prompts, responses), self.pad_id), self.device)

    @torch.no_grad()
    def infer(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> List[InferResult]:
        """One result per sample: ``values`` [R_b] (critic) and ``reward`` (reward model)."""
        self.check_samples(prompts, responses)
        out: List[InferResult] = []
        step = self.config.infer_micro_batch_size
        with self.lock:
            for start in range(0, len(prompts), step):
                mb_p, mb_r = prompts[start:start + step], responses[start:start + step]
                inputs = self._inputs(mb_p, mb_r)
                values = self.critic(inputs).cpu().numpy() if self.critic else None  # [b, T]
                rewards = reward_model_scores(self.reward_model, inputs).cpu().numpy() \
                    if self.reward_model is not None else None  # [b]
                for i, resp in enumerate(mb_r):
                    out.append(InferResult(values=None if values is None else values[i, :len(resp)].tolist(),
                                           reward=None if rewards is None else float(rewards[i])))
        return out

    def train(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
              returns: Sequence[Sequence[float]], old_values: Sequence[Sequence[float]],
              settings: TrainSettings = TrainSettings()) -> Dict[str, float]:
        """One critic update on these samples; statistics averaged over its optimiser steps."""
        if self.critic is None:
            raise NotLoaded("this server has no critic loaded (start it with --critic) and cannot train")
        self.check_samples(prompts, responses)
        for name, lists in (("returns", returns), ("old_values", old_values)):
            if len(lists) != len(responses):
                raise InvalidRequest(f"{name} has {len(lists)} rows for {len(responses)} samples")
            for i, (vals, resp) in enumerate(zip(lists, responses)):
                if len(vals) != len(resp):
                    raise InvalidRequest(f"sample {i}: {name} has {len(vals)} entries for "
                                         f"{len(resp)} response tokens")
            if not np.isfinite(np.fromiter(itertools.chain.from_iterable(lists), np.float64)).all():
                raise InvalidRequest(f"{name} holds a non-finite value")
        if not any(map(len, responses)):
            raise InvalidRequest("every response is empty: nothing to train on")
        table = token_table(prompts, responses, values=old_values, returns=returns)
        inputs = model_inputs(table, self.pad_id)
        padded = padded_tensors(table, ["values", "returns"])  # [B, T] each, right-padded
        data = UpdateData(inputs.input_ids, inputs.attention_mask, inputs.response_positions,
                          inputs.response_mask, old_values=padded["values"].float(),
                          returns=padded["returns"].float())
        seed = settings.seed if settings.seed is not None else self.train_calls
        loop = LoopSettings(settings.epochs, settings.minibatch_size, settings.micro_batch_size,
                            settings.grad_clip, seed)
        with self.lock:
            try:
                stats = run_update(self.critic, self.optimizer, data, critic_loss_fn(settings.value_clip or None),
                                   loop, self._info)
            except NonFiniteUpdate as err:  # the critic and its optimiser are as before the call
                raise InvalidRequest(f"train: {err}") from err
            finally:
                self.critic.eval()
            self.train_calls += 1
            self.optimizer_steps += int(stats["steps"])
        return stats

    def save(self, url: str, overwrite: bool = False) -> Tuple[str, List[str]]:
        """Commit the critic and tokenizer at ``url`` (inside the storage root); ``(url, files)``."""
        target = check_save_url(url, self.config.storage_root)
        if self.critic is None:
            raise NotLoaded("this server has no critic loaded; there is nothing to save")
        with self.lock:
            try:
                marker = save_model_checkpoint(self.critic.critic, self.tokenizer, target, overwrite=overwrite)
            except FileExistsError as err:
                raise AlreadyCommitted(f"{err}; send overwrite=true to replace it") from err
        return target, sorted(marker["files"])

"""Log-probabilities and entropy of the chosen tokens, with temperature.

    log p(y_t) = z_{t,y_t} − logsumexp_v z_{t,v},    H_t = −Σ_v p_{t,v} log p_{t,v},
    z = logits / τ

Position t of ``token_ids`` is the token produced from position t of ``logits`` (shift
them before calling). Results are float32 (float64 for float64 inputs) whatever the
input dtype; ``token_ids`` must lie in ``[0, V)`` everywhere, padding included.

Fast paths never hold a ``[B, T, V]`` float32 tensor (peak extra memory O(B·T + block)):

- from logits: :mod:`kernels.logprobs_chunked` (torch, any device) or, on CUDA,
  :mod:`kernels.logprobs_triton` (one program per row, online softmax over the vocab);
- from hidden states and the output projection: :mod:`kernels.logprobs_hidden`, which
  never materialises the logits at all.

Each has a ``*_reference`` twin here: ``log_softmax`` + ``gather`` on the full logits.
"""

from __future__ import annotations

from enum import Enum
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from kernels.logprobs_chunked import (
    LOGITS_BLOCK_ELEMS,
    LOGITS_BLOCK_ELEMS_CUDA,
    LOGITS_MAX_CHUNK_VOCAB,
    LogitsFn,
)
from kernels.logprobs_hidden import HIDDEN_BLOCK_ELEMS, HIDDEN_BLOCK_ELEMS_CUDA, HIDDEN_CHUNK_VOCAB, HiddenFn
from kernels.masked import compute_dtype

__all__ = [
    "LogprobBackend",
    "TokenLogprobs",
    "token_logprobs",
    "token_logprobs_and_entropy",
    "token_logprobs_from_hidden",
    "token_logprobs_and_entropy_from_hidden",
    "token_logprobs_reference",
    "token_logprobs_and_entropy_reference",
    "token_logprobs_and_entropy_from_hidden_reference",
]


class TokenLogprobs(NamedTuple):
    logp: Tensor  # [B, T]
    entropy: Tensor  # [B, T]


class LogprobBackend(str, Enum):
    """Implementation of the logits path: ``auto`` is Triton on CUDA (if importable), else torch."""

    AUTO = "auto"
    TORCH = "torch"
    TRITON = "triton"


def _torch_backend(logits, ids, temperature, with_entropy, chunk_tokens, chunk_vocab):
    V = logits.shape[-1]
    cv = chunk_vocab or (V if V <= LOGITS_MAX_CHUNK_VOCAB else LOGITS_MAX_CHUNK_VOCAB // 4)
    budget = LOGITS_BLOCK_ELEMS_CUDA if logits.is_cuda else LOGITS_BLOCK_ELEMS
    ct = chunk_tokens or max(1, budget // cv)
    return LogitsFn.apply(logits, ids, temperature, with_entropy, ct, cv)


def _triton_backend(logits, ids, temperature, with_entropy, chunk_tokens, chunk_vocab):
    from kernels.logprobs_triton import triton_token_logprobs

    return triton_token_logprobs(logits, ids, temperature, with_entropy)


_BACKENDS: dict[LogprobBackend, Callable[..., tuple[Tensor, Tensor]]] = {
    LogprobBackend.TORCH: _torch_backend,
    LogprobBackend.TRITON: _triton_backend,
}


def _resolve(backend: LogprobBackend | str, logits: Tensor) -> LogprobBackend:
    backend = LogprobBackend(backend)
    if backend is not LogprobBackend.AUTO:
        return backend
    if logits.is_cuda:
        try:
            import triton  # noqa: F401
        except ImportError:
            return LogprobBackend.TORCH
        return LogprobBackend.TRITON
    return LogprobBackend.TORCH


def _check(x: Tensor, ids: Tensor, temperature: float, what: str) -> None:
    if x.dim() != 3 or ids.shape != x.shape[:2]:
        raise ValueError(f"{what} must be [B, T, *] and token_ids [B, T], got {tuple(x.shape)}, {tuple(ids.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def token_logprobs_and_entropy(
    logits: Tensor,
    token_ids: Tensor,
    temperature: float = 1.0,
    *,
    chunk_tokens: int | None = None,
    chunk_vocab: int | None = None,
    backend: LogprobBackend | str = LogprobBackend.AUTO,
) -> TokenLogprobs:
    """Log-prob of ``token_ids`` and the entropy of each position, differentiable in ``logits``.

    Shape: logits ``[B, T, V]`` (any float dtype; the last dim contiguous for Triton),
    token_ids ``[B, T]`` int; returns two ``[B, T]`` float32 tensors.
    ``chunk_tokens`` / ``chunk_vocab`` set the block of the torch backend (default: whole
    rows up to V=131072, about 1 MiB of float32 per temporary on CPU, 32 MiB on CUDA).
    """
    _check(logits, token_ids, temperature, "logits")
    fn = _BACKENDS[_resolve(backend, logits)]
    return TokenLogprobs(*fn(logits, token_ids, float(temperature), True, chunk_tokens, chunk_vocab))


def token_logprobs(
    logits: Tensor,
    token_ids: Tensor,
    temperature: float = 1.0,
    *,
    chunk_tokens: int | None = None,
    chunk_vocab: int | None = None,
    backend: LogprobBackend | str = LogprobBackend.AUTO,
) -> Tensor:
    """Log-prob of ``token_ids`` only (skips the entropy work). ``[B, T, V]`` → ``[B, T]``."""
    _check(logits, token_ids, temperature, "logits")
    fn = _BACKENDS[_resolve(backend, logits)]
    return fn(logits, token_ids, float(temperature), False, chunk_tokens, chunk_vocab)[0]


def _hidden(hidden, weight, token_ids, temperature, with_entropy, chunk_tokens, chunk_vocab):
    _check(hidden, token_ids, temperature, "hidden")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.dtype != hidden.dtype:
        raise ValueError(f"weight must be [V, D] in the dtype of hidden, got {tuple(weight.shape)} {weight.dtype}")
    cv = chunk_vocab or min(weight.shape[0], HIDDEN_CHUNK_VOCAB)
    budget = HIDDEN_BLOCK_ELEMS_CUDA if hidden.is_cuda else HIDDEN_BLOCK_ELEMS
    ct = chunk_tokens or max(1, budget // cv)
    return HiddenFn.apply(hidden, weight, token_ids, float(temperature), with_entropy, ct, cv)


def token_logprobs_and_entropy_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    token_ids: Tensor,
    temperature: float = 1.0,
    *,
    chunk_tokens: int | None = None,
    chunk_vocab: int | None = None,
) -> TokenLogprobs:
    """As :func:`token_logprobs_and_entropy` for ``logits = hidden @ weightᵀ``, never built.

    Shape: hidden ``[B, T, D]``, weight ``[V, D]`` (an ``nn.Linear`` weight, same dtype),
    token_ids ``[B, T]``; gradients flow into hidden and weight.
    """
    return TokenLogprobs(*_hidden(hidden, weight, token_ids, temperature, True, chunk_tokens, chunk_vocab))


def token_logprobs_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    token_ids: Tensor,
    temperature: float = 1.0,
    *,
    chunk_tokens: int | None = None,
    chunk_vocab: int | None = None,
) -> Tensor:
    """Log-prob only, from hidden states. ``[B, T, D]``, ``[V, D]`` → ``[B, T]``."""
    return _hidden(hidden, weight, token_ids, temperature, False, chunk_tokens, chunk_vocab)[0]


def _reference_log_softmax(logits: Tensor, token_ids: Tensor, temperature: float) -> Tensor:
    _check(logits, token_ids, temperature, "logits")
    z = logits.to(compute_dtype(logits.dtype))  # a float32 copy for bf16, none for float32
    return torch.log_softmax(z if temperature == 1.0 else z / temperature, dim=-1)  # [B, T, V]


def token_logprobs_and_entropy_reference(logits: Tensor, token_ids: Tensor, temperature: float = 1.0) -> TokenLogprobs:
    """Naive reference: full ``log_softmax`` in float32 + ``gather``. ``[B, T, V]`` → 2×``[B, T]``."""
    logp_all = _reference_log_softmax(logits, token_ids, temperature)  # [B, T, V]
    logp = logp_all.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return TokenLogprobs(logp, entropy)


def token_logprobs_reference(logits: Tensor, token_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """Naive reference log-probs. ``[B, T, V]`` → ``[B, T]``."""
    logp_all = _reference_log_softmax(logits, token_ids, temperature)  # [B, T, V]
    return logp_all.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1)


def token_logprobs_and_entropy_from_hidden_reference(
    hidden: Tensor, weight: Tensor, token_ids: Tensor, temperature: float = 1.0
) -> TokenLogprobs:
    """Naive reference: build ``hidden @ weightᵀ`` ``[B, T, V]`` in the model dtype, then as above."""
    return token_logprobs_and_entropy_reference(hidden @ weight.T, token_ids, temperature)


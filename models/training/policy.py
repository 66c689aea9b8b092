"""Training-side forwards: log-probs of response tokens from the policy, values from the critic.

Rows are ``prompt ++ response`` right-padded to ``[B, L]``. Response token t of row b sits at
position ``P_b + t`` and is predicted by the hidden state at ``P_b + t - 1``; both the policy's
log-prob and the critic's value for action t are read there (the index convention of
docs/concepts/rollout_batch.md: position t of a response column is the action that produced response token t). Only those
hidden states go through the output projection, chunked (``kernels.logprobs``), so the
``[B, L, V]`` logits are never materialised.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Dict, Optional, Tuple, TypeVar

import torch
from torch import nn

from kernels.logprobs import (token_logprobs, token_logprobs_and_entropy, token_logprobs_and_entropy_from_hidden,
                              token_logprobs_from_hidden)
from models.training import packing
from models.data.batch_tensors import ModelInputs


def inputs_to(inputs, device):
    """Move every tensor field of a NamedTuple of inputs to ``device``."""
    return type(inputs)(*(t.to(device) for t in inputs))


def _gather_positions(hidden: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``hidden [B, L, ...]`` at ``index [B, T]`` → ``[B, T, ...]``."""
    return hidden[torch.arange(hidden.shape[0], device=hidden.device)[:, None], index]


FROM_HIDDEN_MIN_LOGITS = 1 << 26
"""Logit count (``B·T·V``, 256 MiB in fp32) from which log-probs come from the hidden states in
vocabulary chunks, the logits never materialised. Below it the logits are made whole: the chunked
path recomputes them in backward, ~1.5x the time of the plain path (benchmarks/bench_kernels.py)."""


def _autocast(dtype: Optional[torch.dtype], device: torch.device):
    """``torch.autocast`` to ``dtype`` on ``device``'s kind, or nothing for None."""
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


class PolicyLogprobs(nn.Module):
    """Wraps a causal LM so one ``forward`` (the one DDP/FSDP hook into) gives log-probs and entropy.

    ``packed``: rows go through the trunk packed end to end (:mod:`models.training.packing`) instead of
    padded; give it :func:`packing_supported` (the trunk must keep packed rows apart).
    ``autocast_dtype``: forwards compute in it under ``torch.autocast`` while the weights stay in
    theirs (float32 master weights, :func:`models.training.distributed.wrap_for_training`); log-probs are
    reduced in float32 either way."""

    autocast_dtype: Optional[torch.dtype] = None

    def __init__(self, lm: nn.Module, chunked: bool = True, packed: bool = False):
        super().__init__()
        self.lm = lm
        self.chunked = chunked
        self.packed = packed

    @property
    def trunk(self) -> nn.Module:
        return self.lm.get_decoder() if hasattr(self.lm, "get_decoder") else self.lm.model

    def forward(self, inputs: ModelInputs, temperature: float = 1.0,
                with_entropy: bool = True) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        trunk = self.trunk
        with _autocast(self.autocast_dtype, inputs.input_ids.device):
            h = _at_positions(lambda **kw: trunk(**kw).last_hidden_state, inputs, self.packed,
                              self.lm)  # [B, T, H]: the states that predict each response token
            tokens = inputs.input_ids.gather(1, inputs.response_positions)  # [B, T]
            head = self.lm.get_output_embeddings()
            plain = isinstance(head, nn.Linear) and head.bias is None
            if self.chunked and plain and h.shape[0] * h.shape[1] * head.out_features >= FROM_HIDDEN_MIN_LOGITS:
                if self.autocast_dtype is not None:  # the head's matmuls in the compute dtype, both ways
                    h = h.to(self.autocast_dtype)
                w = head.weight.to(h.dtype)
                logp, ent = (token_logprobs_and_entropy_from_hidden(h, w, tokens, temperature=temperature)
                             if with_entropy else (token_logprobs_from_hidden(h, w, tokens, temperature), None))
            else:  # small logits, LoRA-adapted/sharded/biased heads: logits of the response positions only
                logits = head(h)  # [B, T, V]
                logp, ent = (token_logprobs_and_entropy(logits, tokens, temperature=temperature) if with_entropy
                             else (token_logprobs(logits, tokens, temperature), None))
        mask = inputs.response_mask.bool()
        logp = logp.masked_fill(~mask, 0.0)
        ent = ent.masked_fill(~mask, 0.0) if with_entropy else None  # without: no entropy computed at all
        return logp, ent  # [B, T], [B, T]


class CriticValues(nn.Module):
    """Wraps a token-classification model with one label: the value of each response action.
    ``packed`` and ``autocast_dtype`` as in :class:`PolicyLogprobs`; values are float32."""

    autocast_dtype: Optional[torch.dtype] = None

    def __init__(self, critic: nn.Module, packed: bool = False):
        super().__init__()
        self.critic = critic
        self.packed = packed

    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        with _autocast(self.autocast_dtype, inputs.input_ids.device):
            out = _at_positions(lambda **kw: self.critic(**kw).logits, inputs, self.packed, self.critic)  # [B, T, 1]
        values = out.squeeze(-1).float()  # [B, T]
        return values.masked_fill(~inputs.response_mask.bool(), 0.0)


WrapperT = TypeVar("WrapperT", PolicyLogprobs, CriticValues)


def _at_positions(forward, inputs: ModelInputs, packed: bool, model: nn.Module) -> torch.Tensor:
    """``forward``'s output ``[B, L, ...]`` at ``response_positions - 1`` → ``[B, T, ...]``, from the
    rows packed (when ``packed`` and the plan beats padding) or padded."""
    members = lengths = None
    if packed:
        lengths = inputs.attention_mask.sum(1).tolist()
        members = packing.plan(lengths, packing.hidden_size(model), packing.dense_attention(model))
    if members is None:
        out = forward(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask)
        return _gather_positions(out, inputs.response_positions - 1)
    pk = packing.pack(inputs.input_ids, lengths, members)
    out = forward(input_ids=pk.input_ids, position_ids=pk.position_ids, use_cache=False)
    return packing.read_back(out, pk, inputs.response_positions - 1)


def packing_supported(wrapper: "PolicyLogprobs | CriticValues") -> bool:
    """Whether a :class:`PolicyLogprobs` or :class:`CriticValues` may run packed (see
    :func:`models.training.packing.packing_works`). The verdict is the model's structure's and configuration's,
    not its weights': it is checked once per process for each (:func:`known_packing`), not at every load (under
    FSDP2 the check's two forwards gathered the whole model: 7 s of a resident run's score, each iteration, at
    Qwen3-0.6B's shape on two CPU ranks, for a reference read again each iteration)."""
    key = _packing_key(wrapper)
    if key not in _PACKING:
        if isinstance(wrapper, PolicyLogprobs):
            model, trunk = wrapper.lm, wrapper.trunk
            fn = lambda **kw: trunk(**kw, use_cache=False).last_hidden_state  # noqa: E731
        else:
            model = wrapper.critic
            fn = lambda **kw: model(**kw, use_cache=False).logits  # noqa: E731
        _PACKING[key] = packing.packing_works(model, fn, int(getattr(model.config, "vocab_size", 2)))
    return _PACKING[key]


_PACKING: Dict[str, bool] = {}


def _packing_key(wrapper: "PolicyLogprobs | CriticValues") -> str:
    """What :func:`packing_works`' verdict depends on: the wrapper, the model's modules as ``repr`` lists them
    (classes, shapes), its configuration (attention implementation included) and dtype."""
    inner = wrapper.lm if isinstance(wrapper, PolicyLogprobs) else wrapper.critic
    config = getattr(inner, "config", None)
    parts = [type(wrapper).__name__, repr(inner), str(next(inner.parameters()).dtype),
             config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else repr(config),
             str(getattr(config, "_attn_implementation", None))]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def known_packing(wrapper: "PolicyLogprobs | CriticValues") -> Optional[bool]:
    """:func:`packing_supported`'s verdict when this process has checked a model like ``wrapper``'s, else None."""
    return _PACKING.get(_packing_key(wrapper))


_SAID_PADS: set = set()


def with_packing(wrapper: WrapperT, wanted: bool) -> WrapperT:
    """``wrapper`` set to run packed when ``wanted`` (``model.pack_sequences``) and its model keeps
    packed rows apart; else padded, saying why when packing was wanted."""
    wrapper.packed = bool(wanted) and packing_supported(wrapper)
    inner = wrapper.lm if isinstance(wrapper, PolicyLogprobs) else wrapper.critic
    if wanted and not wrapper.packed and type(inner).__name__ not in _SAID_PADS:
        _SAID_PADS.add(type(inner).__name__)  # once per process and model class, not every task of every iteration
        print(f"model.pack_sequences: {type(inner).__name__} does not keep packed rows apart (checked on three "
              f"rows, packed against padded); its forwards pad rows instead", flush=True)
    return wrapper


@torch.no_grad()
def reward_model_scores(reward_model: nn.Module, inputs: ModelInputs) -> torch.Tensor:
    """Sequence reward ``[B]`` of a sequence-classification model at each row's last real token."""
    logits = reward_model(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask).logits  # [B, L, 1]?
    if logits.dim() == 2:  # HF already pooled at the last non-pad token: [B, 1]
        return logits[:, 0].float()
    last = inputs.attention_mask.long().sum(1) - 1  # [B]
    return logits[torch.arange(logits.shape[0]), last, 0].float()

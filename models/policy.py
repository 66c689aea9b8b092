"""Training-side forwards: log-probs of response tokens from the policy, values from the critic.

Rows are ``prompt ++ response`` right-padded to ``[B, L]``. Response token t of row b sits at
position ``P_b + t`` and is predicted by the hidden state at ``P_b + t - 1``; both the policy's
log-prob and the critic's value for action t are read there (index convention of DESIGN.md:
position t of a response column is the action that produced response token t). Only those
hidden states go through the output projection, chunked (``kernels.logprobs``), so the
``[B, L, V]`` logits are never materialised.
"""

from __future__ import annotations

from typing import Optional, Protocol, Tuple

import torch
from torch import nn

from kernels.logprobs import token_logprobs_and_entropy, token_logprobs_and_entropy_from_hidden


class ModelInputs(Protocol):
    """What a forward needs (``models.batch_tensors.ModelInputs`` provides it)."""

    input_ids: torch.Tensor  # [B, L] prompt ++ response, right-padded
    attention_mask: torch.Tensor  # [B, L]
    response_positions: torch.Tensor  # [B, T] position of response token t in input_ids (>= 1)
    response_mask: torch.Tensor  # [B, T] bool


def inputs_to(inputs, device):
    """Move every tensor field of a NamedTuple of inputs to ``device``."""
    return type(inputs)(*(t.to(device) for t in inputs))


def _gather_positions(hidden: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``hidden [B, L, H]`` at ``index [B, T]`` → ``[B, T, H]``."""
    return hidden.gather(1, index.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))


FROM_HIDDEN_MIN_LOGITS = 1 << 26
"""Logit count (``B·T·V``, 256 MiB in fp32) from which log-probs come from the hidden states in
vocabulary chunks, the logits never materialised. Below it the logits are made whole: the chunked
path recomputes them in backward, ~1.5x the time of the plain path (benchmarks/bench_kernels.py)."""


class PolicyLogprobs(nn.Module):
    """Wraps a causal LM so one ``forward`` (the one DDP/FSDP hook into) gives log-probs and entropy."""

    def __init__(self, lm: nn.Module, chunked: bool = True):
        super().__init__()
        self.lm = lm
        self.chunked = chunked

    def forward(self, inputs: ModelInputs, temperature: float = 1.0,
                with_entropy: bool = True) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        trunk = self.lm.get_decoder() if hasattr(self.lm, "get_decoder") else self.lm.model
        hidden = trunk(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask).last_hidden_state
        h = _gather_positions(hidden, inputs.response_positions - 1)  # [B, T, H]
        tokens = inputs.input_ids.gather(1, inputs.response_positions)  # [B, T]
        head = self.lm.get_output_embeddings()
        plain = isinstance(head, nn.Linear) and head.bias is None
        if self.chunked and plain and h.shape[0] * h.shape[1] * head.out_features >= FROM_HIDDEN_MIN_LOGITS:
            logp, ent = token_logprobs_and_entropy_from_hidden(h, head.weight, tokens,
                                                              temperature=temperature)
        else:  # small logits, LoRA-adapted/sharded/biased heads: logits of the response positions only
            logp, ent = token_logprobs_and_entropy(head(h), tokens, temperature=temperature)
        mask = inputs.response_mask.bool()
        logp = logp.masked_fill(~mask, 0.0)
        ent = ent.masked_fill(~mask, 0.0) if with_entropy else None
        return logp, ent  # [B, T], [B, T]


class CriticValues(nn.Module):
    """Wraps a token-classification model with one label: the value of each response action."""

    def __init__(self, critic: nn.Module):
        super().__init__()
        self.critic = critic

    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        out = self.critic(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask).logits  # [B, L, 1]
        values = out.squeeze(-1).float().gather(1, inputs.response_positions - 1)  # [B, T]
        return values.masked_fill(~inputs.response_mask.bool(), 0.0)


@torch.no_grad()
def reward_model_scores(reward_model: nn.Module, inputs: ModelInputs) -> torch.Tensor:
    """Sequence reward ``[B]`` of a sequence-classification model at each row's last real token."""
    logits = reward_model(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask).logits  # [B, L, 1]?
    if logits.dim() == 2:  # HF already pooled at the last non-pad token: [B, 1]
        return logits[:, 0].float()
    last = inputs.attention_mask.long().sum(1) - 1  # [B]
    return logits[torch.arange(logits.shape[0]), last, 0].float()

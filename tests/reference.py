"""Independent references shared by tests."""

from __future__ import annotations

import torch


def token_logprobs(model, batch):
    """Log-probs of each row's response tokens under ``model``: full logits, log_softmax, gather,
    one row at a time (none of the trainer's batching, padding or chunking)."""
    out = []
    for p, r in zip(batch.column("prompt_tokens").to_pylist(), batch.column("response_tokens").to_pylist()):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([p + r])).logits[0].float(), -1)  # [L, V]
        out.append([float(logp[len(p) + t - 1, tok]) for t, tok in enumerate(r)])
    return out

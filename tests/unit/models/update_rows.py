"""Right-padded update rows for the update-loop and packing tests."""

from __future__ import annotations

from typing import Sequence, Tuple

import torch

from models.training.update import UpdateData


def padded_rows(lengths: Sequence[Tuple[int, int]], vocab: int = 16, seed: int = 1) -> UpdateData:
    """Rows of ``(prompt, response)`` token counts, right-padded, with random tokens, log-probs,
    advantages, values and returns (zero outside the responses)."""
    g = torch.Generator().manual_seed(seed)
    n, L, T = len(lengths), max(p + r for p, r in lengths), max(r for _, r in lengths)
    ids, att = torch.zeros(n, L, dtype=torch.long), torch.zeros(n, L, dtype=torch.long)
    pos, mask = torch.zeros(n, T, dtype=torch.long), torch.zeros(n, T, dtype=torch.bool)
    for b, (p, r) in enumerate(lengths):
        ids[b, :p + r] = torch.randint(1, vocab, (p + r,), generator=g)
        att[b, :p + r] = 1
        pos[b] = torch.clamp(p + torch.arange(T), max=L - 1)  # each response token's place (padding: clamped)
        mask[b, :r] = True
    old = -torch.rand(n, T, generator=g) * mask
    adv = torch.randn(n, T, generator=g) * mask
    values = torch.randn(n, T, generator=g) * mask
    returns = torch.randn(n, T, generator=g) * mask
    return UpdateData(ids, att, pos, mask, old_logp=old, adv=adv, old_values=values, returns=returns)

"""Pad-free forwards: a micro-batch's rows packed end to end into a few shared rows.

Right-padded rows of lengths ``l_b`` cost ``B × max(l)`` token slots in every linear layer; packed,
they cost about ``Σ l_b``. Rows share a packed row without seeing each other: their position ids
restart at 0, and transformers turns position ids that restart (with no attention mask and no
cache) into a block-diagonal causal mask for SDPA/eager attention, or variable-length kernels for
flash attention. Each row's outputs are read back at ``start_b + position``.

How many packed rows: with SDPA/eager the attention of a packed row of ``C`` slots costs ``C²``
whether the pairs are masked or not, so one packed row of everything is not free. Per layer a slot
costs about ``8·H + C`` (linear layers ``32·H²``, attention ``4·H·C``, in units of ``4·H``); the
plan takes the pack count that minimises ``P · C · (8·H + C)`` with rows dealt longest first to the
emptiest packed row (``C`` = the fullest), and never does worse than plain padding, which it
falls back to. With flash attention only real pairs are computed and one packed row is best.
"""

from __future__ import annotations

import heapq
from typing import Callable, List, NamedTuple, Sequence, Tuple

import torch
from torch import nn


class Packed(NamedTuple):
    """A micro-batch's rows packed into ``[P, C]``."""

    input_ids: torch.Tensor  # [P, C]
    position_ids: torch.Tensor  # [P, C] restarting at 0 for every row; 0 in unused slots
    starts: torch.Tensor  # [B] flat slot (``p·C + offset``) of each row's first token


def slot_cost(slots: int, width: int, hidden_size: int, dense_attention: bool) -> float:
    """Relative cost of a forward over ``slots`` token slots in rows of ``width``."""
    return slots * (8.0 * hidden_size + (width if dense_attention else 0.0))


def deal(lengths: Sequence[int], packs: int) -> Tuple[List[List[int]], int]:
    """Rows dealt longest first to the emptiest of ``packs`` packed rows: (members of each, widest fill)."""
    heap = [(0, p) for p in range(packs)]
    members: List[List[int]] = [[] for _ in range(packs)]
    fill = [0] * packs
    for r in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        used, p = heapq.heappop(heap)
        members[p].append(r)
        fill[p] = used + lengths[r]
        heapq.heappush(heap, (fill[p], p))
    return members, max(fill)


def plan(lengths: Sequence[int], hidden_size: int, dense_attention: bool = True) -> List[List[int]] | None:
    """Rows of each packed row, or None when plain padding costs no more."""
    n = len(lengths)
    if n < 2:
        return None
    longest = max(lengths)
    best, best_cost = None, slot_cost(n * longest, longest, hidden_size, dense_attention)
    packs = n - 1
    tried = set()
    while packs >= 1:  # pack counts n-1, ~n/1.25, ...: ~15 plans of O(n log P) each
        if packs not in tried:
            tried.add(packs)
            members, width = deal(lengths, packs)
            cost = slot_cost(packs * width, width, hidden_size, dense_attention)
            if cost < best_cost:
                best, best_cost = members, cost
        packs = min(packs - 1, int(packs / 1.25))
    return best


def pack(input_ids: torch.Tensor, lengths: Sequence[int], members: List[List[int]], pad_id: int = 0) -> Packed:
    """Right-padded ``input_ids [B, L]``, row b ``lengths[b]`` tokens long, packed as ``members`` says
    (from :func:`plan`)."""
    width = max(sum(lengths[r] for r in m) for m in members)
    starts = torch.zeros(len(lengths), dtype=torch.long)
    for p, rows in enumerate(members):
        offset = p * width
        for r in rows:
            starts[r] = offset
            offset += lengths[r]
    lens = torch.as_tensor(lengths, device=input_ids.device)
    first = torch.cumsum(lens, 0) - lens  # [B] each row's first token in the flat real tokens
    token_row = torch.repeat_interleave(torch.arange(len(lengths), device=input_ids.device), lens)  # [N]
    within = torch.arange(int(lens.sum()), device=input_ids.device) - first[token_row]  # [N]
    slots = starts.to(input_ids.device)[token_row] + within  # [N]
    flat_ids = torch.full((len(members) * width,), pad_id, dtype=input_ids.dtype, device=input_ids.device)
    flat_pos = torch.zeros(len(members) * width, dtype=torch.long, device=input_ids.device)
    flat_ids[slots] = input_ids[token_row, within]
    flat_pos[slots] = within
    return Packed(flat_ids.view(len(members), width), flat_pos.view(len(members), width), starts.to(input_ids.device))


def read_back(out: torch.Tensor, packed: Packed, positions: torch.Tensor) -> torch.Tensor:
    """``out [P, C, ...]`` of a packed forward at each row's ``positions [B, T]`` → ``[B, T, ...]``.
    Positions past a row's end (padding of ``positions``) read some other slot: mask them."""
    flat = out.reshape(-1, *out.shape[2:])
    index = (packed.starts[:, None] + positions).clamp(0, flat.shape[0] - 1)  # [B, T]
    return flat[index]


def dense_attention(model: nn.Module) -> bool:
    """False for flash-attention implementations (only real pairs computed), else True."""
    impl = str(getattr(getattr(model, "config", None), "_attn_implementation", "") or "")
    return not impl.startswith("flash")


def hidden_size(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    return int(getattr(config, "hidden_size", 0) or getattr(config, "n_embd", 0) or 1024)


def packing_works(model: nn.Module, forward: Callable[..., torch.Tensor], vocab_size: int) -> bool:
    """Does ``forward(input_ids=, attention_mask=)`` / ``forward(input_ids=, position_ids=)`` of
    ``model`` keep packed rows apart? Checked on three short random rows, padded against packed:
    a model whose attention ignores restarting position ids (so rows would see each other) fails."""
    lengths = [5, 3, 2]
    g = torch.Generator().manual_seed(0)
    device = next(model.parameters()).device
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    att = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.randint(1, max(vocab_size, 2), (n,), generator=g)
        att[b, :n] = 1
    ids, att = ids.to(device), att.to(device)
    packed = pack(ids, lengths, [[0, 1, 2]])
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            padded = forward(input_ids=ids, attention_mask=att).float()
            together = forward(input_ids=packed.input_ids, position_ids=packed.position_ids).float()
    except (TypeError, ValueError, RuntimeError):  # no position_ids, or masks it cannot build
        return False
    finally:
        model.train(was_training)
    positions = torch.arange(max(lengths), device=device).expand(len(lengths), -1)
    again = read_back(together, packed, positions)
    real = att.bool()
    scale = padded[real].abs().max().clamp_min(1e-6)
    tolerance = 1e-2 if next(model.parameters()).dtype == torch.float32 else 5e-2  # rows that see each other: O(1)
    return bool(((again[real] - padded[real]).abs().max() / scale) < tolerance)

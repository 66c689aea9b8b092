"""Chunked log-probs and entropy of chosen tokens from logits, in plain torch (any device).

The softmax over V is taken one block of ``chunk_tokens × chunk_vocab`` scaled logits at
a time, in float32 (float64 for float64 inputs), so the extra memory is O(N + block)
with N = B·T, never a ``[B, T, V]`` float32 copy. Per block c and row n:

    lp_c = log_softmax(x_c),   lse_c = max(x_c) − max(lp_c),   H_c = −Σ softmax(x_c)·lp_c

and across blocks (all terms non-negative, so nothing cancels):

    lse = logsumexp_c(lse_c),  log p(y) = lp_{c(y)}[y] + lse_{c(y)} − lse,
    H = Σ_c exp(lse_c − lse)·(lse − lse_c + H_c)

Backward recomputes each block. With z = x/τ, ``∂log p(y)/∂z_j = 1[j=y] − p_j`` and
``∂H/∂z_j = −p_j (log p_j + H)``, so for upstream grads g (log-prob) and h (entropy):
``∂L/∂x_j = (g·1[j=y] − p_j (g + h·H + h·log p_j)) / τ``.
"""

from __future__ import annotations

from typing import Callable, Iterator, NamedTuple

import torch
from torch import Tensor

from kernels.masked import compute_dtype

__all__ = ["LogitsFn", "forward_stats", "block_grad", "backward_state", "state_block", "row_ranges", "col_ranges"]

LOGITS_BLOCK_ELEMS = 1 << 18  # 1 MiB of float32 per temporary (CPU)
LOGITS_BLOCK_ELEMS_CUDA = 1 << 23  # 32 MiB: fewer, larger kernels on a GPU
LOGITS_MAX_CHUNK_VOCAB = 1 << 17  # whole rows up to this V: one fused log_softmax per row

Ranges = list[tuple[int, int]]


def scaled(block: Tensor, temperature: float, dtype: torch.dtype) -> Tensor:
    """``block / τ`` in ``dtype``; never writes into ``block`` (it may be the caller's logits)."""
    if block.dtype == dtype:
        return block if temperature == 1.0 else torch.div(block, temperature)
    x = block.to(dtype)
    return x if temperature == 1.0 else x.div_(temperature)


def row_ranges(B: int, T: int, chunk: int, flat: bool) -> Ranges:
    """Row ranges over the flattened ``B·T`` rows; inside one sequence unless ``flat``."""
    if flat:
        return [(r0, min(r0 + chunk, B * T)) for r0 in range(0, B * T, chunk)]
    return [(b * T + t0, b * T + min(t0 + chunk, T)) for b in range(B) for t0 in range(0, T, chunk)]


def col_ranges(V: int, chunk: int) -> Ranges:
    return [(v0, min(v0 + chunk, V)) for v0 in range(0, V, chunk)]


def blocks(rows: Ranges, cols: Ranges, vocab_outer: bool) -> Iterator[tuple[int, int, int, int, int]]:
    """``(r0, r1, j, v0, v1)`` for every block; vocab-outer reads each vocab slice once."""
    if vocab_outer:
        return ((r0, r1, j, v0, v1) for j, (v0, v1) in enumerate(cols) for r0, r1 in rows)
    return ((r0, r1, j, v0, v1) for r0, r1 in rows for j, (v0, v1) in enumerate(cols))


class Stats(NamedTuple):
    logp: Tensor  # [N]
    entropy: Tensor | None  # [N]
    lse_c: Tensor | None  # [N, n_cols]; only when the vocab is split


def forward_stats(
    src: Callable[[int, int, int, int], Tensor],
    ids: Tensor,
    rows: Ranges,
    cols: Ranges,
    with_entropy: bool,
    dtype: torch.dtype,
    vocab_outer: bool = False,
) -> Stats:
    """Log-prob of ``ids`` and entropy per row; ``src(r0, r1, v0, v1)`` gives a scaled block."""
    n, nv = ids.numel(), len(cols)
    kw = {"dtype": dtype, "device": ids.device}
    target_lp = torch.zeros(n, **kw)  # [N]
    lse_c = torch.zeros(n, nv, **kw) if nv > 1 else None  # [N, nv]
    ent_c = torch.zeros(n, nv, **kw) if with_entropy else None  # [N, nv]
    for r0, r1, j, v0, v1 in blocks(rows, cols, vocab_outer):
        x = src(r0, r1, v0, v1)  # [r, c]
        lp = torch.log_softmax(x, dim=-1)  # [r, c]
        local = ids[r0:r1] - v0  # [r]
        inside = (local >= 0) & (local < v1 - v0)
        picked = lp.gather(1, local.clamp(0, v1 - v0 - 1).unsqueeze(1)).squeeze(1)
        target_lp[r0:r1] = torch.where(inside, picked, target_lp[r0:r1])
        if lse_c is not None:
            lse_c[r0:r1, j] = x.amax(-1) - lp.amax(-1)
        if ent_c is not None:
            ent_c[r0:r1, j] = -torch.softmax(x, dim=-1).mul_(lp).sum(-1)
    if lse_c is None:
        return Stats(target_lp, None if ent_c is None else ent_c[:, 0], None)
    lse = torch.logsumexp(lse_c, dim=1)  # [N]
    chunk = cols[0][1] - cols[0][0]
    target_lse = lse_c.gather(1, (ids // chunk).unsqueeze(1)).squeeze(1)  # [N]
    entropy = None
    if ent_c is not None:
        shift = lse.unsqueeze(1) - lse_c  # [N, nv], >= 0
        entropy = (torch.exp(-shift) * (shift + ent_c)).sum(1)
    return Stats(target_lp + (target_lse - lse), entropy, lse_c)


class BlockGrads(NamedTuple):
    """Per-row inputs of :func:`block_grad` for rows r0:r1 (None where unused)."""

    g_lp: Tensor | None  # [r] upstream grad of the log-prob
    g_ent: Tensor | None  # [r] upstream grad of the entropy
    entropy: Tensor | None  # [r] saved entropy
    lse: Tensor | None  # [r] full log-sum-exp (split vocab only)
    lse_j: Tensor | None  # [r] log-sum-exp of this vocab slice (split vocab only)


def block_grad(x: Tensor, local: Tensor, bg: BlockGrads, temperature: float) -> Tensor:
    """``∂L/∂logits`` for one block of scaled logits ``x`` ``[r, c]`` (module docstring)."""
    if bg.lse is None:  # the whole vocab is in this block
        p = torch.softmax(x, dim=-1)  # [r, c]
        lp = torch.log_softmax(x, dim=-1) if bg.g_ent is not None else None
    else:
        p = torch.softmax(x, dim=-1).mul_(torch.exp(bg.lse_j - bg.lse).unsqueeze(1))
        lp = x - bg.lse.unsqueeze(1) if bg.g_ent is not None else None
    coef = torch.zeros_like(p[:, 0]) if bg.g_lp is None else bg.g_lp  # [r]
    if bg.g_ent is not None:
        coef = coef + bg.g_ent * bg.entropy
        grad = lp.mul_(bg.g_ent.unsqueeze(1) / -temperature).sub_(coef.unsqueeze(1) / temperature).mul_(p)
    else:
        grad = p.mul_(coef.unsqueeze(1) / -temperature)
    if bg.g_lp is not None:
        rows = ((local >= 0) & (local < x.shape[1])).nonzero().squeeze(1)
        grad[rows, local[rows]] += bg.g_lp[rows] / temperature
    return grad


class BackwardState(NamedTuple):
    """Upstream grads and saved statistics over all N rows, for :func:`state_block`."""

    g_lp: Tensor | None  # [N]
    g_ent: Tensor | None  # [N]
    entropy: Tensor | None  # [N]
    lse: Tensor | None  # [N]
    lse_c: Tensor | None  # [N, n_cols]


def backward_state(g_logp, g_ent, entropy, lse_c, dtype: torch.dtype) -> BackwardState | None:
    """Flattens upstream grads; None when no grad reaches the outputs."""
    g_lp = None if g_logp is None else g_logp.reshape(-1).to(dtype)
    g_h = None if (g_ent is None or entropy is None) else g_ent.reshape(-1).to(dtype)
    if g_lp is None and g_h is None:
        return None
    lse = None if lse_c is None else torch.logsumexp(lse_c, dim=1)
    return BackwardState(g_lp, g_h, entropy, lse, lse_c)


def state_block(st: BackwardState, r0: int, r1: int, j: int) -> BlockGrads:
    """What :func:`block_grad` needs for rows r0:r1 and vocab slice j."""
    pick = lambda t: None if t is None else t[r0:r1]  # noqa: E731
    lse_j = None if st.lse_c is None else st.lse_c[r0:r1, j]
    return BlockGrads(pick(st.g_lp), pick(st.g_ent), pick(st.entropy), pick(st.lse), lse_j)


def logits_source(logits: Tensor, temperature: float, dtype: torch.dtype, chunk_tokens: int):
    """``(src, rows)``: block reader over ``logits [B, T, V]`` and its row ranges."""
    B, T, V = logits.shape
    try:
        flat = logits.view(B * T, V)  # [N, V]
    except RuntimeError:  # e.g. logits[:, :-1]: keep blocks inside one sequence
        flat = None

    def src(r0: int, r1: int, v0: int, v1: int) -> Tensor:
        if flat is not None:
            return scaled(flat[r0:r1, v0:v1], temperature, dtype)
        b, t0 = divmod(r0, T)
        return scaled(logits[b, t0 : t0 + r1 - r0, v0:v1], temperature, dtype)

    return src, row_ranges(B, T, chunk_tokens, flat is not None)


class LogitsFn(torch.autograd.Function):
    """Autograd for ``(log p(y), H)`` from ``logits [B, T, V]``, block by block."""

    @staticmethod
    def forward(ctx, logits, ids, temperature, with_entropy, chunk_tokens, chunk_vocab):
        B, T, V = logits.shape
        dtype = compute_dtype(logits.dtype)
        src, rows = logits_source(logits, temperature, dtype, chunk_tokens)
        flat_ids = ids.reshape(-1).long()
        stats = forward_stats(src, flat_ids, rows, col_ranges(V, chunk_vocab), with_entropy, dtype)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, flat_ids, stats.entropy, stats.lse_c)
        ctx.args = (temperature, dtype, chunk_tokens, chunk_vocab)
        entropy = stats.entropy.view(B, T) if with_entropy else stats.logp.new_zeros(0)
        return stats.logp.view(B, T), entropy

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, ids, entropy, lse_c = ctx.saved_tensors
        temperature, dtype, chunk_tokens, chunk_vocab = ctx.args
        B, T, V = logits.shape
        st = backward_state(g_logp, g_ent, entropy, lse_c, dtype)
        if st is None:
            return None, None, None, None, None, None
        src, rows = logits_source(logits, temperature, dtype, chunk_tokens)
        grad = torch.empty(B * T, V, dtype=logits.dtype, device=logits.device)  # [N, V]
        for r0, r1, j, v0, v1 in blocks(rows, col_ranges(V, chunk_vocab), vocab_outer=False):
            gx = block_grad(src(r0, r1, v0, v1), ids[r0:r1] - v0, state_block(st, r0, r1, j), temperature)
            grad[r0:r1, v0:v1] = gx
        return grad.view(B, T, V), None, None, None, None, None

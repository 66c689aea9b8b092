"""Generalised advantage estimation on padded ``[B, T]`` batches.

    δ_t = r_t + γ·V_{t+1} − V_t,    A_t = δ_t + γλ·A_{t+1},    G_t = A_t + V_t

(Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE", eq. 16), with
the value after each row's last response token bootstrapped to 0.

Masked positions inside a row (tool or observation tokens of a multi-turn rollout) are
skipped: ``V_{t+1}`` is the value at the next *valid* position (0 if none) and the
running advantage carries through masked positions unchanged. Rewards and values at
masked positions are ignored, and ``A_t = G_t = 0`` there.

:func:`compute_gae_reference` is the plain reverse loop. :func:`compute_gae` solves the
same recurrence without a loop over T, on one of three paths:

- one span per row (single-turn): ``A = discounted_cumsum(δ, γλ)``, a constant-coefficient
  recurrence that :func:`discounted_cumsum` solves with one ``[L, L]`` matrix of discount
  powers per block of L tokens and a recursive pass over the block starts;
- gaps inside rows, g = γλ >= 1/16: expanding δ and collecting the terms of each r_j and
  V_j gives, for a valid t, with n(t, j) the number of valid tokens in ``[t, j)``,

      A_t = r_t − V_t + Σ_{valid j > t} g^n(t,j) · (r_j + (1/λ − 1)·V_j)

  Within a block of L tokens ``g^n(t,j) = p_j / p_t`` with p the running product of g
  over valid tokens, so the sum is one matmul with a fixed strict-suffix matrix on
  ``p_j·(r_j + (1/λ − 1)·V_j)`` (masked tokens are zeros: no packing); the blocks are
  chained by a doubling scan over their T/L carries;
- gaps with g < 1/16 (where p would span more than 2^64 within a block): valid tokens
  are packed to the front of each row, then :func:`discounted_cumsum`.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Iterator, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.masked import as_bool_mask, compute_dtype

__all__ = ["GAEResult", "compute_gae", "compute_gae_reference", "discounted_cumsum"]

_BLOCK = 32  # tokens per block; ~32 minimises matmul work (∝ L) plus block-level work (∝ T/L)
_SEG_BLOCK = 16  # tokens per block of the gap path: half the matmul work of 32, one scan step more
_MIN_SEG_DECAY = 2.0 ** (-64 / _SEG_BLOCK)  # γλ below it takes the packed path: keeps g^L >= 2^-64


class GAEResult(NamedTuple):
    advantages: Tensor  # [B, T], 0 at masked positions
    returns: Tensor  # [B, T], A + V, 0 at masked positions


def _check(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> None:
    if rewards.dim() != 2 or rewards.shape != values.shape or rewards.shape != mask.shape:
        raise ValueError(
            f"rewards, values and mask must share one [B, T] shape, got "
            f"{tuple(rewards.shape)}, {tuple(values.shape)}, {tuple(mask.shape)}"
        )
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma and lam must lie in [0, 1], got gamma={gamma}, lam={lam}")


def compute_gae_reference(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> GAEResult:
    """The plain reverse loop over T; the reference that :func:`compute_gae` must match.

    Shape: rewards, values, mask ``[B, T]``; returns two ``[B, T]`` tensors in the dtype
    of ``rewards`` (computed in float32, or float64 for float64 inputs).
    """
    _check(rewards, values, mask, gamma, lam)
    dtype = compute_dtype(rewards.dtype)
    r, v, m = rewards.to(dtype), values.to(dtype), as_bool_mask(mask)
    B, T = r.shape
    adv = torch.zeros_like(r)  # [B, T]
    last_adv = r.new_zeros(B)  # running A_{t+1}
    next_value = r.new_zeros(B)  # V at the next valid position
    for t in reversed(range(T)):
        delta = r[:, t] + gamma * next_value - v[:, t]
        a = delta + gamma * lam * last_adv
        adv[:, t] = torch.where(m[:, t], a, 0.0)
        last_adv = torch.where(m[:, t], a, last_adv)
        next_value = torch.where(m[:, t], v[:, t], next_value)
    returns = torch.where(m, adv + v, 0.0)
    return GAEResult(adv.to(rewards.dtype), returns.to(rewards.dtype))


@functools.lru_cache(maxsize=64)
def _discount_matrix(g: float, n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``M[i, j] = g^(j-i)`` for ``j >= i``, else 0; built in float64 (and 0^0 = 1)."""
    idx = torch.arange(n, dtype=torch.float64)
    gap = idx[None, :] - idx[:, None]  # [n, n]
    powers = torch.pow(torch.tensor(g, dtype=torch.float64), gap.clamp(min=0))
    return torch.where(gap >= 0, powers, 0.0).to(device=device, dtype=dtype)


@contextlib.contextmanager
def _exact_matmul(device: torch.device) -> Iterator[None]:
    """Turns TF32 off for CUDA matmuls inside the block (TF32 would cost ~1e-3 accuracy)."""
    if device.type != "cuda":
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def discounted_cumsum(x: Tensor, g: float, block: int = _BLOCK, out: Tensor | None = None) -> Tensor:
    """``y_t = Σ_{s>=t} g^(s-t)·x_s`` along the last dim, i.e. ``y_t = x_t + g·y_{t+1}``.

    Blocked: inside each block of ``block`` tokens, ``y = x @ Mᵀ`` with the discount matrix
    M; the values at block starts obey the same recurrence with factor ``g^block`` and are
    solved by recursion; each block then adds ``g^(block-i)·y_{start of next block}``. All
    coefficients are powers of g <= 1, so nothing overflows (underflow only drops terms
    below float resolution, as the loop would).

    Shape: x ``[B, T]`` float; returns ``[B, T]``, in ``out`` if given (contiguous, x's
    shape, T at most ``block`` or a multiple of it).
    """
    B, T = x.shape
    if T <= block:
        return torch.mm(x, _discount_matrix(g, T, x.dtype, x.device).T, out=out)
    nb = -(-T // block)
    xp = x if nb * block == T else F.pad(x, (0, nb * block - T))  # zeros at the end change nothing
    m = _discount_matrix(g, block, x.dtype, x.device)  # [L, L]
    out = None if out is None else out.view(B * nb, block)
    local = torch.mm(xp.reshape(B * nb, block), m.T, out=out).view(B, nb, block)  # [B, nb, L]
    starts = discounted_cumsum(local[:, 1:, 0], g**block, block)  # [B, nb-1], y at blocks 1..nb-1
    tail = m[0].flip(0) * g  # [L], g^(L-i)
    local[:, :-1, :].addcmul_(starts.unsqueeze(-1), tail)
    return local.view(B, nb * block)[:, :T]


def _single_span(m: Tensor) -> bool:
    """True if every row's valid positions form one contiguous span (or none)."""
    u = m.view(torch.uint8)  # sums over uint8 are faster than over bool
    rises = (u[:, 1:] > u[:, :-1]).view(torch.uint8).sum(1, dtype=torch.int32)  # [B]
    return bool((rises + u[:, 0] <= 1).all())


def _workspace(m: Tensor, dtype: torch.dtype, n: int, tp: int) -> tuple[Tensor, Tensor]:
    """``n`` buffers of ``[B, tp]`` in one allocation, the first holding the mask as 0/1.

    One allocation for all of a path's temporaries also keeps that memory in the process
    between calls: glibc trims its heap once the free space on top exceeds twice the largest
    block it has freed, and the workspace is over half of what a call allocates. Otherwise
    a small process hands the memory back after every call and pages it in again (~1 µs per
    4 KiB: up to half the time of a call at B=256, T=1024).
    Returns the workspace ``[n, B, tp]`` and the mask ``[B, T]``, a view of its first buffer.
    """
    B, T = m.shape
    ws = torch.empty(n, B, tp, dtype=dtype, device=m.device)
    ws[0, :, :T] = m.view(torch.uint8)  # via uint8: bool → float is slow on CPU
    ws[0, :, T:] = 0.0
    return ws, ws[0, :, :T]


def _advantages_single_span(
    r: Tensor, v: Tensor, m: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Fast path: with one span per row, V_next = V_{t+1}·m_{t+1} and no packing is needed.

    Returns the advantages (0 where masked) and the mask as 0/1 floats, both ``[B, T]``.
    """
    B, T = r.shape
    ws, mf = _workspace(m, r.dtype, 3, -(-T // _BLOCK) * _BLOCK)
    padded = ws[1]  # [B, Tp], block-aligned
    padded[:, T:] = 0.0
    delta = padded[:, :T]
    torch.sub(r, v, out=delta)
    delta[:, :-1].addcmul_(v[:, 1:], mf[:, 1:], value=gamma)
    delta.mul_(mf)
    return discounted_cumsum(padded, gamma * lam, out=ws[2])[:, :T] * mf, mf


def _advantages_packed(
    r: Tensor, v: Tensor, m: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """General path: pack the valid tokens of each row to slots 1..n_b, solve, unpack.

    Slot 0 of each row is a dump for masked positions (zeroed). The packed values live
    in one flat buffer so that "value at the next slot" is a contiguous shifted view;
    the next slot after a row's last token is 0 (unwritten, or the next row's dump).
    Returns like :func:`_advantages_single_span`.
    """
    B, T = r.shape
    mf = m.view(torch.uint8).to(r.dtype)  # [B, T]
    tp = -(-(T + 1) // _BLOCK) * _BLOCK  # slots 0..T, block-aligned
    slot = (mf.cumsum(1) * mf).long()  # [B, T]: k for the k-th valid token, 0 if masked
    v_flat = r.new_zeros(B * tp + 1)
    v_packed = v_flat[:-1].view(B, tp).scatter_(1, slot, v)  # [B, Tp]
    v_packed[:, 0] = 0.0
    delta = r.new_zeros(B, tp).scatter_(1, slot, r)  # [B, Tp], r at its slot
    delta[:, 0] = 0.0
    delta.sub_(v_packed).add_(v_flat[1:].view(B, tp), alpha=gamma)  # r_k + γ·v_{k+1} − v_k
    adv = torch.gather(discounted_cumsum(delta, gamma * lam), 1, slot)  # [B, T]; slot 0: masked
    return adv.mul_(mf), mf


@functools.lru_cache(maxsize=16)
def _strict_suffix_matrix(n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``S[j, i] = 1`` for ``j > i``, else 0: ``(x @ S)_i = Σ_{j>i} x_j``."""
    j = torch.arange(n, device=device)
    return (j[:, None] > j[None, :]).to(dtype)  # [n, n]


def _chain_blocks(x: Tensor, c: Tensor) -> Tensor:
    """``y_b = x_b + c_b·y_{b+1}`` along dim 1 (0 past the end), by doubling: log2(n) steps.

    Products of many ``c`` may underflow to 0; the terms they weight are then as negligible
    as in the sequential loop. Shape: x, c ``[B, n]``; returns ``[B, n]`` (x, updated).
    """
    n, s = x.shape[1], 1
    while s < n:
        x[:, :-s].add_(c[:, : n - s] * x[:, s:])  # x_b: the terms of [b, b + 2s)
        if 2 * s < n:
            c = c[:, :-s] * c[:, s:]  # c_b: the product over [b, b + 2s), where still needed
        s *= 2
    return x


def _add_later_blocks(s: Tensor, z: Tensor, mp: Tensor, g: float) -> None:
    """Adds to ``s`` (in place) what all later blocks contribute, in each block's p units.

    Block b receives ``g^(valid tokens in b)·(Σ z over block b+1 + what b+1 receives)``.
    Shape: s, z, mp ``[B, nb, L]``.
    """
    B, nb, L = s.shape
    # g^(valid tokens in block) from the exact count in float64, not from p[:, :, -1]:
    # chained over thousands of tokens, g rounded to float32 would drift by ~1e-4 at g ≈ 1
    count = mp.reshape(B * nb, L).mv(mp.new_ones(L)).view(B, nb)[:, :-1]  # [B, nb-1]
    decay = count.double().mul_(math.log2(g)).exp2_().to(s.dtype)
    block_sum = s[:, 1:, 0] + z[:, 1:, 0]  # [B, nb-1]: blocks 1..nb-1
    s[:, :-1].add_(_chain_blocks(decay * block_sum, decay).unsqueeze(-1))


def _advantages_segmented(
    r: Tensor, v: Tensor, m: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Gap path: ``A_t = r_t − V_t + Σ_{valid j>t} (p_j / p_t)·w_j``, ``w = r + (1/λ − 1)·V``.

    p, the running product of g over valid tokens, restarts in every block of L tokens (so
    it stays in ``[g^L, 1]``); ``s_t = Σ_{j>t} p_j·w_j`` over the rest of the block is one
    matmul, and :func:`_add_later_blocks` adds the rest of the row. Returns like
    :func:`_advantages_single_span`.
    """
    B, T = r.shape
    L, g = _SEG_BLOCK, gamma * lam
    nb = -(-T // L)
    ws, mf = _workspace(m, r.dtype, 4, nb * L)  # mask, p, z, s
    mp = ws[0].view(B, nb, L)  # [B, nb, L]; padding counts as masked
    # running product of g (valid) and 1 (masked); (1 − m) + g·m is exactly g, unlike 1 + (g − 1)·m
    p = torch.sub(mp.new_ones(()), mp, out=ws[1].view(B, nb, L)).add_(mp, alpha=g).cumprod_(2)
    z = ws[2]  # [B, Tp]: p_j·w_j at valid j, else 0
    z[:, T:] = 0.0
    torch.add(r, v, alpha=1.0 / lam - 1.0, out=z[:, :T]).mul_(mf)
    z.mul_(p.view(B, nb * L))
    suffix = _strict_suffix_matrix(L, r.dtype, r.device)
    s = torch.mm(z.view(B * nb, L), suffix, out=ws[3].view(B * nb, L)).view(B, nb, L)
    if nb > 1:
        _add_later_blocks(s, z.view(B, nb, L), mp, g)
    adv = torch.sub(r, v).addcdiv_(s.view(B, nb * L)[:, :T], p.view(B, nb * L)[:, :T])  # [B, T]
    return adv.mul_(mf), mf


def compute_gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> GAEResult:
    """GAE advantages and returns without a Python loop over T (see the module docstring).

    Within 1e-5 (absolute plus relative) of :func:`compute_gae_reference` run in float64,
    also at T=8192 with γλ = 1, where the float32 loop itself drifts by ~3e-5. Inputs in
    bf16/fp16 are computed in float32, float64 in float64; outputs come back in the dtype
    of ``rewards``. Rewards and values at masked positions are ignored but must be finite
    (the fast paths multiply them by 0). Not differentiable: pass detached tensors.

    Shape: rewards, values, mask ``[B, T]`` (mask bool or 0/1); returns two ``[B, T]``.
    """
    _check(rewards, values, mask, gamma, lam)
    dtype = compute_dtype(rewards.dtype)
    r, v, m = rewards.to(dtype), values.to(dtype), as_bool_mask(mask)
    if r.numel() == 0:
        return GAEResult(torch.zeros_like(rewards), torch.zeros_like(rewards))
    if _single_span(m):
        path = _advantages_single_span
    elif gamma * lam >= _MIN_SEG_DECAY:
        path = _advantages_segmented
    else:
        path = _advantages_packed
    with _exact_matmul(r.device):
        adv, mf = path(r, v, m, gamma, lam)  # [B, T] each
    returns = torch.addcmul(adv, v, mf)
    return GAEResult(adv.to(rewards.dtype), returns.to(rewards.dtype))

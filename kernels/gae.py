"""Generalised advantage estimation on padded ``[B, T]`` batches.

    δ_t = r_t + γ·V_{t+1} − V_t,    A_t = δ_t + γλ·A_{t+1},    G_t = A_t + V_t

(Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE", eq. 16), with
the value after each row's last response token bootstrapped to 0.

Masked positions inside a row (tool or observation tokens of a multi-turn rollout) are
skipped: ``V_{t+1}`` is the value at the next *valid* position (0 if none) and the
running advantage carries through masked positions unchanged. Rewards and values at
masked positions are ignored, and ``A_t = G_t = 0`` there.

:func:`compute_gae_reference` is the plain reverse loop. :func:`compute_gae` solves the
same recurrence without a loop over T: valid tokens are packed to the front of each row
(skipped if every row's mask is a single span, the single-turn case), after which
``A = discounted_cumsum(δ, γλ)`` is a constant-coefficient recurrence that
:func:`discounted_cumsum` solves with one ``[L, L]`` matrix of discount powers per block
of L tokens and a recursive pass over the block starts.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.masked import as_bool_mask

__all__ = ["GAEResult", "compute_gae", "compute_gae_reference", "discounted_cumsum"]

_BLOCK = 32  # tokens per block; ~32 minimises matmul work (∝ L) plus block-level work (∝ T/L)


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


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def compute_gae_reference(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> GAEResult:
    """The plain reverse loop over T; the reference that :func:`compute_gae` must match.

    Shape: rewards, values, mask ``[B, T]``; returns two ``[B, T]`` tensors in the dtype
    of ``rewards`` (computed in float32, or float64 for float64 inputs).
    """
    _check(rewards, values, mask, gamma, lam)
    dtype = _compute_dtype(rewards.dtype)
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


def discounted_cumsum(x: Tensor, g: float, block: int = _BLOCK) -> Tensor:
    """``y_t = Σ_{s>=t} g^(s-t)·x_s`` along the last dim, i.e. ``y_t = x_t + g·y_{t+1}``.

    Blocked: inside each block of ``block`` tokens, ``y = x @ Mᵀ`` with the discount matrix
    M; the values at block starts obey the same recurrence with factor ``g^block`` and are
    solved by recursion; each block then adds ``g^(block-i)·y_{start of next block}``. All
    coefficients are powers of g <= 1, so nothing overflows (underflow only drops terms
    below float resolution, as the loop would).

    Shape: x ``[B, T]`` float; returns ``[B, T]``.
    """
    B, T = x.shape
    if T <= block:
        return x @ _discount_matrix(g, T, x.dtype, x.device).T
    nb = -(-T // block)
    xp = x if nb * block == T else F.pad(x, (0, nb * block - T))  # zeros at the end change nothing
    m = _discount_matrix(g, block, x.dtype, x.device)  # [L, L]
    local = torch.mm(xp.reshape(B * nb, block), m.T).view(B, nb, block)  # [B, nb, L]
    starts = discounted_cumsum(local[:, 1:, 0], g**block, block)  # [B, nb-1], y at blocks 1..nb-1
    tail = m[0].flip(0) * g  # [L], g^(L-i)
    local[:, :-1, :].addcmul_(starts.unsqueeze(-1), tail)
    return local.view(B, nb * block)[:, :T]


def _single_span(m: Tensor) -> bool:
    """True if every row's valid positions form one contiguous span (or none)."""
    rises = m[:, 0].to(torch.int32) + (m[:, 1:] & ~m[:, :-1]).sum(1, dtype=torch.int32)  # [B]
    return bool((rises <= 1).all())


def _advantages_single_span(r: Tensor, v: Tensor, mf: Tensor, gamma: float, g: float) -> Tensor:
    """Fast path: with one span per row, V_next = V_{t+1}·m_{t+1} and no packing is needed."""
    B, T = r.shape
    padded = r.new_zeros(B, -(-T // _BLOCK) * _BLOCK)  # [B, Tp], block-aligned, no later copy
    delta = padded[:, :T]
    torch.sub(r, v, out=delta)
    delta[:, :-1].addcmul_(v[:, 1:], mf[:, 1:], value=gamma)
    delta.mul_(mf)
    return discounted_cumsum(padded, g)[:, :T]


def _advantages_packed(r: Tensor, v: Tensor, mf: Tensor, gamma: float, g: float) -> Tensor:
    """General path: pack the valid tokens of each row to slots 1..n_b, solve, unpack.

    Slot 0 of each row is a dump for masked positions (zeroed). The packed values live
    in one flat buffer so that "value at the next slot" is a contiguous shifted view;
    the next slot after a row's last token is 0 (unwritten, or the next row's dump).
    """
    B, T = r.shape
    tp = -(-(T + 1) // _BLOCK) * _BLOCK  # slots 0..T, block-aligned
    slot = (mf.cumsum(1) * mf).long()  # [B, T]: k for the k-th valid token, 0 if masked
    v_flat = r.new_zeros(B * tp + 1)
    v_packed = v_flat[:-1].view(B, tp).scatter_(1, slot, v)  # [B, Tp]
    v_packed[:, 0] = 0.0
    delta = r.new_zeros(B, tp).scatter_(1, slot, r)  # [B, Tp], r at its slot
    delta[:, 0] = 0.0
    delta.sub_(v_packed).add_(v_flat[1:].view(B, tp), alpha=gamma)  # r_k + γ·v_{k+1} − v_k
    return torch.gather(discounted_cumsum(delta, g), 1, slot)  # [B, T]; slot 0 is masked out later


def compute_gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> GAEResult:
    """GAE advantages and returns without a Python loop over T (see the module docstring).

    Within 1e-5 (absolute plus relative) of :func:`compute_gae_reference` run in float64,
    also at T=8192 with γλ = 1, where the float32 loop itself drifts by ~3e-5. Inputs in
    bf16/fp16 are computed in float32, float64 in float64; outputs come back in the dtype
    of ``rewards``. Rewards and values at masked positions are ignored but must be finite
    (the single-span path multiplies them by 0).

    Shape: rewards, values, mask ``[B, T]`` (mask bool or 0/1); returns two ``[B, T]``.
    """
    _check(rewards, values, mask, gamma, lam)
    dtype = _compute_dtype(rewards.dtype)
    r, v, m = rewards.to(dtype), values.to(dtype), as_bool_mask(mask)
    if r.numel() == 0:
        return GAEResult(torch.zeros_like(rewards), torch.zeros_like(rewards))
    mf = m.to(dtype)  # [B, T]
    with _exact_matmul(r.device):
        if _single_span(m):
            adv = _advantages_single_span(r, v, mf, gamma, gamma * lam)
        else:
            adv = _advantages_packed(r, v, mf, gamma, gamma * lam)
    adv = adv * mf
    returns = torch.addcmul(adv, v, mf)
    return GAEResult(adv.to(rewards.dtype), returns.to(rewards.dtype))

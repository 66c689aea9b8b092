"""Triton kernels for log-probs and entropy of chosen tokens from logits ``[B, T, V]``.

One program per row (b, t) streams the vocab in tiles of ``BLOCK_V`` with an online
softmax (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"):

    m' = max(m, max x),   s' = s·e^(m−m') + Σ e^(x−m'),
    u' = e^(m−m')·(u + (m−m')·s) + Σ e^(x−m')·(x−m')

so that ``lse = m + log s`` and ``H = log s − u/s`` (both terms >= 0, no cancellation),
reading the logits once, in their dtype, with float32 arithmetic. Backward is one more
pass per row: ``∂L/∂x_j = (g·1[j=y] − p_j (g + h·H + h·log p_j)) / τ``, written in the
dtype of the logits. Extra memory: three float32 values per row.

Used for CUDA tensors by :func:`kernels.logprobs.token_logprobs` (backend ``auto`` or
``triton``); tests run it on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["triton_token_logprobs", "TritonLogitsFn"]


@triton.jit
def _fwd_kernel(
    logits_ptr, ids_ptr, logp_ptr, ent_ptr, lse_ptr,
    stride_b, stride_t, T, V, inv_temp,
    WITH_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    base = logits_ptr + (row // T).to(tl.int64) * stride_b + (row % T).to(tl.int64) * stride_t
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    u = tl.zeros([], tl.float32)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        inside = offs < V
        x = tl.load(base + offs, mask=inside, other=float("-inf")).to(tl.float32) * inv_temp
        m_new = tl.maximum(m, tl.max(x, axis=0))
        alpha = tl.exp(m - m_new)  # 0 on the first tile (m = -inf)
        xm = tl.where(inside, x - m_new, 0.0)  # [BLOCK_V], finite everywhere
        e = tl.where(inside, tl.exp(xm), 0.0)
        if WITH_ENTROPY:
            shift = tl.where(s > 0, m - m_new, 0.0)  # avoids -inf * 0 on the first tile
            u = alpha * (u + shift * s) + tl.sum(e * xm, axis=0)
        s = alpha * s + tl.sum(e, axis=0)
        m = m_new
    log_s = tl.log(s)
    lse = m + log_s
    target = tl.load(ids_ptr + row)
    x_t = tl.load(base + target).to(tl.float32) * inv_temp
    tl.store(logp_ptr + row, x_t - lse)
    tl.store(lse_ptr + row, lse)
    if WITH_ENTROPY:
        tl.store(ent_ptr + row, log_s - u / s)


@triton.jit
def _bwd_kernel(
    logits_ptr, ids_ptr, lse_ptr, ent_ptr, g_lp_ptr, g_ent_ptr, grad_ptr,
    stride_b, stride_t, T, V, inv_temp,
    HAS_G_LP: tl.constexpr, HAS_G_ENT: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    base = logits_ptr + (row // T).to(tl.int64) * stride_b + (row % T).to(tl.int64) * stride_t
    out = grad_ptr + row.to(tl.int64) * V
    lse = tl.load(lse_ptr + row)
    target = tl.load(ids_ptr + row)
    g = tl.zeros([], tl.float32)
    h = tl.zeros([], tl.float32)
    ent = tl.zeros([], tl.float32)
    if HAS_G_LP:
        g = tl.load(g_lp_ptr + row).to(tl.float32)
    if HAS_G_ENT:
        h = tl.load(g_ent_ptr + row).to(tl.float32)
        ent = tl.load(ent_ptr + row)
    a = -(g + h * ent) * inv_temp
    b = -h * inv_temp
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        inside = offs < V
        x = tl.load(base + offs, mask=inside, other=0.0).to(tl.float32) * inv_temp
        lp = x - lse
        grad = tl.exp(lp) * (a + b * lp) + tl.where(offs == target, g * inv_temp, 0.0)
        tl.store(out + offs, grad.to(grad_ptr.dtype.element_ty), mask=inside)


def _block_v(V: int) -> int:
    return min(triton.next_power_of_2(V), 4096)


class TritonLogitsFn(torch.autograd.Function):
    """Autograd wrapper of the two kernels; outputs ``(logp, entropy)`` float32 ``[B, T]``."""

    @staticmethod
    def forward(ctx, logits: Tensor, ids: Tensor, temperature: float, with_entropy: bool, block_v: int):
        B, T, V = logits.shape
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        logp = torch.empty(B * T, dtype=torch.float32, device=logits.device)  # [N]
        lse = torch.empty_like(logp)
        ent = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
        if B * T:
            ent_ptr = ent if with_entropy else lse  # an unused pointer must still be a valid allocation
            _fwd_kernel[(B * T,)](
                logits, ids, logp, ent_ptr, lse, logits.stride(0), logits.stride(1), T, V,
                1.0 / temperature, WITH_ENTROPY=with_entropy, BLOCK_V=block_v,
            )  # fmt: skip
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, ids, lse, ent)
        ctx.temperature, ctx.with_entropy, ctx.block_v = temperature, with_entropy, block_v
        return logp.view(B, T), (ent.view(B, T) if with_entropy else ent)

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, ids, lse, ent = ctx.saved_tensors
        has_h = ctx.with_entropy and g_ent is not None
        if g_logp is None and not has_h:
            return None, None, None, None, None
        B, T, V = logits.shape
        grad = torch.empty(B, T, V, dtype=logits.dtype, device=logits.device)  # [B, T, V]
        g_lp = g_logp.reshape(-1).contiguous() if g_logp is not None else lse
        g_h = g_ent.reshape(-1).contiguous() if has_h else lse
        if B * T:
            _bwd_kernel[(B * T,)](
                logits, ids, lse, ent if has_h else lse, g_lp, g_h, grad,
                logits.stride(0), logits.stride(1), T, V, 1.0 / ctx.temperature,
                HAS_G_LP=g_logp is not None, HAS_G_ENT=has_h, BLOCK_V=ctx.block_v,
            )  # fmt: skip
        return grad, None, None, None, None


def triton_token_logprobs(
    logits: Tensor, ids: Tensor, temperature: float, with_entropy: bool, block_v: int | None = None
) -> tuple[Tensor, Tensor]:
    """``(logp [B, T], entropy [B, T] or empty)`` via the Triton kernels.

    ``block_v``: vocab tile (a power of two; default min(next_pow2(V), 4096)).
    """
    block_v = block_v or _block_v(logits.shape[-1])
    return TritonLogitsFn.apply(logits, ids, temperature, with_entropy, block_v)

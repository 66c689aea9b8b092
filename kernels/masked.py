"""Masked reductions and whitening over padded ``[B, T]`` tensors.

Every function takes a ``mask`` of the same shape as the data (bool, or 0/1 of any
dtype); positions where the mask is false never influence a result, even if they hold
NaN or inf. Empty selections give 0 instead of NaN, so an all-masked row or batch is
safe to feed through a training step.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["compute_dtype", "as_bool_mask", "masked_sum", "masked_mean", "masked_var", "masked_whiten"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype reductions and recurrences run in: float64 stays float64; bfloat16, float16 and
    float32 compute in float32 (sums of many bf16 terms lose most of their bits)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def as_bool_mask(mask: Tensor) -> Tensor:
    """Returns ``mask`` as a bool tensor (``mask != 0`` for numeric masks)."""
    return mask if mask.dtype == torch.bool else mask != 0


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """``Σ x`` over the positions where ``mask`` is true; masked values are ignored.

    Shape: x and mask alike; the result drops ``dim`` (all dims when ``dim`` is None).
    """
    kept = torch.where(as_bool_mask(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return kept.sum() if dim is None else kept.sum(dim)


def _count(mask: Tensor, dim: int | None, dtype: torch.dtype) -> Tensor:
    m = as_bool_mask(mask)
    return (m.sum() if dim is None else m.sum(dim)).to(dtype)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """``Σ_mask x / n`` with ``n`` the number of selected positions; 0 where ``n == 0``.

    Shape: x and mask alike; the result drops ``dim``.
    """
    return masked_sum(x, mask, dim) / _count(mask, dim, x.dtype).clamp(min=1)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the selected entries of ``x`` (over all dims), a scalar.

    ``Σ (x - μ)² / (n - 1)`` (Bessel) when ``unbiased`` and ``n > 1``, else ``/ n``;
    0 when ``n <= 1`` so that a single token or an empty batch never gives NaN.
    """
    n = _count(mask, None, x.dtype)
    centred = x - masked_mean(x, mask)
    sq = masked_sum(centred * centred, mask)
    denom = n - 1 if unbiased else n
    return torch.where(n > 1, sq / denom.clamp(min=1), torch.zeros_like(sq))


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Whitening over all selected entries: ``(x - μ) / sqrt(σ² + eps)``.

    With ``shift_mean=False`` the mean is added back, ``(x - μ)/sqrt(σ² + eps) + μ``:
    only the scale changes (the "shift-preserving" variant of TRL's ``masked_whiten``).
    μ and σ² are :func:`masked_mean` and unbiased :func:`masked_var` over the whole
    tensor. Masked positions come out as 0.

    Shape: x and mask alike, e.g. ``[B, T]``.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(as_bool_mask(mask), out, torch.zeros((), dtype=out.dtype, device=out.device))

"""Log-probs and entropy of chosen tokens from hidden states and the output projection.

``logits = hidden @ weightᵀ`` is never materialised: each block of
``chunk_tokens × chunk_vocab`` logits is computed from a row chunk of ``hidden`` and a
vocab chunk of ``weight`` (in their dtype, as ``nn.Linear`` would), scaled by 1/τ and
reduced in float32 by :mod:`kernels.logprobs_chunked`. Blocks run vocab-outer, so each
slice of ``weight`` is read once per pass. Backward recomputes each block and sends

    ∂L/∂hidden[rows] += G @ weight[cols],    ∂L/∂weight[cols] += Gᵀ @ hidden[rows]

with G the block's ``∂L/∂logits``; both are accumulated in float32 across blocks (for
low-precision inputs this costs one float32 ``[N, D]`` buffer and one ``[chunk_vocab, D]``
buffer, the size of the hidden states, not of the logits).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.logprobs_chunked import (
    backward_state,
    block_grad,
    blocks,
    col_ranges,
    forward_stats,
    row_ranges,
    scaled,
    state_block,
)
from kernels.masked import compute_dtype

__all__ = ["HiddenFn", "HIDDEN_BLOCK_ELEMS", "HIDDEN_BLOCK_ELEMS_CUDA", "HIDDEN_CHUNK_VOCAB"]

HIDDEN_BLOCK_ELEMS = 1 << 20  # 4 MiB of float32 per temporary (CPU)
HIDDEN_BLOCK_ELEMS_CUDA = 1 << 24  # 64 MiB: GEMMs large enough to keep a GPU busy
HIDDEN_CHUNK_VOCAB = 4096


def _source(h2d: Tensor, weight: Tensor, temperature: float, dtype: torch.dtype):
    def src(r0: int, r1: int, v0: int, v1: int) -> Tensor:
        return scaled(h2d[r0:r1] @ weight[v0:v1].T, temperature, dtype)  # [r, c]

    return src


class HiddenFn(torch.autograd.Function):
    """Autograd for ``(log p(y), H)`` from ``hidden [B, T, D]`` and ``weight [V, D]``."""

    @staticmethod
    def forward(ctx, hidden, weight, ids, temperature, with_entropy, chunk_tokens, chunk_vocab):
        B, T, D = hidden.shape
        dtype = compute_dtype(hidden.dtype)
        h2d = hidden.reshape(B * T, D)  # [N, D]
        rows, cols = row_ranges(B, T, chunk_tokens, True), col_ranges(weight.shape[0], chunk_vocab)
        flat_ids = ids.reshape(-1).long()
        src = _source(h2d, weight, temperature, dtype)
        stats = forward_stats(src, flat_ids, rows, cols, with_entropy, dtype, vocab_outer=True)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, flat_ids, stats.entropy, stats.lse_c)
        ctx.args = (temperature, dtype, chunk_tokens, chunk_vocab)
        entropy = stats.entropy.view(B, T) if with_entropy else stats.logp.new_zeros(0)
        return stats.logp.view(B, T), entropy

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, ids, entropy, lse_c = ctx.saved_tensors
        temperature, dtype, chunk_tokens, chunk_vocab = ctx.args
        st = backward_state(g_logp, g_ent, entropy, lse_c, dtype)
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if st is None or not (want_h or want_w):
            return None, None, None, None, None, None, None
        B, T, D = hidden.shape
        V = weight.shape[0]
        h2d = hidden.reshape(B * T, D)  # [N, D]
        src = _source(h2d, weight, temperature, dtype)
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        grad_h = torch.zeros(B * T, D, dtype=acc, device=hidden.device) if want_h else None  # [N, D]
        grad_w = (torch.empty_like(weight) if B * T else torch.zeros_like(weight)) if want_w else None  # [V, D]
        rows, cols = row_ranges(B, T, chunk_tokens, True), col_ranges(V, chunk_vocab)
        w_acc = None
        for r0, r1, j, v0, v1 in blocks(rows, cols, vocab_outer=True):
            if r0 == 0 and want_w:
                w_acc = torch.zeros(v1 - v0, D, dtype=acc, device=weight.device)  # [c, D]
            g = block_grad(src(r0, r1, v0, v1), ids[r0:r1] - v0, state_block(st, r0, r1, j), temperature)
            g = g.to(hidden.dtype)  # [r, c]; the matmuls run in the model's dtype
            if want_h and acc == hidden.dtype:
                grad_h[r0:r1].addmm_(g, weight[v0:v1])
            elif want_h:
                grad_h[r0:r1] += g @ weight[v0:v1]
            if want_w:
                w_acc += g.T @ h2d[r0:r1]
                if r1 == B * T:
                    grad_w[v0:v1] = w_acc
        grad_hidden = grad_h.to(hidden.dtype).view(B, T, D) if want_h else None
        return grad_hidden, grad_w, None, None, None, None, None

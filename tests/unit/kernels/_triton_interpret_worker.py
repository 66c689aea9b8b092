"""Runs the Triton log-prob kernels under TRITON_INTERPRET=1 on CPU and prints, per case,
how far each output is from the naive reference, as JSON on stdout.

Started by ``test_logprobs_triton.py`` in a fresh interpreter: ``triton.jit`` (and
triton's own library functions) pick interpreted mode when triton is first imported, so
the variable must be set before that import and cannot be flipped inside a test session.

Each figure is ``max |got − ref| / (atol + rtol·|ref|)``: at most 1 means within tolerance.
"""

import json
import math
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from kernels.logprobs import token_logprobs_and_entropy_reference  # noqa: E402
from kernels.logprobs_triton import triton_token_logprobs  # noqa: E402

CASES = [
    # name, B, T, V, temperature, block_v, sliced, dtype
    ("single_token_vocab", 1, 1, 1, 1.0, None, False, "float32"),
    ("one_tile", 2, 3, 7, 1.0, None, False, "float32"),
    ("five_tiles_last_partial_sliced", 2, 4, 37, 0.7, 8, True, "float32"),
    ("tiles_divide_vocab", 3, 2, 64, 1.5, 16, False, "float32"),
    ("bf16_three_tiles_sliced", 2, 3, 37, 1.0, 16, True, "bfloat16"),
]


def violation(got: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float) -> float:
    return ((got.double() - ref.double()).abs() / (atol + rtol * ref.double().abs())).max().item()


def run(name, B, T, V, temperature, block_v, sliced, dtype):
    g = torch.Generator().manual_seed(len(name))
    logits = (torch.randn(B, T + sliced, V, generator=g) * 4).to(getattr(torch, dtype))[:, :T]
    logits.requires_grad_(True)
    ids = torch.randint(0, V, (B, T), generator=g)
    g_lp, g_h = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)

    lp, ent = triton_token_logprobs(logits, ids, temperature, True, block_v)
    (grad,) = torch.autograd.grad((lp * g_lp).sum() + (ent * g_h).sum(), logits)
    lp_only, _ = triton_token_logprobs(logits, ids, temperature, False, block_v)
    (grad_lp,) = torch.autograd.grad((lp_only * g_lp).sum(), logits)

    up = logits.detach().float().requires_grad_(True)  # the same values in float32
    ref = token_logprobs_and_entropy_reference(up, ids, temperature)
    (grad_ref,) = torch.autograd.grad((ref.logp * g_lp).sum() + (ref.entropy * g_h).sum(), up, retain_graph=True)
    (grad_lp_ref,) = torch.autograd.grad((ref.logp * g_lp).sum(), up)
    # float32 arithmetic on identical values, then one rounding of the gradient to bf16. The
    # interpreter truncates fp32 -> bf16 (a GPU rounds to nearest), so allow one bf16 ulp:
    # 2^-7 relative (the GPU test holds 2^-8).
    grad_rtol = 2**-7 if dtype == "bfloat16" else 1e-5
    return {
        "dtypes_ok": lp.dtype == torch.float32 and grad.dtype == logits.dtype,
        "logp": violation(lp, ref.logp, 1e-5, 1e-5),
        "entropy": violation(ent, ref.entropy, 1e-5, 1e-5),
        "grad": violation(grad, grad_ref, grad_rtol, 1e-6),
        "logp_only": violation(lp_only, ref.logp, 1e-5, 1e-5),
        "grad_logp_only": violation(grad_lp, grad_lp_ref, grad_rtol, 1e-6),
    }


def by_hand():
    """logits/τ = [0, ln 2, ln 5] (τ = 2), token 2: the numbers worked out in the test."""
    logits = (2 * torch.tensor([0.0, math.log(2.0), math.log(5.0)])).view(1, 1, 3).requires_grad_(True)
    lp, ent = triton_token_logprobs(logits, torch.tensor([[2]]), 2.0, True, 2)  # two tiles of 2
    (grad,) = torch.autograd.grad(lp.sum(), logits)
    return {"logp": lp.item(), "entropy": ent.item(), "grad": grad.view(3).tolist()}


if __name__ == "__main__":
    report = {case[0]: run(*case) for case in CASES}
    report["by_hand"] = by_hand()
    json.dump(report, sys.stdout)

"""Triton log-prob/entropy kernels: on CPU through TRITON_INTERPRET=1, on a GPU when present.

``triton.jit`` (and triton's own library functions) choose interpreted mode when triton
is first imported, so the CPU check runs ``_triton_interpret_worker.py`` in a fresh
Python with the variable set and asserts on the errors it reports; the modules of this
session, used for CUDA tensors, stay compiled.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.logprobs import token_logprobs, token_logprobs_and_entropy, token_logprobs_and_entropy_reference

pytestmark = pytest.mark.slow  # starts processes (make test-unit leaves it to make test)

pytest.importorskip("triton")

WORKER = Path(__file__).with_name("_triton_interpret_worker.py")
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def interpreted_report():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(WORKER)], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout)


CASES = [
    "single_token_vocab",
    "one_tile",
    "five_tiles_last_partial_sliced",  # online softmax across tiles; logits[:, :-1] strides
    "tiles_divide_vocab",
    "bf16_three_tiles_sliced",
]


@pytest.mark.parametrize("case", CASES)
def test_interpreted_kernels_match_reference(interpreted_report, case):
    report = interpreted_report[case]
    assert report.pop("dtypes_ok")
    # each figure is max |got - ref| / (atol + rtol·|ref|); <= 1 is within tolerance
    # (values: rtol = atol = 1e-5; gradients: rtol 1e-5 fp32 or 2^-7 bf16, atol 1e-6)
    assert all(v <= 1.0 for v in report.values()), report


def test_interpreted_kernels_by_hand(interpreted_report):
    # logits/τ = [0, ln 2, ln 5] -> p = [1/8, 2/8, 5/8]; token 2: log p = ln(5/8) = -0.4700036,
    # H = 1/8·ln 8 + 2/8·ln 4 + 5/8·ln(8/5) = 0.9002561 (as in test_logprobs.py);
    # ∂log p/∂logits = (onehot − p)/τ = [-1/16, -1/8, 3/16] with τ = 2
    report = interpreted_report["by_hand"]
    assert report["logp"] == pytest.approx(-0.4700036, abs=1e-6)
    assert report["entropy"] == pytest.approx(0.9002561, abs=1e-6)
    assert report["grad"] == pytest.approx([-1 / 16, -1 / 8, 3 / 16], abs=1e-7)


def test_cpu_tensors_never_dispatch_to_triton():
    logits = torch.randn(1, 2, 5)
    ids = torch.tensor([[0, 4]])
    # auto on CPU is the torch backend: it runs without a GPU and without the interpreter
    torch.testing.assert_close(token_logprobs(logits, ids), token_logprobs_and_entropy_reference(logits, ids).logp)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-5)])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_gpu_backends_match_reference(dtype, tol, backend):
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(4, 65, 5003, generator=g) * 3).to(dtype).cuda()[:, :64].requires_grad_(True)
    ids = torch.randint(0, 5003, (4, 64), generator=g).cuda()
    g_lp, g_h = torch.randn(4, 64, device="cuda"), torch.randn(4, 64, device="cuda")
    out = token_logprobs_and_entropy(logits, ids, 0.9, backend=backend)
    (grad,) = torch.autograd.grad((out.logp * g_lp).sum() + (out.entropy * g_h).sum(), logits)
    up = logits.detach().float().requires_grad_(True)
    ref = token_logprobs_and_entropy_reference(up, ids, 0.9)
    (grad_ref,) = torch.autograd.grad((ref.logp * g_lp).sum() + (ref.entropy * g_h).sum(), up)
    torch.testing.assert_close(out.logp, ref.logp, rtol=tol, atol=tol)
    torch.testing.assert_close(out.entropy, ref.entropy, rtol=tol, atol=tol)
    grad_tol = 2**-8 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(grad.float(), grad_ref, rtol=grad_tol, atol=1e-6)

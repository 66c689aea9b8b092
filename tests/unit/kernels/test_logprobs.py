"""Chunked log-probs / entropy (torch backend) against the naive log_softmax + gather."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.logprobs import (
    token_logprobs,
    token_logprobs_and_entropy,
    token_logprobs_and_entropy_from_hidden,
    token_logprobs_and_entropy_from_hidden_reference,
    token_logprobs_and_entropy_reference,
    token_logprobs_from_hidden,
    token_logprobs_reference,
)

# logits / τ = [0, ln 2, ln 5] -> p = [1/8, 2/8, 5/8]
LN = torch.tensor([0.0, math.log(2.0), math.log(5.0)])
# log p(2) = ln(5/8) = -0.4700036
# H = 1/8·ln 8 + 2/8·ln 4 + 5/8·ln(8/5) = 0.2599302 + 0.3465736 + 0.2937523 = 0.9002561
LOGP_2, ENTROPY = -0.4700036, 0.9002561


@pytest.mark.parametrize("chunk_vocab", [None, 1, 2])
def test_by_hand_with_temperature(chunk_vocab):
    logits = (2.0 * LN).view(1, 1, 3).requires_grad_(True)  # τ = 2 undoes the factor 2
    ids = torch.tensor([[2]])
    out = token_logprobs_and_entropy(logits, ids, temperature=2.0, chunk_vocab=chunk_vocab)
    assert out.logp.item() == pytest.approx(LOGP_2, abs=1e-6)
    assert out.entropy.item() == pytest.approx(ENTROPY, abs=1e-6)
    # ∂log p(2)/∂logits = (onehot - p)/τ = ([0, 0, 1] - [1/8, 2/8, 5/8])/2 = [-1/16, -1/8, 3/16]
    (grad,) = torch.autograd.grad(out.logp.sum(), logits)
    torch.testing.assert_close(grad.view(3), torch.tensor([-1 / 16, -1 / 8, 3 / 16]))
    lp = token_logprobs(logits, ids, temperature=2.0, chunk_vocab=chunk_vocab)
    assert lp.item() == pytest.approx(LOGP_2, abs=1e-6)


def test_entropy_gradient_by_hand():
    # ∂H/∂z_j = -p_j (ln p_j + H); z = logits (τ = 1), p = [1/8, 2/8, 5/8], H = 0.9002561
    # j=0: -0.125·(-2.0794415 + 0.9002561) = 0.1473982
    # j=1: -0.25 ·(-1.3862944 + 0.9002561) = 0.1215096
    # j=2: -0.625·(-0.4700036 + 0.9002561) = -0.2689078
    logits = LN.view(1, 1, 3).clone().requires_grad_(True)
    out = token_logprobs_and_entropy(logits, torch.tensor([[0]]), chunk_vocab=2)
    (grad,) = torch.autograd.grad(out.entropy.sum(), logits)
    torch.testing.assert_close(grad.view(3), torch.tensor([0.1473982, 0.1215096, -0.2689078]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("chunk_vocab", [None, 2])
def test_from_hidden_by_hand(chunk_vocab):
    # h = [1, 0] and W rows [0, 0], [ln 2, 0], [ln 5, 0] give logits [0, ln 2, ln 5] again
    hidden = torch.tensor([[[1.0, 0.0]]], requires_grad=True)
    weight = torch.stack([LN, torch.zeros(3)], dim=1).requires_grad_(True)  # [3, 2]
    out = token_logprobs_and_entropy_from_hidden(hidden, weight, torch.tensor([[2]]), chunk_vocab=chunk_vocab)
    assert out.logp.item() == pytest.approx(LOGP_2, abs=1e-6)
    assert out.entropy.item() == pytest.approx(ENTROPY, abs=1e-6)
    gh, gw = torch.autograd.grad(out.logp.sum(), (hidden, weight))
    # ∂log p(2)/∂h = Σ_j (1[j=2] − p_j)·W_j = -2/8·[ln 2, 0] + 3/8·[ln 5, 0]
    #              = [-0.1732868 + 0.6035392, 0] = [0.4302524, 0]
    torch.testing.assert_close(gh, torch.tensor([[[0.4302524, 0.0]]]))
    # ∂log p(2)/∂W_j = (1[j=2] − p_j)·h = rows [-1/8, 0], [-2/8, 0], [3/8, 0]
    torch.testing.assert_close(gw, torch.tensor([[-0.125, 0.0], [-0.25, 0.0], [0.375, 0.0]]))


@st.composite
def logit_cases(draw):
    B, T, V = draw(st.integers(1, 3)), draw(st.integers(1, 6)), draw(st.integers(1, 40))
    seed = draw(st.integers(0, 2**31))
    return dict(
        B=B, T=T, V=V, seed=seed,
        temperature=draw(st.sampled_from([1.0, 0.6, 1.7])),
        chunk_tokens=draw(st.none() | st.integers(1, 7)),
        chunk_vocab=draw(st.none() | st.integers(1, 45)),
        sliced=draw(st.booleans()),  # logits[:, :-1]: not viewable as [B·T, V]
        scale=draw(st.sampled_from([1.0, 10.0])),
    )  # fmt: skip


def _make(case, dtype):
    g = torch.Generator().manual_seed(case["seed"])
    B, T, V = case["B"], case["T"], case["V"]
    logits = torch.randn(B, T + case["sliced"], V, generator=g, dtype=torch.float64) * case["scale"]
    logits = logits.to(dtype)[:, :T]
    ids = torch.randint(0, V, (B, T), generator=g)
    return logits.requires_grad_(True), ids, torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)


def _values_and_grads(fn, logits, ids, g_lp, g_h, **kw):
    out = fn(logits, ids, **kw)
    loss = (out.logp * g_lp.to(out.logp.dtype)).sum() + (out.entropy * g_h.to(out.logp.dtype)).sum()
    (grad,) = torch.autograd.grad(loss, logits)
    return out.logp.detach(), out.entropy.detach(), grad


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(logit_cases())
def test_chunked_matches_reference_float64_and_float32(case):
    kw = dict(chunk_tokens=case["chunk_tokens"], chunk_vocab=case["chunk_vocab"])
    for dtype, tol in [(torch.float64, 1e-10), (torch.float32, 1e-5)]:
        logits, ids, g_lp, g_h = _make(case, dtype)
        t = case["temperature"]
        got = _values_and_grads(token_logprobs_and_entropy, logits, ids, g_lp, g_h, temperature=t, **kw)
        ref = _values_and_grads(token_logprobs_and_entropy_reference, logits, ids, g_lp, g_h, temperature=t)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
        # log-prob only: value and gradient
        lp = token_logprobs(logits, ids, t, **kw)
        (g1,) = torch.autograd.grad((lp * g_lp.to(dtype)).sum(), logits)
        lp_ref = token_logprobs_reference(logits, ids, t)
        (g2,) = torch.autograd.grad((lp_ref * g_lp.to(dtype)).sum(), logits)
        torch.testing.assert_close(lp, lp_ref, rtol=tol, atol=tol)
        torch.testing.assert_close(g1, g2, rtol=tol, atol=tol)


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(logit_cases())
def test_bfloat16_logits_against_float32_reference(case):
    logits, ids, g_lp, g_h = _make(case, torch.bfloat16)
    kw = dict(chunk_tokens=case["chunk_tokens"], chunk_vocab=case["chunk_vocab"], temperature=case["temperature"])
    lp, ent, grad = _values_and_grads(token_logprobs_and_entropy, logits, ids, g_lp, g_h, **kw)
    assert lp.dtype == torch.float32 and grad.dtype == torch.bfloat16
    up = logits.detach().float().requires_grad_(True)  # the same bf16 values, exactly, in float32
    lp_ref, ent_ref, grad_ref = _values_and_grads(
        token_logprobs_and_entropy_reference, up, ids, g_lp, g_h, temperature=case["temperature"]
    )
    # float32 accumulation on identical inputs: values agree to float32 rounding
    torch.testing.assert_close(lp, lp_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ent_ref, rtol=1e-5, atol=1e-5)
    # the gradient is rounded once to bf16 (relative error <= 2^-9)
    # (atol: the reference itself varies by ~1e-6 with the thread count on near-zero entries)
    torch.testing.assert_close(grad.float(), grad_ref, rtol=2**-8, atol=1e-5)


@pytest.mark.slow
def test_gradcheck_float64_split_vocab():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 7, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 7, (2, 3), generator=g)

    def f(x):
        out = token_logprobs_and_entropy(x, ids, 0.8, chunk_tokens=2, chunk_vocab=3)
        return out.logp, out.entropy

    assert torch.autograd.gradcheck(f, (logits,))


@pytest.mark.slow
def test_gradcheck_from_hidden():
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(9, 4, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 9, (2, 3), generator=g)

    def f(h, w):
        out = token_logprobs_and_entropy_from_hidden(h, w, ids, 1.3, chunk_tokens=4, chunk_vocab=4)
        return out.logp, out.entropy

    assert torch.autograd.gradcheck(f, (hidden, weight))


@st.composite
def hidden_cases(draw):
    return dict(
        B=draw(st.integers(1, 3)), T=draw(st.integers(1, 5)), V=draw(st.integers(1, 30)), D=draw(st.integers(1, 8)),
        seed=draw(st.integers(0, 2**31)), temperature=draw(st.sampled_from([1.0, 0.7])),
        chunk_tokens=draw(st.none() | st.integers(1, 6)), chunk_vocab=draw(st.none() | st.integers(1, 31)),
    )  # fmt: skip


def _hidden_inputs(case, dtype):
    g = torch.Generator().manual_seed(case["seed"])
    B, T, V, D = case["B"], case["T"], case["V"], case["D"]
    hidden = torch.randn(B, T, D, generator=g).to(dtype).requires_grad_(True)
    weight = torch.randn(V, D, generator=g).to(dtype).requires_grad_(True)
    ids = torch.randint(0, V, (B, T), generator=g)
    return hidden, weight, ids, torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)


def _hidden_values_and_grads(fn, hidden, weight, ids, g_lp, g_h, **kw):
    out = fn(hidden, weight, ids, **kw)
    loss = (out.logp * g_lp.to(out.logp.dtype)).sum() + (out.entropy * g_h.to(out.logp.dtype)).sum()
    return (out.logp.detach(), out.entropy.detach(), *torch.autograd.grad(loss, (hidden, weight)))


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(hidden_cases())
def test_from_hidden_matches_reference(case):
    kw = dict(chunk_tokens=case["chunk_tokens"], chunk_vocab=case["chunk_vocab"])
    for dtype, tol in [(torch.float64, 1e-10), (torch.float32, 2e-5)]:
        h, w, ids, g_lp, g_h = _hidden_inputs(case, dtype)
        t = case["temperature"]
        args = (h, w, ids, g_lp, g_h)
        got = _hidden_values_and_grads(token_logprobs_and_entropy_from_hidden, *args, temperature=t, **kw)
        ref = _hidden_values_and_grads(token_logprobs_and_entropy_from_hidden_reference, *args, temperature=t)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
        lp = token_logprobs_from_hidden(h, w, ids, t, **kw)
        torch.testing.assert_close(lp, token_logprobs_reference(h @ w.T, ids, t), rtol=tol, atol=tol)


def test_from_hidden_bfloat16_error_is_that_of_bf16_logits():
    # bf16 logits carry a relative rounding error of 2^-9 (more with a different GEMM
    # blocking), so |Δ log p| <= 2·max|Δz| <= 2·2^-8·max|z|. The naive bf16 path obeys the
    # same bound; the chunked one must too, against exact float32 products.
    g = torch.Generator().manual_seed(5)
    h32, w32 = torch.randn(2, 16, 32, generator=g), torch.randn(300, 32, generator=g) / 4
    ids = torch.randint(0, 300, (2, 16), generator=g)
    exact = token_logprobs_and_entropy_from_hidden_reference(h32, w32, ids)
    h, w = h32.bfloat16(), w32.bfloat16()
    bound = 2 * 2**-8 * (h.float() @ w.float().T).abs().max().item() + 1e-5
    got = token_logprobs_and_entropy_from_hidden(h, w, ids, chunk_tokens=8, chunk_vocab=64)
    naive = token_logprobs_and_entropy_from_hidden_reference(h, w, ids)
    for out in (got, naive):
        assert (out.logp - exact.logp).abs().max().item() <= bound
        assert (out.entropy - exact.entropy).abs().max().item() <= bound


def test_no_grad_needed_for_frozen_weight():
    h = torch.randn(1, 2, 3, requires_grad=True)
    w = torch.randn(5, 3)
    lp = token_logprobs_from_hidden(h, w, torch.tensor([[1, 4]]))
    (gh,) = torch.autograd.grad(lp.sum(), h)
    (gh_ref,) = torch.autograd.grad(token_logprobs_reference(h @ w.T, torch.tensor([[1, 4]])).sum(), h)
    torch.testing.assert_close(gh, gh_ref)


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="token_ids"):
        token_logprobs(torch.zeros(1, 2, 3), torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="weight"):
        token_logprobs_from_hidden(torch.zeros(1, 2, 3), torch.zeros(5, 4), torch.zeros(1, 2, dtype=torch.long))

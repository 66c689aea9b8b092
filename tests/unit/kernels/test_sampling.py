"""The processed distribution (temperature, top-k, top-p as vLLM applies them) and the exponential
race that draws from it, against hand-worked values and observed frequencies."""

import math

import pytest
import torch

from kernels.sampling import exponential_race, processed_logprobs, top_k_top_p_filter

LOGITS = torch.tensor([[2.0, 1.0, 0.0, -1.0]])  # softmax: 0.6439 0.2369 0.0871 0.0321


def test_top_k_keeps_the_k_largest_and_their_ties():
    kept = top_k_top_p_filter(LOGITS, top_k=2).isfinite()
    assert kept.tolist() == [[True, True, False, False]]
    ties = torch.tensor([[3.0, 1.0, 1.0, 0.0]])
    assert top_k_top_p_filter(ties, top_k=2).isfinite().tolist() == [[True, True, True, False]]  # vLLM: >= k-th


def test_top_p_keeps_the_smallest_set_reaching_p():
    # ascending probs 0.0321 0.0871 0.2369 0.6439, cumulative 0.0321 0.1192 0.3561 1: drop where <= 1 - p
    assert top_k_top_p_filter(LOGITS, top_p=0.7).isfinite().tolist() == [[True, True, False, False]]
    assert top_k_top_p_filter(LOGITS, top_p=0.9).isfinite().tolist() == [[True, True, True, False]]
    assert top_k_top_p_filter(LOGITS, top_p=0.1).isfinite().tolist() == [[True, False, False, False]]  # >= 1 kept


def test_processed_logprobs_are_of_the_renormalised_distribution():
    p = torch.softmax(LOGITS[0] / 0.5, -1)  # temperature 0.5
    kept = p[0] + p[1]
    got = processed_logprobs(LOGITS, 0.5, top_k=2)[0]
    assert got[:2].tolist() == pytest.approx([math.log(p[0] / kept), math.log(p[1] / kept)], abs=1e-6)
    assert got[2:].tolist() == [-math.inf, -math.inf]
    whole = processed_logprobs(LOGITS, 0.5)[0]
    assert whole.tolist() == pytest.approx(torch.log(p).tolist(), abs=1e-6)
    greedy = processed_logprobs(LOGITS, 0.0)[0]  # vLLM's greedy log-probs: the plain log-softmax
    assert greedy.tolist() == pytest.approx(torch.log_softmax(LOGITS[0], -1).tolist(), abs=1e-6)


def test_exponential_race_draws_with_the_probabilities():
    logp = processed_logprobs(LOGITS, 1.0).expand(20000, 4).contiguous()
    tokens = exponential_race(logp, [torch.Generator().manual_seed(s) for s in range(20000)])
    freq = torch.bincount(tokens, minlength=4).double() / 20000
    want = torch.softmax(LOGITS[0].double(), -1)
    assert (freq - want).abs().max() < 4 * math.sqrt(0.25 / 20000)  # 4 standard errors at most
    masked = processed_logprobs(LOGITS, 1.0, top_k=1).expand(100, 4).contiguous()
    assert exponential_race(masked, [torch.Generator().manual_seed(s) for s in range(100)]).eq(0).all()


def test_each_row_depends_on_its_own_generator_only():
    logp = torch.log_softmax(torch.randn(6, 50, generator=torch.Generator().manual_seed(0)), -1)
    seeds = [11, 12, 13, 14, 15, 16]
    together = exponential_race(logp, [torch.Generator().manual_seed(s) for s in seeds])
    alone = [int(exponential_race(logp[i:i + 1], [torch.Generator().manual_seed(seeds[i])])) for i in range(6)]
    assert together.tolist() == alone

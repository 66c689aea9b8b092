"""Masked reductions, whitening and loss aggregation: hand-worked values and edge cases."""

import math

import pytest
import torch

from kernels.aggregation import LossAgg, aggregate
from kernels.masked import masked_mean, masked_sum, masked_var, masked_whiten

X = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
M = torch.tensor([[1, 1, 1, 0]])


def test_masked_sum_mean_var_by_hand():
    # selected 1, 2, 3: sum 6, mean 2, unbiased var ((1-2)² + 0 + (3-2)²)/2 = 1, biased 2/3
    assert masked_sum(X, M).item() == 6.0
    assert masked_mean(X, M).item() == 2.0
    assert masked_var(X, M).item() == pytest.approx(1.0)
    assert masked_var(X, M, unbiased=False).item() == pytest.approx(2 / 3)


def test_masked_mean_per_row_and_empty_rows():
    x = torch.tensor([[1.0, 3.0], [5.0, float("nan")]])
    m = torch.tensor([[True, True], [False, False]])
    # row 0: (1+3)/2 = 2; row 1: nothing selected -> 0, and its NaN never leaks
    torch.testing.assert_close(masked_mean(x, m, dim=1), torch.tensor([2.0, 0.0]))
    assert masked_mean(x, m).item() == 2.0


def test_masked_var_single_and_empty_selection_are_zero():
    assert masked_var(torch.tensor([4.0, 7.0]), torch.tensor([True, False])).item() == 0.0
    assert masked_var(torch.tensor([4.0, 7.0]), torch.tensor([False, False])).item() == 0.0


def test_masked_whiten_by_hand():
    # mean 2, var 1 -> (x - 2)/sqrt(1 + 1e-8) = [-1, 0, 1]; masked position -> 0
    out = masked_whiten(X, M)
    torch.testing.assert_close(out, torch.tensor([[-1.0, 0.0, 1.0, 0.0]]), atol=1e-6, rtol=0)
    # shift-preserving: the mean 2 is added back -> [1, 2, 3]
    out = masked_whiten(X, M, shift_mean=False)
    torch.testing.assert_close(out, torch.tensor([[1.0, 2.0, 3.0, 0.0]]), atol=1e-6, rtol=0)


def test_masked_whiten_of_one_token_is_finite():
    out = masked_whiten(torch.tensor([[5.0, 1.0]]), torch.tensor([[1, 0]]))
    assert torch.equal(out, torch.zeros(1, 2))


LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [7.0, 7.0, 7.0]])
LMASK = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize(
    "agg, expected",
    [
        # tokens 1, 2, 3, 4: 10 / 4
        (LossAgg.TOKEN_MEAN, 2.5),
        # row means 2 and 4; the empty row does not count: (2 + 4) / 2
        (LossAgg.SEQ_MEAN_TOKEN_MEAN, 3.0),
        # row sums 6 and 4: (6 + 4) / 2
        (LossAgg.SEQ_MEAN_TOKEN_SUM, 5.0),
        # the same over a constant L = 4 (Dr. GRPO): (6 + 4) / (2 · 4)
        (LossAgg.SEQ_MEAN_TOKEN_SUM_NORM, 1.25),
    ],
)
def test_aggregation_by_hand(agg, expected):
    assert aggregate(LOSS, LMASK, agg, horizon=4).item() == pytest.approx(expected)


def test_token_sum_norm_weighs_every_token_alike_whatever_the_lengths():
    # one token of loss 1 in a row of 1 token or of 3: the same contribution 1/(N_seq·L), unlike
    # the per-sequence mean (1 vs 1/3)
    loss = torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    short, long_ = torch.tensor([[1, 0, 0], [0, 0, 0]]), torch.tensor([[1, 1, 1], [0, 0, 0]])
    norm = [aggregate(loss, m, "seq_mean_token_sum_norm", num_seqs=2, horizon=8).item() for m in (short, long_)]
    assert norm == pytest.approx([1 / 16, 1 / 16])
    means = [aggregate(loss, m, "seq_mean_token_mean", num_seqs=2).item() for m in (short, long_)]
    assert means == pytest.approx([1 / 2, 1 / 6])
    with pytest.raises(ValueError, match="needs a horizon L > 0"):
        aggregate(loss, short, "seq_mean_token_sum_norm")


def test_aggregation_global_denominators():
    # token_mean over a global count of 8 tokens: 10 / 8; seq modes over 5 sequences
    assert aggregate(LOSS, LMASK, "token_mean", num_tokens=8).item() == pytest.approx(1.25)
    assert aggregate(LOSS, LMASK, "seq_mean_token_mean", num_seqs=5).item() == pytest.approx(6 / 5)
    assert aggregate(LOSS, LMASK, "seq_mean_token_sum", num_seqs=5).item() == pytest.approx(10 / 5)


def test_minibatch_losses_sum_to_the_global_token_mean():
    torch.manual_seed(0)
    loss, mask = torch.randn(6, 5), torch.rand(6, 5) > 0.3
    n = int(mask.sum())
    parts = [aggregate(loss[i : i + 2], mask[i : i + 2], "token_mean", num_tokens=n) for i in range(0, 6, 2)]
    assert sum(parts).item() == pytest.approx(aggregate(loss, mask).item(), rel=1e-6)


@pytest.mark.parametrize("agg", list(LossAgg))
def test_aggregation_of_empty_mask_is_zero_not_nan(agg):
    out = aggregate(torch.ones(2, 3), torch.zeros(2, 3), agg, horizon=3)
    assert out.item() == 0.0 and not math.isnan(out.item())

"""GAE: hand-worked examples, the fast paths against the reverse loop, long rows, bf16."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import gae
from kernels.gae import _chain_blocks, _single_span, compute_gae, compute_gae_reference, discounted_cumsum

BOTH = [compute_gae, compute_gae_reference]


@pytest.mark.parametrize("fn", BOTH)
def test_gap_inside_row_by_hand(fn):
    # γ = λ = 0.5 (γλ = 0.25); row 0 has a tool token at t=1 (masked), row 1 is all masked.
    # t=3: next V = 0 (last token)  δ = 2 + 0 - 1 = 1             A = 1            G = 2
    # t=2: next V = V3 = 1          δ = 0 + 0.5·1 - 1 = -0.5      A = -0.5 + 0.25·1 = -0.25    G = 0.75
    # t=1: masked: A = G = 0; the carry (A = -0.25, next V = V2 = 1) passes through unchanged
    # t=0: next V = V2 = 1          δ = 1 + 0.5·1 - 0.5 = 1       A = 1 + 0.25·(-0.25) = 0.9375  G = 1.4375
    rewards = torch.tensor([[1.0, 9.0, 0.0, 2.0], [1.0, 1.0, 1.0, 1.0]])
    values = torch.tensor([[0.5, 7.0, 1.0, 1.0], [3.0, 3.0, 3.0, 3.0]])
    mask = torch.tensor([[1, 0, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    adv, ret = fn(rewards, values, mask, gamma=0.5, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.9375, 0.0, -0.25, 1.0], [0.0] * 4]))
    torch.testing.assert_close(ret, torch.tensor([[1.4375, 0.0, 0.75, 2.0], [0.0] * 4]))


@pytest.mark.parametrize("fn", BOTH)
def test_right_padded_row_by_hand(fn):
    # one span per row (the fast path); γ = λ = 0.5
    # t=2: δ = 1 + 0 - 0.5 = 0.5                    A = 0.5                          G = 1.0
    # t=1: δ = 0 + 0.5·0.5 - 0.5 = -0.25            A = -0.25 + 0.25·0.5 = -0.125      G = 0.375
    # t=0: δ = -0.25                                A = -0.25 + 0.25·(-0.125) = -0.28125  G = 0.21875
    rewards = torch.tensor([[0.0, 0.0, 1.0, 5.0]])
    values = torch.tensor([[0.5, 0.5, 0.5, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    adv, ret = fn(rewards, values, mask, 0.5, 0.5)
    torch.testing.assert_close(adv, torch.tensor([[-0.28125, -0.125, 0.5, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.21875, 0.375, 1.0, 0.0]]))


def test_single_span_detection():
    assert _single_span(torch.tensor([[1, 1, 0], [0, 1, 1], [0, 0, 0]], dtype=torch.bool))
    assert not _single_span(torch.tensor([[1, 0, 1]], dtype=torch.bool))


def test_discounted_cumsum_by_hand_across_blocks():
    # x = 1 everywhere, g = 0.5: y_t = Σ_{k < T-t} 0.5^k = 2 - 0.5^(T-1-t); block 4 forces 3 levels
    x = torch.ones(1, 37, dtype=torch.float64)
    t = torch.arange(37, dtype=torch.float64)
    torch.testing.assert_close(discounted_cumsum(x, 0.5, block=4), (2 - 0.5 ** (36 - t)).unsqueeze(0))


@pytest.mark.parametrize("T", [5, 32, 96])
def test_discounted_cumsum_writes_into_out(T):
    x = torch.randn(3, T, dtype=torch.float64)
    out = torch.full_like(x, float("nan"))
    y = discounted_cumsum(x, 0.9, out=out)
    assert y.data_ptr() == out.data_ptr()
    torch.testing.assert_close(y, discounted_cumsum(x, 0.9), rtol=0, atol=0)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 63])
def test_chain_blocks_matches_the_sequential_recurrence(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(3, n, generator=g, dtype=torch.float64)
    c = torch.rand(3, n, generator=g, dtype=torch.float64)
    expected, y = torch.zeros_like(x), torch.zeros(3, dtype=torch.float64)
    for b in reversed(range(n)):  # y_b = x_b + c_b·y_{b+1}
        y = x[:, b] + c[:, b] * y
        expected[:, b] = y
    torch.testing.assert_close(_chain_blocks(x.clone(), c), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "gamma, lam, path",
    [
        (1.0, 0.95, "segmented"),
        (0.5, 0.5, "segmented"),
        (1.0, 1 / 16, "segmented"),
        (0.2, 0.2, "packed"),
        (1.0, 0.0, "packed"),
    ],
)
def test_gap_masks_take_the_expected_path(monkeypatch, gamma, lam, path):
    # gaps with γλ >= 1/16 skip packing; below it (g^L near float32 underflow) they pack
    calls = []
    for name in ("_advantages_segmented", "_advantages_packed", "_advantages_single_span"):
        fn = getattr(gae, name)
        monkeypatch.setattr(gae, name, lambda *a, _fn=fn, _name=name: calls.append(_name) or _fn(*a))
    mask = torch.tensor([[1, 0, 1, 1]], dtype=torch.bool)
    compute_gae(torch.ones(1, 4), torch.ones(1, 4), mask, gamma, lam)
    assert calls == [f"_advantages_{path}"]


def test_rejects_bad_arguments():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="gamma"):
        compute_gae(x, x, x, gamma=1.5, lam=0.9)
    with pytest.raises(ValueError, match="shape"):
        compute_gae(x, torch.zeros(2, 4), x, 1.0, 0.9)


def _masks(draw, B, T):
    kind = draw(st.sampled_from(["random", "span", "prefix", "none", "all"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    if kind == "random":
        m = torch.rand(B, T, generator=g) < draw(st.floats(0.1, 0.9))
    elif kind in ("span", "prefix"):
        start = torch.randint(0, T + 1, (B, 1), generator=g)
        if kind == "prefix":
            start.zero_()
        end = torch.randint(0, T + 1, (B, 1), generator=g)
        m = (torch.arange(T) >= start) & (torch.arange(T) < end)
    else:
        m = torch.full((B, T), kind == "all")
    if B > 1 and draw(st.booleans()):
        m[draw(st.integers(0, B - 1))] = False  # an all-masked row
    return m, g


@st.composite
def gae_cases(draw):
    B, T = draw(st.integers(1, 5)), draw(st.sampled_from([1, 2, 3, 31, 32, 33, 64, 70, 100]))
    m, g = _masks(draw, B, T)
    gamma = draw(st.sampled_from([0.0, 0.5, 0.99, 1.0]) | st.floats(0.0, 1.0))
    lam = draw(st.sampled_from([0.0, 0.95, 1.0]) | st.floats(0.0, 1.0))
    rewards, values = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    return rewards, values, m, gamma, lam


def _assert_matches_reference_loop(rewards, values, mask, gamma, lam, fast_mask):
    """compute_gae against the reverse loop: to rounding in float64, within 1e-5 in float32
    (``fast_mask``: the mask as the fast path is given it, bool or float)."""
    ref64 = compute_gae_reference(rewards.double(), values.double(), mask, gamma, lam)
    out64 = compute_gae(rewards.double(), values.double(), mask, gamma, lam)
    torch.testing.assert_close(out64.advantages, ref64.advantages, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out64.returns, ref64.returns, rtol=1e-10, atol=1e-10)
    ref = compute_gae_reference(rewards, values, mask, gamma, lam)
    out = compute_gae(rewards, values, fast_mask, gamma, lam)
    torch.testing.assert_close(out.advantages, ref.advantages, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.returns, ref.returns, rtol=1e-5, atol=1e-5)
    return out


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(gae_cases())
def test_fast_matches_reference_loop(case):
    rewards, values, mask, gamma, lam = case
    out = _assert_matches_reference_loop(rewards, values, mask, gamma, lam, fast_mask=mask.float())
    assert torch.all(out.advantages[~mask] == 0) and torch.all(out.returns[~mask] == 0)


@st.composite
def multi_turn_cases(draw):
    # rows of alternating response spans and masked tool/observation spans of 1..40 tokens,
    # crossing the 16-token blocks of the gap path; γλ on both sides of the packing threshold
    B, T = draw(st.integers(1, 4)), draw(st.sampled_from([1, 2, 15, 16, 17, 33, 100, 257]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    m = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        t, valid = 0, draw(st.booleans())
        while t < T:
            n = int(torch.randint(1, 41, (1,), generator=g))
            m[b, t : t + n] = valid
            t, valid = t + n, not valid
    if draw(st.booleans()):
        m[draw(st.integers(0, B - 1))] = False  # an all-masked row
    gamma = draw(st.sampled_from([1.0, 0.99, 0.5, 0.25]) | st.floats(0.0, 1.0))
    lam = draw(st.sampled_from([1.0, 0.95, 0.25, 1 / 16]) | st.floats(0.0, 1.0))
    rewards, values = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    return rewards, values, m, gamma, lam


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(multi_turn_cases())
def test_fast_matches_reference_loop_on_multi_turn_masks(case):
    rewards, values, mask, gamma, lam = case
    out = _assert_matches_reference_loop(rewards, values, mask, gamma, lam, fast_mask=mask)
    assert torch.all(out.advantages[~mask] == 0) and torch.all(out.returns[~mask] == 0)


@pytest.mark.slow
@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (1.0, 0.999), (0.999, 0.95)])
@pytest.mark.parametrize("gaps", [False, True])
def test_long_rows_stay_within_1e5_of_the_loop(gamma, lam, gaps):
    # At T=8192 with γλ near 1 the float32 loop itself drifts by up to ~3e-5 from the exact
    # result (8192 sequential roundings), so the yardstick is the same loop in float64.
    g = torch.Generator().manual_seed(1)
    B, T = 3, 8192
    rewards, values = torch.randn(B, T, generator=g) * 0.1, torch.randn(B, T, generator=g)
    mask = torch.arange(T) < torch.tensor([[T], [5000], [1]])
    if gaps:
        mask &= torch.rand(B, T, generator=g) < 0.8
    exact = compute_gae_reference(rewards.double(), values.double(), mask, gamma, lam)
    out = compute_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(out.advantages.double(), exact.advantages, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.returns.double(), exact.returns, rtol=1e-5, atol=1e-5)
    # and the fast float32 result is no further from exact than the float32 loop (or 1e-5)
    loop32 = compute_gae_reference(rewards, values, mask, gamma, lam)
    loop_err = (loop32.advantages.double() - exact.advantages).abs().max().item()
    fast_err = (out.advantages.double() - exact.advantages).abs().max().item()
    assert fast_err <= max(loop_err, 1e-5)


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.1), (0.3, 0.3)])
def test_gap_path_with_small_lambda_is_as_accurate_as_the_float32_loop(gamma, lam):
    # the gap path weighs each V by 1/λ − 1 (9 at λ = 0.1) and scales by running products of γλ,
    # so γλ must enter exactly as fl32(γλ), not as 1 + (γλ − 1) (off by ~1e-7 relative)
    g = torch.Generator().manual_seed(3)
    rewards, values = torch.randn(64, 1024, generator=g) * 2, torch.randn(64, 1024, generator=g) * 2
    mask = torch.rand(64, 1024, generator=g) < 0.6
    exact = compute_gae_reference(rewards.double(), values.double(), mask, gamma, lam).advantages
    loop32 = compute_gae_reference(rewards, values, mask, gamma, lam).advantages
    loop_err = (loop32.double() - exact).abs().max()
    fast_err = (compute_gae(rewards, values, mask, gamma, lam).advantages.double() - exact).abs().max()
    assert fast_err <= 2 * loop_err


def test_bfloat16_inputs_match_float32_reference_to_bf16_rounding():
    g = torch.Generator().manual_seed(2)
    rewards, values = torch.randn(4, 50, generator=g).bfloat16(), torch.randn(4, 50, generator=g).bfloat16()
    mask = torch.rand(4, 50, generator=g) < 0.7
    out = compute_gae(rewards, values, mask, 0.99, 0.95)
    ref = compute_gae_reference(rewards.float(), values.float(), mask, 0.99, 0.95)
    assert out.advantages.dtype == torch.bfloat16
    # computed in float32 from the same bf16 inputs; only the final rounding to bf16
    # (relative error <= 2^-9) separates them
    torch.testing.assert_close(out.advantages.float(), ref.advantages, rtol=2**-8, atol=1e-6)
    torch.testing.assert_close(out.returns.float(), ref.returns, rtol=2**-8, atol=1e-6)


def test_empty_batch():
    out = compute_gae(torch.zeros(0, 5), torch.zeros(0, 5), torch.zeros(0, 5), 1.0, 0.95)
    assert out.advantages.shape == (0, 5)

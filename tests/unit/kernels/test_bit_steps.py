"""The delta push's one pass (kernels/bit_steps.py) against torch's own cast and the separate passes it replaces:
the same positions, new bits and steps, bit for bit, on the values where a rounding could differ."""

from __future__ import annotations

import pytest
import torch

from kernels.bit_steps import changed_steps, library, simd
from models.engines.weight_delta import changed, exceptions_of, steps_of

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler builds kernels/bit_steps.py")

INT = {torch.bfloat16: torch.int16, torch.float32: torch.int32}


def _edges() -> torch.Tensor:
    """float32 values where a cast to bfloat16 is easy to get wrong: ties to even either way, the largest finite
    value (rounds to inf), subnormals, signed zeros and infinities."""
    words = [0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0x7F7FFFFF, 0x7F7F7FFF, 0x00000001, 0x80008000,
             0x00018000, 0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0xBF808000, 0x3F7FFFFF]
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32).view(torch.float32)


def _reference(src: torch.Tensor, held: torch.Tensor):
    new = src.to(held.dtype)
    idx = changed(new, held)
    return idx, new.reshape(-1)[idx], steps_of(new.reshape(-1)[idx], held.reshape(-1)[idx])


LOOPS = [False, pytest.param(True, marks=pytest.mark.skipif(not simd(), reason="no AVX2 on this CPU"))]
"""The scalar loop and the AVX2 one (the default where the CPU has it)."""


@pytest.mark.parametrize("vectorised", LOOPS, ids=["scalar", "avx2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_pass_equals_the_separate_passes(dtype, vectorised):
    gen = torch.Generator().manual_seed(3)
    before = torch.cat([_edges(), torch.randn(20_000, generator=gen) * 0.02,
                        torch.randn(1_000, generator=gen) * 1e-38])  # with subnormals
    held = before.to(dtype).reshape(3, -1) if before.numel() % 3 == 0 else before.to(dtype)
    after = before.clone()
    moved = torch.rand(before.numel(), generator=gen) < 0.05
    after[moved] -= 3e-4 * torch.sign(torch.randn(int(moved.sum()), generator=gen))  # some cross zero
    after[:15] = torch.flip(_edges(), [0])  # each edge against another: steps far outside int8
    near = slice(100, 400)  # moved by -3..3 units in the held dtype's last place
    ints = held.reshape(-1)[near].view(INT[dtype]) + torch.arange(300, dtype=INT[dtype]) % 7 - 3
    after[near] = ints.view(dtype).to(torch.float32)
    after = after.reshape(held.shape)
    kept = held.clone()
    got = changed_steps(after, kept, capacity=after.numel(), vectorised=vectorised, keep=True)
    assert got is not None
    idx, values, steps = _reference(after, held)
    assert torch.equal(got.positions, idx)
    assert torch.equal(got.values.view(INT[dtype]), values.view(INT[dtype]))
    assert torch.equal(got.steps, steps)
    assert (steps == -128).any() and ((steps != 1) & (steps != -1) & (steps != -128)).any()  # every kind of step
    assert got.exceptions == exceptions_of(steps) and min(got.exceptions) > 0
    assert torch.equal(kept.view(INT[dtype]), after.to(dtype).view(INT[dtype]))  # the new values kept, bit for bit


@pytest.mark.parametrize("vectorised", LOOPS, ids=["scalar", "avx2"])
def test_hand_worked_bfloat16(vectorised):
    """1.00390625 (0x3F808000) is halfway between bfloat16 0x3F80 and 0x3F81: ties to even give 0x3F80; 1.01171875
    (0x3F818000) is halfway between 0x3F81 and 0x3F82: 0x3F82, two steps above a held 0x3F80."""
    src = torch.tensor([0x3F808000, 0x3F818000], dtype=torch.int32).view(torch.float32)
    held = torch.tensor([0x3F80, 0x3F80], dtype=torch.int16).view(torch.bfloat16)
    pos, new, steps, tally = changed_steps(src.repeat(9), held.repeat(9), vectorised=vectorised)  # 8 at once, then 10
    assert pos.tolist() == list(range(1, 18, 2)) and new.view(torch.int16).tolist() == [0x3F82] * 9
    assert steps.tolist() == [2] * 9 and tally == (9, 0)  # a step of 2: SIGN cannot carry it, STEP8 can
    pos, new, steps, _ = changed_steps(src, held, vectorised=vectorised)
    assert pos.tolist() == [1] and new.view(torch.int16).tolist() == [0x3F82] and steps.tolist() == [2]


@pytest.mark.parametrize("vectorised", LOOPS, ids=["scalar", "avx2"])
def test_where_it_does_not_apply(vectorised):
    src = torch.randn(4099)
    held = src.to(torch.bfloat16)
    kept = held.clone()
    assert changed_steps(src + 1.0, kept, capacity=100, vectorised=vectorised, keep=True) is None  # more changed
    for at in (7, 4098):  # in a block of 8, and in the tail the scalar loop takes
        nan = src + 1.0
        nan[at] = float("nan")
        assert changed_steps(nan, kept, vectorised=vectorised, keep=True) is None  # torch's casts disagree on NaN
    assert torch.equal(kept.view(torch.int16), held.view(torch.int16))  # where the pass does not apply, nothing kept
    kept32 = src.clone()  # (the loop writes as it goes and puts the old bits back: a float32 copy too)
    assert changed_steps(src + 1.0, kept32, capacity=100, vectorised=vectorised, keep=True) is None
    assert torch.equal(kept32.view(torch.int32), src.view(torch.int32))
    assert changed_steps(src, src.to(torch.float16)) is None
    assert changed_steps(src.to(torch.float64), held) is None
    assert changed_steps(src[:4096].reshape(64, 64).t(), held[:4096].reshape(64, 64)) is None  # not contiguous
    pos, new, steps, tally = changed_steps(src, held)
    assert pos.numel() == new.numel() == steps.numel() == 0 and tally == (0, 0)
    assert pos.view(torch.uint8).numel() == 0  # nothing changed: empty tensors a delta can still lay out as bytes


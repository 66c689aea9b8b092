"""The delta push's one pass (kernels/bit_steps.py) against torch's own cast and the separate passes it replaces:
the same positions, new bits and steps, bit for bit, on the values where a rounding could differ."""

from __future__ import annotations

import pytest
import torch

from kernels.bit_steps import changed_steps, library
from models.engines.weight_delta import changed, steps_of

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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_pass_equals_the_separate_passes(dtype):
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
    got = changed_steps(after, held, capacity=after.numel())
    assert got is not None
    idx, values, steps = _reference(after, held)
    assert torch.equal(got[0], idx)
    assert torch.equal(got[1].view(INT[dtype]), values.view(INT[dtype]))
    assert torch.equal(got[2], steps)
    assert (steps == -128).any() and ((steps != 1) & (steps != -1) & (steps != -128)).any()  # every kind of step


def test_hand_worked_bfloat16():
    """1.00390625 (0x3F808000) is halfway between bfloat16 0x3F80 and 0x3F81: ties to even give 0x3F80; 1.01171875
    (0x3F818000) is halfway between 0x3F81 and 0x3F82: 0x3F82, two steps above a held 0x3F80."""
    src = torch.tensor([0x3F808000, 0x3F818000], dtype=torch.int32).view(torch.float32)
    held = torch.tensor([0x3F80, 0x3F80], dtype=torch.int16).view(torch.bfloat16)
    pos, new, steps = changed_steps(src, held)
    assert pos.tolist() == [1] and new.view(torch.int16).tolist() == [0x3F82] and steps.tolist() == [2]


def test_where_it_does_not_apply():
    src = torch.randn(4096)
    held = src.to(torch.bfloat16)
    assert changed_steps(src + 1.0, held, capacity=100) is None  # more changed than taken
    nan = src.clone()
    nan[7] = float("nan")
    assert changed_steps(nan, held) is None  # torch's casts disagree on NaN's bits
    assert changed_steps(src, src.to(torch.float16)) is None
    assert changed_steps(src.to(torch.float64), held) is None
    assert changed_steps(src.reshape(64, 64).t(), held.reshape(64, 64)) is None  # not contiguous
    pos, new, steps = changed_steps(src, held)
    assert pos.numel() == new.numel() == steps.numel() == 0
    assert pos.view(torch.uint8).numel() == 0  # nothing changed: empty tensors a delta can still lay out as bytes


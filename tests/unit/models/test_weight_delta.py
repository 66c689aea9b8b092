"""A delta push's encodings and buckets (models/engines/weight_delta.py) against a plain reference: the old tensor
with the changed elements written one by one gives the new tensor bit for bit, whichever encoding carried them; the
smallest encoding is picked by hand-worked byte counts; a bucket corrupted on the way is refused naming it."""

from __future__ import annotations

import pytest
import torch

from models.engines.weight_delta import (BITMAP, BLOCK8, FULL, IDX32, IDX64, RAW, SIGN, STEP8, Delta, changed, choose,
                                         decode, encode, mode_of, nbytes, open_delta, seal_delta, sparse_code,
                                         step_mode, stepped, steps_of)
from models.engines.weight_stream import PushError, bits, plan_push


def _changed(shape, dtype, fraction, seed=0):
    gen = torch.Generator().manual_seed(seed)
    old = torch.randn(shape, generator=gen).to(dtype)
    new = old.clone()
    flat = new.view(-1)
    picks = torch.randperm(flat.numel(), generator=gen)[:int(fraction * flat.numel())]
    flat[picks] = torch.randn(picks.numel(), generator=gen).to(dtype)
    return old, new


def test_the_smallest_encoding_by_hand_worked_bytes():
    # 1000 bfloat16 elements: IDX32 = 40 + 2 c, IDX64 = 80 + 2 c, BITMAP = 128 (125 padded to 8) + 2 c, BLOCK8 = 4
    # block counts + c offsets padded to 8, + 2 c; FULL = 2000
    assert (nbytes(IDX32, 1000, 10, 2), nbytes(IDX64, 1000, 10, 2), nbytes(BITMAP, 1000, 10, 2),
            nbytes(BLOCK8, 1000, 10, 2)) == (60, 100, 148, 36)
    assert choose(1000, 10, 2) == BLOCK8 and choose(1000, 10, 2, block8=False) == IDX32
    assert choose(1000, 600, 2) == BITMAP  # 1328 against IDX32's 3600 and FULL's 2000
    assert choose(1000, 990, 2) == FULL  # BITMAP 2108
    assert choose(1 << 31, 10, 2, block8=False) == IDX64  # positions past int32
    assert sparse_code(1000, torch.arange(256), 2) == BITMAP  # a block all changed: not BLOCK8 (BITMAP 640 bytes)
    assert choose(1000, 990, 2, full=False) == BITMAP  # the sender holds the changed elements only
    # steps instead of values: BLOCK8's 16 bytes of positions, then 10 bytes (STEP8) or 2 (SIGN: 10 bits) padded to
    # 8, the count of exceptions (8), their int32 ordinals padded to 8 and their values
    assert (nbytes(BLOCK8 | STEP8, 1000, 10, 2), nbytes(BLOCK8 | SIGN, 1000, 10, 2)) == (40, 32)
    assert nbytes(BLOCK8 | SIGN, 1000, 10, 2, exact=1) == 42
    assert step_mode(10, 0, 0, 2) == (SIGN, 0)  # 16 bytes of values, against STEP8's 24 and the raw 20
    assert step_mode(10, 10, 0, 2) == (RAW, 0)  # STEP8: 16 + 8 bytes against 20
    assert step_mode(100, 100, 0, 2) == (STEP8, 0) and step_mode(100, 100, 100, 2) == (RAW, 0)  # 104 + 8 against 200
    assert step_mode(100, 3, 100, 2) == (SIGN, 3)  # 16 + 8 + 16 + 6 bytes: the exceptions SIGN leaves
    assert choose(1000, 10, 2, mode=SIGN) == BLOCK8 | SIGN and choose(1000, 600, 2, mode=SIGN) == BITMAP | SIGN
    assert choose(1000, 990, 2, mode=SIGN) == BITMAP | SIGN  # 125 + 124 bytes: under FULL's 2000

def test_a_zero_of_the_other_sign_is_a_change():
    old, new = torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0])
    assert changed(new, old).tolist() == [0]
    assert changed(new, None).tolist() == [0, 1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64, torch.bool])
def test_the_changed_positions_are_those_a_plain_compare_finds(dtype):
    gen = torch.Generator().manual_seed(2)
    for n in (1, 7, 4099):  # under a word, a tail past the whole words
        old = (torch.randn(n, generator=gen) * 100).to(dtype)
        new = old.clone()
        picks = torch.randperm(n, generator=gen)[:max(1, n // 9)]
        new[picks] = (torch.randn(picks.numel(), generator=gen) * 100).to(dtype) if dtype != torch.bool else \
            ~new[picks]
        plain = (bits(new) != bits(old)).nonzero().reshape(-1)
        assert torch.equal(changed(new, old), plain) and plain.numel()
        none = changed(old, old.clone())
        assert none.numel() == 0 and encode(IDX32, n, none, old[none]).numel() == 0


@pytest.mark.parametrize("code", [FULL, IDX32, IDX64, BITMAP, BLOCK8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_encoding_gives_the_new_tensor_back(code, dtype):
    old, new = _changed((37, 11), dtype, 0.05)
    indices = changed(new, old)
    flat = new.reshape(-1)
    payload = encode(code, new.numel(), indices, flat if code == FULL else flat[indices])
    assert payload.numel() == nbytes(code, new.numel(), indices.numel(), new.element_size())
    patch = decode(code, payload, list(new.shape), dtype, indices.numel())
    rebuilt = old.clone().reshape(-1)
    if patch.indices is None:
        rebuilt = patch.values.reshape(-1).clone()
    else:
        for i, v in zip(patch.indices.tolist(), patch.values):  # the reference: one element at a time
            rebuilt[i] = v
    assert torch.equal(bits(rebuilt), bits(new))


@pytest.mark.parametrize("code", [IDX32, IDX64, BITMAP, BLOCK8])
@pytest.mark.parametrize("mode", [STEP8, SIGN])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_steps_added_to_the_old_tensor_give_the_new_one(code, mode, dtype):
    gen = torch.Generator().manual_seed(1)
    old = torch.randn(37, 11, generator=gen).to(dtype).reshape(-1)
    as_int = {2: torch.int16, 4: torch.int32}[old.element_size()]
    idx = torch.randperm(old.numel(), generator=gen)[:20].sort().values
    steps = torch.randint(0, 2, (20,), generator=gen) * 2 - 1 if mode == SIGN else \
        torch.randint(-127, 128, (20,), generator=gen)
    steps[[3, 11, 12]] = torch.tensor([1000, -300, 128])  # exceptions: their values travel
    new = old.clone()
    new.view(as_int)[idx] = (old.view(as_int)[idx].to(torch.int64) + steps).to(as_int)  # (no wrap at these values)
    expected = torch.where(steps.abs() <= 127, steps, -128).to(torch.int8)
    assert torch.equal(steps_of(new[idx], old[idx]), expected)
    assert mode_of(expected.repeat(50), 2) == (mode, 150)  # (20 raw values take fewer bytes than their steps' sections)
    payload = encode(code | mode, old.numel(), idx, new[idx], expected)
    assert payload.numel() == nbytes(code | mode, old.numel(), 20, old.element_size(), exact=3)
    patch = decode(code | mode, payload, [37, 11], dtype, 20)
    assert patch.step == dtype and torch.equal(patch.indices, idx) and patch.exact[0].tolist() == [3, 11, 12]
    assert torch.equal(bits(stepped(old[idx], patch)), bits(new[idx]))
    with pytest.raises(PushError, match="steps were taken at"):
        stepped(old[idx].double(), patch)


def test_steps_wrap_at_the_width_of_the_bits():
    old = torch.tensor([32767, -32768, 5], dtype=torch.int16).view(torch.bfloat16)  # NaN's top, then -0.0
    new = torch.tensor([-32768, 32767, 5 + 200], dtype=torch.int16).view(torch.bfloat16)
    steps = steps_of(new, old)
    assert steps.tolist() == [1, -1, -128]  # the last one does not fit an int8: an exception
    assert mode_of(steps[:2].repeat(100), 2) == (SIGN, 0)
    assert mode_of(steps.repeat(100), 2) == mode_of(None, 2) == (RAW, 0)
    patch = decode(IDX32 | SIGN, encode(IDX32 | SIGN, 3, torch.arange(3), new, steps), [3], torch.bfloat16, 3)
    assert torch.equal(bits(stepped(old, patch)), bits(new))


def test_a_bucket_round_trip_and_one_refused_on_a_flipped_bit():
    old, new = _changed((64, 8), torch.bfloat16, 0.02)
    other = torch.arange(5, dtype=torch.int64)
    header = plan_push([("w", [64, 8], torch.bfloat16), ("steps", [5], torch.int64)], {}, 1 << 20)
    header["delta"] = {"base": "a"}
    idx = changed(new, old)
    code = choose(new.numel(), idx.numel(), 2)
    deltas = [("w", Delta(code, idx.numel(), encode(code, new.numel(), idx, new.reshape(-1)[idx]),
                          torch.stack([idx[:2], bits(new.reshape(-1)[idx[:2]])]))),
              ("steps", Delta(FULL, 5, encode(FULL, 5, None, other), torch.zeros(2, 0, dtype=torch.int64)))]
    bucket = seal_delta(header, 0, deltas)
    assert bucket.numel() < new.numel() * 2  # fewer bytes than the tensor itself
    patches, samples, counts = open_delta(header, 0, bucket.clone())
    assert counts == {"changed": idx.numel() + 5, "elements": 64 * 8 + 5}
    assert torch.equal(patches["w"].indices, idx) and torch.equal(patches["steps"].values, other)
    assert samples["w"] == list(zip(idx[:2].tolist(), bits(new.reshape(-1)[idx[:2]]).tolist()))
    bucket[41] ^= 1
    with pytest.raises(PushError, match=r"bucket 0 of the delta push arrived other than it was sent .* \['w', 'steps'\]"):
        open_delta(header, 0, bucket)

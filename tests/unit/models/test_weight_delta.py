"""A delta push's encodings and buckets (models/engines/weight_delta.py) against a plain reference: the old tensor
with the changed elements written one by one gives the new tensor bit for bit, whichever encoding carried them; the
smallest encoding is picked by hand-worked byte counts; a bucket corrupted on the way is refused naming it."""

from __future__ import annotations

import pytest
import torch

from models.engines.weight_delta import (BITMAP, BLOCK8, FULL, IDX32, IDX64, Delta, changed_mask, choose, decode,
                                         encode, nbytes, open_delta, seal_delta, sparse_code)
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

def test_a_zero_of_the_other_sign_is_a_change():
    old, new = torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0])
    assert changed_mask(new, old).tolist() == [True, False]
    assert changed_mask(new, None).tolist() == [True, True]


@pytest.mark.parametrize("code", [FULL, IDX32, IDX64, BITMAP, BLOCK8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_encoding_gives_the_new_tensor_back(code, dtype):
    old, new = _changed((37, 11), dtype, 0.05)
    indices = changed_mask(new, old).nonzero().reshape(-1)
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


def test_a_bucket_round_trip_and_one_refused_on_a_flipped_bit():
    old, new = _changed((64, 8), torch.bfloat16, 0.02)
    other = torch.arange(5, dtype=torch.int64)
    header = plan_push([("w", [64, 8], torch.bfloat16), ("steps", [5], torch.int64)], {}, 1 << 20)
    header["delta"] = {"base": "a"}
    idx = changed_mask(new, old).nonzero().reshape(-1)
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

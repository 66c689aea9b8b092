"""BLOCK8 deltas built and applied in C (kernels/block8.py) against torch's path they replace: the same payload bytes
from the ranks' pieces as :func:`encode` of the joined positions, and the same engine tensor, bit for bit, as the
decoded positions stepped and ``index_copy_``-ed; and torch's path taken, to the same result, where no C compiler
builds the kernels."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

import kernels.block8 as block8
from models.engines.weight_delta import BLOCK8, RAW, SIGN, STEP8, changed, decode, encode, encoded, exceptions, steps_of
from models.engines.weight_patch import patch_into, stepped
from models.engines.weight_stream import PushError

pytestmark = pytest.mark.skipif(block8.library() is None, reason="no C compiler builds kernels/block8.py")

INT = {torch.bfloat16: torch.int16, torch.float32: torch.int32}


def _update(dtype: torch.dtype, numel: int = 70_001, density: float = 0.03, seed: int = 0):
    """A tensor held by the engine and its update: most changed elements one unit in the last place either way, some
    by many (exceptions to SIGN and STEP8), one block of 256 untouched, one with 255 changed."""
    gen = torch.Generator().manual_seed(seed)
    old = (torch.randn(numel, generator=gen) * 0.02).to(dtype)
    step = torch.where(torch.rand(numel, generator=gen) < 0.5, 1, -1)
    step[torch.rand(numel, generator=gen) < 0.002] = 300  # exceptions to both modes
    step[torch.rand(numel, generator=gen) < 0.002] = 5  # exceptions to SIGN only
    moved = torch.rand(numel, generator=gen) < density
    moved[256:512], moved[512:768] = False, True
    moved[700] = False  # 255 of the block [512, 768)
    new = old.clone()
    as_int = new.view(INT[dtype])
    as_int[moved] = (as_int[moved].to(torch.int64) + step[moved]).to(INT[dtype])
    idx = changed(new, old)
    return old, new, idx, steps_of(new[idx], old[idx])


def _pieces(idx: torch.Tensor, numel: int, ranks: int = 3):
    """``idx`` as FSDP2's ranks gather them: each rank's positions within its rows (int32), from its first element."""
    cut = [min(r * -(-numel // ranks), numel) for r in range(ranks)] + [numel]
    return [((idx[(idx >= lo) & (idx < hi)] - lo).to(torch.int32), lo) for lo, hi in zip(cut, cut[1:])]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", [RAW, STEP8, SIGN])
def test_pieces_encode_to_the_bytes_of_the_joined_positions(dtype, mode):
    old, new, idx, steps = _update(dtype)
    exact = 0 if mode == RAW else {SIGN: int(exceptions(SIGN, steps).sum()), STEP8: int((steps == -128).sum())}[mode]
    code, payload = encoded(new.numel(), _pieces(idx, new.numel()), new[idx], steps, mode, exact)
    assert code == BLOCK8 | mode
    reference = encode(code, new.numel(), idx, new[idx], steps)  # torch's path: bincount of the int64 positions
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(block8, "library", lambda: None)
        assert torch.equal(encode(code, new.numel(), idx, new[idx], steps), reference)  # without a C compiler
        assert torch.equal(encoded(new.numel(), _pieces(idx, new.numel()), new[idx], steps, mode, exact)[1],
                           reference)
    assert torch.equal(payload, reference)
    counts = torch.bincount(idx >> 8, minlength=-(-new.numel() // 256))
    assert int(counts.max()) == 255 and torch.equal(payload[:counts.numel()], counts.to(torch.uint8))


def test_a_block_all_changed_takes_another_encoding_and_bad_positions_are_refused():
    positions = torch.arange(1000, 1300)  # [1024, 1280) all changed: BLOCK8 cannot count it
    assert block8.head([(positions, 0)], 4096) is None
    values = torch.ones(300, dtype=torch.bfloat16)
    code, payload = encoded(4096, [(positions[:100].to(torch.int32), 0), (positions[100:] - 1100, 1100)], values)
    assert code & 15 != BLOCK8 and code != 0
    assert torch.equal(decode(code, payload, [4096], torch.bfloat16, 300).indices, positions)
    with pytest.raises(ValueError, match="not ascending"):
        block8.head([(torch.tensor([5, 3]), 0)], 4096)
    with pytest.raises(ValueError, match="not ascending"):
        block8.head([(torch.tensor([5]), 0), (torch.tensor([1]), 2)], 4096)  # 3 after 5
    with pytest.raises(ValueError, match="not ascending"):
        block8.head([(torch.tensor([4096]), 0)], 4096)


@pytest.mark.parametrize("vectorised", [True, False], ids=["avx2", "scalar"])
@pytest.mark.parametrize("sign", [True, False])
def test_exceptions_and_sign_bits_are_numpys(sign, vectorised):
    gen = torch.Generator().manual_seed(2)
    steps = torch.cat([torch.tensor([1, -1, 5, -128, 1, 1, -1, 127, -1, 2, 1], dtype=torch.int8).repeat(37),
                       torch.randint(-128, 128, (333,), generator=gen).to(torch.int8),
                       (torch.randint(0, 2, (1000,), generator=gen) * 2 - 1).to(torch.int8)])  # (not a multiple of 32)
    got_bits, ordinals = block8.exceptions(steps, sign, vectorised=vectorised)
    mask = (steps != 1) & (steps != -1) if sign else steps == -128
    assert ordinals.dtype == torch.int32 and ordinals.tolist() == np.flatnonzero(mask.numpy()).tolist()
    if sign:
        assert got_bits.tolist() == np.packbits((steps > 0).numpy(), bitorder="little").tolist()
    assert block8.exceptions(steps, sign, 2, vectorised)[1].tolist() == ordinals.tolist()  # (too little room: again)
    assert block8.exceptions(torch.ones(5, dtype=torch.int8), sign, vectorised=vectorised)[1].numel() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", [RAW, STEP8, SIGN])
def test_the_engine_takes_a_packed_delta_as_torch_would(dtype, mode):
    old, new, idx, steps = _update(dtype, seed=1)
    payload = encode(BLOCK8 | mode, new.numel(), idx, new[idx], steps)
    patch = decode(BLOCK8 | mode, payload, [new.numel()], dtype, idx.numel())
    assert patch.packed is not None
    target = old.clone()
    patch_into(target, patch)  # one pass from the payload
    assert torch.equal(target.view(INT[dtype]), new.view(INT[dtype]))
    reference = old.clone()  # torch's path: the positions and values expanded, stepped, index_copy_
    expanded = pickle.loads(pickle.dumps(patch))  # (as a vLLM worker gets it: expanded)
    assert expanded.packed is None and torch.equal(expanded.indices, idx)
    reference.index_copy_(0, expanded.indices, stepped(reference[expanded.indices], expanded))
    assert torch.equal(reference.view(INT[dtype]), new.view(INT[dtype]))
    with pytest.MonkeyPatch.context() as mp:  # no C compiler: the same through torch
        mp.setattr(block8, "library", lambda: None)
        again = old.clone()
        patch_into(again, decode(BLOCK8 | mode, payload, [new.numel()], dtype, idx.numel()))
        assert torch.equal(again.view(INT[dtype]), new.view(INT[dtype]))


def test_a_packed_delta_that_does_not_fit_writes_nothing():
    old, new, idx, steps = _update(torch.bfloat16, numel=1000)
    payload = encode(BLOCK8 | SIGN, 1000, idx, new[idx], steps)
    with pytest.raises(PushError, match="positions for another count"):
        decode(BLOCK8 | SIGN, payload, [1000], torch.bfloat16, idx.numel() + 1)
    past = payload.clone()
    past[4 + idx.numel() - 1] = 250  # the last position moved to offset 250 of block 3: 768 + 250 past 1,000
    target = old.clone()
    with pytest.raises(PushError, match="run past"):
        patch_into(target, decode(BLOCK8 | SIGN, past, [1000], torch.bfloat16, idx.numel()))
    assert torch.equal(target.view(torch.int16), old.view(torch.int16))  # nothing written
    with pytest.raises(PushError, match="steps were taken at"):
        patch_into(old.float(), decode(BLOCK8 | SIGN, payload, [1000], torch.bfloat16, idx.numel()))

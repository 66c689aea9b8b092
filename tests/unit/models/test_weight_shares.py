"""A worker's share of a push (models/engines/weight_shares.py): a bucket cut into the regions one
tensor-parallel worker loads (its rows of a row-split tensor, its columns of a column-split one, a replicated
tensor whole) arrives with exactly those bytes, its own checksum and the bucket's samples, and is rebuilt at the
tensors' full shapes with those regions equal to what was sent."""

from __future__ import annotations

import pytest
import torch

from models.engines.weight_shares import distinct_regions, pack, share_nbytes, tensor_share_bytes, unpack
from models.engines.weight_stream import BucketWriter, PushError, open_bucket, plan_push, tensor_bytes


def _bucket():
    gen = torch.Generator().manual_seed(3)
    state = {"rows": torch.randn(6, 4, generator=gen), "cols": torch.randn(4, 6, generator=gen).bfloat16(),
             "norm": torch.randn(4, generator=gen)}
    header = plan_push([(n, list(t.shape), t.dtype) for n, t in state.items()], {})
    writer = BucketWriter(header, 0, torch.device("cpu"), torch.Generator().manual_seed(0))
    for name, t in state.items():
        writer.put(name, t)
    return state, header, writer.seal()


# worker 1 of 2: the last 3 rows of `rows` (offset 12 elements), the last 3 columns of `cols` (offset 3, rows of 6
# apart); `norm` not named: whole. `rows` read twice in the same place (as a tied tensor is).
SHARE = {"rows": [[12, [3, 4], [4, 1]], [12, [3, 4], [4, 1]]], "cols": [[3, [4, 3], [6, 1]]]}


def test_a_share_carries_its_regions_only_and_rebuilds_them():
    state, header, bucket = _bucket()
    payload = pack(header, 0, bucket, SHARE)
    region_bytes = 3 * 4 * 4 + 4 * 3 * 2 + 4 * 4  # float32 rows, bfloat16 columns, the whole float32 norm
    assert tensor_share_bytes(header, SHARE) == region_bytes < tensor_bytes(header)
    assert payload.numel() == share_nbytes(header, 0, SHARE)
    # regions at 16-byte offsets (0: 48 B, 48: 24 B, 80: 16 B), then 8 + 8 + 4 samples of 16 B and the checksum
    assert payload.numel() == 96 + 16 * 20 + 8
    tensors, samples = unpack(header, 0, payload, SHARE)
    assert torch.equal(tensors["rows"][3:], state["rows"][3:])
    assert torch.equal(tensors["cols"][:, 3:].float(), state["cols"][:, 3:].float())
    assert torch.equal(tensors["norm"], state["norm"])
    assert [list(t.shape) for t in tensors.values()] == [[6, 4], [4, 6], [4]]
    assert samples == open_bucket(header, 0, bucket)[1]  # the bucket's own samples, whole-tensor positions
    whole, _ = unpack(header, 0, pack(header, 0, bucket, None), None)  # no share: every tensor whole
    assert all(torch.equal(whole[n].float(), t.float()) for n, t in state.items())


def test_a_share_that_arrives_wrong_is_refused_naming_the_bucket():
    _, header, bucket = _bucket()
    payload = pack(header, 0, bucket, SHARE)
    payload[5] ^= 1
    with pytest.raises(PushError, match=r"bucket 0's share of the push arrived other than it was sent"):
        unpack(header, 0, payload, SHARE)
    with pytest.raises(PushError, match=r"bucket 0's share of the push arrived with 10 bytes where this worker's "
                                        r"share is 424"):
        unpack(header, 0, payload[:10], SHARE)


def test_repeated_regions_count_once():
    assert distinct_regions(SHARE["rows"]) == [(12, (3, 4), (4, 1))]

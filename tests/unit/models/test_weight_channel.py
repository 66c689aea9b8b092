"""The weight channel (models/engines/weight_channel.py) between two processes over gloo: a state dict in
several dtypes, with a tied tensor and views of one storage, arrives bit for bit in several buckets of mixed
dtypes (models/engines/weight_stream.py), each checked against its checksum; a sender that dies mid-push, a
sender that never joins and a receiver that is not there fail with the channel named, within the timeout; a
bad header is named before anything is received."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict

import pytest
import torch

from models.engines.weight_channel import ChannelError, Receiver, Sender, choose_backend
from models.engines.weight_stream import (BucketWriter, PushError, check_header, checksum, open_bucket,
                                          plan_push)
from models.engines.weights import distinct_tensors
from tests.unit.models.test_weights import _awkward, _bits

REPO = Path(__file__).resolve().parents[3]
BUCKET = 4096
"""Bytes per buffer in these tests: the float32 tensors need several."""


def _state() -> Dict[str, torch.Tensor]:
    """Several dtypes, a tied head (one tensor under two names), views of one storage, a scalar, an empty one."""
    w = _awkward(torch.float32)
    embed = torch.randn(40, 16, generator=torch.Generator().manual_seed(1))
    return {"embed": embed, "head": embed, "w": w, "w.t": w.t(), "rows": w[2:5],
            "big": torch.arange(3000, dtype=torch.float32).reshape(30, 100) / 7,
            "bf16": _awkward(torch.bfloat16), "f16": _awkward(torch.float16),
            "steps": torch.tensor(3, dtype=torch.int64), "empty": torch.zeros(0, 4)}


def _plan(bucket: int = BUCKET):
    """The header of a push of :func:`_state` (each tensor as it is: no cast) and its sealed buckets."""
    import torch

    distinct, aliases = distinct_tensors(_state())
    header = plan_push([(n, list(t.shape), t.dtype) for n, t in distinct.items()], aliases, bucket)
    out, gen = [], torch.Generator().manual_seed(0)
    for i in range(len(header["buckets"])):
        writer = BucketWriter(header, i, torch.device("cpu"), gen)
        for entry in writer.entries:
            writer.put(entry[0], distinct[entry[0]])
        out.append(writer.seal())
    return header, out


def _send(offer: dict, header_path: Path, stop_after: int = -1) -> subprocess.Popen:
    """The sender in a process of its own: plans :func:`_state`, writes the header, sends (the first
    ``stop_after`` buckets only, then dies, when given), exits without closing it (at exit, by itself)."""
    code = f"""
import json, os, sys
from models.engines.weight_channel import Sender
from tests.unit.models.test_weight_channel import _plan
sender = Sender("127.0.0.1", {offer!r}, timeout_s=20)
header, buckets = _plan()
open({str(header_path)!r}, "w").write(json.dumps(header))
sender.wait_ready(1, lambda: False, 20)
for bucket in (buckets if {stop_after} < 0 else buckets[:{stop_after}]):
    sender.send_bucket(bucket)
if {stop_after} >= 0:
    os._exit(3)
"""
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": ""})


def _header(path: Path, proc: subprocess.Popen) -> dict:
    deadline = time.monotonic() + 60
    while not path.exists() or not path.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, "the sender did not plan its push"
        time.sleep(0.05)
    return json.loads(path.read_text())


def test_a_state_dict_arrives_bit_for_bit(tmp_path):
    receiver = Receiver("127.0.0.1", sender_gpu="", timeout_s=20)
    assert receiver.offer()["backend"] == "gloo"
    proc = _send(receiver.offer(), tmp_path / "header.json")
    header = _header(tmp_path / "header.json", proc)
    got, sizes = {}, []
    for index, buffer in receiver.buckets(header, 1, lambda n, device: torch.empty(n, dtype=torch.uint8)):
        tensors, samples = open_bucket(header, index, buffer)
        got.update(tensors)
        sizes.append(buffer.numel())
        assert set(samples) == set(tensors)
    assert proc.wait(30) == 0
    got.update({a: got[t] for a, t in header["aliases"].items()})
    state = _state()
    assert set(got) == set(state)
    for name, t in state.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(_bits(got[name]) if t.is_floating_point() else got[name], _bits(t) if t.is_floating_point()
                           else t), name
    assert got["head"] is got["embed"] and header["aliases"] == {"head": "embed"}
    assert 3 <= len(sizes) < len(state)  # bucketed: not one broadcast per tensor (the 12000-byte one alone)
    receiver.close()


def test_a_sender_that_dies_mid_push_fails_the_receive(tmp_path):
    receiver = Receiver("127.0.0.1", sender_gpu="", timeout_s=20)
    proc = _send(receiver.offer(), tmp_path / "header.json", stop_after=1)
    header = _header(tmp_path / "header.json", proc)
    with pytest.raises(ChannelError, match="a broadcast over the gloo weight channel failed"):
        list(receiver.buckets(header, 1, lambda n, device: torch.empty(n, dtype=torch.uint8)))
    assert proc.wait(30) == 3


def test_a_channel_that_does_not_form_or_is_not_there_is_named():
    receiver = Receiver("127.0.0.1", sender_gpu="", timeout_s=1)
    header = plan_push([("w", [3], torch.float32)], {})
    with pytest.raises(ChannelError, match=r"the gloo weight channel on 127\.0\.0\.1:\d+ did not form"):
        next(receiver.buckets(header, 1, lambda n, device: torch.empty(n, dtype=torch.uint8)))
    port = receiver.offer()["port"]
    receiver.close()
    with pytest.raises(ChannelError, match=rf"joining the gloo weight channel at 127\.0\.0\.1:{port} failed"):
        Sender("127.0.0.1", {"port": port, "backend": "gloo", "key": "k"}, timeout_s=1)


def test_bad_headers_checksums_and_the_backend_choice():
    header = plan_push([("w", [3], torch.float32), ("v", [2], torch.int32)], {})
    check_header(header)
    with pytest.raises(ValueError, match="not a weights header"):
        check_header({"tensors": []})
    with pytest.raises(ValueError, match="names dtype 'float99'"):
        check_header({**header, "tensors": [["w", "float99", [3], 0, 0, 3]], "buckets": [[16, 3]]})
    with pytest.raises(ValueError, match=r"puts 'w' \[3\] \(float32\) at byte 16 of bucket 0, outside it"):
        check_header({**header, "tensors": [["w", "float32", [3], 0, 16, 3]], "buckets": [[16, 3]]})
    with pytest.raises(ValueError, match="aliases of tensors it does not hold"):
        check_header({**header, "aliases": {"head": "embed"}})
    _, buckets = _plan()
    with pytest.raises(PushError, match=r"bucket 0 of the push arrived other than it was sent .* it holds \['embed'"):
        spoiled = buckets[0].clone()
        spoiled[3] ^= 4
        open_bucket(_plan()[0], 0, spoiled)
    data = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    for kind in ("crc32", "sum61"):  # each sensitive to one bit and to the order of words
        swapped = data.view(torch.int32).clone()
        swapped[[7, 9]] = swapped[[9, 7]]
        one_bit = data.clone()
        one_bit[100] ^= 1
        sums = {checksum(d, kind) for d in (data, swapped.view(torch.uint8), one_bit)}
        assert len(sums) == 3, kind
    assert checksum(data, "crc32") == __import__("zlib").crc32(data.numpy())
    assert choose_backend("GPU-a", "GPU-b") == "nccl"
    assert choose_backend("GPU-a", "GPU-a") == "gloo"  # one device: NCCL cannot join two ranks on it
    assert choose_backend("", "GPU-b") == choose_backend("GPU-a", "") == "gloo"

"""The weight channel (models/engines/weight_channel.py) between two processes over gloo: a state dict in
several dtypes, with a tied tensor and views of one storage, arrives bit for bit in several buffers per
dtype; a sender that dies mid-push, a sender that never joins and a receiver that is not there fail with
the channel named, within the timeout; a bad header is named before anything is received."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict

import pytest
import torch

from models.engines.weight_channel import ChannelError, Receiver, Sender, check_header, choose_backend, plan
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


def _send(offer: dict, header_path: Path, stop_after: int = -1) -> subprocess.Popen:
    """The sender in a process of its own: plans :func:`_state`, writes the header, sends (the first
    ``stop_after`` buffers only, then dies, when given), exits without closing it (at exit, by itself)."""
    code = f"""
import json, os, sys
from models.engines.weight_channel import Sender, plan
from tests.unit.models.test_weight_channel import BUCKET, _state
sender = Sender("127.0.0.1", {offer!r}, timeout_s=20)
header, buckets = plan(_state(), BUCKET)
open({str(header_path)!r}, "w").write(json.dumps(header))
sender.wait_ready(1, lambda: False, 20)
sender.send(buckets if {stop_after} < 0 else buckets[:{stop_after}])
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
    got = receiver.receive(header, 1)
    assert proc.wait(30) == 0
    state = _state()
    assert set(got) == set(state)
    for name, t in state.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(_bits(got[name]) if t.is_floating_point() else got[name], _bits(t) if t.is_floating_point()
                           else t), name
    assert got["head"] is got["embed"] and header["aliases"] == {"head": "embed"}
    dtypes = [dtype for dtype, _ in header["buffers"]]
    assert dtypes.count("float32") >= 3 and {"bfloat16", "float16", "int64"} <= set(dtypes)
    assert len(header["buffers"]) < len(state)  # bucketed: not one broadcast per tensor
    receiver.close()


def test_a_sender_that_dies_mid_push_fails_the_receive(tmp_path):
    receiver = Receiver("127.0.0.1", sender_gpu="", timeout_s=20)
    proc = _send(receiver.offer(), tmp_path / "header.json", stop_after=1)
    header = _header(tmp_path / "header.json", proc)
    with pytest.raises(ChannelError, match="a broadcast over the gloo weight channel failed"):
        receiver.receive(header, 1)
    assert proc.wait(30) == 3


def test_a_channel_that_does_not_form_or_is_not_there_is_named():
    receiver = Receiver("127.0.0.1", sender_gpu="", timeout_s=1)
    header, _ = plan({"w": torch.ones(3)})
    with pytest.raises(ChannelError, match=r"the gloo weight channel on 127\.0\.0\.1:\d+ did not form"):
        receiver.receive(header, 1)
    port = receiver.offer()["port"]
    receiver.close()
    with pytest.raises(ChannelError, match=rf"joining the gloo weight channel at 127\.0\.0\.1:{port} failed"):
        Sender("127.0.0.1", {"port": port, "backend": "gloo", "key": "k"}, timeout_s=1)


def test_bad_headers_and_the_backend_choice():
    header, _ = plan({"w": torch.ones(3), "v": torch.ones(2, dtype=torch.int32)})
    check_header(header)
    with pytest.raises(ValueError, match="not a weights header"):
        check_header({"tensors": []})
    with pytest.raises(ValueError, match="names dtype 'float99'"):
        check_header({**header, "buffers": [["float99", 3]]})
    with pytest.raises(ValueError, match=r"puts 'w' \[3\] at 2, past the end of buffer 0 \(3 elements\)"):
        check_header({**header, "tensors": [["w", "float32", [3], 0, 2]]})
    with pytest.raises(ValueError, match=r"puts 'w' \(float32\) in buffer 1, which it does not declare as float32"):
        check_header({**header, "tensors": [["w", "float32", [3], 1, 0]]})
    with pytest.raises(ValueError, match="aliases of tensors it does not hold"):
        check_header({**header, "aliases": {"head": "embed"}})
    assert choose_backend("GPU-a", "GPU-b") == "nccl"
    assert choose_backend("GPU-a", "GPU-a") == "gloo"  # one device: NCCL cannot join two ranks on it
    assert choose_backend("", "GPU-b") == choose_backend("GPU-a", "") == "gloo"

"""models/memory.py: memory handed back only after a model worth a full garbage collection (about 0.3 s in a
process that imported torch and transformers)."""

from __future__ import annotations

import gc

import torch

from models import memory


def test_release_runs_after_a_large_model_only(monkeypatch):
    collected = []
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(1) or 0)
    small = torch.nn.Linear(16, 16)  # 16 * 16 * 4 + 16 * 4 = 1,088 bytes
    assert memory.nbytes(small) == 1088
    assert memory.release(memory.nbytes(small)) is False and collected == []
    assert memory.release(memory.RELEASE_MIN_BYTES) is True and collected == [1]  # glibc here: trimmed
    assert memory.release() is True and collected == [1, 1]  # no size given: what a caller closing an engine frees

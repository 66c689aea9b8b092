"""The bytes one small PPO iteration really moves through S3 (moto), counted per task by
``models/storage.count_bytes``, against the projection's byte formula at that run's shape
(``benchmarks/iteration_bytes.py``, printed by ``project_iteration.py --check-small``)."""

from __future__ import annotations

import pytest

from benchmarks.iteration_bytes import by_kind, compare, kind, measure
from models import storage


def test_counter_sees_whole_files_and_nothing_outside_it(tmp_path):
    url = str(tmp_path / "a.bin")
    storage.write_bytes(url, b"x" * 10)  # not counted: no counter open
    with storage.count_bytes() as outer:
        storage.write_bytes(url, b"y" * 7)
        with storage.count_bytes() as inner:
            assert storage.read_bytes(url) == b"y" * 7
            storage.get_file(url, str(tmp_path / "copy.bin"))
    assert [(t.op, t.nbytes) for t in outer] == [("write", 7), ("read", 7), ("read", 7)]
    assert [(t.op, t.nbytes) for t in inner] == [("read", 7), ("read", 7)]


def test_kinds_by_file_name():
    assert kind("s3://b/r/iter-000001/actor/model.safetensors") == "weights"
    assert kind("s3://b/r/iter-000001/actor-optimizer.tmp-0a1b/optimizer.safetensors") == "optimizer"
    assert kind("s3://b/r/iter-000001/score.arrow") == "batch"
    assert kind("s3://b/r/iter-000001/score.arrow.blake3") == "other"


@pytest.mark.integration  # a real moto server and two whole tiny iterations (~20 s alone, ~55 s under load)
def test_formula_matches_measured_weights_and_optimizer_state_per_task(s3_url, tmp_path):
    """Each task moves exactly the checkpoints the formula says, at 4 B per parameter (weights) and 8 B
    (AdamW's two moments), plus only the files' own headers and step scalars; every batch a task reads is
    exactly the file the task before it wrote."""
    m = measure(s3_url, tmp_path)
    rows = {(r["task"], r["op"], r["kind"]): r for r in compare(m)}
    for key, files in {("rollout", "read", "weights"): 2, ("score", "read", "weights"): 3,
                       ("actor_update", "read", "weights"): 2, ("actor_update", "read", "optimizer"): 1,
                       ("actor_update", "write", "weights"): 1, ("actor_update", "write", "optimizer"): 1,
                       ("critic_update", "read", "weights"): 2, ("critic_update", "read", "optimizer"): 1,
                       ("critic_update", "write", "weights"): 1, ("critic_update", "write", "optimizer"): 1}.items():
        r = rows[key]
        assert r["files"] == files and r["formula"] > 0, (key, r)
        assert r["residual"] == 0 and 0 < r["explained"] < 0.02 * r["measured"], (key, r)
    # the actor's AdamW state is twice its weights' payload: 8 B vs 4 B per parameter
    assert rows[("actor_update", "write", "optimizer")]["formula"] == 8 * m.actor_params
    assert not any(k in ("weights", "optimizer") for _, k in by_kind(m.transfers["advantages"]))
    wrote = {t.url: t.nbytes for ts in m.transfers.values() for t in ts if t.op == "write" and kind(t.url) == "batch"}
    for task in ("score", "advantages", "actor_update", "critic_update"):
        batches = [t for t in m.transfers[task] if t.op == "read" and kind(t.url) == "batch"]
        assert len(batches) == 1 and wrote[batches[0].url] == batches[0].nbytes, task

"""benchmarks/bench_resident_pods.py without the harness runs: which moved bytes count as "between
checkpoints" (hand-made transfer logs of a 3-iteration run, checkpoint at iteration 2), the pod counts, and
the rows."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from benchmarks import bench_resident_pods as bench  # noqa: E402

RUN = "s3://b/resident/bench"


def _attempt(tmp_path, task, lines, pods=1):
    out = []
    for i in range(pods):
        folder = tmp_path / f"{task}-{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        (folder / bench.LOG).write_text("".join(json.dumps(t) + "\n" for t in lines))
        out.append(SimpleNamespace(folder=folder))
    return SimpleNamespace(task=f"tasks.x.{task}", pods=out)


def test_state_bytes_between_checkpoints_and_pod_starts(tmp_path):
    def t(op, url, n):
        return {"op": op, "url": f"{RUN}/{url}", "nbytes": n}

    ex = SimpleNamespace(attempts=[
        _attempt(tmp_path, "actor_service", [t("read", "reference/model.safetensors", 100)], pods=2),
        _attempt(tmp_path, "actor_service", [t("write", "iter-000002/actor/model.safetensors", 10),
                                             t("write", "iter-000002/actor-optimizer/optimizer.safetensors", 20),
                                             t("write", "iter-000000/actor/model.safetensors", 7)]),
        _attempt(tmp_path, "rollout_resident", [t("write", "iter-000000/batch/rollout.arrow", 999)]),
        _attempt(tmp_path, "actor_update", [t("read", "iter-000000/actor/model.safetensors", 5)], pods=2),
        _attempt(tmp_path, "commit_iteration", [t("read", "iter-000002/actor/model.safetensors", 10)]),
    ])
    moved = bench.transfers(ex)
    assert len(moved) == 2 + 3 + 1 + 2 + 1 and moved[-1]["task"] == "commit_iteration"
    # between: the write of a non-checkpoint iteration (7) and the per-iteration task's reads (2 pods x 5);
    # the batch is not state; the rest: the service's load (2 pods x 100), the checkpoint (10 + 20) and its
    # commit's read of it (10)
    assert bench.state_bytes(moved, checkpoint_iteration=2) == (7 + 10, 200 + 30 + 10)
    assert bench.pod_starts(ex) == (4, 3)


def test_rows_judge_the_resident_run():
    out = {"stateless": {"s": 40.0, "between": 3e6, "rest": 1e6, "pods": 8.0, "run_pods": 4},
           "resident": {"s": 12.0, "between": 0, "rest": 2e6, "pods": 6.0, "run_pods": 8}}
    ratio, moved, pods = bench.rows(out, 6)
    assert (round(ratio.value, 3), ratio.target, ratio.ok) == (0.3, "<= 0.5", True)
    assert (moved.value, moved.ok) == (0, True) and "stateless 3.0 MB per iteration" in moved.detail
    assert pods.value == 6.0 and "stateless 8.0" in pods.detail

"""What the control plane reads back stays within its download limit at the presets' sizes: the
``DynamicJobSpec`` of a chunk grows with ``run.iterations_per_chunk`` (every node binds the whole config),
and propeller refuses a ``futures.pb`` over ``storage.limits.maxDownloadMBs`` (2 MB by default)."""

from __future__ import annotations

import pytest

from tests.cluster.conftest import DEPLOY, registration_env
from tests.cluster.literals import MAX_DOWNLOAD_BYTES

pytestmark = pytest.mark.integration


def chunk_inputs(cfg, stop: int):
    from flyteidl.core import literals_pb2
    from flytekit import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine

    from models.config import TrainConfig
    from models.run.types import PolicyState, RunHandle

    ctx = FlyteContextManager.current_context()
    values = {"cfg": (cfg, TrainConfig),
              "run": (RunHandle("s3://b/runs", "r", "0" * 32, "s3://b/runs/r/reference", "s3://b/p.jsonl",
                                "s3://b/e.jsonl"), RunHandle),
              "state": (PolicyState(0, "s3://b/runs/r/reference", "s3://b/runs/r/critic-init", 0.01), PolicyState),
              "stop": (stop, int), "launch": ("flyte:p/development/e0", str)}
    return literals_pb2.LiteralMap(literals={
        k: TypeEngine.to_literal(ctx, v, t, TypeEngine.to_literal_type(t)).to_flyte_idl() for k, (v, t) in values.items()})


def test_the_largest_preset_chunk_fits_the_download_limit(packages, make_cluster, s3_server, mlflow_url):
    from models.config.io import load_config

    cluster = make_cluster(packages(*DEPLOY, registration_env(s3_server, mlflow_url)))
    sizes = {}
    for per_chunk in (1, 20):  # 20: configs/llama8b_ppo_gpu.yaml
        cfg = load_config("llama8b_ppo_gpu", [f"run.iterations_per_chunk={per_chunk}", "run.eval_interval=1"])
        ex = cluster.run_task("workflows.ppo.ppo_chunk", chunk_inputs(cfg, per_chunk))
        assert not ex.error and ex.attempts[0].outcome == "futures", ex.error
        sizes[per_chunk] = ex.attempts[0].document_bytes
    per_iteration = (sizes[20] - sizes[1]) / 19
    print(f"futures.pb: {sizes[1]} bytes for 1 iteration, {sizes[20]} for 20 ({per_iteration:.0f} per iteration); "
          f"limit {MAX_DOWNLOAD_BYTES}")
    assert sizes[20] < MAX_DOWNLOAD_BYTES

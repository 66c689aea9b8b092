"""vLLM's CPU engine serves a checkpoint committed by rank (``actor.checkpoint_by_rank``,
``models/training/weight_shards.py``): two gloo ranks commit the Qwen2-shaped chat model (tied head) as two
weight files and an index, and the engine's log-probs are a plain transformers forward's of rank 0's whole
write within 1e-3 nats (vLLM's CPU kernels against transformers, ``test_hub_checkpoints.py``)."""

from __future__ import annotations

import os

import pytest

from models import storage
from models.checkpoint import save_checkpoint
from models.engines import SamplingSpec
from models.training.sharded_load import INDEX
from tests.integration.test_hub_checkpoints import TOL, _prompt, _worst_gap, vllm_engine_cls  # noqa: F401
from tests.processes import free_port
from tests.ranks import spawn
from tests.unit.models.test_weight_shards import _worker

pytestmark = pytest.mark.integration


def test_vllm_serves_the_folder_each_rank_wrote_its_file_of(vllm_engine_cls, qwen2_chat_dir, tmp_path):  # noqa: F811
    root = str(tmp_path / "run")
    start = storage.join(root, "start", "actor")
    save_checkpoint(str(qwen2_chat_dir), start)
    spawn(_worker, (2, free_port(), {"actor": start}, root, str(tmp_path)))
    by_rank, whole = os.path.join(root, "actor", "by_rank"), os.path.join(root, "actor", "whole")
    assert {f for f in os.listdir(by_rank) if "safetensors" in f} == {
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", INDEX}
    engine = vllm_engine_cls(by_rank, max_model_len=256)
    try:
        prompts = [_prompt(by_rank, "Reverse: abc"), _prompt(by_rank, "7 7 7 7")]
        assert _worst_gap(engine, whole, prompts, SamplingSpec(n=2, max_new_tokens=8, seed=5)) < TOL
    finally:
        engine.close()

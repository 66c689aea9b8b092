"""The public CLI on a checkpoint at a real width and vocabulary: ``configs/qwen3_grpo.yaml`` (Qwen3-0.6B's shape,
cut to 2 decoder layers: 1,024 wide, the tied 151,936-row embedding, Qwen3's real tokenizer, chat template and two eos
ids, TRL-format conversational prompts and a TRL-style reward function) through ``pyflyte run``, resident in the
separate layout with vLLM in its engine service: 2 iterations of GRPO on 2 FSDP2 ranks, the update's weights pushed
in place into the engine between them (#46 item 4).

What a user of such a checkpoint relies on: the engine starts with the run's context, not the checkpoint's 40,960
tokens (what failed before #46); it samples from the distribution the trainer scores (the log-prob gap at float32
rounding); the push carries the engine dtype's bytes for every parameter once (the tied embedding once); generation
stops only at one of the checkpoint's eos ids or at ``rollout.max_new_tokens``; the committed actor keeps the
released shape. About 100 s and 60 s of CPU here (2026-11-29): the suite's one run at a real width."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from models.data.batch import RolloutBatch
from models.run.layout import RunLayout
from tests.integration.flyte_runs import FlyteRun, isolated_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NEW_TOKENS = 8
OVERRIDES = ["model.builder=models.demos.builders:real_shape_chat(shape='qwen3-0.6b', num_layers=2)",
             "run.num_iterations=2", "rollout.prompts_per_iteration=2", "rollout.n_samples_per_prompt=2",
             f"rollout.max_new_tokens={NEW_TOKENS}", "actor.minibatch_size=4", "actor.micro_batch_size=2",
             "run.resident=true"]
EOS_IDS = {151645, 151643}
"""``<|im_end|>`` and ``<|endoftext|>``: Qwen3's ``generation_config.json``."""


@pytest.fixture
def runs(tmp_path):
    """The run's folder, removed afterwards: 2.5 GB (the reference, the final actor and AdamW's state) that no later
    test reads."""
    yield tmp_path / "runs"
    shutil.rmtree(tmp_path / "runs", ignore_errors=True)


def test_a_qwen3_shaped_checkpoint_trains_resident_through_the_cli(tmp_path, runs):
    from mlflow.tracking import MlflowClient

    db = f"sqlite:///{tmp_path}/mlflow.db"
    # RLHF_VERBOSE, vLLM's INFO: vLLM's own log lines in the engine service's log (its context among them)
    env = isolated_env(tmp_path / "home", {"MLFLOW_TRACKING_URI": db, "TMPDIR": str(tmp_path), "RLHF_VERBOSE": "1",
                                           "VLLM_LOGGING_LEVEL": "INFO"})
    out = FlyteRun("workflows/reinforce.py", "reinforce_training", "configs/qwen3_grpo.yaml",
                   [f"run.storage_root={runs}"] + OVERRIDES, "qwen3", env, tmp_path / "run.log").wait(900)
    assert "Run qwen3 finished: 2 iterations of grpo." in out, out[-3000:]

    layout = RunLayout(str(runs), "qwen3")
    run = MlflowClient(db).get_run(layout.read_run_info().mlflow_run_id)
    metrics = run.data.metrics
    assert run.info.status == "FINISHED"
    assert metrics["rollout/logprob_gap_max"] < 1e-4  # float32 engine and trainer: rounding only
    # the push: every parameter once at the engine's dtype (float32), the tied embedding counted once
    assert metrics["resident/weights_params"] == 151936 * 1024 + 2 * 15_730_944 + 1024  # layers, final norm
    assert metrics["resident/weights_bytes"] == 4 * metrics["resident/weights_params"]

    for i in range(2):
        table = RolloutBatch.read(layout.batch_url(i, "rollouts")).table
        for tokens, end in zip(table.column("response_tokens").to_pylist(), table.column("is_end").to_pylist()):
            assert (tokens[-1] in EOS_IDS and not EOS_IDS & set(tokens[:-1])) if end else \
                (len(tokens) == NEW_TOKENS and not EOS_IDS & set(tokens)), (tokens, end)
        assert max(len(p) for p in table.column("prompt_tokens").to_pylist()) <= 512  # data.max_prompt_tokens
    actor = Path(layout.read_state().actor_url.replace("file://", ""))
    config = json.loads((actor / "config.json").read_text())
    assert (config["vocab_size"], config["hidden_size"], config["num_hidden_layers"], config["tie_word_embeddings"]) \
        == (151936, 1024, 2, True)
    # the engine's context: the prompt budget and the new tokens (data.max_prompt_tokens + rollout.max_new_tokens),
    # not the checkpoint's max_position_embeddings
    engine_log = "".join(p.read_text() for p in tmp_path.glob("resident-*/engine.log"))
    assert f"Maximum concurrency for {512 + NEW_TOKENS:,} tokens per request" in engine_log, engine_log[-3000:]

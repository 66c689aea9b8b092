"""The public CLI on a checkpoint at a real width and vocabulary: ``configs/qwen3_grpo.yaml`` (Qwen3-0.6B's shape,
cut to 2 decoder layers: 1,024 wide, the tied 151,936-row embedding, Qwen3's real tokenizer, chat template and two eos
ids, TRL-format conversational prompts and a TRL-style reward function) through ``pyflyte run``, 2 iterations of GRPO
with vLLM each time (#46 item 4): resident on one actor rank, as docs/real_checkpoints.md advises on one machine,
in the separate layout (the update's weights pushed in place into the engine service between them, the engine's
weights and KV cache freed from the rollout to the push) and in the colocated one (the rank's own engine, the
weights loaded into it in process), and stateless on 2 FSDP2 ranks with LoRA adapters and multi-turn episodes (the
calculator environment, Qwen3's template rendering its turns, vLLM serving the adapter on the base).

What a user of such a checkpoint relies on: the engine starts with the run's context, not the checkpoint's 40,960
tokens (what failed before #46); it samples from the distribution the trainer scores (the log-prob gap at float32
rounding); the push carries the engine dtype's bytes for every parameter once (the tied embedding once); generation
stops only at one of the checkpoint's eos ids or at ``rollout.max_new_tokens``; the committed actor keeps the
released shape; the adapter of the stateless run trained on the sampled tokens of its episodes only. 70-130 s and
60-80 s of CPU each here (2026-11-29): the suite's three runs at a real width."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from models.data.batch import RolloutBatch
from models.demos.tool_tasks import problems
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


@pytest.mark.parametrize("placement", ["separate", "colocated"])
def test_a_qwen3_shaped_checkpoint_trains_resident_through_the_cli(tmp_path, runs, placement):
    from mlflow.tracking import MlflowClient

    db = f"sqlite:///{tmp_path}/mlflow.db"
    # RLHF_VERBOSE, vLLM's INFO: vLLM's own log lines in the engine service's log (its context among them)
    env = isolated_env(tmp_path / "home", {"MLFLOW_TRACKING_URI": db, "TMPDIR": str(tmp_path), "RLHF_VERBOSE": "1",
                                           "VLLM_LOGGING_LEVEL": "INFO"})
    out = FlyteRun("workflows/reinforce.py", "reinforce_training", "configs/qwen3_grpo.yaml",
                   [f"run.storage_root={runs}", f"run.resident_layout={placement}", "actor.nproc_per_node=1"]
                   + OVERRIDES, "qwen3", env,
                   tmp_path / "run.log").wait(900)
    assert "Run qwen3 finished: 2 iterations of grpo." in out, out[-3000:]

    layout = RunLayout(str(runs), "qwen3")
    run = MlflowClient(db).get_run(layout.read_run_info().mlflow_run_id)
    metrics = run.data.metrics
    assert run.info.status == "FINISHED"
    assert metrics["rollout/logprob_gap_max"] < 1e-4  # float32 engine and trainer: rounding only
    assert "resident/sleep_s" in metrics and "resident/wake_s" in metrics  # the engine freed its weights and cache
    # the push: every parameter once at the engine's dtype (float32), the tied embedding counted once; sent to the
    # engine service (separate), or loaded into the rank's own engine (colocated)
    assert metrics["resident/weights_params"] == 151936 * 1024 + 2 * 15_730_944 + 1024  # layers, final norm
    sent = "resident/weights_bytes" if placement == "separate" else "resident/weights_loaded_bytes"
    assert metrics[sent] == 4 * metrics["resident/weights_params"]

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
    engine_log = "".join(p.read_text() for p in tmp_path.glob("resident-*/*.log"))  # the service's, or the rank's
    assert f"Maximum concurrency for {512 + NEW_TOKENS:,} tokens per request" in engine_log, engine_log[-3000:]


def _spans(mask):
    """The runs of 1s in a loss mask: ``[(start, end)]``."""
    out, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def test_stateless_lora_episodes_at_the_real_shape_through_the_cli(tmp_path, runs):
    """The default (stateless) mode with rank-8 LoRA adapters on every projection and multi-turn episodes of the
    calculator environment, Qwen3's template rendering the system prompt, the turns and the tool results: the
    engine (the base with the adapter, vLLM) samples exactly what the trainer scores on the stored episode tokens,
    each assistant turn ends at an eos id or the budget, only those tokens are trained on, and the update moved
    the adapter (its B matrices start at zero)."""
    from mlflow.tracking import MlflowClient
    from safetensors.torch import load_file

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in problems(8, 0)))
    db = f"sqlite:///{tmp_path}/mlflow.db"
    episodes = ["rollout.environment=models.demos.tool_tasks:ArithmeticEnv", "rollout.max_turns=2",
                "rollout.max_episode_tokens=64", f"data.train_prompts={data}", f"data.eval_prompts={data}",
                "reward.function=", "reward.weights=[1.0,1.0]",  # the environment's and the preset's TRL-style one
                'reward.functions=["models.environments.episode_rollout:environment_reward",'
                '"models.demos.chat_prompts:answer_reward"]', "actor.lora.rank=8", "actor.lora.alpha=16"]
    overrides = [o for o in OVERRIDES if o != "run.resident=true"] + [f"run.storage_root={runs}"] + episodes
    out = FlyteRun("workflows/reinforce.py", "reinforce_training", "configs/qwen3_grpo.yaml", overrides, "episodes",
                   isolated_env(tmp_path / "home", {"MLFLOW_TRACKING_URI": db}), tmp_path / "run.log").wait(900)
    assert "Run episodes finished: 2 iterations of grpo." in out, out[-3000:]

    layout = RunLayout(str(runs), "episodes")
    run_id = layout.read_run_info().mlflow_run_id
    metrics = MlflowClient(db).get_run(run_id).data.metrics
    assert metrics["rollout/logprob_gap_max"] < 1e-4 and "episode/turns_mean" in metrics
    assert len(MlflowClient(db).get_metric_history(run_id, "actor/loss")) == 2  # an update each iteration
    for i in range(2):
        b = RolloutBatch.read(layout.batch_url(i, "advantages"))
        assert b.num_rows == 4
        for tokens, mask, adv, episode in zip(b.column("response_tokens").to_pylist(),
                                              b.column("loss_mask").to_pylist(), b.column("advantages").to_pylist(),
                                              b.column("episode").to_pylist()):
            turns = [m for m in json.loads(episode) if m["role"] == "assistant"]
            spans = _spans(mask)
            assert len(spans) == len(turns) >= 1 and all(a == 0 for a, m in zip(adv, mask) if not m)
            for start, end in spans:  # each turn as sampled: up to an eos id, or the budget
                turn = tokens[start:end]
                assert (turn[-1] in EOS_IDS and not EOS_IDS & set(turn[:-1])) or \
                    (len(turn) == NEW_TOKENS and not EOS_IDS & set(turn)), turn
    adapter = load_file(str(Path(layout.read_state().actor_url.replace("file://", "")) / "adapter_model.safetensors"))
    b_matrices = {k: v for k, v in adapter.items() if "lora_B" in k}
    assert adapter["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (8, 1024)
    assert b_matrices and all(v.abs().max() > 0 for v in b_matrices.values())  # trained from zero

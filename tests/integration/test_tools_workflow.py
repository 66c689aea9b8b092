"""Multi-turn episodes through ``pyflyte run``: 2 iterations of GRPO (``configs/tiny_tools.yaml``, resident and
colocated: two actor ranks sampling the episodes; and asynchronous, ``run.max_staleness=2``: the engine service
sampling episodes ahead of the trainer, each token tagged with its policy version, SIGKILLed once iteration 0 is
committed: the run starts it again and no episode is lost or trained twice) and
of PPO (``configs/tiny_ppo.yaml`` with an environment) on the Qwen2-shaped chat checkpoint, with
the calculator task: this project's environment for the colocated GRPO run, the same task written as a
``verifiers`` ToolEnv (``verifiers:models.demos.verifiers_calculator``) for PPO and as an OpenEnv MCP environment
(``openenv:models.demos.openenv_calculator:CalculatorEnvironment``) for the asynchronous run, each used unchanged
through its adapter. The batches hold one row per episode with its ``loss_mask``, the rewards are the
environment's (for ``verifiers``, its rubric's; for OpenEnv, its observation's), the advantages are 0 off the
policy's tokens, and MLflow has the ``episode/*`` metrics, ``rollout/reward_mean`` and the conversations in its
sample table. The other libraries' adapters run in-process in ``test_env_adapters.py``."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from pathlib import Path

import mlflow
import numpy as np
import pytest

from models.demos.tool_tasks import final_number, problems
from models.data.batch import RolloutBatch
from models.data.draws import draw_ids, iteration_indices
from models.run.layout import RunLayout
from tests.integration.flyte_runs import FlyteRun, isolated_env
from tests.integration.test_async_resume import _iteration, _pids

pytestmark = pytest.mark.integration

SMALL = ["run.storage_root={root}/runs", "run.num_iterations=2", "run.eval_interval=2", "run.save_interval=2",
         "rollout.engine=hf", "rollout.prompts_per_iteration=4", "rollout.n_samples_per_prompt=2",
         "rollout.max_new_tokens=12", "actor.nproc_per_node=1", "actor.minibatch_size=8", "actor.micro_batch_size=8",
         "rollout.max_turns=2", "rollout.max_episode_tokens=48", "data.train_prompts={root}/train.jsonl",
         "data.eval_prompts={root}/eval.jsonl", "model.actor_path={root}/actor"]
ENV = ["rollout.environment=verifiers:models.demos.verifiers_calculator", "rollout.max_turns=3",
       "reward.function=models.environments.episode_rollout:environment_reward"]


@pytest.fixture(scope="module")
def root(qwen2_chat_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("tools")
    shutil.copytree(qwen2_chat_dir, root / "actor")
    for name, rows in (("train", problems(8, 0)), ("eval", problems(4, 1))):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _check(root: Path, run_name: str) -> None:
    layout = RunLayout(str(root / "runs"), run_name)
    for i in range(2):
        b = RolloutBatch.read(layout.batch_url(i, "advantages"))
        assert b.num_rows == 8
        mask = b.column("loss_mask").to_pylist()
        for m, adv, lp in zip(mask, b.column("advantages").to_pylist(), b.column("sampler_logprobs").to_pylist()):
            assert all(a == 0 for a, k in zip(adv, m) if not k) and all(x == 0 for x, k in zip(lp, m) if not k)
        np.testing.assert_array_equal(b.column("reward_raw").to_numpy(), b.column("episode_reward").to_numpy())
        # OpenEnv's reset gives the question as an observation (a user turn); ours and verifiers' a system prompt
        first = "user" if run_name == "tools-async" else "system"
        assert all(json.loads(e)[0]["role"] == first for e in b.column("episode").to_pylist())
        if run_name != "tools-grpo":  # verifiers' rubric, OpenEnv's observation: the exact answer of a finished
            for e, r, end in zip(b.column("episode").to_pylist(), b.column("episode_reward").to_pylist(),  # episode
                                 b.column("is_end").to_pylist()):
                messages = json.loads(e)
                question = [m for m in messages if m["role"] == "user"][0]["content"]
                a, c = map(int, re.findall(r"\d+", question)[-2:])  # "... What is A*B?"
                last = [m for m in messages if m["role"] == "assistant"][-1]
                assert r == (float(final_number(last["content"]) == str(a * c)) if end else 0.0)
    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")
    run_id = layout.read_run_info().mlflow_run_id
    metrics = client.get_run(run_id).data.metrics
    assert {"episode/turns_mean", "episode/tool_calls_mean", "episode/tool_errors_mean", "episode/truncated_frac",
            "eval/reward_mean", "rollout/logprob_gap_max"} <= set(metrics)
    assert metrics["rollout/logprob_gap_max"] < 1e-3
    means = [np.mean(RolloutBatch.read(layout.batch_url(i, "advantages")).column("reward_raw").to_numpy())
             for i in range(2)]
    logged = sorted(client.get_metric_history(run_id, "rollout/reward_mean"), key=lambda m: m.step)
    np.testing.assert_allclose([m.value for m in logged], means, atol=1e-6)
    # the preset evaluates the starting policy too (GRPO: run.eval_before_training in tiny_tools.yaml)
    steps = [m.step for m in client.get_metric_history(run_id, "eval/reward_mean")]
    assert sorted(steps) == ([1] if run_name == "tools-ppo" else [-1, 1])
    table = json.loads(Path(client.download_artifacts(run_id, "samples/iter-000001.json", str(root))).read_text())
    assert "conversation" in table["columns"]


@pytest.mark.parametrize("name, workflow, preset, extra", [
    # the GRPO run keeps its models in a resident run's services (run.resident), colocated: episodes sampled by
    # the actor service's two ranks' engines (each turn's prompts dealt over them), scored and trained by the
    # same service; the checks are the same in both modes
    ("grpo", "workflows/reinforce.py reinforce_training", "configs/tiny_tools.yaml",
     ["run.resident=true", "run.resident_layout=colocated", "actor.nproc_per_node=2", "actor.micro_batch_size=4"]),
    ("ppo", "workflows/ppo.py ppo_training", "configs/tiny_ppo.yaml", ENV + ["critic.minibatch_size=8",
                                                                             "critic.micro_batch_size=8"]),
    # asynchronous (run.max_staleness=2): the engine service samples the episodes of iterations ahead of the
    # trainer, a unit of prompts at a time, each token tagged with the version that drew it; the environment is
    # the calculator task written for OpenEnv (an MCPEnvironment in process), through its adapter unchanged
    ("async", "workflows/reinforce.py reinforce_training", "configs/tiny_tools.yaml",
     ["run.resident=true", "run.max_staleness=2", "actor.tis_cap=2",
      "rollout.environment=openenv:models.demos.openenv_calculator:CalculatorEnvironment", "run.save_interval=1",
      'reward.functions=["models.environments.episode_rollout:environment_reward"]', "reward.weights=[1.0]"]),
], ids=["grpo", "ppo", "async"])
def test_two_multi_turn_iterations(root, name, workflow, preset, extra):
    overrides = [o.format(root=root) for o in SMALL] + extra
    (root / f"tmp-{name}").mkdir()  # where the services' folders go
    env = isolated_env(root / "home", {"MLFLOW_TRACKING_URI": f"sqlite:///{root}/mlflow.db",
                                       "TMPDIR": str(root / f"tmp-{name}")})
    run = FlyteRun(*workflow.split(), preset, overrides, f"tools-{name}", env, root / f"{name}.log")
    layout = RunLayout(str(root / "runs"), f"tools-{name}")
    if name == "async":  # the engine service SIGKILLed once iteration 0 is committed, its episodes of iteration 1
        run.wait_until(lambda: _iteration(layout) >= 0 and "engine" in _pids(layout), "iteration 0's commit")
        os.kill(_pids(layout)["engine"], signal.SIGKILL)  # (sampled ahead) lost with it: sampled again
    log = run.wait(timeout_s=1200)
    _check(root, f"tools-{name}")
    if name == "async":
        killed = r"the engine service \(pid \d+\) was killed by SIGKILL[^\n]*: started again"
        assert re.search(killed, log), log[-3000:]
        # a finished run removes its services' folder, but not one whose engine was started again: its logs say why
        assert sorted(p.name for p in (root / "tmp-async").glob("resident-*/engine*.log")) == ["engine-1.log",
                                                                                               "engine.log"]
        rows = []
        for i in range(2):  # no episode lost or trained twice: each iteration's prompts, once each, N episodes each
            table = RolloutBatch.read(layout.batch_url(i, "advantages")).table
            assert table.column("prompt_id").to_pylist() == np.repeat(draw_ids(4, i), 2).tolist()
            rows += table.column("row_id").to_numpy()[::2].tolist()
            assert table.column("row_id").to_numpy()[::2].tolist() == iteration_indices(8, 4, i, 0).tolist()
        assert sorted(rows) == list(range(8))  # the epoch, each problem once
        # every trained token at most k = 2 versions old; iteration 0's drawn by version 0
        lags = [[i - v for vs in RolloutBatch.read(layout.batch_url(i, "advantages")).column("token_versions")
                 .to_pylist() for v in vs] for i in range(2)]
        assert max(lags[0]) == 0 and max(lags[1]) <= 2 and min(min(lag) for lag in lags) == 0, lags
    if name == "grpo":  # resident (colocated) and finished: its services' folder removed
        assert not list((root / "tmp-grpo").glob("resident-*"))

"""Critic-free algorithms end to end through ``pyflyte run``, and PPO with its critic (and the
reward model) behind the HTTP server."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from models.checkpoint import is_committed
from models.data.batch import ADVANTAGE_COLUMNS, RolloutBatch
from models.run.layout import RunLayout
from tests.integration.console_lines import demo_env, library_lines
from tests.processes import server_process

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["run.num_iterations=2", "run.eval_interval=2", "rollout.prompts_per_iteration=8",
         "actor.minibatch_size=32", "actor.micro_batch_size=16", "data.num_demo_train_prompts=64",
         "data.num_demo_eval_prompts=8"]
CRITIC_SMALL = ["critic.minibatch_size=32", "critic.micro_batch_size=32"]


def _pyflyte(workflow: str, entry: str, preset: str, overrides, run_name: str, db, env=None,
             stderr: bool = False) -> str:
    """The run's stdout (``stderr``: and its stderr after it); ``env``: its environment (default: this one's)."""
    env = dict(env or os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{db}", PYTHONUNBUFFERED="1")
    cmd = [os.path.join(os.path.dirname(sys.executable), "pyflyte"), "run", workflow, entry, "--preset", preset,
           "--overrides", json.dumps(overrides), "--run_name", run_name]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout + proc.stderr if stderr else proc.stdout


@pytest.mark.parametrize("algo", ["rloo", "reinforce_pp", "reinforce"])  # grpo: test_learns_the_tiny_task
def test_critic_free_two_iterations(algo, tmp_path):
    """Two iterations of each critic-free algorithm through the stage functions in this process (the
    reinforce workflow's wiring runs under ``pyflyte`` for GRPO and Dr. GRPO below): the batches carry
    every advantage column, no critic is trained or logged."""
    import mlflow

    from models.run.types import PolicyState
    from models.stages.evaluate import run_evaluate
    from tests.hub_runs import iterate
    from tests.stages import tiny_run

    with tiny_run(tmp_path, f"tiny_{algo}", SMALL, algo) as (cfg, run, state):
        stats = iterate(cfg, run, state, 2)
        run_evaluate(cfg, run, PolicyState.resumed(run.layout.read_state(), cfg.kl.coef, False))  # after the last
        client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
        metrics = client.get_run(run.mlflow_run_id).data.metrics
    layout = RunLayout(str(tmp_path), algo)
    for i in range(2):
        batch = RolloutBatch.read(layout.batch_url(i, "advantages"))
        batch.validate(ADVANTAGE_COLUMNS)
        assert "values" not in batch.column_names
        assert not os.path.exists(layout.critic_url(i))  # no critic trained
    assert not os.path.exists(os.path.join(layout.url, "critic-init"))
    assert len(stats) == 2 and "actor/loss" in metrics and "eval/reward_mean" in metrics
    assert not [k for k in metrics if k.startswith("critic/")]


def _metrics(db, run_id: str, key: str) -> list:
    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{db}")
    return [m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]


def test_dr_grpo_with_the_rlvr_options(tmp_path):
    """Dr. GRPO with DAPO's dynamic sampling, overlong filtering and soft overlong punishment and
    truncated IS, through ``pyflyte run``: the loss mask each batch carries is the one its rewards,
    groups and ``is_end`` call for, and each option's metric is logged."""
    opts = ["advantage.dynamic_sampling=true", "advantage.mask_truncated=true", "advantage.overlong_buffer=2",
            "actor.tis_cap=2"]
    out = _pyflyte("workflows/reinforce.py", "reinforce_training", "configs/tiny_dr_grpo.yaml",
                   [f"run.storage_root={tmp_path}"] + SMALL + opts, "dapo", tmp_path / "mlflow.db")
    assert "[dr_grpo] iter 2/2" in out
    layout = RunLayout(str(tmp_path), "dapo")
    for i in range(2):
        t = RolloutBatch.read(layout.batch_url(i, "advantages")).table
        reward, pid = t.column("reward").to_numpy(), t.column("prompt_id").to_numpy()
        spread = {p: np.ptp(reward[pid == p]) for p in set(pid.tolist())}
        want = [spread[p] > 0 and end for p, end in zip(pid.tolist(), t.column("is_end").to_pylist())]
        got = [all(m) if any(m) else False for m in t.column("loss_mask").to_pylist()]
        assert got == want and any(want)
    run_id = layout.read_run_info().mlflow_run_id
    db = tmp_path / "mlflow.db"
    assert all(0 < v <= 1 for v in _metrics(db, run_id, "adv/dynamic_sampling_kept"))
    assert all(v <= 0 for v in _metrics(db, run_id, "adv/overlong_penalty_mean"))
    # the vLLM sampler and the trainer both compute in float32: the weights are 1 up to rounding
    assert _metrics(db, run_id, "actor/tis_weight_mean") == pytest.approx([1.0, 1.0], abs=0.02)


@pytest.mark.slow
@pytest.mark.parametrize("algo, workflow", [("ppo", "ppo"), ("grpo", "reinforce")])
def test_learns_the_tiny_task(algo, workflow, tmp_path):
    """PPO and GRPO raise the tiny task's reward by >= 0.1 within 15 iterations: the preset as ``make demo``
    runs it, shortened, its policy after 15 iterations against the one it started from on 512 held-out
    prompts (both evaluated by the run itself, ``run.eval_before_training``), sampled at the training
    temperature with the same seed (paired: prompt difficulty cancels; the rollout reward of iteration 1
    against the last ones moves with each iteration's prompts).

    Both runs are resident (``run.resident``: the engine, the actor and PPO's critic as the run's services,
    a third of the stateless time per iteration with the same rewards: tests/integration/test_resume.py
    compares the two modes bit for bit). The PPO run is also what ``make demo`` prints, its services' output
    included: it runs in a user's environment (none of the quieting variables of this pytest process),
    registers its policy as the demo does, and its stdout and stderr hold the project's own lines only
    (``console_lines.py``)."""
    quick = ["run.num_iterations=15", "run.eval_interval=15", "run.eval_before_training=true",
             "rollout.eval_temperature=1.0", "data.num_demo_eval_prompts=512", "run.save_interval=100"]
    quick += ["run.resident=true"]
    if algo != "ppo":  # registering and logging the checkpoint prove nothing more here
        quick += ["run.registered_model_name=", "run.checkpoint_artifact_max_mb=0"]
    env = demo_env(tmp_path / "home") if algo == "ppo" else None
    out = _pyflyte(f"workflows/{workflow}.py", f"{workflow}_training", f"configs/tiny_{algo}.yaml",
                   [f"run.storage_root={tmp_path}"] + quick, algo, tmp_path / "mlflow.db", env=env, stderr=True)
    if algo == "ppo":  # formerly test_quiet_console.py
        assert "[ppo] iter 15/15" in out and "Run ppo finished: 15 iterations of ppo." in out
        assert {what: lines for what, lines in library_lines(out).items() if lines} == {}, out[-4000:]
    run_id = RunLayout(str(tmp_path), algo).read_run_info().mlflow_run_id
    before, after = _metrics(tmp_path / "mlflow.db", run_id, "eval/reward_mean")  # steps -1 and 14
    rollout = _metrics(tmp_path / "mlflow.db", run_id, "rollout/reward_mean")
    print(f"{algo}: held-out reward {before:.3f} -> {after:.3f} ({after - before:+.3f}); rollout reward "
          f"{[round(r, 3) for r in rollout]}")
    assert len(rollout) == 15 and after - before >= 0.1
    hits = _metrics(tmp_path / "mlflow.db", run_id, "rollout/prefix_cache_hit_rate")  # vLLM in the engine service
    assert len(hits) == 15 and all(0 <= h < 1 for h in hits), hits


def test_reinforce_workflow_refuses_ppo(tmp_path):
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/m.db")
    cmd = [os.path.join(os.path.dirname(sys.executable), "pyflyte"), "run", "workflows/reinforce.py",
           "reinforce_training", "--preset", "configs/tiny_ppo.yaml", "--overrides",
           json.dumps([f"run.storage_root={tmp_path}"])]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "run.algorithm=ppo trains a critic: use workflows/ppo.py ppo_training" in proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory):
    """A tiny PPO run (HF engine, one process) set up in-process, and its first rollout."""
    from models.stages.rollout import run_rollout
    from models.run.setup import setup_run

    root = tmp_path_factory.mktemp("remote")
    mp = pytest.MonkeyPatch()
    mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root}/mlflow.db")
    overrides = [f"run.storage_root={root}", "rollout.engine=hf", "actor.nproc_per_node=1"] + SMALL + CRITIC_SMALL
    setup = setup_run("tiny_ppo", overrides, "remote")
    yield root, overrides, setup, run_rollout(setup.cfg, setup.run, setup.state)
    mp.undo()


def _with(cfg, **sections):
    from models.config.io import config_from_json_dict, to_dict

    data = to_dict(cfg)
    for section, values in sections.items():
        data[section].update(values)
    return config_from_json_dict(data)


def test_remote_critic_matches_in_task_critic(ppo_run, tmp_path):
    from models.stages.score import run_score
    from models.stages.critic import train_critic

    root, _, setup, ro = ppo_run
    assert "rollout/prefix_cache_hit_rate" not in ro.stats and "time/generate_s" in ro.stats  # HF: no cache
    local = run_score(setup.cfg, setup.run, setup.state, ro.batch)
    token = "s3cret-token"
    with server_process(["--critic", setup.state.critic_url, "--storage-root", str(root), "--threads", "1",
                         "--token-env", "RS_TOKEN"], env={"RS_TOKEN": token}, log_path=tmp_path / "srv.log") as srv:
        os.environ["RLHF_SERVER_TOKEN"] = token
        try:
            cfg = _with(setup.cfg, critic={"remote_url": srv.url})
            remote = run_score(cfg, setup.run, setup.state, ro.batch)
            np.testing.assert_allclose(np.concatenate(remote.batch.column("values").to_pylist()),
                                       np.concatenate(local.batch.column("values").to_pylist()), atol=1e-5)
            from models.stages.advantages import run_advantages

            adv = run_advantages(cfg, setup.run, setup.state, remote.batch)
            out = train_critic(cfg, setup.run, setup.state, adv.batch)
        finally:
            os.environ.pop("RLHF_SERVER_TOKEN", None)
    assert out.checkpoint_url == setup.run.layout.critic_url(0) and is_committed(out.checkpoint_url)
    assert np.isfinite(out.stats["critic/loss"])


def test_remote_reward_model_matches_local(ppo_run, tmp_path):
    from models.stages.evaluate import eval_reward
    from models.checkpoint import save_checkpoint
    from models.demos.tiny import TinyModelConfig, build_reward_model, save_model
    from models.demos.tokenizer import build_char_tokenizer
    from models.stages.score import run_score

    root, _, setup, ro = ppo_run
    tok = build_char_tokenizer()
    rm_url = str(root / "rm")
    save_checkpoint(str(save_model(build_reward_model(TinyModelConfig(), tok), tok, tmp_path / "rm")), rm_url)
    local_cfg = _with(setup.cfg, reward={"source": "model", "model_path": rm_url})
    local = run_score(local_cfg, dataclasses.replace(setup.run, reward_model_url=rm_url), setup.state, ro.batch)
    with server_process(["--reward-model", rm_url, "--threads", "1"], log_path=tmp_path / "srv.log") as srv:
        cfg = _with(setup.cfg, reward={"source": "remote", "remote_url": srv.url})
        remote = run_score(cfg, setup.run, setup.state, ro.batch)
        remote_eval = eval_reward(cfg, setup.run, setup.state.actor_url)
    np.testing.assert_allclose(remote.batch.column("reward").to_numpy(), local.batch.column("reward").to_numpy(),
                               atol=1e-5)
    # evaluation scores held-out samples with the run's reward source too, not only reward functions
    local_eval = eval_reward(local_cfg, dataclasses.replace(setup.run, reward_model_url=rm_url), setup.state.actor_url)
    assert local_eval == pytest.approx(remote_eval, abs=1e-5)
    assert local_eval != pytest.approx(eval_reward(setup.cfg, setup.run, setup.state.actor_url), abs=1e-3)


def test_ppo_end_to_end_with_critic_server(ppo_run, tmp_path):
    root, _, setup, _ = ppo_run
    with server_process(["--critic", setup.state.critic_url, "--storage-root", str(tmp_path), "--threads", "1"],
                        log_path=tmp_path / "srv.log") as srv:
        out = _pyflyte("workflows/ppo.py", "ppo_training", "configs/tiny_ppo.yaml",
                       [f"run.storage_root={tmp_path}", f"critic.remote_url={srv.url}", "rollout.engine=hf"]
                       + SMALL + CRITIC_SMALL,  # the HF engine: the remote critic is the point, not vLLM's start
                       "e2e-remote", tmp_path / "mlflow.db")
    assert "[ppo] iter 2/2" in out
    layout = RunLayout(str(tmp_path), "e2e-remote")
    assert layout.read_state().critic_url == layout.critic_url(1)
    assert is_committed(layout.critic_url(1))  # written by the server's save
    RolloutBatch.read(layout.batch_url(1, "advantages")).validate(ADVANTAGE_COLUMNS + ("values",))

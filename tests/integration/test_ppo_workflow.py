"""``ppo_training`` end to end through ``pyflyte run`` (local Flyte execution): vLLM rollouts,
2-process elastic actor and critic updates (the critic's launch set from the run's
``critic.nproc_per_node``, as the actor's; FSDP2 with AdamW's state committed per rank), the moto S3
server as storage and MLflow in SQLite."""

from __future__ import annotations

import os
import json
import subprocess
import sys

import pytest

from models import storage
from models.checkpoint import download_checkpoint, is_committed
from models.training.files import optimizer_url
from models.data.batch import ADVANTAGE_COLUMNS, RolloutBatch
from models.config.io import load_config
from models.run.layout import RunLayout

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DESIGN_METRICS = [
    "rollout/reward_mean", "rollout/reward_std", "rollout/reward_with_kl_mean", "rollout/init_policy_kl",
    "rollout/response_length_mean", "rollout/fraction_ended",
    "adv/advantages_mean", "adv/advantages_std", "adv/returns_mean", "adv/values_mean",
    "actor/loss", "actor/clip_frac", "actor/approx_kl", "actor/entropy", "actor/grad_norm", "actor/lr",
    "critic/loss", "critic/explained_variance", "critic/grad_norm", "eval/reward_mean",
    "time/rollout_s", "time/score_s", "time/advantages_s", "time/actor_update_s", "time/critic_update_s",
    "throughput/rollout_tokens_per_s",
]


def test_two_iterations_on_s3(s3_url, tmp_path):
    db = tmp_path / "mlflow.db"
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{db}", PYTHONUNBUFFERED="1")
    overrides = [f"run.storage_root={s3_url}", "run.num_iterations=2", "run.eval_interval=2",
                 "run.save_interval=1", "rollout.prompts_per_iteration=8", "actor.minibatch_size=32",
                 "actor.micro_batch_size=16", "critic.minibatch_size=32", "critic.micro_batch_size=16",
                 "critic.nproc_per_node=2", "critic.sharding=fsdp2", "critic.optimizer_state_sharded=true",
                 "data.num_demo_train_prompts=64", "data.num_demo_eval_prompts=8"]
    cmd = [os.path.join(os.path.dirname(sys.executable), "pyflyte"), "run", "workflows/ppo.py", "ppo_training",
           "--preset", "configs/tiny_ppo.yaml", "--overrides", json.dumps(overrides), "--run_name", "e2e"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "[ppo] iter 2/2" in proc.stdout
    assert "Run e2e finished: 2 iterations of ppo." in proc.stdout

    layout = RunLayout(s3_url, "e2e")
    state = layout.read_state()
    assert state.iteration == 1 and state.actor_url == layout.actor_url(1)
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    for i in range(2):  # save_interval=1 keeps every iteration's checkpoints
        assert is_committed(layout.actor_url(i)) and is_committed(layout.critic_url(i))
        AutoModelForCausalLM.from_pretrained(download_checkpoint(layout.actor_url(i)))
        AutoModelForTokenClassification.from_pretrained(download_checkpoint(layout.critic_url(i)))
        batch = RolloutBatch.read(layout.batch_url(i, "advantages"))
        batch.validate(ADVANTAGE_COLUMNS + ("values", "prompt", "response"))
        assert batch.num_rows == 8 * 4 and batch.metadata.iteration == i

    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{db}")
    run_id = layout.read_run_info().mlflow_run_id
    metrics = client.get_run(run_id).data.metrics
    missing = [k for k in DESIGN_METRICS if k not in metrics]
    assert not missing, f"metrics missing from the MLflow run: {missing}"
    assert [m.step for m in client.get_metric_history(run_id, "rollout/reward_mean")] == [0, 1]
    assert client.get_run(run_id).data.params["actor.lr"] == "0.0001"
    # AdamW's state goes from one iteration's update to the next, beside the newest checkpoints only
    cfg = load_config("configs/tiny_ppo.yaml", overrides)
    per_iteration = {"actor": cfg.actor.ppo_epochs * 32 // 32, "critic": cfg.critic.epochs * 32 // 32}
    for role, steps in per_iteration.items():
        urls = [getattr(layout, f"{role}_url")(i) for i in range(2)]
        assert not storage.exists(optimizer_url(urls[0])) and is_committed(optimizer_url(urls[1]))
        history = [m.value for m in sorted(client.get_metric_history(run_id, f"{role}/optimizer_steps_total"),
                                           key=lambda m: m.step)]
        assert history == [steps, 2 * steps], role
    shards = [f for f in storage.list_files(optimizer_url(layout.critic_url(1))) if f.endswith(".safetensors")]
    assert sorted(shards) == ["rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"]  # 2 ranks
    tables = [a.path for a in client.list_artifacts(run_id, "samples")]
    assert tables == ["samples/iter-000000.json", "samples/iter-000001.json"]
    assert storage.exists(storage.join(layout.url, "data", "train_prompts.jsonl"))

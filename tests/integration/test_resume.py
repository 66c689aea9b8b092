"""Kill a whole local training run (SIGKILL of the ``pyflyte`` process group) during a rollout,
and during a checkpoint commit, and SIGKILL the ``pyflyte`` process alone (as the kernel's OOM killer does:
its keeper ends the run, FAILED, and no process of it lives on) during the elastic actor update (all in
iteration 1, so each rerun resumes after iteration 0); rerun it with the same run name each time; compare with a
run that was never interrupted (same seeds, other run name). The killed run keeps only what a resume
needs (``run.keep_checkpoints=0``, ``run.keep_batches=0``): each rerun resumes after retention deleted
iteration 0's batches, takes iteration 1's finished tasks from Flyte's cache (their batch files are
after the resume point: kept), and the finished run holds the final checkpoints alone.

The same run with ``run.resident=true``, first colocated (``run.resident_layout=colocated``: the actor and the
critic as services for the whole run, the actor trainer's ranks generating), has its actor trainer service
SIGKILLed during iteration 1; the run fails naming it, leaves no service behind, and its rerun, in the separate
layout (an engine service of its own), resumes with fresh services from iteration 0's checkpoints (weights and
AdamW's moments). The rerun then has its engine service SIGKILLed once iteration 1 is sampled: the run
starts it again, the actor trainer gives it the weights it holds, and the run goes on without failing or
redoing an iteration, to the uninterrupted stateless run's metrics (the final evaluation's by the restarted
engine among them), batches and weights.

Both runs use the moto S3 server as storage, with fake credentials and tokens in the
environment and one in a config URL: the same runs serve the credential check (nothing secret
in MLflow params, tags, metrics, artifacts or the logs).
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import numpy as np
import psutil
import pytest

from models import storage
from models.checkpoint import is_committed, read_marker
from models.data.batch import ADVANTAGE_COLUMNS, RolloutBatch
from models.run.layout import RunLayout
from models.run.retention import usage
from tests.conftest import BUCKET
from tests.integration.flyte_runs import FlyteRun, isolated_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ITERATIONS = 2
SECRETS = {"AWS_ACCESS_KEY_ID": "AKIAFAKEKEYID0123456", "AWS_SECRET_ACCESS_KEY": "fake-aws-secret-Zq8rT2vX9wLm4",
           "MLFLOW_TRACKING_TOKEN": "fake-mlflow-token-Hj5kP0sQ", "RLHF_SERVER_TOKEN": "fake-server-token-Yb3nC7dF"}
URL_PASSWORD = "url-password-Wx6eR1tU"
OVERRIDES = [f"run.num_iterations={ITERATIONS}", "run.eval_interval=2", "run.save_interval=1",
             "rollout.prompts_per_iteration=8", "rollout.n_samples_per_prompt=4",
             "actor.minibatch_size=16", "actor.micro_batch_size=8", "critic.minibatch_size=16",
             "critic.micro_batch_size=16", "data.num_demo_train_prompts=64", "data.num_demo_eval_prompts=8",
             "rollout.engine=hf",  # what is killed and resumed is the run; a stateless vLLM starts ~20 s per task
             # unused with reward.source=function, but a config value: it must not reach MLflow as is
             f"reward.remote_url=http://trainer:{URL_PASSWORD}@127.0.0.1:9/"]
RETAIN = ["run.keep_checkpoints=0", "run.keep_batches=0"]  # the killed run's: only what a resume needs
PER_ITERATION = ["rollout/reward_mean", "rollout/init_policy_kl", "actor/loss", "critic/loss", "adv/returns_mean"]


class Runs:
    def __init__(self, root: str, tmp: Path, env: dict):
        self.root, self.tmp, self.env = root, tmp, env
        self.db = tmp / "mlflow.db"
        self.logs: list[str] = []

    def start(self, name: str, attempt: str, fault_env: dict | None = None, extra=()) -> FlyteRun:
        env = dict(self.env, **(fault_env or {}))
        return FlyteRun("workflows/ppo.py", "ppo_training", "configs/tiny_ppo.yaml",
                        [f"run.storage_root={self.root}"] + OVERRIDES + list(extra), name, env,
                        self.tmp / f"{name}-{attempt}.log")

    def layout(self, name: str) -> RunLayout:
        return RunLayout(self.root, name)

    def state_iteration(self, name: str) -> int:
        state = self.layout(name).read_state()
        return -1 if state is None else state.iteration

    def kill_at(self, name: str, attempt: int, point: str, check=None, extra=(), alone: bool = False):
        """Start (or resume) ``name`` paused at ``point``; once it is there, SIGKILL the group, or with ``alone`` the
        ``pyflyte`` process alone, as the kernel's OOM killer does (its keeper then ends the run: the processes of
        the run, as they were just before, are returned once the keeper has said so)."""
        faults = self.tmp / f"faults-{attempt}"
        run = self.start(name, str(attempt), {"RLHF_FAULT_PAUSE": f"{point}:300", "RLHF_FAULT_DIR": str(faults)},
                         extra)
        paused = faults / "paused"
        run.wait_until(lambda: paused.exists() and point in paused.read_text(), f"the pause at {point}")
        if check is not None:
            check(run)
        procs = run.descendants()
        cmdlines = {p.pid: " ".join(_cmdline_if_alive(p) or []) for p in procs}  # before any of them exits
        if alone:
            os.kill(run.proc.pid, signal.SIGKILL)
            run.proc.wait(timeout=60)
            keeper = [p for p in procs if "models.run.keeper" in cmdlines[p.pid]]
            assert len(keeper) == 1, list(cmdlines.values())
            keeper[0].wait(timeout=120)  # it has stopped the rest and marked the run
        else:
            run.kill()
        self.logs.append(run.output())
        return procs


@pytest.fixture(scope="module")
def runs(s3_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    env_vars = dict(SECRETS, AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=s3_server,
                    FSSPEC_S3_ENDPOINT_URL=s3_server, MLFLOW_TRACKING_URI=f"sqlite:///{tmp / 'mlflow.db'}")
    mp = pytest.MonkeyPatch()
    for k, v in env_vars.items():
        mp.setenv(k, v)
    mp.delenv("AWS_SESSION_TOKEN", raising=False)
    mp.delenv("AWS_PROFILE", raising=False)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    r = Runs(f"s3://{BUCKET}/resume-{os.getpid()}", tmp, isolated_env(tmp / "home", env_vars))
    r.logs.append(r.start("reference", "0").wait(900))

    layout = r.layout("resumed")
    # 1. during the rollout of iteration 1 (iteration 0 committed, its batches deleted, none written yet)
    r.kill_at("resumed", 1, "rollout/iter-000001", extra=RETAIN)
    assert r.state_iteration("resumed") == 0
    assert not storage.exists(layout.batch_url(1, "rollouts"))
    assert usage(layout).batches == {} and list(usage(layout).checkpoints) == [0]

    # 2. during the elastic actor update of iteration 1 (its workers alive, nothing saved)
    def workers_alive(run: FlyteRun) -> None:
        # local runs fork the workers from a forkserver (tasks/elastic.py): its children
        workers = [p for p in run.descendants() if "multiprocessing.forkserver" in " ".join(p.parent().cmdline())]
        assert len(workers) >= 2, [p.cmdline() for p in run.descendants()]

    # pyflyte alone, as the kernel's OOM killer does: its keeper stops the workers, says so, marks the run FAILED
    r.killed_alone = r.kill_at("resumed", 2, "actor_update/iter-000001", workers_alive, RETAIN, alone=True)
    r.left_alive = [c for c in map(_cmdline_if_alive, r.killed_alone) if c is not None]
    r.status_after_kill = _client(r).get_run(_run_id(r, "resumed")).info.status
    r.lease_after_kill = json.loads(storage.read_bytes(layout.lock_url))
    assert r.state_iteration("resumed") == 0
    assert storage.exists(layout.batch_url(1, "advantages")) and not is_committed(layout.actor_url(1))

    # 3. during the commit of iteration 1's critic checkpoint (files in place, no marker yet);
    # the actor update finished: the rerun takes it from Flyte's cache
    r.kill_at("resumed", 3, f"commit/{layout.critic_url(1)}", extra=RETAIN)
    assert r.state_iteration("resumed") == 0 and is_committed(layout.actor_url(1))
    assert storage.exists(storage.join(layout.critic_url(1), "config.json"))
    assert not is_committed(layout.critic_url(1))
    # what the rerun trains on (the cache's answer): compared with the reference, though retention deletes it
    r.batch_1 = _advantages(layout, 1)

    r.logs.append(r.start("resumed", "4", extra=RETAIN).wait(900))
    yield r
    mp.undo()
    s3fs.S3FileSystem.clear_instance_cache()


def _cmdline_if_alive(p: psutil.Process):
    """``p``'s command line if it still runs; None once it has exited (a zombie, or reaped meanwhile)."""
    try:
        return None if p.status() == psutil.STATUS_ZOMBIE else p.cmdline()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None


def _client(runs: Runs):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{runs.db}")


def _run_id(runs: Runs, name: str) -> str:
    return runs.layout(name).read_run_info().mlflow_run_id


def _advantages(layout: RunLayout, i: int):
    """Iteration ``i``'s batch after the advantages stage, without its metadata (times, run name)."""
    return RolloutBatch.read(layout.batch_url(i, "advantages")).table.replace_schema_metadata(None)


def _weights_digest(url: str) -> str:
    return read_marker(url)["files"]["model.safetensors"]["blake3"]


def test_resumed_run_completes_every_iteration_once(runs):
    final = runs.logs[-1]
    assert "Run resumed finished: 2 iterations of ppo." in final
    assert "[ppo] iter 1/2" not in final  # iteration 0 was committed before: not redone
    assert "[ppo] iter 2/2" in final
    state = runs.layout("resumed").read_state()
    assert state.iteration == ITERATIONS - 1 and state.actor_url == runs.layout("resumed").actor_url(ITERATIONS - 1)
    client = _client(runs)
    run_id = _run_id(runs, "resumed")
    for key in client.get_run(run_id).data.metrics:  # no step logged twice, for any metric
        steps = [m.step for m in client.get_metric_history(run_id, key)]
        assert len(steps) == len(set(steps)), (key, steps)
    for key in PER_ITERATION:
        assert sorted(m.step for m in client.get_metric_history(run_id, key)) == list(range(ITERATIONS)), key
    assert sorted(m.step for m in client.get_metric_history(run_id, "eval/reward_mean")) == [1]
    tables = sorted(a.path for a in client.list_artifacts(run_id, "samples"))
    assert tables == [f"samples/iter-{i:06d}.json" for i in range(ITERATIONS)]
    for path in tables:  # logged once each: not appended to by the redone commit
        data = json.loads(Path(client.download_artifacts(run_id, path, str(runs.tmp / "dl"))).read_text())
        assert len(data["data"]) == 8, path
    leftovers = [k for k in storage.list_files(runs.layout("resumed").url) if ".tmp-" in k or "write-check" in k]
    assert not leftovers


def test_a_run_whose_process_is_killed_is_ended_by_its_keeper(runs):
    """The second kill: ``pyflyte`` alone SIGKILLed during the elastic update, as the kernel's OOM killer does.
    Nothing in it can act: its keeper (models/run/keeper_process.py) stops the workers and the forkserver, says what
    happened, marks the MLflow run FAILED and releases the lock; the next launch resumes it (the other tests)."""
    killed = runs.logs[2]
    said = [line for line in killed.splitlines() if line.startswith("[flyte-rlhf] run resumed failed: ")]
    assert len(said) == 1, killed[-4000:]
    assert re.search(r"the run's process pyflyte \(pid \d+\) ended without running its exit handlers: killed by "
                     r"SIGKILL \(.*\); its peak memory was [\d.]+ GiB \(RSS, sampled every 0.5 s\), the run's "
                     r"processes together [\d.]+ GiB of [^;]*; the last task it started: tasks.updates.actor_update.*: "
                     r"MLflow run \w+ marked FAILED, lock released, iterations up to "
                     r"iter-000000 committed \(state.json\); rerun the same command to resume", said[0]), said[0]
    # the workers die with the forkserver (PR_SET_PDEATHSIG), which ends with pyflyte; what is left, the keeper stops
    assert runs.left_alive == [], "a process of the run outlived it"
    assert len(runs.killed_alone) >= 4  # the forkserver, two workers, the keeper (and the reward workers)
    assert runs.status_after_kill == "FAILED" and runs.lease_after_kill["released_at"]


def test_resumed_run_equals_the_uninterrupted_one(runs):
    """With fixed seeds the resumed run is bit-identical: rewards, losses, batches, weights. Retention kept
    the final checkpoints alone, here and in MLflow (the reference, keeping all, holds both iterations')."""
    _assert_equals_the_reference(runs, "resumed", batches={1: runs.batch_1}, checkpoints=[1])
    kept = usage(runs.layout("resumed"))
    assert (list(kept.checkpoints), kept.batches) == ([1], {})
    assert "  batches:        " in runs.logs[-1] and ".arrow: none, run.keep_batches=0" in runs.logs[-1]
    client = _client(runs)
    for name, copied in (("reference", [0, 1]), ("resumed", [1])):
        assert [a.path for a in client.list_artifacts(_run_id(runs, name), "checkpoints")] == \
            [f"checkpoints/iter-{i:06d}" for i in copied], name
    tags = client.get_run(_run_id(runs, "resumed")).data.tags
    assert sorted(t for t in tags if t.startswith("checkpoint.")) == ["checkpoint.iter-000001/actor",
                                                                     "checkpoint.iter-000001/critic"]


def _assert_equals_the_reference(runs: Runs, name: str, batches=None, checkpoints=range(ITERATIONS),
                                 sampler_atol: float = 0.0) -> None:
    """Run ``name`` has the uninterrupted run's metrics, batches (``batches``: ``{iteration: table}`` taken
    before retention deleted them; default: its files) and checkpoint files (of ``checkpoints``), bit for bit;
    the batches' ``sampler_logprobs`` within ``sampler_atol`` where not 0 (HF ``generate`` computes them over
    its left-padded batch, whose shape depends on the prompts each engine got: the same tokens, rounding apart)."""
    client = _client(runs)
    ref_id, res_id = _run_id(runs, "reference"), _run_id(runs, name)
    for key in PER_ITERATION + ["eval/reward_mean"]:
        ref = sorted((m.step, m.value) for m in client.get_metric_history(ref_id, key))
        res = sorted((m.step, m.value) for m in client.get_metric_history(res_id, key))
        assert ref == res, key
    ref_l, res_l = runs.layout("reference"), runs.layout(name)
    for i, b in (batches or {i: _advantages(res_l, i) for i in range(ITERATIONS)}).items():
        ref = _advantages(ref_l, i)
        if sampler_atol:  # every column bit for bit but the engine's own log-probs, within sampler_atol
            got, want = (np.concatenate(t.column("sampler_logprobs").to_pylist()) for t in (b, ref))
            assert got.shape == want.shape and np.abs(got - want).max() <= sampler_atol, f"iteration {i}"
            ref, b = (t.drop_columns(["sampler_logprobs"]) for t in (ref, b))
        assert ref.equals(b), f"iteration {i}: batches differ"
    for i in checkpoints:
        for url_a, url_b in ((ref_l.actor_url(i), res_l.actor_url(i)), (ref_l.critic_url(i), res_l.critic_url(i))):
            assert _weights_digest(url_a) == _weights_digest(url_b), url_b


def _texts_of_mlflow_run(runs: Runs, run_id: str) -> str:
    client = _client(runs)
    run = client.get_run(run_id)
    parts = [json.dumps(run.data.params), json.dumps(run.data.tags), json.dumps(sorted(run.data.metrics))]
    out = runs.tmp / f"artifacts-{run_id}"
    client.download_artifacts(run_id, "", str(out))
    for path in out.rglob("*"):
        if path.is_file() and path.suffix in (".json", ".txt", ".yaml", ".md", ".py", "") and path.stat().st_size < 5e6:
            parts.append(path.read_text(errors="replace"))
    return "\n".join(parts)


DESIGN_METRICS = [
    "rollout/reward_mean", "rollout/reward_std", "rollout/reward_with_kl_mean", "rollout/init_policy_kl",
    "rollout/response_length_mean", "rollout/fraction_ended",
    "adv/advantages_mean", "adv/advantages_std", "adv/returns_mean", "adv/values_mean",
    "actor/loss", "actor/clip_frac", "actor/approx_kl", "actor/entropy", "actor/grad_norm", "actor/lr",
    "critic/loss", "critic/explained_variance", "critic/grad_norm", "eval/reward_mean",
    "time/rollout_s", "time/score_s", "time/advantages_s", "time/actor_update_s", "time/critic_update_s",
    "throughput/rollout_tokens_per_s",
]
"""What docs/design.md promises a PPO run logs to MLflow."""


def test_the_uninterrupted_run_is_a_whole_ppo_run_on_s3(runs):
    """``ppo_training`` through ``pyflyte run`` on the moto S3 server with MLflow in SQLite (formerly
    ``test_ppo_workflow.py``, whose run was this one's twin): every iteration's checkpoints load as HF models, its
    batch holds every advantage column, every design metric is logged, AdamW's state goes from one update to the
    next and is kept beside the newest checkpoints only, the run's prompts and sample tables are stored."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from models.checkpoint import download_checkpoint
    from models.config.io import load_config
    from models.training.files import optimizer_url

    layout = runs.layout("reference")
    for i in range(ITERATIONS):
        assert is_committed(layout.actor_url(i)) and is_committed(layout.critic_url(i))
        AutoModelForCausalLM.from_pretrained(download_checkpoint(layout.actor_url(i)))
        AutoModelForTokenClassification.from_pretrained(download_checkpoint(layout.critic_url(i)))
        batch = RolloutBatch.read(layout.batch_url(i, "advantages"))
        batch.validate(ADVANTAGE_COLUMNS + ("values", "prompt", "response"))
        assert batch.num_rows == 8 * 4 and batch.metadata.iteration == i
    client, run_id = _client(runs), _run_id(runs, "reference")
    metrics = client.get_run(run_id).data.metrics
    assert not [k for k in DESIGN_METRICS if k not in metrics]
    assert client.get_run(run_id).data.params["actor.lr"] == "0.0001"
    cfg = load_config("configs/tiny_ppo.yaml", OVERRIDES)
    samples = cfg.rollout.prompts_per_iteration * cfg.rollout.n_samples_per_prompt
    per_iteration = {"actor": cfg.actor.ppo_epochs * samples // cfg.actor.minibatch_size,
                     "critic": cfg.critic.epochs * samples // cfg.critic.minibatch_size}
    for role, steps in per_iteration.items():
        urls = [getattr(layout, f"{role}_url")(i) for i in range(ITERATIONS)]
        assert not storage.exists(optimizer_url(urls[0])) and is_committed(optimizer_url(urls[1]))
        history = [m.value for m in sorted(client.get_metric_history(run_id, f"{role}/optimizer_steps_total"),
                                           key=lambda m: m.step)]
        assert history == [steps, 2 * steps], role
    assert [a.path for a in client.list_artifacts(run_id, "samples")] == \
        [f"samples/iter-{i:06d}.json" for i in range(ITERATIONS)]
    assert storage.exists(storage.join(layout.url, "data", "train_prompts.jsonl"))


def test_no_credentials_in_mlflow_or_logs(runs):
    secrets = list(SECRETS.values()) + [URL_PASSWORD]
    for name in ("reference", "resumed"):
        run_id = _run_id(runs, name)
        text = _texts_of_mlflow_run(runs, run_id)
        assert "reward.remote_url" in text and "http://***@127.0.0.1:9/" in text  # logged, masked
        leaked = [s for s in secrets if s in text]
        assert not leaked, f"MLflow run {name} holds {leaked}"
    db = runs.db.read_bytes()
    assert not [s for s in secrets if s.encode() in db], "a secret is in the MLflow database"
    logs = "\n".join(runs.logs)
    assert "[ppo] iter 2/2" in logs
    assert not [s for s in secrets if s in logs], "a secret is in the captured logs"


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def _service_pids(layout: RunLayout) -> dict:
    from models.service import book
    from models.stages.services import SERVICES

    return {n: address.pid for n in SERVICES if (address := book.read(layout.url, n)) is not None}


@pytest.fixture(scope="module")
def resident(runs):
    """``run.resident=true``, colocated (``run.resident_layout=colocated``: the actor trainer's ranks generate):
    its actor trainer service SIGKILLed once iteration 0 is committed; then rerun in the separate layout, its
    engine service SIGKILLed once iteration 1 is sampled."""
    layout, progress = runs.layout("resident"), f"{runs.layout('resident').url}/progress.json"
    first = runs.start("resident", "r1", extra=["run.resident=true", "run.resident_layout=colocated"])
    first.wait_until(lambda: storage.exists(progress), "iteration 0's commit")
    pids = _service_pids(layout)
    os.kill(pids["actor"], signal.SIGKILL)
    code = first.proc.wait(timeout=300)
    killed = first.output()
    alive = [n for n, pid in pids.items() if _alive(pid)]
    sampled = layout.batch_url(1, "rollouts")
    storage.remove(sampled)  # the first run's, if it got that far
    second = runs.start("resident", "r2", extra=["run.resident=true", "run.resident_layout=separate",  # set: kept
                                                 "run.resident_reference=reload"])  # π_ref read for each score
    pids2: dict = {}
    second.wait_until(lambda: pids2.update(_service_pids(layout)) or len(pids2) == 3 and not set(pids2.values()) &
                      set(pids.values()), "the services' addresses")  # the rerun's, not those the killed run left
    second.wait_until(lambda: storage.exists(sampled), "iteration 1's rollout")
    os.kill(pids2["engine"], signal.SIGKILL)
    second.wait_until(lambda: _service_pids(layout).get("engine", pids2["engine"]) != pids2["engine"],
                      "the engine started again")
    restarted = _service_pids(layout)["engine"]
    runs.logs.append(second.wait(900))
    return dict(code=code, killed=killed, pids=pids, alive=alive, resumed=runs.logs[-1],
                alive_after=[n for n, p in {**pids2, "restarted engine": restarted}.items() if _alive(p)])


def test_a_resident_run_killed_and_resumed_equals_the_stateless_one(runs, resident):
    assert set(resident["pids"]) == {"actor", "critic"}  # colocated: no engine service
    assert resident["code"] != 0
    assert "the actor trainer service" in resident["killed"] and "does not answer" in resident["killed"], \
        resident["killed"][-4000:]
    assert resident["alive"] == [] and resident["alive_after"] == [], "a service outlived its run"
    resumed = resident["resumed"]  # the engine killed mid-run: started again, given the weights, nothing redone
    assert re.search(r"the engine service \(pid \d+\) was killed by SIGKILL[^\n]*; its peak memory was "
                     r"[\d.]+ GiB[^\n]*: started again", resumed), resumed[-4000:]
    assert resumed.count("[ppo] iter 2/2") == 1 and "[ppo] iter 1/2" not in resumed
    client, run_id = _client(runs), _run_id(runs, "resident")
    transports = client.get_metric_history(run_id, "resident/weights_transport")
    assert transports and {m.value for m in transports} == {1.0}, "the weights did not go over the gloo channel"
    sent = {m.step: m.value for m in client.get_metric_history(run_id, "resident/weights_bytes")}
    assert sent[0] == 0 and sent[1] > 0, sent  # iteration 0 colocated (loaded in process), 1 separate (sent)
    _assert_equals_the_reference(runs, "resident", sampler_atol=1e-4)  # colocated: each rank samples half the prompts

"""Asynchronous training (``run.max_staleness=2``, resident) killed at two points, resumed, counted: the tiny GRPO
run has its engine service SIGKILLed once iteration 1 is committed (the run starts it again and goes on), then the
whole launch is SIGKILLed (the ``pyflyte`` process group) while the restarted engine service hands out iteration 4's
batch; the second launch finishes the run. Every iteration is committed once (its progress line printed once over
the two launches, its metrics logged once), the batches the updates trained on hold exactly the prompts of the data
order, no row twice within the epoch, and every trained token is at most k = 2 policy versions old (read from the
batches' ``token_versions``). Samples the killed launch had finished but not trained are sampled again, so the
resumed results need not equal an uninterrupted run's. (A killed actor trainer service failing the run with its
name is ``test_resume.py``'s resident run's first launch.)"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import numpy as np
import pytest

from models.data.batch import RolloutBatch
from models.data.draws import draw_ids, iteration_indices
from models.run.layout import RunLayout
from tests.integration.flyte_runs import FlyteRun, isolated_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]

K, ITERATIONS, PROMPTS, N, DATA = 2, 5, 8, 4, 64
OVERRIDES = [f"run.num_iterations={ITERATIONS}", "run.save_interval=1", "run.eval_interval=0",
             f"rollout.prompts_per_iteration={PROMPTS}", f"rollout.n_samples_per_prompt={N}",
             "actor.minibatch_size=32", "actor.micro_batch_size=16", f"data.num_demo_train_prompts={DATA}",
             "data.num_demo_eval_prompts=8", "run.registered_model_name=", "run.checkpoint_artifact_max_mb=0",
             "run.resident=true", f"run.max_staleness={K}", "actor.tis_cap=2", "rollout.engine=hf"]


def _pids(layout: RunLayout) -> dict:
    from models.service import book
    from models.stages.services import SERVICES

    return {n: a.pid for n in SERVICES if (a := book.read(layout.url, n)) is not None}


def _iteration(layout: RunLayout) -> int:
    state = layout.read_state()
    return -1 if state is None else state.iteration


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("async")
    root, env = str(tmp / "runs"), isolated_env(tmp / "home", {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp}/mlflow.db"})
    layout = RunLayout(root, "async")

    def start(attempt: str, extra_env=None) -> FlyteRun:
        return FlyteRun("workflows/reinforce.py", "reinforce_training", "configs/tiny_grpo.yaml",
                        [f"run.storage_root={root}"] + OVERRIDES, "async", dict(env, **(extra_env or {})),
                        tmp / f"{attempt}.log")

    faults = tmp / "faults"  # 2. the whole launch, while the restarted engine service hands out iteration 4's batch
    point = "rollout/iter-000004"
    (tmp / "tmp1").mkdir()  # the services' logs (models/hosts/resident.py) under a folder of this test's
    first = start("1", {"RLHF_FAULT_PAUSE": f"{point}:300", "RLHF_FAULT_DIR": str(faults), "TMPDIR": str(tmp / "tmp1")})
    first.wait_until(lambda: _iteration(layout) >= 1 and "engine" in _pids(layout), "iteration 1's commit")
    engine = _pids(layout)["engine"]  # 1. the engine service, once iteration 1 is committed
    os.kill(engine, signal.SIGKILL)
    first.wait_until(lambda: _pids(layout).get("engine", engine) != engine and _iteration(layout) >= 2,
                     "the engine started again and iteration 2's commit")
    first.wait_until(lambda: (faults / "paused").exists() and point in (faults / "paused").read_text(),
                     f"the pause at {point}")
    first.kill()
    resume = _iteration(layout)  # the last iteration committed
    assert 2 <= resume < ITERATIONS - 1, first.output()[-4000:]
    logs = [first.output(), start("2").wait(900)]
    services = "".join(p.read_text() for p in sorted((tmp / "tmp1").glob("resident-*/actor.log")))
    return dict(layout=layout, logs=logs, db=tmp / "mlflow.db", actor_log=services)


def test_killed_twice_no_prompt_is_lost_or_trained_twice(killed):
    first, last = killed["logs"]
    assert re.search(r"the engine service \(pid \d+\) was killed by SIGKILL[^\n]*; its peak memory was "
                     r"[\d.]+ GiB[^\n]*: started again", first), first[-4000:]
    assert f"Run async finished: {ITERATIONS} iterations of grpo." in last, last[-4000:]
    # run.weight_push=delta (the default): the restarted engine got a full push (the trainer had confirmed a push)
    actor = killed["actor_log"]
    assert "as a full push (the engine holds no push of this trainer's, which last confirmed " in actor, actor[-4000:]
    for i in range(1, ITERATIONS + 1):  # each iteration committed once over the two launches
        assert sum(log.count(f"[grpo] iter {i}/{ITERATIONS} ") for log in killed["logs"]) == 1, i
    layout, rows = killed["layout"], []
    for i in range(ITERATIONS):
        table = RolloutBatch.read(layout.batch_url(i, "advantages")).table  # what the update of iteration i trained
        assert table.column("prompt_id").to_pylist() == np.repeat(draw_ids(PROMPTS, i), N).tolist()
        drawn = table.column("row_id").to_numpy()[::N]
        assert drawn.tolist() == iteration_indices(DATA, PROMPTS, i, 0).tolist()
        rows += drawn.tolist()
        lags = [i - v for versions in table.column("token_versions").to_pylist() for v in versions]
        assert lags and 0 <= min(lags) and max(lags) <= K, (i, sorted(set(lags)))
    assert len(rows) == len(set(rows)) == ITERATIONS * PROMPTS  # one epoch: no row trained twice

    from mlflow.tracking import MlflowClient

    run_id = layout.read_run_info().mlflow_run_id
    history = MlflowClient(tracking_uri=f"sqlite:///{killed['db']}").get_metric_history(run_id, "async/staleness_p100")
    assert sorted(m.step for m in history) == list(range(ITERATIONS))  # logged once per iteration
    assert max(m.value for m in history) <= K
    density = MlflowClient(tracking_uri=f"sqlite:///{killed['db']}").get_metric_history(run_id, "resident/push_density")
    assert density and min(m.value for m in density) < 1.0, density  # deltas between the full pushes

"""One run per name (models/run/lock.py): a live holder refuses every other launch and is named; the same
execution takes its lock again; a released, stale or dead holder's lock is taken over, and the old holder
then finds it lost. On a local folder and on S3 (moto)."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from models import storage
from models.run import lock as run_lock
from models.run.lock import LostLock, RunLocked

A, B = "flyte:proj/development/exec-a", "flyte:proj/development/exec-b"
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.integration)])  # s3: a moto server process
def lock_url(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "run" / "lock.json")
    return storage.join(request.getfixturevalue("s3_url"), "run", "lock.json")


def test_a_live_holder_refuses_others_and_takes_its_own_lock_again(lock_url):
    first = run_lock.acquire(lock_url, ttl_s=60, owner=A)
    with pytest.raises(RunLocked, match=rf"run .*run is held by {re.escape(A)} \(host \S+, pid \d+\) since "
                                        rf"{re.escape(first.acquired_at)}, last heartbeat .* stale after 60 s\)"):
        run_lock.acquire(lock_url, ttl_s=60, owner=B)
    again = run_lock.acquire(lock_url, ttl_s=60, owner=A)  # a retried prepare_run of the same execution
    assert again.acquired_at == first.acquired_at and again.heartbeat_at >= first.heartbeat_at
    assert run_lock.renew(lock_url, A).owner == A
    assert not run_lock.release(lock_url, B)  # only the holder lets go
    assert run_lock.release(lock_url, A)
    assert run_lock.acquire(lock_url, ttl_s=60, owner=B).owner == B  # released: free


def test_a_stale_lock_is_taken_over_and_its_old_holder_stops(lock_url, caplog):
    run_lock.acquire(lock_url, ttl_s=0.5, owner=A)
    with pytest.raises(RunLocked):
        run_lock.acquire(lock_url, ttl_s=60, owner=B)
    time.sleep(1.0)  # no heartbeat for longer than the lease's ttl
    assert run_lock.acquire(lock_url, ttl_s=60, owner=B).owner == B
    assert f"taking over from {A} (stale: no heartbeat" in caplog.text
    with pytest.raises(LostLock, match=rf"this execution \({re.escape(A)}\) no longer holds the run; it is held "
                                       rf"by {re.escape(B)}"):
        run_lock.renew(lock_url, A)
    assert not run_lock.release(lock_url, A)


def test_a_clock_step_does_not_make_a_live_holder_look_gone(monkeypatch):
    """psutil's start time is the boot time read afresh from the wall clock plus the start ticks, so a clock
    step of a second moved it and the live holder of a run looked gone: a second launch took the run over.
    The lease tells the process by its start ticks after boot; another process on that pid is still told."""
    import psutil

    lease = run_lock.Lease.new(run_lock.current_owner(), ttl_s=3600)
    assert lease.pid_start_ticks > 0 and not lease.holder_gone()
    started = psutil.Process.create_time
    monkeypatch.setattr(psutil.Process, "create_time", lambda self: started(self) + 1.0)  # btime moved 1 s
    assert not lease.holder_gone() and lease.free_because() == ""
    reused = dataclasses.replace(lease, pid_start_ticks=lease.pid_start_ticks - 1)  # same pid, other process
    assert reused.holder_gone()
    old = json.loads(lease.encode())  # a lease written before the ticks: the start time tells, as it did
    del old["pid_start_ticks"]
    assert run_lock.Lease(**old).holder_gone()  # here the shifted create_time: looks gone
    monkeypatch.setattr(psutil.Process, "create_time", started)
    assert not run_lock.Lease(**old).holder_gone()


@pytest.mark.slow
def test_a_lock_whose_local_process_died_is_taken_over_at_once(lock_url):
    """A ``pyflyte run`` on this host holds the run while it lives; SIGKILLed, its lock is taken over at
    once, without waiting for its hour-long TTL."""
    code = (f"import sys, time; from models.run import lock; print(lock.acquire({lock_url!r}, ttl_s=3600).owner, "
            f"flush=True); time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        owner = holder.stdout.readline().strip()
        assert owner.startswith("local:") and f":{holder.pid}:" in owner
        with pytest.raises(RunLocked, match=rf"held by {re.escape(owner)} \(host \S+, pid {holder.pid}\)"):
            run_lock.acquire(lock_url, ttl_s=60)
    finally:
        holder.kill()
        holder.wait()
    assert run_lock.acquire(lock_url, ttl_s=60).owner == run_lock.current_owner()


def test_of_racing_launches_exactly_one_gets_the_run(lock_url):
    owners = [f"flyte:proj/development/exec-{i}" for i in range(6)]
    won, refused, gate = [], [], threading.Barrier(len(owners))

    def launch(owner: str) -> None:
        gate.wait()
        try:
            won.append(run_lock.acquire(lock_url, ttl_s=60, owner=owner).owner)
        except RunLocked:
            refused.append(owner)

    threads = [threading.Thread(target=launch, args=(o,)) for o in owners]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(refused) == len(owners) - 1
    assert json.loads(storage.read_bytes(lock_url))["owner"] == won[0]


def test_a_heartbeat_keeps_the_lease_fresh_and_notices_a_takeover(lock_url):
    run_lock.acquire(lock_url, ttl_s=60, owner=A)
    beat = run_lock.Heartbeat(lock_url, A, interval_s=0.2)
    try:
        first = json.loads(storage.read_bytes(lock_url))["heartbeat_at"]
        time.sleep(1.0)
        assert json.loads(storage.read_bytes(lock_url))["heartbeat_at"] > first
        held = json.loads(storage.read_bytes(lock_url))
        storage.write_json(lock_url, dict(held, owner=B))  # someone took it (here: by hand)
        time.sleep(1.0)
        assert isinstance(beat.lost, LostLock)
    finally:
        beat.stop()


def test_a_second_launch_is_refused_before_it_touches_the_run(tmp_path, monkeypatch):
    from models.run.setup import setup_run

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    lock_url = str(tmp_path / "runs" / "r" / "lock.json")
    run_lock.acquire(lock_url, ttl_s=60, owner=A)  # the first launch, alive on a cluster
    before = storage.read_bytes(lock_url)
    with pytest.raises(RunLocked, match=rf"run .*/runs/r is held by {re.escape(A)} .*another launch is training it"):
        setup_run("tiny_ppo", [f"run.storage_root={tmp_path}/runs"], "r", "ppo")
    assert sorted(p.name for p in (tmp_path / "runs" / "r").iterdir()) == ["lock.json", "lock.json.guard"]
    assert storage.read_bytes(lock_url) == before
    assert not (tmp_path / "mlflow.db").exists()


def test_the_holder_is_the_execution_on_a_cluster_and_the_process_locally(monkeypatch):
    """Every task pod of one execution (and the elastic workers they start, whose Flyte context names no
    execution) holds the run as the same owner; a local process holds it as itself."""
    import os
    import socket

    for key in ("FLYTE_INTERNAL_EXECUTION_PROJECT", "FLYTE_INTERNAL_EXECUTION_DOMAIN", "FLYTE_INTERNAL_EXECUTION_ID"):
        monkeypatch.delenv(key, raising=False)
    local = run_lock.current_owner()
    assert local.startswith(f"local:{socket.gethostname()}:{os.getpid()}:")
    monkeypatch.setenv("FLYTE_INTERNAL_EXECUTION_PROJECT", "proj")
    monkeypatch.setenv("FLYTE_INTERNAL_EXECUTION_DOMAIN", "development")
    monkeypatch.setenv("FLYTE_INTERNAL_EXECUTION_ID", "exec-a")
    assert run_lock.current_owner() == A
    # A later execution of the run's chain (a long run, docs/cluster.md#long-runs) is told the holder: its tasks
    # renew the lease as the execution that took the run, and call the services published under its name.
    monkeypatch.setenv("FLYTE_INTERNAL_EXECUTION_ID", "exec-b")
    assert run_lock.execution_name() == "exec-b" and run_lock.execution_name(A) == A.rsplit("/", 1)[-1]
    assert run_lock.execution_name(local) == "local"


def test_the_run_lifecycle_reads_the_execution_without_flytekit(monkeypatch):
    """The run's lifecycle (models/run/) imports no flytekit, not even inside a function: the execution
    id comes from the environment Flyte gives a task pod, and a local run (domain ``local``) is no
    cluster execution."""
    import ast

    importers = []
    for path in sorted((ROOT / "models" / "run").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            importers += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "flytekit"]
    assert importers == []
    monkeypatch.setenv("FLYTE_INTERNAL_EXECUTION_PROJECT", "proj")
    monkeypatch.setenv("FLYTE_INTERNAL_EXECUTION_DOMAIN", "local")
    monkeypatch.setenv("FLYTE_INTERNAL_EXECUTION_ID", "exec-a")
    assert run_lock.current_execution() == run_lock.Execution("proj", "local", "exec-a")
    assert not run_lock.on_cluster(run_lock.current_execution())
    assert run_lock.current_owner().startswith("local:")

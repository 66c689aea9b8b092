"""Child processes that serve HTTP on 127.0.0.1 in tests and benchmarks: a free port, waiting until
a URL answers, stopping them (SIGTERM, then SIGKILL), and a moto S3 server with a bucket."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Iterator

from models.service.launch import ChildProcess, end_process


def server_process(args, command: str = "serve", env=None, log_path=None, timeout_s: float = 120.0) -> ChildProcess:
    """``python -m models.hosts {command} --port 0 {args}`` on 127.0.0.1 as a child process (``start()`` or a
    ``with`` block starts it and waits until it listens: its ``url``); its log in ``log_path`` (or a temporary
    file)."""
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix=f"{command}-", suffix=".log")
        os.close(fd)
    return ChildProcess([sys.executable, "-m", "models.hosts", command, "--port", "0", *args], log_path, command,
                        env, timeout_s)


def free_port() -> int:
    """A port of 127.0.0.1 nothing listens on, for a child process to bind seconds later. It is taken below
    the kernel's ephemeral range (``ip_local_port_range``), where no bind to port 0 meanwhile (gloo,
    stores, servers of the other xdist worker) can land; a port 0 of our own was one such a bind could
    take before the child bound it. Random, so the two workers' picks seldom meet."""
    low = _ephemeral_low()
    pick = random.SystemRandom()
    for _ in range(200 if low > 12_000 else 0):
        port = pick.randrange(10_000, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # no room below the range
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def wait_http(url: str, proc: subprocess.Popen, what: str, timeout_s: float = 30.0) -> None:
    """Return once ``url`` answers; fail naming ``what`` if ``proc`` exits or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{what} at {url} not ready after {timeout_s}s")


def stop(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    end_process(proc, timeout_s)


@contextlib.contextmanager
def moto_s3_server(bucket: str) -> Iterator[str]:
    """Endpoint URL of ``python -m moto.server`` on 127.0.0.1 (its own process, so no in-process
    moto patching can leak) holding an empty ``bucket``; stopped on exit."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http(f"{endpoint}/moto-api/", proc, "moto server")
        import boto3

        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket=bucket)
        yield endpoint
    finally:
        stop(proc)


def s3_client_env(endpoint: str) -> dict:
    """The standard AWS/fsspec environment for a client of the moto server at ``endpoint`` (dummy
    credentials); unset :data:`S3_ENV_TO_UNSET` too, so no real profile or token is mixed in."""
    return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint, "FSSPEC_S3_ENDPOINT_URL": endpoint}


S3_ENV_TO_UNSET = ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL_S3")
"""Variables that would override :func:`s3_client_env`'s endpoint or credentials."""


def mlflow_server_env() -> dict:
    """The environment of a test's ``mlflow server``: this process's, without MLflow 3's job execution (a job runner
    and seven huey consumers, each a Python process importing MLflow and polling for as long as the server lives,
    and outliving it unless its process group is killed; no test runs a server job)."""
    return {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


@contextlib.contextmanager
def mlflow_server(folder, timeout_s: float = 180.0) -> Iterator[str]:
    """Base URL of ``mlflow server`` on 127.0.0.1 with its database in ``folder/mlflow.db`` and artifacts
    proxied by the server into ``folder/artifacts`` (clients never write the artifact store
    themselves, as with a remote tracking server); stopped on exit."""
    import os
    import signal

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "mlflow"), "server", "--host", "127.0.0.1",
                             "--port", str(port), "--backend-store-uri", f"sqlite:///{folder}/mlflow.db",
                             "--artifacts-destination", f"{folder}/artifacts", "--workers", "1"],
                            env=mlflow_server_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        wait_http(f"{base}/health", proc, "mlflow server", timeout_s=timeout_s)
        yield base
    finally:  # the server's job consumers (huey) outlive it unless its whole group goes
        stop(proc)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

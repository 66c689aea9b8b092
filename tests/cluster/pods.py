"""A task pod as Flyte starts it: the template's container command in a fresh process with a clean
environment and its own working folder, the variables propeller and the PyTorch operator inject,
the secrets the template requests mounted as files (the K8s secret webhook's default), and the
process group ended with the pod.

What a pod gets, and from where:

- the image's ``ENV`` (``Dockerfile``), with the image's code on ``PYTHONPATH`` (this checkout);
- the template's ``container.env`` (registration-time ``--env``, flytekit's ``_F_SS_C``);
- propeller's ``FLYTE_INTERNAL_*`` execution and task ids, ``FLYTE_ATTEMPT_NUMBER``, and the
  cluster's default variables (the metadata bucket's ``FLYTE_AWS_*``);
- each requested secret ``{group}/{key}`` that the cluster holds, as the file
  ``$FLYTE_SECRETS_DEFAULT_DIR/{group}/{key}`` (mount requirement ANY or FILE; the webhook mounts it
  optional, so a missing key is simply absent) or, for ENV_VAR, as ``_FSEC_{GROUP}_{KEY}``;
- for a ``pytorch`` task of N workers (the plugin's elastic job): N pods with what the training
  operator gives an elastic PyTorchJob's workers: ``PET_RDZV_ENDPOINT`` (worker 0's address),
  ``PET_RDZV_BACKEND``, ``PET_NNODES`` (``min:max``), ``PET_NPROC_PER_NODE``, ``PET_MAX_RESTARTS``.
  Flyte's plugin drops the master replica of elastic jobs, so ``MASTER_ADDR``/``MASTER_PORT``/
  ``RANK``/``WORLD_SIZE`` are not set on the pods (torch elastic sets them for its workers).
"""

from __future__ import annotations

import functools
import itertools
import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

from flyteidl.core import security_pb2, tasks_pb2
from google.protobuf.json_format import MessageToDict

from tests.cluster.package import BIN, ROOT, container_args, template_env
from tests.processes import free_port

SECRET_FILE_MOUNTS = (security_pb2.Secret.ANY, security_pb2.Secret.FILE)
_turn = itertools.count()


@dataclass(frozen=True)
class PodSettings:
    """What every pod of one (pretend) cluster shares."""

    root: Path
    """Local folder under which each pod gets its own working folder."""
    image_env: Mapping[str, str]
    """The image's environment (``tests.cluster.package.image_env``)."""
    cluster_env: Mapping[str, str] = field(default_factory=dict)
    """Variables propeller adds to every pod (``default-env-vars``, storage access)."""
    secrets: Mapping[Tuple[str, str], str] = field(default_factory=dict)
    """The cluster's Kubernetes secrets: ``{(group, key): value}``."""
    project: str = "flytesnacks"
    domain: str = "development"
    timeout_s: float = 900.0
    """A pod running longer is killed (and counts as a failed attempt)."""
    pin_cores: Tuple[int, ...] = ()
    """Cores to pin pods to, one core per pod in turn (``sched_setaffinity``: each node limited to one
    core, for timings with ``Cluster.parallelism`` > 1); empty: no pinning."""


@dataclass
class Pod:
    name: str
    folder: Path
    proc: subprocess.Popen
    log: Path
    started: float
    exit_code: Optional[int] = None
    seconds: float = 0.0
    disk_bytes: int = 0

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def folder_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            p = os.path.join(dirpath, n)
            if not os.path.islink(p):
                total += os.path.getsize(p)
    return total


def secret_env_and_files(template: tasks_pb2.TaskTemplate, settings: PodSettings, secrets_dir: Path) -> Dict[str, str]:
    """Mount the requested secrets the cluster holds (see the module docstring); the variables that
    tell flytekit where to look."""
    env: Dict[str, str] = {}
    for s in template.security_context.secrets:
        value = settings.secrets.get((s.group, s.key))
        if s.mount_requirement in SECRET_FILE_MOUNTS:
            env.update(FLYTE_SECRETS_DEFAULT_DIR=str(secrets_dir), FLYTE_SECRETS_FILE_PREFIX="")
            if value is not None:
                path = secrets_dir / s.group.lower() / s.key.lower()
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(value)
        elif value is not None:
            env["FLYTE_SECRETS_ENV_PREFIX"] = "_FSEC_"
            env[f"_FSEC_{s.group}_{s.key}".upper()] = value
    return env


def elastic_workers(template: tasks_pb2.TaskTemplate) -> Optional[dict]:
    """The plugin's ``elasticConfig`` and worker count of a multi-node ``pytorch`` task, else None."""
    if template.type != "pytorch":
        return None
    custom = MessageToDict(template.custom)
    return {"replicas": int(custom["workerReplicas"]["replicas"]), **custom["elasticConfig"]}


def elastic_env(elastic: dict, rdzv_port: int) -> Dict[str, str]:
    """What the training operator sets on every worker of an elastic PyTorchJob (its ``elastic.go``),
    with worker 0's service name replaced by the loopback address."""
    return {"PYTHONUNBUFFERED": "0", "PET_RDZV_ENDPOINT": f"127.0.0.1:{rdzv_port}",
            "PET_RDZV_BACKEND": elastic.get("rdzvBackend", "c10d"),
            "PET_NNODES": f"{int(elastic['minReplicas'])}:{int(elastic['maxReplicas'])}",
            "PET_MAX_RESTARTS": str(int(elastic.get("maxRestarts", 0))),
            "PET_NPROC_PER_NODE": str(int(elastic["nprocPerNode"]))}


def pod_env(template: tasks_pb2.TaskTemplate, settings: PodSettings, folder: Path, ids: Mapping[str, str],
            attempt: int, extra: Mapping[str, str]) -> Dict[str, str]:
    """The whole environment of one pod (nothing inherited from the test process)."""
    for sub in ("home", "tmp", "secrets"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    env = {"PATH": f"{BIN}:/usr/local/bin:/usr/bin:/bin", "HOME": str(folder / "home"), "TMPDIR": str(folder / "tmp"),
           "LANG": "C.UTF-8", "HOSTNAME": folder.name}
    env.update(settings.image_env)
    env["PYTHONPATH"] = str(ROOT)  # the image's code (WORKDIR /root, PYTHONPATH=/root): this checkout
    env.update(template_env(template))
    env.update(settings.cluster_env)
    env.update({"FLYTE_INTERNAL_EXECUTION_ID": ids["execution"], "FLYTE_INTERNAL_EXECUTION_PROJECT": settings.project,
                "FLYTE_INTERNAL_EXECUTION_DOMAIN": settings.domain,
                "FLYTE_INTERNAL_EXECUTION_WORKFLOW": ids["workflow"],
                "FLYTE_INTERNAL_EXECUTION_LAUNCHPLAN": ids["workflow"],
                "FLYTE_INTERNAL_TASK_PROJECT": settings.project, "FLYTE_INTERNAL_TASK_DOMAIN": settings.domain,
                "FLYTE_INTERNAL_TASK_NAME": template.id.name, "FLYTE_INTERNAL_TASK_VERSION": ids["version"],
                "FLYTE_ATTEMPT_NUMBER": str(attempt)})
    env.update(secret_env_and_files(template, settings, folder / "secrets"))
    env.update(extra)
    return env


def start_pods(template: tasks_pb2.TaskTemplate, settings: PodSettings, name: str, placeholders: Mapping[str, str],
               ids: Mapping[str, str], attempt: int, extra: Mapping[str, str]) -> List[Pod]:
    """One pod, or the workers of an elastic job, started; ``name`` names the pods' folders."""
    args = list(container_args(template, placeholders))
    args[0] = os.path.join(BIN, args[0])  # the image's pyflyte-execute
    elastic = elastic_workers(template)
    replicas = elastic["replicas"] if elastic else 1
    shared = elastic_env(elastic, free_port()) if elastic else {}
    pods = []
    for i in range(replicas):
        core = settings.pin_cores[next(_turn) % len(settings.pin_cores)] if settings.pin_cores else None
        pod_name = f"{name}-worker-{i}" if elastic else name
        folder = settings.root / pod_name
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        worker = {"FLYTE_INTERNAL_DIST_ERROR_STRATEGY": "Earliest", "FLYTE_INTERNAL_WORKER_NAME": pod_name} \
            if elastic else {}
        env = pod_env(template, settings, folder, ids, attempt, {**shared, **worker, **extra})
        log = folder / "pod.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(args, cwd=folder, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    preexec_fn=None if core is None else functools.partial(os.sched_setaffinity, 0,
                                                                                            {core}))
        pods.append(Pod(pod_name, folder, proc, log, time.monotonic()))
    return pods


def end_pod(pod: Pod) -> None:
    """The pod is gone: every process it started ends with it (SIGKILL to its process group)."""
    try:
        os.killpg(pod.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    pod.proc.wait()


def wait_pods(pods: List[Pod], timeout_s: float, kill_when: Optional[Path] = None,
              abort: Optional[threading.Event] = None) -> None:
    """Wait for every pod; kill them all at ``timeout_s``, as soon as the file ``kill_when`` exists
    (a fault: the node is lost there) or when ``abort`` is set (the execution failed). Records exit codes,
    seconds and the disk each pod used."""
    deadline = time.monotonic() + timeout_s
    while any(p.proc.poll() is None for p in pods):
        lost = kill_when is not None and kill_when.exists() or abort is not None and abort.is_set()
        if lost or time.monotonic() > deadline:
            for p in pods:
                if p.proc.poll() is None:
                    os.killpg(p.proc.pid, signal.SIGKILL)
            break
        time.sleep(0.2)
    for p in pods:
        p.proc.wait()
        p.exit_code = p.proc.returncode
        p.seconds = time.monotonic() - p.started
        end_pod(p)
        p.disk_bytes = folder_bytes(p.folder / "tmp") + folder_bytes(p.folder / "home")

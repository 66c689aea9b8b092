"""The compiled package a cluster registers (``make package``: ``pyflyte --pkgs workflows package``),
read back as the task and workflow templates Flyte's control plane would hold, and the environment
the task image gives every container (the ``ENV`` lines of the ``Dockerfile``)."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Mapping, Sequence

from flyteidl.admin import launch_plan_pb2, task_pb2, workflow_pb2
from flyteidl.core import tasks_pb2, workflow_pb2 as core_workflow_pb2

ROOT = Path(__file__).resolve().parents[2]
BIN = os.path.dirname(sys.executable)


@dataclass(frozen=True)
class Package:
    """Task templates by name, workflow templates by name (sub-workflows included) and launch plans by name."""

    tasks: Dict[str, tasks_pb2.TaskTemplate]
    workflows: Dict[str, core_workflow_pb2.WorkflowTemplate]
    path: Path
    launch_plans: Dict[str, launch_plan_pb2.LaunchPlan] = None


def build_package(out: Path, image: str, deploy_preset: str, deploy_overrides: str,
                  env: Mapping[str, str] = ()) -> Path:
    """``make package`` of this checkout into ``out``, with ``env`` as its registration-time variables
    (``MLFLOW_TRACKING_URI=...``; the Makefile passes each to ``pyflyte package --env``). The venv is
    the one running the tests, taken as installed (``-o`` its stamp: nothing is reinstalled).
    Returns the ``.tgz``."""
    out.mkdir(parents=True, exist_ok=True)
    tgz = out / "flyte-package.tgz"
    venv = os.path.dirname(BIN)
    cmd = ["make", "-s", "-o", f"{venv}/.installed", "package", f"VENV={venv}", f"IMAGE={image}", f"PACKAGE={tgz}",
           f"DEPLOY_PRESET={deploy_preset}", f"DEPLOY_OVERRIDES={deploy_overrides}"]
    cmd += [f"{k}={v}" for k, v in dict(env).items()]
    proc_env = {k: v for k, v in os.environ.items()
                if not k.startswith(("RLHF_DEPLOY", "MLFLOW_", "AWS_ENDPOINT", "RLHF_MLFLOW"))}
    proc = subprocess.run(cmd, cwd=ROOT, env=proc_env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"make package failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return tgz


def _read(path: str, cls):
    msg = cls()
    with open(path, "rb") as f:
        msg.ParseFromString(f.read())
    return msg


def load_package(tgz: Path) -> Package:
    """Every ``*_1.pb`` (TaskSpec), ``*_2.pb`` (WorkflowSpec) and ``*_3.pb`` (LaunchPlan) of the package."""
    root = tgz.parent / (tgz.name + ".d")
    with tarfile.open(tgz) as tar:
        tar.extractall(root, filter="data")
    tasks = {}
    for path in glob.glob(f"{root}/*_1.pb"):
        t = _read(path, task_pb2.TaskSpec).template
        tasks[t.id.name] = t
    workflows = {}
    for path in glob.glob(f"{root}/*_2.pb"):
        spec = _read(path, workflow_pb2.WorkflowSpec)
        for wf in [spec.template, *spec.sub_workflows]:
            workflows[wf.id.name] = wf
    plans = {}
    for path in glob.glob(f"{root}/*_3.pb"):
        plan = _read(path, launch_plan_pb2.LaunchPlan)
        plans[plan.id.name] = plan
    return Package(tasks, workflows, tgz, plans)


_ENV_LINE = re.compile(r"^ENV\s+(.*)$")
_ARG_LINE = re.compile(r"^ARG\s+(\w+)(?:=(.*))?$")


def image_env(dockerfile: Path, build_args: Mapping[str, str] = ()) -> Dict[str, str]:
    """The environment the image sets: every ``ENV key=value`` of ``dockerfile`` (continuation
    lines joined), ``${ARG}`` replaced by ``build_args`` or the ``ARG`` default."""
    text = dockerfile.read_text().replace("\\\n", " ")
    args: Dict[str, str] = {}
    env: Dict[str, str] = {}
    for line in (ln.strip() for ln in text.splitlines()):
        if m := _ARG_LINE.match(line):
            args[m.group(1)] = dict(build_args).get(m.group(1), (m.group(2) or "").strip('"'))
        elif m := _ENV_LINE.match(line):
            for key, value in re.findall(r'(\w+)=("[^"]*"|\S*)', m.group(1)):
                value = re.sub(r"\$\{(\w+)\}", lambda v: args.get(v.group(1), env.get(v.group(1), "")), value)
                env[key] = value.strip('"')
    return env


def template_env(template: tasks_pb2.TaskTemplate) -> Dict[str, str]:
    """``container.env`` of the template (the registration-time ``--env`` and flytekit's own)."""
    return {kv.key: kv.value for kv in primary_container(template).env}


def primary_container(template: tasks_pb2.TaskTemplate) -> tasks_pb2.Container:
    if template.HasField("container"):
        return template.container
    raise NotImplementedError(f"task {template.id.name}: only container tasks are run by the harness")


def container_args(template: tasks_pb2.TaskTemplate, values: Mapping[str, str]) -> Sequence[str]:
    """The container's command line with Flyte's ``{{.input}}``-style placeholders filled in."""
    c = primary_container(template)
    out = []
    for arg in list(c.command) + list(c.args):
        for key, value in values.items():
            arg = arg.replace("{{.%s}}" % key, value)
        if "{{" in arg:
            raise ValueError(f"task {template.id.name}: unknown placeholder in {arg!r}")
        out.append(arg)
    return out

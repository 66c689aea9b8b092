"""What the heavy tasks ask of a Flyte cluster: resources, GPU type and the updates' elastic topologies.

Two places use the same config fields (``resources.*``, ``actor.nnodes/nproc_per_node`` and
``critic.nnodes/nproc_per_node``):

- the task decorators, from the **deployment config** :data:`REGISTERED`: the preset named by
  ``RLHF_DEPLOY_PRESET`` plus the space-separated ``section.field=value`` items of
  ``RLHF_DEPLOY_OVERRIDES`` (both unset: the config defaults, the tiny CPU settings), read by
  :func:`read_deployment`, the one place these variables are read, once, when this module is first
  imported. This is what ``pyflyte package``/``register`` compiles into the task templates, and what a
  task pod runs with, so every pod must see the same two variables (``make package`` puts them in every
  task's environment; the ``Dockerfile``'s are the fallback). Why it cannot wait for the run: the
  "Why the deployment is read when the tasks load" section of docs/cluster.md;
- the training workflows' dynamic chunks, from the run's own config, as node overrides
  (``with_overrides(requests=..., limits=..., accelerator=...)``).

The elastic topology is special: flytekit's kfpytorch plugin fixes the task type (``pytorch`` for
more than one node) and the worker count when the task object is built, and a task pod re-imports
the module, so a run can change ``actor.nnodes``/``actor.nproc_per_node`` (and the critic's) only in
local executions; on a cluster they must match the deployment config (:func:`check_topology`).
"""

from __future__ import annotations

import os
from typing import Any, Dict, Mapping

from flytekit import Resources
from flytekit.extras.accelerators import GPUAccelerator

from models.config import ConfigError, TrainConfig
from models.config.io import load_config
from tasks.elastic import FORKSERVER, ActorElastic
from tasks.flyte_internals import set_task_config

from models.run.preflight import DEPLOY_OVERRIDES_ENV, DEPLOY_PRESET_ENV, check_topology  # noqa: F401


def read_deployment(environ: Mapping[str, str]) -> TrainConfig:
    """The deployment config of ``environ``: the preset its ``RLHF_DEPLOY_PRESET`` names plus its
    ``RLHF_DEPLOY_OVERRIDES`` (space-separated ``section.field=value``); both unset: the defaults."""
    return load_config(environ.get(DEPLOY_PRESET_ENV, ""), environ.get(DEPLOY_OVERRIDES_ENV, "").split())


REGISTERED: TrainConfig = read_deployment(os.environ)
"""The config the registered tasks are compiled with, and that every task pod rebuilds its tasks with
(see the module docstring): read here, once, before any task module builds a task."""


def is_local_execution() -> bool:
    """True under ``pyflyte run`` without ``--remote`` (and in tests): the execution's domain is
    ``local``; a task pod of a cluster has its project's domain (``FLYTE_INTERNAL_EXECUTION_DOMAIN``)."""
    from flytekit import current_context

    return current_context().execution_id.domain == "local"


def resources_for(cfg: TrainConfig, task: str) -> Dict[str, Any]:
    """``requests``/``limits`` (equal: CPU, memory, GPUs, ephemeral storage) and ``accelerator`` for
    ``task`` in rollout, score, actor, critic."""
    r = cfg.resources
    gpu = getattr(r, f"{task}_gpu")
    res = Resources(cpu=getattr(r, f"{task}_cpu"), mem=getattr(r, f"{task}_mem"), gpu=str(gpu) if gpu else None,
                    ephemeral_storage=getattr(r, f"{task}_disk"))
    out: Dict[str, Any] = {"requests": res, "limits": res}
    if gpu and r.accelerator:
        out["accelerator"] = GPUAccelerator(r.accelerator)
    return out


def elastic_for(cfg: TrainConfig, local: bool = False, section: str = "actor") -> ActorElastic:
    """The torch-elastic launch of ``{section}_update`` (``actor`` or ``critic``): ``{section}.nnodes`` ×
    ``{section}.nproc_per_node`` processes.

    ``local`` (one node): workers forked from a forkserver that outlives the launch, polled every
    0.1 s (:mod:`tasks.elastic`); registered tasks keep the plugin's spawn and 1 s polling. One process
    on one node, local or registered, is no launch: the task's own process trains (the critic's
    default, as before it was elastic).
    """
    t = getattr(cfg, section)
    fast = t.nnodes == 1 and (local or t.world_size == 1)
    return ActorElastic(nnodes=t.nnodes, nproc_per_node=t.nproc_per_node, max_restarts=t.max_restarts,
                        monitor_interval=0.1 if fast else 1,  # type: ignore[arg-type]  # the field says int
                        start_method=FORKSERVER if fast else "spawn", increase_shared_mem=False)


def use_local_topology(elastic_task, cfg: TrainConfig, section: str = "actor") -> None:
    """Give ``elastic_task`` (``{section}_update``) the run's launch before a local execution calls it.

    Local executions run each task as soon as the workflow calls it, so a node override
    (``with_overrides(task_config=...)``) arrives after the launch and is ignored; this sets what
    that override sets (:func:`tasks.flyte_internals.set_task_config`).
    """
    set_task_config(elastic_task, elastic_for(cfg, local=True, section=section))

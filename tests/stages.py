"""A tiny run set up and taken through its first stages in-process (rollout, score, advantages),
shared by the test modules that score, train or commit from there."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Iterator, Sequence

import pytest

from models.config.io import parse_override
from models.run.setup import RunSetup, setup_run


@contextlib.contextmanager
def tiny_run(root: Path, preset: str, overrides: Sequence[str], name: str,
             local_cache: bool = True) -> Iterator[RunSetup]:
    """``setup_run`` of ``preset`` stored under ``root``, MLflow in ``root/mlflow.db`` (and Flyte's
    local cache off unless ``local_cache``: each call must really run); the environment is restored
    on exit."""
    mp = pytest.MonkeyPatch()
    mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root}/mlflow.db")
    if not local_cache:
        mp.setenv("FLYTE_LOCAL_CACHE_ENABLED", "false")
    try:
        yield setup_run(preset, [f"run.storage_root={root}"] + list(overrides), name)
    finally:
        mp.undo()


def to_advantages(cfg, run, state):
    """``(rollout, score, advantages)`` outputs of ``state``'s iteration, each stage on the one before."""
    from models.stages.advantages import run_advantages
    from models.stages.rollout import run_rollout
    from models.stages.score import run_score

    ro = run_rollout(cfg, run, state)
    sc = run_score(cfg, run, state, ro.batch)
    return ro, sc, run_advantages(cfg, run, state, sc.batch)


def with_overrides(cfg, *overrides: str):
    """``cfg`` with ``section.field=value`` overrides applied (as ``load_config`` takes them), each
    section checked again."""
    def replaced(node, path, value):
        inner = value if len(path) == 1 else replaced(getattr(node, path[0]), path[1:], value)
        return dataclasses.replace(node, **{path[0]: inner})

    for text in overrides:
        cfg = replaced(cfg, *parse_override(text))
    return cfg

"""Retention: which iterations' checkpoints and batches a run keeps (``run.keep_checkpoints``,
``run.keep_batches``; docs/concepts/run_layout.md#retention), decided by each commit that moves
``state.json`` (``models/stages/commit.py``).

What a resume needs is never deleted: the checkpoints ``state.json`` names (the resume point's actor and
critic, with ``run.off_policy_steps=1`` the behaviour actor of the iteration before), every final policy's
checkpoint, and no batch of an iteration after the resume point (a resumed run redoes those iterations, and
Flyte's cache may answer a redone stateless task with the batch it wrote before). No task reads a committed
iteration's batch, and a resumed run samples the iteration after its resume point again.

Order: the commit writes ``state.json`` with this module's record in its extras (:class:`Retained`: what is
kept, and what this commit deletes), then deletes; the next commit deletes the same again, so a crash in
between leaks nothing and nothing is deleted before the ``state.json`` that no longer needs it. A commit
touches what the records name, never a listing of the run folder (its cost does not grow with the run),
except once when retention starts on a run that has committed without it (:func:`usage`).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Dict, FrozenSet, NamedTuple, Optional, Tuple

from models import storage
from models.checkpoint import MARKER
from models.config import TrainConfig
from models.run.layout import RunLayout, RunState
from models.run.types import RunHandle
from models.storage.bulk import remove_dir_if_empty, remove_files
from models.tracking import registry
from models.training.files import optimizer_url

RECORD_KEY = "retention"
"""Key of :class:`Retained` in ``state.json``'s extras."""


def saves_checkpoint(cfg: TrainConfig, iteration: int) -> bool:
    """Whether ``iteration``'s checkpoints are kept at ``run.save_interval``: every save_interval-th and the last."""
    return (iteration + 1) % cfg.run.save_interval == 0 or iteration + 1 == cfg.run.num_iterations


@dataclass(frozen=True)
class Retained:
    """``state.json``'s record of retention (``extras["retention"]``), written by the commit that deletes."""

    checkpoints: Optional[Tuple[int, ...]] = None
    """Iterations whose checkpoints were kept at ``save_interval`` and are still there; None: checkpoints are
    not tracked (``run.keep_checkpoints=-1`` when this was written)."""
    finals: Tuple[int, ...] = ()
    """Iterations whose checkpoint was the final policy when they committed: never deleted."""
    deleting: Tuple[int, ...] = ()
    """Iterations whose checkpoints this commit deletes after writing the record (the next commit again)."""
    batches_from: Optional[int] = None
    """The first iteration whose batches are kept; None: batches are not tracked (``run.keep_batches=-1``)."""
    batches_deleting_from: int = 0
    """This commit deletes the batches of the iterations ``batches_deleting_from .. batches_from - 1``."""

    @classmethod
    def of(cls, point: Optional[RunState]) -> Optional["Retained"]:
        record = point.extras.get(RECORD_KEY) if point is not None else None
        if record is None:
            return None
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in record.items()})

    def recorded(self, point: RunState) -> RunState:
        """``point`` with this record in its extras."""
        record = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}
        return dataclasses.replace(point, extras={**point.extras, RECORD_KEY: record})


def checkpoint_iterations(layout: RunLayout, point: Optional[RunState]) -> FrozenSet[int]:
    """The iterations whose checkpoints ``point`` names: its actor, critic and behaviour actor."""
    if point is None:
        return frozenset()
    urls = (point.actor_url, point.critic_url, point.extras.get("behaviour_url"))
    return frozenset(j for j in map(layout.iteration_of, urls) if j is not None)


def plan(cfg: TrainConfig, layout: RunLayout, point: RunState, prev: Optional[RunState]) -> Optional[Retained]:
    """The record the commit writes with ``point`` (the new resume point, ``prev`` the one it replaces);
    None when nothing is deleted (both settings -1)."""
    keep_c, keep_b = cfg.run.keep_checkpoints, cfg.run.keep_batches
    if keep_c < 0 and keep_b < 0:
        return None
    old = Retained.of(prev) or Retained()
    found = None  # retention starts on a run that committed without it: what is there, listed once
    if prev is not None and ((keep_c >= 0 and old.checkpoints is None) or (keep_b >= 0 and old.batches_from is None)):
        found = usage(layout)
    record = Retained()
    if keep_c >= 0:
        record = _checkpoints(cfg, layout, point, prev, old, found)
    if keep_b >= 0:
        start = old.batches_from
        if start is None:
            start = min(found.batches, default=point.iteration + 1) if found is not None else 0
        record = dataclasses.replace(record, batches_from=max(start, point.iteration + 1 - keep_b),
                                     batches_deleting_from=start)
    return record


def _checkpoints(cfg: TrainConfig, layout: RunLayout, point: RunState, prev: Optional[RunState], old: Retained,
                 found: Optional["Usage"]) -> Retained:
    """Keep the newest ``keep_checkpoints`` of the saved ones, the new point's and the finals; delete the rest
    of the saved ones and the previous point's that are not kept."""
    i, protected, released = point.iteration, checkpoint_iterations(layout, point), checkpoint_iterations(layout, prev)
    saved, finals = set(old.checkpoints or ()), set(old.finals)
    if old.checkpoints is None and found is not None:  # what survived its commit was kept at save_interval
        saved = {j for j in found.checkpoints if j not in protected | released or saves_checkpoint(cfg, j)}
        finals = previous_finals(layout) & set(found.checkpoints)
    if saves_checkpoint(cfg, i) and i in protected:
        saved.add(i)
    if i + 1 == cfg.run.num_iterations:
        finals.add(i)
    keep_c = cfg.run.keep_checkpoints
    keep = set(sorted(saved)[-keep_c:] if keep_c else ()) | protected | finals
    deleting = (saved | released) - keep
    return Retained(checkpoints=tuple(sorted(saved - deleting)), finals=tuple(sorted(finals)),
                    deleting=tuple(sorted(deleting)))


def previous_finals(layout: RunLayout) -> set:
    """The iterations a finished run ended at before it was extended (``run.json``'s changes of
    ``run.num_iterations`` made once that many iterations were done)."""
    changes = layout.read_run_info().config_changes
    return {c["old"] - 1 for c in changes if c["key"] == "run.num_iterations" and c["iteration"] >= c["old"]}


def apply(run: RunHandle, old: Optional[Retained], new: Optional[Retained]) -> None:
    """Delete what ``new`` drops, and what ``old`` (the record before it; None when redoing ``new``'s commit)
    dropped, again: each checkpoint folder with its optimizer state and its MLflow copy, then the batch files,
    then (locally) iteration folders left empty."""
    checkpoints = set(new.deleting if new else ()) | set(old.deleting if old else ())
    batches = range(0)
    if new is not None and new.batches_from is not None:
        start = old.batches_deleting_from if old is not None and old.batches_from is not None \
            else new.batches_deleting_from
        batches = range(start, new.batches_from)
    layout = run.layout
    for j in sorted(checkpoints):
        for url in (layout.actor_url(j), layout.critic_url(j)):
            for folder in (url, optimizer_url(url)):
                storage.remove(storage.join(folder, MARKER))  # first: a folder half deleted is never committed
                storage.remove(folder, recursive=True)
    if checkpoints and run.mlflow_run_id:
        registry.forget_checkpoints(run.mlflow_run_id, [f"iter-{j:06d}" for j in sorted(checkpoints)])
    remove_files([u for j in batches for u in layout.batch_files(j)])
    for j in checkpoints | set(batches):
        remove_dir_if_empty(layout.iter_dir(j))


class Usage(NamedTuple):
    """What a run folder holds (:func:`usage`)."""

    checkpoints: Dict[int, int]
    """Iteration -> bytes of its committed checkpoints (actor, critic) and their optimizer states."""
    batches: Dict[int, int]
    """Iteration -> bytes of its batch files."""
    total: int
    """Bytes of every file under the run folder."""


_ITER_FILE = re.compile(r"iter-(\d{6})/(?:(actor|critic)(?:-optimizer)?/(.+)|([a-z0-9_]+\.arrow(?:\.blake3)?))")


def usage(layout: RunLayout) -> Usage:
    """The run folder's checkpoints, batches and size, from one listing of it."""
    files = storage.list_files(layout.url)
    ckpt_bytes: Dict[int, int] = {}
    committed, batches = set(), {}
    for rel, size in files.items():
        m = _ITER_FILE.fullmatch(rel)
        if m is None:
            continue
        j = int(m[1])
        if m[4]:
            batches[j] = batches.get(j, 0) + size
            continue
        ckpt_bytes[j] = ckpt_bytes.get(j, 0) + size
        if m[3] == MARKER and "-optimizer/" not in rel:
            committed.add(j)
    return Usage({j: ckpt_bytes[j] for j in sorted(committed)}, dict(sorted(batches.items())), sum(files.values()))


def human_bytes(n: float) -> str:
    """``1.1 MB`` (powers of 1000)."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"

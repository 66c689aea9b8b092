"""Where a run keeps its files (docs/concepts/run_layout.md)::

    {storage_root}/{run_name}/
      run.json                       RunInfo: config, MLflow run id, algorithm, start time, changes on resume
      state.json                     RunState: last completed iteration + checkpoints (resume point)
      lock.json                      the lease of the launch that trains the run (models/run/lock.py)
      reference/                     frozen initial policy (HF directory)
      iter-000007/{stage}.arrow      the batch after each stage (rollouts, score, advantages), and its .blake3
      iter-000007/actor/             actor checkpoint written by iteration 7
      iter-000007/critic/
      iter-000007/actor-optimizer/   AdamW's state after that update (also critic-optimizer/)

``state.json`` is written last in an iteration, atomically, and may only point at
committed checkpoints, so resuming from it never meets a half-written checkpoint.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, List, Mapping, Optional

from models import storage
from models.checkpoint import CheckpointError, is_committed

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
BATCH_STAGES = ("rollouts", "score", "advantages")
"""The stages that write an iteration's batch (``iter-000007/{stage}.arrow``): retention deletes these files."""


@dataclass(frozen=True)
class RunInfo:
    """Content of ``run.json``: what the run is (written at start; a resume adds its config changes).
    The stored record a launch and a resume read, unlike :class:`~models.run.types.RunHandle`, the few URLs
    and ids every task gets."""

    run_name: str
    """The run's folder name under ``storage_root``."""
    algorithm: str
    """``ppo``, ``reinforce``, ``rloo``, ``grpo``, ... (the names of ``models/algorithms/``)."""
    config: Mapping[str, Any] = field(default_factory=dict)
    """The full training config as a JSON-able dict."""
    mlflow_run_id: Optional[str] = None
    """MLflow run that tracks this run (None before MLflow starts)."""
    mlflow_tracking_uri: str = ""
    """Tracking URI the MLflow run lives at (credentials masked), so a resume against another one can say
    which to set; empty in runs started before it was recorded."""
    started_at: str = field(default_factory=lambda: storage.utc_now_iso("milliseconds"))
    """Start time, ISO 8601 UTC."""
    config_changes: List[Mapping[str, Any]] = field(default_factory=list)
    """Changes made on resume, oldest first: ``{"key", "old", "new", "iteration"}`` (``models/run/resume.py``);
    ``config`` holds the values in force now."""

    def __post_init__(self) -> None:
        if not _NAME.match(self.run_name):
            raise ValueError(f"RunInfo.run_name {self.run_name!r} is not a valid folder name")
        if not self.algorithm:
            raise ValueError("RunInfo.algorithm must not be empty")


@dataclass(frozen=True)
class RunState:
    """Content of ``state.json``: the resume point, numbered by the last completed iteration. The stored
    form of the :class:`~models.run.types.PolicyState` the next iteration starts from (``resume_point``)."""

    iteration: int
    """Last completed iteration (0-based); the next run resumes at ``iteration + 1``."""
    actor_url: str
    """Committed actor checkpoint written by that iteration (the policy to continue from)."""
    critic_url: Optional[str] = None
    """Committed critic checkpoint (PPO), else None."""
    extras: Mapping[str, Any] = field(default_factory=dict)
    """JSON-able state to carry over, e.g. ``{"kl_coef": 0.012}`` of an adaptive controller."""
    updated_at: str = field(default_factory=lambda: storage.utc_now_iso("milliseconds"))
    """When the state was written, ISO 8601 UTC."""

    def __post_init__(self) -> None:
        if self.iteration < 0:
            raise ValueError(f"RunState.iteration must be >= 0, got {self.iteration}")
        if not self.actor_url:
            raise ValueError("RunState.actor_url must not be empty")


@dataclass(frozen=True)
class RunLayout:
    """URLs of one run's files under ``{root}/{run_name}/``: where things are, not what they say
    (that is :class:`RunInfo` and :class:`RunState`, which it reads and writes)."""

    root: str
    """``storage_root``: any fsspec URL (a local folder by default, ``s3://...`` on a cluster)."""
    run_name: str
    """The run's folder name: letters, digits, ``.``, ``_``, ``-``."""

    def __post_init__(self) -> None:
        if not self.root:
            raise ValueError("RunLayout.root must not be empty")
        if not _NAME.match(self.run_name):
            raise ValueError(f"RunLayout.run_name {self.run_name!r} is not a valid folder name "
                             f"(letters, digits, '.', '_', '-')")

    @property
    def url(self) -> str:
        """``{root}/{run_name}``."""
        return storage.join(self.root, self.run_name)

    @property
    def run_info_url(self) -> str:
        return storage.join(self.url, "run.json")

    @property
    def state_url(self) -> str:
        return storage.join(self.url, "state.json")

    @property
    def lock_url(self) -> str:
        """The run's lease: one launch at a time (``models/run/lock.py``)."""
        return storage.join(self.url, "lock.json")

    def reference_url(self) -> str:
        """The frozen initial policy (HF directory)."""
        return storage.join(self.url, "reference")

    def iter_dir(self, iteration: int) -> str:
        """``{run}/iter-000007``."""
        if iteration < 0:
            raise ValueError(f"iteration must be >= 0, got {iteration}")
        return storage.join(self.url, f"iter-{iteration:06d}")

    def batch_url(self, iteration: int, stage: str = "rollouts") -> str:
        """``{run}/iter-000007/{stage}.arrow``, stage one of :data:`BATCH_STAGES`."""
        if stage not in BATCH_STAGES:
            raise ValueError(f"stage {stage!r} is not one of {BATCH_STAGES} (a new stage goes there, so that "
                             f"retention deletes its batches too)")
        return storage.join(self.iter_dir(iteration), f"{stage}.arrow")

    def batch_files(self, iteration: int) -> List[str]:
        """Every batch file ``iteration`` may have written: each stage's ``.arrow`` and its ``.arrow.blake3``."""
        return [u + suffix for u in (self.batch_url(iteration, s) for s in BATCH_STAGES) for suffix in ("", ".blake3")]

    def actor_url(self, iteration: int) -> str:
        """Actor checkpoint written by ``iteration``."""
        return storage.join(self.iter_dir(iteration), "actor")

    def critic_url(self, iteration: int) -> str:
        """Critic checkpoint written by ``iteration``."""
        return storage.join(self.iter_dir(iteration), "critic")

    def iteration_of(self, url: Optional[str]) -> Optional[int]:
        """The iteration whose actor or critic checkpoint ``url`` is (``{run}/iter-000007/actor``: 7), or None
        (the reference, another run's, empty)."""
        m = re.fullmatch(re.escape(self.url) + r"/iter-(\d{6})/(?:actor|critic)/?", url or "")
        return int(m[1]) if m else None

    # --- run.json / state.json ----------------------------------------------------------------
    def write_run_info(self, info: RunInfo) -> None:
        """Write ``run.json``; ``info.run_name`` must be this layout's."""
        if info.run_name != self.run_name:
            raise ValueError(f"RunInfo.run_name {info.run_name!r} != layout run {self.run_name!r}")
        storage.write_json(self.run_info_url, asdict(info))

    def read_run_info(self) -> RunInfo:
        """Read ``run.json`` (FileNotFoundError naming the URL if the run does not exist)."""
        return RunInfo(**storage.read_json(self.run_info_url))

    def write_state(self, state: RunState) -> None:
        """Atomically replace ``state.json``; refuses uncommitted checkpoints."""
        for url in (state.actor_url, state.critic_url):
            if url is not None and not is_committed(url):
                raise CheckpointError(f"state.json of {self.url} may only point at committed "
                                      f"checkpoints; {url} is not committed")
        storage.write_json(self.state_url, asdict(state))

    def read_state(self) -> Optional[RunState]:
        """The resume point, or None if no iteration has completed yet."""
        if not storage.exists(self.state_url):
            return None
        return RunState(**storage.read_json(self.state_url))

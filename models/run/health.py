"""Whether a run ended healthy, checked by ``finish_run`` before it registers the final policy.

Each update already fails when more than ``<role>.guard.max_skipped_fraction`` of its steps were
skipped (``models/training/step_guard.py``); this is the same rule over the whole run, from what MLflow holds
(``<role>/steps`` and ``<role>/skipped_steps`` of every iteration), so a run whose bounds were
loosened on resume, or whose updates each stayed just under the share, registers no policy either
when most of its steps were skipped.
"""

from __future__ import annotations

from typing import Optional, Tuple

from models import tracking
from models.config import TrainConfig


class UnhealthyRun(RuntimeError):
    """Most of the run's optimiser steps were skipped: its final policy is not registered."""


def skipped_share(run_id: str, role: str) -> Optional[Tuple[int, int]]:
    """``(skipped, taken)`` optimiser steps of ``role`` over every iteration MLflow has logged; None when
    ``role`` logged no ``steps`` (no critic, or a critic server predating them)."""
    taken = tracking.metric_history(run_id, f"{role}/steps")
    if not taken:
        return None
    skipped = tracking.metric_history(run_id, f"{role}/skipped_steps")
    return int(sum(v for _, v in skipped)), int(sum(v for _, v in taken))


def check_healthy(cfg: TrainConfig, run_id: str) -> None:
    """Raise :class:`UnhealthyRun` naming the counts and the bound when, for the actor or the critic,
    more than ``guard.max_skipped_fraction`` of the run's steps were skipped."""
    for role, section in (("actor", cfg.actor), ("critic", cfg.critic)):
        share = skipped_share(run_id, role)
        if share is None:
            continue
        skipped, taken = share
        fraction = section.guard.max_skipped_fraction
        if skipped and skipped > fraction * (skipped + taken):
            raise UnhealthyRun(
                f"{skipped} of the run's {skipped + taken} {role} optimiser steps were skipped (non-finite or "
                f"out of {role}.guard's bounds; {role}/skipped_steps in MLflow), more than "
                f"{role}.guard.max_skipped_fraction={fraction:g}: the run did not end healthy and its final "
                f"policy is not registered")

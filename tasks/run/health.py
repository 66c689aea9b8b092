"""Whether a run ended healthy, checked by ``finish_run`` before it registers the final policy.

Each update already fails when more than ``<role>.guard.max_skipped_fraction`` of its steps were
skipped (``models/update.py``); this is the same rule over the whole run, from what MLflow holds
(``<role>/steps`` and ``<role>/skipped_steps`` of every iteration), so a run whose bounds were
loosened on resume, or whose updates each stayed just under the share, registers no policy either
when most of its steps were skipped.
"""

from __future__ import annotations

from tasks import tracking
from tasks.config import TrainConfig


class UnhealthyRun(RuntimeError):
    """Most of the run's optimiser steps were skipped: its final policy is not registered."""


def skipped_share(run_id: str, role: str) -> tuple:
    """``(skipped, taken)`` optimiser steps of ``role`` over every iteration MLflow has logged."""
    total = lambda key: sum(v for _, v in tracking.metric_history(run_id, f"{role}/{key}"))  # noqa: E731
    return int(total("skipped_steps")), int(total("steps"))


def check_healthy(cfg: TrainConfig, run_id: str) -> None:
    """Raise :class:`UnhealthyRun` naming the counts and the bound when, for the actor or the critic,
    more than ``guard.max_skipped_fraction`` of the run's steps were skipped."""
    for role, section in (("actor", cfg.actor), ("critic", cfg.critic)):
        skipped, taken = skipped_share(run_id, role)
        fraction = section.guard.max_skipped_fraction
        if skipped and skipped > fraction * (skipped + taken):
            raise UnhealthyRun(
                f"{skipped} of the run's {skipped + taken} {role} optimiser steps were skipped (non-finite or "
                f"out of {role}.guard's bounds; {role}/skipped_steps in MLflow), more than "
                f"{role}.guard.max_skipped_fraction={fraction:g}: the run did not end healthy and its final "
                f"policy is not registered")

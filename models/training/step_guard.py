"""Which optimiser steps the update loop (:func:`models.training.update.run_update`) skips, and when an update
that skipped too many fails.

A step is skipped when its loss or gradient norm (before clipping) is NaN or infinite on any rank, or
above ``LoopSettings.max_loss`` / ``max_grad_norm`` (``actor.guard`` and ``critic.guard`` of the config;
0: no bound): no ``optimizer.step()``, so the weights and AdamW's moments stay as they were, as a
dynamic loss scaler skips an overflowing step. Each skipped step is one console line (rank 0). An
update that skipped steps and took none, or skipped more than ``max_skipped_fraction`` of them,
raises :class:`NonFiniteUpdate` (every skipped step non-finite, none taken) or :class:`DivergedUpdate`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Protocol

import torch

from models.training.distributed import DistInfo, all_reduce_sum


class GuardSettings(Protocol):
    """What the guard reads of the loop's settings (:class:`models.training.update.LoopSettings`)."""

    max_loss: float
    max_grad_norm: float
    max_skipped_fraction: float
    role: str


class NonFiniteUpdate(FloatingPointError):
    """Every optimiser step of an update had a non-finite loss or gradient norm: nothing was trained."""


class DivergedUpdate(FloatingPointError):
    """More than ``max_skipped_fraction`` of an update's steps were skipped (non-finite or out of bound)."""


NONFINITE, LOSS_BOUND, GRAD_BOUND = "non-finite", "max_loss", "max_grad_norm"
"""Why a step is skipped, in the order they are checked."""


def skip_reason(loss: float, grad_norm: float, settings: GuardSettings) -> str:
    """Why this step is skipped ("" if it is not), the same on every rank: each rank's verdict is summed
    over the ranks, or their replicas (DDP) or shards (FSDP2) would step apart."""
    flags = torch.tensor([not (math.isfinite(loss) and math.isfinite(grad_norm)),
                          0 < settings.max_loss < abs(loss), 0 < settings.max_grad_norm < grad_norm],
                         dtype=torch.float64)  # [3]: the reasons, NONFINITE first
    flags = all_reduce_sum(flags)
    return next((r for r, f in zip((NONFINITE, LOSS_BOUND, GRAD_BOUND), flags.tolist()) if f > 0), "")


@dataclass
class Skips:
    """The steps an update skipped: how many for each reason, the first one's numbers."""

    counts: Dict[str, int] = field(default_factory=lambda: {NONFINITE: 0, LOSS_BOUND: 0, GRAD_BOUND: 0})
    first: str = ""

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def add(self, reason: str, steps: int, stats: Dict[str, float], settings: GuardSettings, info: DistInfo) -> None:
        k = steps + self.total
        what = f"loss {stats['loss']:.3g}, gradient norm {stats['grad_norm']:.3g}"
        why = "non-finite" if reason == NONFINITE else \
            f"above {settings.role}.guard.{reason}={getattr(settings, reason):g}"
        self.first = self.first or f"step {k}, {what}" + ("" if reason == NONFINITE else f", {why}")
        self.counts[reason] += 1
        if info.rank == 0:
            print(f"[{settings.role}] step {k} skipped ({what}: {why}); weights and AdamW's moments unchanged",
                  flush=True)

    def check(self, steps: int, settings: GuardSettings) -> None:
        """Raise when no step was taken, or more than ``max_skipped_fraction`` of them were skipped."""
        skipped, n = self.total, steps + self.total
        if not skipped or (steps and skipped <= settings.max_skipped_fraction * n):
            return
        if not steps and self.counts[NONFINITE] == skipped:
            raise NonFiniteUpdate(
                f"all {skipped} optimiser steps of this update had a non-finite loss or gradient norm (first: "
                f"{self.first}); no step was taken and nothing is committed. Look for NaN/inf in the batch's "
                f"advantages, log-probs and rewards, and at the learning rate")
        r = settings.role
        raise DivergedUpdate(
            f"{skipped} of {n} optimiser steps of this {r} update were skipped, more than "
            f"{r}.guard.max_skipped_fraction={settings.max_skipped_fraction:g} ({self.counts[NONFINITE]} non-finite, "
            f"{self.counts[LOSS_BOUND]} with |loss| above {r}.guard.max_loss={settings.max_loss:g}, "
            f"{self.counts[GRAD_BOUND]} with a gradient norm above {r}.guard.max_grad_norm="
            f"{settings.max_grad_norm:g}; first: {self.first}): the update diverged and nothing of this iteration "
            f"is committed. Lower {r}.lr (or look for NaN/inf in the batch), or change the bounds (they may change "
            f"on resume)")

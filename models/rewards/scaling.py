"""From the raw reward to the reward the advantages use: running normalisation, scale, clip.

    r = raw                                          # [B], the weighted sum of the reward functions
    r = (r - μ_n) / max(σ_n, eps)                    # reward.normalize: running moments incl. this batch
    r = scale · r                                    # reward.scale
    r = clip(r, -c, c)                               # reward.clip = c > 0

μ_n, σ_n are the mean and (population) standard deviation of every raw reward seen so far, this
batch included, merged batch by batch with Chan et al.'s parallel update ("Updating formulae and a
pairwise algorithm for computing sample variances", 1979), as OpenRLHF's and TRL's running
moments do. The moments (count, mean, M2) are part of the run's state: written beside ``kl_coef``
in ``state.json`` at each commit, so a resumed run normalises exactly as an unbroken one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Mapping, NamedTuple, Optional, Sequence, Tuple

import numpy as np

EPS = 1e-8
"""Floor of σ in the normalisation (a constant reward stays finite)."""


@dataclass(frozen=True)
class RunningMoments:
    """Count, mean and sum of squared deviations (M2) of every value seen."""

    count: float = 0.0
    mean: float = 0.0
    m2: float = 0.0

    def update(self, values: Sequence[float]) -> "RunningMoments":
        """The moments with ``values`` merged in (Chan et al.: δ = μ_b − μ_a,
        M2 = M2_a + M2_b + δ²·n_a·n_b / n)."""
        x = np.asarray(values, dtype=np.float64)
        if x.size == 0:
            return self
        n_b, mean_b = float(x.size), float(x.mean())
        m2_b = float(((x - mean_b) ** 2).sum())
        n = self.count + n_b
        delta = mean_b - self.mean
        return RunningMoments(n, self.mean + delta * n_b / n, self.m2 + m2_b + delta ** 2 * self.count * n_b / n)

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count else 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Optional[Mapping[str, float]]) -> "RunningMoments":
        return cls(**{k: float(v) for k, v in (data or {}).items()})


class ShapedRewards(NamedTuple):
    rewards: np.ndarray
    """``[B]`` float32: what the advantages use."""
    moments: RunningMoments
    """The running moments after this batch (unchanged without normalisation)."""


def shape_rewards(raw: Sequence[float], scale: float = 1.0, clip: float = 0.0, normalize: bool = False,
                  moments: RunningMoments = RunningMoments()) -> ShapedRewards:
    """The module docstring's formula on ``raw`` ``[B]``."""
    r = np.asarray(raw, dtype=np.float64)  # [B]
    if normalize:
        moments = moments.update(r)
        r = (r - moments.mean) / max(moments.std, EPS)
    r = r * scale
    if clip > 0:
        r = np.clip(r, -clip, clip)
    return ShapedRewards(r.astype(np.float32), moments)


def out_of_range(raw: Sequence[float], expected: Tuple[float, float]) -> Optional[str]:
    """A warning when raw rewards fall outside ``expected = (lo, hi)``; None when all are inside."""
    r = np.asarray(raw, dtype=np.float64)
    lo, hi = expected
    outside = int(((r < lo) | (r > hi)).sum())
    if not outside:
        return None
    return (f"{outside} of {r.size} raw rewards are outside reward.expected_range [{lo:g}, {hi:g}] "
            f"(min {r.min():.4g}, max {r.max():.4g}): rewards this large swamp the KL penalty and the critic; "
            f"set reward.scale, reward.clip or reward.normalize (or widen reward.expected_range if they are meant)")

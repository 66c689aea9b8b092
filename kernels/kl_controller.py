"""β steered towards a target KL (Ziegler et al. 2019, "Fine-Tuning Language Models from Human
Preferences", §2.2): plain arithmetic on floats, apart from the KL's tensor math (:mod:`kernels.kl`,
which exports it too) so that the commit stage, which moves β to the next iteration, loads no torch."""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["AdaptiveKLController"]


@dataclass(frozen=True)
class AdaptiveKLController:
    """β steered towards a target KL (Ziegler et al. 2019, §2.2):

    ``e = clip(KL / target − 1, −0.2, 0.2)``,  ``β ← β·(1 + e·n_steps / horizon)``
    """

    value: float
    """current β"""
    target: float
    """the KL per sequence to steer towards"""
    horizon: float
    """number of samples (steps) over which the error is corrected; larger is slower"""

    def __post_init__(self) -> None:
        if not (self.value >= 0 and self.target > 0 and self.horizon > 0):
            raise ValueError(f"need value >= 0, target > 0, horizon > 0, got {self}")

    def update(self, current_kl: float, n_steps: int) -> "AdaptiveKLController":
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        return replace(self, value=self.value * (1.0 + proportional_error * n_steps / self.horizon))

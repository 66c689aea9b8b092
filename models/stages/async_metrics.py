"""The ``async/*`` metrics of an asynchronous run's batch (``run.max_staleness`` k ≥ 2, docs/off_policy.md).

A token's lag is how many updates its actor is behind the one the update starts from:
``lag_t = iteration − token_versions_t`` (0 ≤ lag_t ≤ k for every token trained). Per iteration:

- ``async/staleness_p50``, ``async/staleness_p100``: the median and the largest lag over the batch's tokens;
- ``async/lag_{d}_share`` for d = 0 … k: the share of the batch's tokens at lag d (they sum to 1);
- ``async/partial_fraction``: the share of samples whose tokens come from more than one policy version (a
  generation that took new weights half-way);
- ``async/dropped_samples``: samples the engine drew but the run did not train (too stale when taken), since the
  previous batch; their prompts are sampled again;
- ``async/reweighted_samples``: samples too stale when taken but trained (``run.stale_samples=reweight``), with
  ``async/lag_over_k_share`` the share of the batch's tokens more than k updates old;
- ``async/engine_idle_fraction``, ``async/trainer_idle_fraction``: of the time since the previous batch was taken,
  the share the engine waited because the staleness bound held it back, and the share the trainer's rollout task
  waited for the batch to finish.
"""

from __future__ import annotations

from typing import Dict, Sequence

import numpy as np


def staleness_stats(iteration: int, token_versions: Sequence[Sequence[int]], k: int,
                    reweighted: bool = False) -> Dict[str, float]:
    """The lag metrics of a batch trained at ``iteration`` (the module docstring); refuses a token from a future
    policy, and one staler than ``k`` unless stale samples are ``reweighted`` (``run.stale_samples``)."""
    lags = np.concatenate([iteration - np.asarray(v, dtype=np.int64) for v in token_versions] or
                          [np.zeros(0, dtype=np.int64)])  # [T] over every response token
    if lags.size and (lags.min() < 0 or lags.max() > k and not reweighted):
        raise ValueError(f"batch of iteration {iteration} holds tokens {int(lags.max())} updates old (or from a "
                         f"later policy: {int(lags.min())}); run.max_staleness={k} allows 0..{k}")
    out = {"async/staleness_p50": float(np.median(lags)) if lags.size else 0.0,
           "async/staleness_p100": float(lags.max()) if lags.size else 0.0}
    counts = np.bincount(lags, minlength=k + 1) if lags.size else np.zeros(k + 1)
    for d in range(k + 1):
        out[f"async/lag_{d}_share"] = float(counts[d] / max(lags.size, 1))
    if reweighted:
        out["async/lag_over_k_share"] = float(np.sum(lags > k) / max(lags.size, 1))
    mixed = [len(set(v)) > 1 for v in token_versions]
    out["async/partial_fraction"] = float(np.mean(mixed)) if mixed else 0.0
    return out


def idle_stats(window_s: float, engine_idle_s: float, trainer_wait_s: float, dropped: int,
               reweighted: int = 0) -> Dict[str, float]:
    """The idle fractions of a window of ``window_s`` seconds (between two batches taken), the drops in it and
    the stale samples kept."""
    window = max(window_s, 1e-9)
    return {"async/engine_idle_fraction": min(engine_idle_s / window, 1.0),
            "async/trainer_idle_fraction": min(trainer_wait_s / window, 1.0),
            "async/dropped_samples": float(dropped), "async/reweighted_samples": float(reweighted)}

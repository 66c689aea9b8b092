"""Which prompts an iteration draws: seeded per-epoch permutations of the run's prompts."""

from __future__ import annotations

import numpy as np


def iteration_indices(num_prompts: int, per_iteration: int, iteration: int, seed: int) -> np.ndarray:
    """Rows for ``iteration``: consecutive slices of per-epoch seeded permutations (no repeats within an epoch).

    Draw k of the run (iteration ``k // per_iteration``) is row ``permutation(seed, epoch)[k mod N]`` with
    epoch ``k // N``: every row once per epoch, a fresh shuffle each epoch. When ``per_iteration > N`` an
    iteration spans several epochs and takes a row more than once (:func:`draw_ids` keeps them apart)."""
    start = iteration * per_iteration
    out = []
    while len(out) < per_iteration:
        epoch, offset = divmod(start + len(out), num_prompts)
        perm = np.random.default_rng([seed, epoch]).permutation(num_prompts)
        out.extend(perm[offset:offset + per_iteration - len(out)].tolist())
    return np.asarray(out, dtype=np.int64)


def draw_ids(per_iteration: int, iteration: int) -> np.ndarray:
    """``[per_iteration]`` int64: the run-wide index of each prompt drawn in ``iteration``, its
    ``prompt_id``. Every drawn instance is its own group (GRPO/RLOO baselines over exactly
    ``n_samples_per_prompt`` samples), even when one row is drawn twice in an iteration."""
    return np.arange(iteration * per_iteration, (iteration + 1) * per_iteration, dtype=np.int64)

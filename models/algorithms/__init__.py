"""Every training algorithm, declared once: one module per algorithm (its equation and source in
the module docstring, an :class:`~models.algorithms.spec.AlgorithmSpec` named ``SPEC``).

What reads the declarations: config validation (``models/config/train.py``, through
:mod:`models.algorithms.checks`: group sizes, the options an algorithm does not use), the
workflow choice (``models/run/setup.check_workflow``), the ``advantages`` task (the estimator), the
actor update (the policy loss and its aggregation) and the docs' table (``python -m
models.algorithms docs/algorithms.md``). A new algorithm is a new module here plus its line in
:data:`ALGORITHMS`.
"""

from __future__ import annotations

from typing import Dict

from models.algorithms import dr_grpo, grpo, ppo, reinforce, reinforce_pp, rloo
from models.algorithms.spec import KL_PLACEMENTS, OPTIONS, WORKFLOWS, AlgorithmSpec

ALGORITHMS: Dict[str, AlgorithmSpec] = {m.SPEC.name: m.SPEC for m in (ppo, reinforce, rloo, grpo, dr_grpo,
                                                                       reinforce_pp)}
"""``run.algorithm`` value → its declaration."""


def get(name: str) -> AlgorithmSpec:
    """The declaration of algorithm ``name``; an unknown name raises listing the known ones."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"run.algorithm={name!r} is not one of {list(ALGORITHMS)}") from None


__all__ = ["ALGORITHMS", "AlgorithmSpec", "KL_PLACEMENTS", "OPTIONS", "WORKFLOWS", "get"]
